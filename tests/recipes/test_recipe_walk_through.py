"""README.md's quickstart and its hub example, run as written from a copy of the repository's
layout: your own text -> SentencePiece -> binarized -> train.sh FAMILY own over seeds ->
evaluate.sh -> ea-fairseq-compare -> fairseq-interactive, and the hub on the same model."""
import ast
import json
import re
import sys

import pytest

from support.recipe_support import (RECIPES, REPO, TRAIN_SH_RUN, WALK_SIZES, doc_block, doc_commands, env,  # noqa: F401
                            lines, run, walk_through_tree)

QUICKSTART = "## Quickstart: your own parallel text"
SETUP = "bash scripts/setup_env.sh && source .venv/bin/activate"  # the environment these tests run in
SHORT = dict(max_len_a=0, max_len_b=10)  # an untrained model's output is long otherwise
# what the test adds to each command, by its first words: on this machine two seeds (SEEDS), one
# epoch (MAX_EPOCH) of a one-layer model, that epoch's checkpoint scored (NUM_AVG), short outputs
CHANGES = {
    "bash examples/translation/prepare-own.sh": "",
    "CPU=1 SEEDS=": " --encoder-layers 1 --decoder-layers 1 " + " ".join(TRAIN_SH_RUN),
    "bash examples/translation/evaluate.sh": " --cpu --progress 0.5 -- --max-len-a 0 --max-len-b 8",
    "ea-fairseq-compare": "",
    "head -3 data-bin/bible.es-en/test.raw.es-en.es | fairseq-interactive":
        "".join(f" --{k.replace('_', '-')} {v}" for k, v in SHORT.items()),
}


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory, env):  # noqa: F811
    root = tmp_path_factory.mktemp("quickstart")
    walk_through_tree(root)
    commands = doc_commands(REPO / "README.md", QUICKSTART)
    assert commands[0].split("  #")[0].strip() == SETUP
    walk_env = dict(env, MAX_EPOCH="1", MAX_TOKENS="2000", NUM_AVG="1")
    outputs = []
    for command in commands[1:]:
        (extra,) = [extra for start, extra in CHANGES.items() if command.startswith(start)]
        outputs.append(run(["bash", "-c", command.replace('SEEDS="1 2 3"', 'SEEDS="1 2"') + extra], walk_env,
                           cwd=root))
    return dict(root=root, commands=commands[1:], outputs=outputs)


def test_the_quickstart(quickstart):
    root = quickstart["root"]
    prepare_out, *train_outs, base_eval, ea_eval, compare_out, interactive_out = quickstart["outputs"]
    data = root / "data-bin" / "bible.es-en"
    assert (data / "sentencepiece.bpe.model").is_file() and not (data / "code").exists()
    for split, n in WALK_SIZES.items():
        assert f"{split}: {n} pairs" in prepare_out.stderr
    assert len(lines(data / "test.raw.es-en.en")) == WALK_SIZES["test"]
    assert "\u2581" in (root / "work" / "own.es-en" / "prep" / "train.es").read_text(encoding="utf-8")
    for family, arch, out in (("transformer_lite", "transformer_lite", train_outs[0]),
                              ("ea_lite", "ea_transformer_lite", train_outs[1])):
        for seed in (1, 2):
            save = root / "checkpoints" / f"{family}.own" / f"seed{seed}"
            assert f"arch='{arch}'" in (save / "train.log").read_text()
            assert (save / "checkpoint1.pt").is_file() and (save / "sentencepiece.bpe.model").is_file()
            hyps = lines(save / "eval" / "test.es-en.hyp.sacrebleu")  # SentencePiece removed, detokenized
            assert len(hyps) == WALK_SIZES["test"] and not any("\u2581" in h for h in hyps)
        assert f"evaluate.sh checkpoints/{family}.own data-bin/bible.es-en wmt" in out.stderr
    out, err = ea_eval.stdout, ea_eval.stderr
    assert re.search(r"^detokenized sacreBLEU .*: [0-9.]+ .*signature: ", out, re.M), out
    assert re.search(r"\d+\.\d+ ± \d+\.\d+", out), out  # the mean over the seeds
    assert re.search(rf"^\[evaluate\] \d+ of {WALK_SIZES['test']} sentences translated$", err, re.M), err
    assert re.search(r"ea_lite\.own .*\d+\.\d+ ± \d+\.\d+", compare_out.stdout), compare_out.stdout
    detok = dict(re.findall(r"^D-(\d+)\t\S+\t(.*)$", interactive_out.stdout, re.M))
    assert sorted(detok) == ["0", "1", "2"] and not any("\u2581" in d for d in detok.values())


HUB_CHECKS = f"""
import json
sentence = "And God said, Let there be light: and there was light."
hyp = ea.generate([ea.encode("Y dijo Dios: Sea la luz.")], beam=5)[0][0]["tokens"]
raw = open("data-bin/bible.es-en/test.raw.es-en.es", encoding="utf-8").read().splitlines()[:3]
print("CHECKS", json.dumps(dict(
    spanish=ea.tokenize("Vea la pág. 12 de la Sra. García."), pieces=ea.apply_bpe(ea.tokenize(sentence)),
    round_trip=ea.decode(ea.encode(sentence)), first=ea.decode(hyp),
    interactive=ea.translate(raw, beam=5, **{SHORT!r}))))
"""


def test_readme_hub_example_takes_raw_text(quickstart, env):  # noqa: F811
    """README.md's hub example, run as written on the quickstart's model (in a Python of its
    own, from the repository layout's root): raw Spanish in, detokenized English out, Spanish
    Moses rules on the way in, and the translations of the quickstart's fairseq-interactive."""
    code = doc_block(REPO / "README.md", QUICKSTART, "python")
    out = run([sys.executable, "-c", code + HUB_CHECKS], env, cwd=quickstart["root"]).stdout.splitlines()
    translations, checks = ast.literal_eval(out[-2]), json.loads(out[-1].removeprefix("CHECKS "))
    assert len(translations) == 2 and all(isinstance(t, str) and t for t in translations)
    assert not any("\u2581" in t for t in translations)
    assert checks["first"] == translations[0]  # the pieces, joined and detokenized
    assert checks["spanish"] == "Vea la pág. 12 de la Sra. García ."  # Spanish abbreviations
    # raw in, raw out: into pieces and back, spacing and punctuation restored
    assert "\u2581" in checks["pieces"]
    assert checks["round_trip"] == "And God said, Let there be light: and there was light."
    detok = dict(re.findall(r"^D-(\d+)\t\S+\t(.*)$", quickstart["outputs"][-1].stdout, re.M))
    assert [detok[str(i)] for i in range(3)] == checks["interactive"]


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
