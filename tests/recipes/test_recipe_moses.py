"""nmt_text.py, the recipes' text steps in Python, against Moses' Perl scripts: the bytes of
every fixture line (tests/fixtures/moses, made once from mosesdecoder by make_fixtures.sh)."""
import importlib.util
from pathlib import Path

import pytest

from support.recipe_support import RECIPES

MOSES = Path(__file__).parents[1] / "fixtures" / "moses"
# the steps of each fixture file, as nmt_text.py's text options (make_fixtures.sh: the Perl)
MOSES_PIPELINES = {
    "normalize": ["--normalize-punct"],
    "wmt": ["--normalize-punct", "--remove-non-printing", "--tokenize", "--aggressive-dash"],
    "wmt-test": ["--fix-apostrophe", "--tokenize", "--aggressive-dash"],
    "iwslt": ["--tokenize", "--lowercase"],
}


def _read_exact(path: Path):
    with open(path, encoding="utf-8", newline="\n") as f:  # keep \r and trailing spaces
        return f.read().split("\n")[:-1]


def load_recipe_module(name="nmt_text"):
    spec = importlib.util.spec_from_file_location(f"ea_recipes_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("step", sorted(MOSES_PIPELINES))
def test_moses_steps_equal_the_perl_scripts(step, tmp_path):
    """nmt_text.py gives the Moses Perl scripts' bytes on every fixture line (outputs made once
    from mosesdecoder's scripts by tests/fixtures/moses/make_fixtures.sh)."""
    checked = 0
    for expected in sorted(MOSES.glob(f"{step}.*")):
        lang = expected.suffix[1:]
        out = tmp_path / f"{step}.{lang}"
        assert load_recipe_module().main(["text", "-l", lang, *MOSES_PIPELINES[step], "-o", str(out),
                                          str(MOSES / f"input.{lang}")]) == 0
        inputs, want, got = _read_exact(MOSES / f"input.{lang}"), _read_exact(expected), _read_exact(out)
        assert len(want) == len(inputs)
        diffs = [(src, w, g) for src, w, g in zip(inputs, want, got, strict=True) if w != g]
        assert not diffs, f"{step}.{lang}: differs from the Perl on {len(diffs)} lines: {diffs[:3]}"
        checked += len(want)
    assert checked >= 10


def test_clean_equals_clean_corpus_n_perl(tmp_path):
    """nmt_text.py clean keeps and rewrites the pairs clean-corpus-n.perl does (fixture made
    once from the Perl script): pipes removed, Unicode white space folded but not \\x1c,
    \\r inside a line, empty / too long / too short / over-ratio / 1001-character-word pairs
    dropped."""
    assert load_recipe_module().main(["clean", "--ratio", "1.5", str(MOSES / "clean-input"), "de", "en",
                                      str(tmp_path / "clean"), "1", "10"]) == 0
    for lang in ("de", "en"):
        want, got = _read_exact(MOSES / f"clean.{lang}"), _read_exact(tmp_path / f"clean.{lang}")
        assert got == want
    assert len(_read_exact(MOSES / "clean-input.de")) > len(want) >= 8  # it does drop pairs


def test_moses_cases_sacremoses_gets_wrong():
    """The cases that made the recipes' data differ from the papers': Perl's normalizer maps
    ’ to a double quote and moves a sentence-final period out of a closing quote; its fi/sv
    rule keeps colons inside words; its last word's period is always split."""
    m = load_recipe_module("nmt_moses")
    assert m.PunctNormalizer("en").normalize("Rock ’n’ roll is ‘here’") == 'Rock "n" roll is \'here"'
    assert m.PunctNormalizer("de").normalize("Er sagte: „Wir kommen.“") == 'Er sagte: "Wir kommen".'
    fi = m.MosesTokenizer("fi", aggressive_dash=True)
    assert fi.tokenize("EU:ssa on 20:00, S:t USA:n") == "EU:ssa on 20 : 00 , S:t USA:n"
    assert m.MosesTokenizer("sv").tokenize("I EU:s budget: 20:e maj.") == "I EU:s budget : 20:e maj ."
    assert m.MosesTokenizer("en").tokenize("EU:ssa") == "EU : ssa"
    assert m.MosesTokenizer("de").tokenize("Ein Satz endet mit U.S.A.") == "Ein Satz endet mit U.S.A ."
    # the fixtures hold these cases, so the file comparison above covers them too
    assert "EU:ssa on 27" in (MOSES / "wmt.fi").read_text(encoding="utf-8")
    normalized = _read_exact(MOSES / "normalize.en") + _read_exact(MOSES / "normalize.de")
    assert 'Rock "n" roll is \'here" to stay.' in normalized and 'Er sagte: "Wir kommen".' in normalized
