"""train.sh with an option fairseq-train does not know: fairseq's error line without the ~200
lines of argparse usage before it, and ea-fairseq-options' answer (what was meant) after it;
other output of fairseq-train on stderr passes unchanged. fairseq-train is a stand-in that
prints as argparse does; ea-fairseq-options is the real one."""
import os
import stat
import subprocess
import sys
from pathlib import Path

RECIPES = Path(__file__).resolve().parent.parent / "examples" / "translation"

# fairseq-train's argparse refusal: the usage of every option, then the error line (exit 2)
FAKE_TRAIN = """#!/usr/bin/env bash
{ echo "usage: fairseq-train [-h] [--no-progress-bar] [--log-interval LOG_INTERVAL]"
  echo "                     [--log-format {json,none,simple,tqdm}]"
  echo "                     data"
  echo "fairseq-train: error: unrecognized arguments: --ea-alpah 0.5"; } >&2
exit 2
"""
# a usage block not followed by an error (a program's own text): shown as it is
FAKE_OTHER = """#!/usr/bin/env bash
{ echo "usage: something else"; echo "   indented"; echo "not an error"; } >&2
"""


def train_sh(tmp_path, fake, *extra):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for name in ("train.xx-yy.xx.idx", "dict.xx.txt", "dict.yy.txt"):
        (data / name).write_text("a 1\n")
    stub = tmp_path / "fairseq-train"
    stub.write_text(fake)
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if k not in ("EA_FAIRSEQ_SHOW_WARNINGS", "SEEDS", "EVAL_BLEU")}
    env.update(CPU="1", FAIRSEQ_TRAIN=str(stub), DATA=str(data), SAVE_DIR=str(tmp_path / "save"),
               PYTHON=sys.executable, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run(["bash", str(RECIPES / "train.sh"), "ea_lite", "own", *extra], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_an_unknown_option_is_its_error_line_and_what_was_meant(tmp_path):
    proc = train_sh(tmp_path, FAKE_TRAIN, "--ea-alpah", "0.5")
    assert proc.returncode == 2, proc.stderr
    assert "usage:" not in proc.stderr and "[--log-format" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-2:] == [
        "fairseq-train: error: unrecognized arguments: --ea-alpah 0.5",
        "[train] not options of fairseq-train --arch ea_transformer_lite: --ea-alpah 0.5 (did you mean --ea-alpha?); "
        "ea-fairseq-options ea_transformer_lite lists the model options"], proc.stderr


def test_other_output_after_a_usage_line_is_kept(tmp_path):
    proc = train_sh(tmp_path, FAKE_OTHER)
    assert proc.returncode == 0 and proc.stderr.splitlines()[-4:-1] == [
        "usage: something else", "   indented", "not an error"], proc.stderr
