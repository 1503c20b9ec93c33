"""Tiny checkpoints trained by the real ``fairseq-train``, one per family, shared by the
test modules of one pytest session (trained once, on first use, in one process)."""
import json
import os
import subprocess
import sys

from conftest import REPO, cli
from support.families import TRAINED

USER_DIR = os.path.join(REPO, "ea_fairseq")
# 2+2 layers (so EA/PA/RAN hand maps between layers), every dimension 32, 4 heads
TINY = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32",
        "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
FAMILIES = TRAINED  # family -> (arch, extra options), from tests/support/families.py
DRIVER = os.path.join(REPO, "tests", "drivers", "fairseq_train_many.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
_CACHE = {}


def train_command(data_bin, arch, save_dir, *extra, updates=3):
    return [cli("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--arch", arch, *TINY, *extra,
            "--share-all-embeddings", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "600",
            "--max-update", str(updates), "--save-dir", str(save_dir), "--no-epoch-checkpoints",
            "--disable-validation", "--cpu", "--num-workers", "0", "--no-progress-bar",
            "--log-interval", "1", "--seed", "3"]


def run(cmd, expect_ok=True, **kw):
    """Run a command; (returncode, stdout+stderr). Asserts success unless told otherwise."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=ENV, **kw)
    out = proc.stdout + proc.stderr
    if expect_ok:
        assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{out[-4000:]}"
    return proc.returncode, out


def train_many(*commands, timeout=600):
    """Run several ``train_command`` lines in one process (one import of fairseq); output."""
    return run([sys.executable, DRIVER, *(json.dumps([str(c) for c in cmd[1:]]) for cmd in commands)],
               timeout=timeout)[1]


def family_checkpoints(tmp_path_factory, data_bin):
    """family -> checkpoint_last.pt of a 3-update ``fairseq-train`` run of each family."""
    if "families" not in _CACHE:
        root = tmp_path_factory.mktemp("families")
        train_many(*(train_command(data_bin, arch, root / family, *extra)
                     for family, (arch, extra) in FAMILIES.items()))
        _CACHE["families"] = {family: root / family / "checkpoint_last.pt" for family in FAMILIES}
    return _CACHE["families"]
