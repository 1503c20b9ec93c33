"""Names and counts from files and arguments that carry shell code: every recipe refuses them
in one line and never runs the code (negative controls: the code runs without the checks)."""
import subprocess

from support.recipe_support import RECIPES, REPO, env, run  # noqa: F401  (fixture)


# A language that closes GNU sed's s::: command and then runs its e command: the sed program
# evaluate.sh built from the data-bin's file names ran it (the negative control below).
HOSTILE = "::;etouch${IFS}pwned;#"
OLD_PROGRESS_SED = r'sed -n "s:.*loaded \([0-9,]*\) examples from\: .*/$subset\.$src-$tgt\.$src\$:\1:p" "$log"'


def test_hostile_names_are_refused_in_one_line_not_run(env, tmp_path):
    """A data-bin whose file names carry a shell command in the language, and the same name
    as an argument (-s, --subset, SRC, prepare-own.sh's SRC, DEMO_ARCHS): every recipe stops
    with one line before using it, and the command never runs."""
    data = tmp_path / "data-bin"
    data.mkdir()
    for split in ("train", "test"):
        for lang in (HOSTILE, "en"):
            (data / f"{split}.{HOSTILE}-en.{lang}.idx").write_text("")
    (data / "dict.en.txt").write_text("a 1\n")
    ckpt = tmp_path / "checkpoint.pt"
    ckpt.write_text("")
    stub = tmp_path / "generate"  # fairseq-generate as far as evaluate.sh's progress report sees it
    stub.write_text("#!/bin/sh\necho '| loaded 3 examples from: x' >&2\nsleep 1\n")
    stub.chmod(0o755)
    marker = tmp_path / "pwned"
    # negative control: the sed program evaluate.sh used to paste these names into runs the command
    log = tmp_path / "generate.log"
    log.write_text("| loaded 3 examples from: x\n")
    subprocess.run(["bash", "-c", OLD_PROGRESS_SED], env=dict(env, subset="test", src=HOSTILE, tgt="en", log=str(log)),
                   cwd=tmp_path, capture_output=True)
    assert marker.exists()
    marker.unlink()

    evaluate = ["bash", RECIPES / "evaluate.sh", tmp_path, data, "wmt", "--checkpoint", ckpt, "--cpu", "--progress", "0.1"]
    cases = [
        (evaluate, {}),
        (evaluate + ["-s", HOSTILE, "-t", "en"], {}),
        (evaluate + ["-s", "de", "-t", "en", "--subset", HOSTILE], {}),
        (["bash", RECIPES / "train.sh", "ea_lite", "own"], {"DATA": str(data), "DRY_RUN": "1", "PYTHON": "true"}),
        (["bash", RECIPES / "train.sh", "ea_lite", "own"], {"DATA": str(data), "DRY_RUN": "1", "PYTHON": "true",
                                                           "SRC": HOSTILE, "TGT": "en"}),
        (["bash", RECIPES / "prepare-own.sh", HOSTILE, "en", tmp_path], {}),
        (["bash", REPO / "scripts" / "demo.sh"], {"DEMO_DIR": str(tmp_path / "demo"),
                                                   "DEMO_ARCHS": f"transformer_lite {HOSTILE}"}),
    ]
    for cmd, extra in cases:
        proc = run(cmd, dict(env, FAIRSEQ_GENERATE=str(stub), **extra), tmp_path, check=False)
        lines_ = proc.stderr.splitlines()
        assert proc.returncode == 1 and len(lines_) == 1, (cmd, proc.stderr)
        assert "error" in lines_[0].lower() and "[A-Za-z0-9_@-]+" in lines_[0], lines_
        assert "\\$\\{IFS\\}" in lines_[0]  # the name shown quoted, as one line
        assert not marker.exists(), cmd
    assert not (tmp_path / "demo").exists()


# bash evaluates array subscripts in arithmetic, so a count pasted into $((...)) or [[ -gt ]] runs code
ARITHMETIC = "a[$(touch pwned)]"


def test_hostile_counts_are_refused_before_bash_arithmetic(env, tmp_path):
    """Counts the recipes compute with (NGPUS, --max-tokens after PAIR, --num-avg,
    DEMO_UPDATES) are whole numbers or a one-line refusal; bash's arithmetic would run the
    command in the text otherwise (the negative control)."""
    marker = tmp_path / "pwned"
    subprocess.run(["bash", "-c", 'echo $(( x + 1 ))'], env=dict(env, x=ARITHMETIC), cwd=tmp_path, capture_output=True)
    assert marker.exists()
    marker.unlink()
    dry = dict(env, DRY_RUN="1", PYTHON="true")
    cases = [
        (["bash", RECIPES / "train.sh", "ea_lite", "wmt14_en_de"], dict(dry, NGPUS=ARITHMETIC)),
        (["bash", RECIPES / "train.sh", "ea_lite", "wmt14_en_de"], dict(dry, UPDATE_FREQ=ARITHMETIC)),
        (["bash", RECIPES / "train.sh", "ea_lite", "wmt14_en_de", "--max-tokens", ARITHMETIC], dry),
        (["bash", RECIPES / "evaluate.sh", tmp_path, tmp_path, "wmt", "--num-avg", ARITHMETIC], env),
        (["bash", REPO / "scripts" / "demo.sh"], dict(env, DEMO_DIR=str(tmp_path / "demo"), DEMO_UPDATES=ARITHMETIC)),
    ]
    for cmd, cmd_env in cases:
        proc = run(cmd, cmd_env, tmp_path, check=False)
        assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, (cmd, proc.stderr)
        assert "\\$\\(touch\\ pwned\\)" in proc.stderr, proc.stderr  # the value shown quoted
        assert not marker.exists(), cmd
