"""fairseq's distributed training on CPU: 2 processes (gloo, legacy_ddp) stay identical."""
import os
import socket
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from support.families import FAMILIES

DRIVER = os.path.join(REPO, "tests", "drivers", "train_and_dump_rank.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("arch", [FAMILIES["ea-lite"].arch])
def test_two_cpu_processes_train_identical_replicas(tmp_path, tiny_data_bin, arch):
    port = free_port()
    env = dict(os.environ, EA_DUMP_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    common = [
        sys.executable, DRIVER, tiny_data_bin, "--user-dir", os.path.join(REPO, "ea_fairseq"),
        "--arch", arch, "--encoder-layers", "2", "--decoder-layers", "2",
        "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "400", "--max-update", "4",
        "--dropout", "0.1", "--save-dir", str(tmp_path / "ckpt"), "--no-epoch-checkpoints",
        "--no-progress-bar", "--log-interval", "1", "--cpu", "--num-workers", "0",
        "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-world-size", "2",
        "--distributed-no-spawn", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
    ]
    procs = [
        subprocess.Popen(common + ["--distributed-rank", str(r)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    assert "num_updates 4" in logs[0] or "num_updates=4" in logs[0], logs[0][-2000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert r0.keys() == r1.keys()
    assert any(k.endswith("self_attn.conv.weight") for k in r0)
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k
    assert os.path.exists(tmp_path / "ckpt" / "checkpoint_last.pt")
