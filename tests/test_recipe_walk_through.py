"""The own-data walk-through of examples/translation/README.md and README.md's hub and
fairseq-interactive examples, run as written from a copy of the repository's layout."""
import ast
import json
import os
import re
import sys

import pytest

from recipe_support import (BIN, RECIPES, REPO, TRAIN_SH_RUN, WALK_SIZES, doc_block, doc_commands, env,  # noqa: F401
                            lines, run, walk_through_tree)


def _own_walk_through(root, env):
    """examples/translation/README.md's own-data commands, run as written from a copy of the
    repository's layout; on this machine CPU=1, one epoch (MAX_EPOCH) of a one-layer model
    (options appended to train.sh), that epoch's checkpoint scored (NUM_AVG), generation kept
    short (options appended to evaluate.sh)."""
    walk_through_tree(root)
    commands = doc_commands(RECIPES / "README.md", "### Your own parallel text")
    assert [c.split()[:3] for c in commands] == [
        ["bash", "examples/translation/prepare-own.sh", "es"],
        ["DATA=data-bin/bible.es-en", "bash", "examples/translation/train.sh"],
        ["bash", "examples/translation/evaluate.sh", "checkpoints/ea_lite.own"]]
    walk_env = dict(env, CPU="1", MAX_EPOCH="1", MAX_TOKENS="2000", NUM_AVG="1")
    appended = ["", " --encoder-layers 1 --decoder-layers 1 " + " ".join(TRAIN_SH_RUN),
                " --cpu --progress 0.5 -- --max-len-a 0 --max-len-b 8"]
    outputs = [run(["bash", "-c", command + extra], walk_env, cwd=root)
               for command, extra in zip(commands, appended)]
    return dict(root=root, commands=commands, outputs=outputs)


@pytest.fixture(scope="module")
def walk_through(tmp_path_factory, env):  # noqa: F811
    return _own_walk_through(tmp_path_factory.mktemp("own_walk_through"), env)


def test_own_data_walk_through(walk_through):
    """Your own text -> SentencePiece -> binarized -> train.sh FAMILY own -> evaluate.sh."""
    res = walk_through
    root = res["root"]
    prepare_out, train_out, evaluate_out = res["outputs"]
    data, save = root / "data-bin" / "bible.es-en", root / "checkpoints" / "ea_lite.own"
    assert (data / "sentencepiece.bpe.model").is_file() and not (data / "code").exists()
    for split, n in WALK_SIZES.items():
        assert f"{split}: {n} pairs" in prepare_out.stderr
    assert len(lines(data / "test.raw.es-en.en")) == WALK_SIZES["test"]
    assert "\u2581" in (root / "work" / "own.es-en" / "prep" / "train.es").read_text(encoding="utf-8")
    assert "arch='ea_transformer_lite'" in (save / "train.log").read_text()
    assert (save / "checkpoint1.pt").is_file() and (save / "sentencepiece.bpe.model").is_file()
    assert "evaluate with: bash examples/translation/evaluate.sh checkpoints/ea_lite.own data-bin/bible.es-en wmt" \
        in train_out.stderr
    out, err = evaluate_out.stdout, evaluate_out.stderr
    assert re.search(r"^detokenized sacreBLEU .*: [0-9.]+ .*signature: ", out, re.M), out
    assert "its log: checkpoints/ea_lite.own/eval/generate-test.es-en.log" in err
    # progress while translating (every 0.5 s here: the test set is known before the model loads)
    assert re.search(rf"^\[evaluate\] \d+ of {WALK_SIZES['test']} sentences translated$", err, re.M), err
    assert f"[evaluate] {WALK_SIZES['test']} sentences translated in" in err
    hyps = lines(save / "eval" / "test.es-en.hyp.sacrebleu")  # SentencePiece removed, detokenized
    assert len(hyps) == WALK_SIZES["test"] and not any("\u2581" in h for h in hyps)


# the Spanish that test_readme_interactive_example_takes_raw_text gives fairseq-interactive
RAW = ["Y dijo Dios: Sea la luz.", "¿Dónde está el rey?", "Y fué la tarde y la mañana el día primero."]
SHORT = dict(max_len_a=0, max_len_b=10)  # an untrained model's output is long otherwise

HUB_CHECKS = f"""
import json
sentence = "And God said, Let there be light: and there was light."
hyp = ea.generate([ea.encode("Y dijo Dios: Sea la luz.")], beam=5)[0][0]["tokens"]
print("CHECKS", json.dumps(dict(
    spanish=ea.tokenize("Vea la pág. 12 de la Sra. García."), pieces=ea.apply_bpe(ea.tokenize(sentence)),
    round_trip=ea.decode(ea.encode(sentence)), first=ea.decode(hyp),
    interactive=ea.translate({RAW!r}, beam=5, **{SHORT!r}))))
"""


@pytest.fixture(scope="module")
def hub(walk_through, env):  # noqa: F811
    """README.md's hub example, run as written on the walk-through's model (in a Python of its
    own, from the repository layout's root), and checks of the hub object it makes: (the
    example's print, the checks)."""
    code = doc_block(REPO / "README.md", "### Translating from Python (fairseq's hub)", "python")
    out = run([sys.executable, "-c", code + HUB_CHECKS], env, cwd=walk_through["root"]).stdout.splitlines()
    return ast.literal_eval(out[-2]), json.loads(out[-1].removeprefix("CHECKS "))  # a list of strings; the checks


def test_readme_hub_example_takes_raw_text(hub):
    """README.md's hub example: raw Spanish in, detokenized English out, Spanish Moses rules on
    the way in."""
    translations, checks = hub
    assert len(translations) == 2 and all(isinstance(t, str) and t for t in translations)
    assert not any("\u2581" in t for t in translations)
    assert checks["first"] == translations[0]  # the pieces, joined and detokenized
    assert checks["spanish"] == "Vea la pág. 12 de la Sra. García ."  # Spanish abbreviations
    # raw in, raw out: into pieces and back, spacing and punctuation restored
    assert "\u2581" in checks["pieces"]
    assert checks["round_trip"] == "And God said, Let there be light: and there was light."


def test_readme_interactive_example_takes_raw_text(walk_through, hub):
    """README.md's fairseq-interactive command, run as written: detokenized D- lines, the
    translations of README.md's hub object."""
    root = walk_through["root"]
    (command,) = doc_commands(REPO / "README.md", "### fairseq-interactive")
    assert command.startswith("fairseq-interactive ") and command.endswith("< raw.es")
    (root / "raw.es").write_text("".join(line + "\n" for line in RAW), encoding="utf-8")
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", CUDA_VISIBLE_DEVICES="")
    short = "".join(f" --{k.replace('_', '-')} {v}" for k, v in SHORT.items())
    out = run(["bash", "-c", command.replace(" < raw.es", short + " < raw.es")], env, cwd=root).stdout
    detok = dict(re.findall(r"^D-(\d+)\t\S+\t(.*)$", out, re.M))
    assert sorted(detok) == ["0", "1", "2"]
    assert not any("\u2581" in d for d in detok.values())
    assert [detok[str(i)] for i in range(3)] == hub[1]["interactive"]


def test_documented_generate_commands_translate_every_sentence():
    """fairseq drops a last batch smaller than --required-batch-size-multiple (default 8):
    every fairseq-generate command in the documentation sets it to 1."""
    found = 0
    for doc in [REPO / "README.md", RECIPES / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"```[a-z]*\n(.*?)```", doc.read_text(encoding="utf-8"), re.S):
            for command in block.replace("\\\n", " ").splitlines():
                if re.match(r"\s*fairseq-generate(\s|$)", command):  # (not its "fairseq-generate: error" lines)
                    found += 1
                    assert "--required-batch-size-multiple 1" in command, f"{doc.name}: {command}"
    assert found
