"""Every architecture through the real command-line tools, as a user runs them:
fairseq-train (--user-dir) -> ea-fairseq-average-checkpoints -> fairseq-generate --beam 5."""
import os
import re
import subprocess

import pytest

from conftest import REPO, cli

TINY = ["--encoder-layers", "2", "--decoder-layers", "2"]
CASES = {
    "transformer_lite": [],
    "ea_transformer_lite": [],
    "ea_transformer_lite+dropattention": ["--drop-attention", "element", "--drop-attention-p", "0.2",
                                          "--drop-attention-window", "2"],
    "pa_transformer_lite": [],
    "ran_e_lite": [],
    "ran_d_lite": [],
    "ran_all_lite": [],
    "hcsa_lite": [],
    "syn_r_lite": [],
    "conv_transformer_lite": [],
    "pa_conv_transformer_lite": [],
    "realformer_lite": [],
    "resformer_lite": [],
}


def run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_train_average_generate(tmp_path, tiny_data_bin, case):
    arch = case.split("+")[0]
    save = str(tmp_path / "ckpt")
    user_dir = os.path.join(REPO, "ea_fairseq")
    log = run([
        cli("fairseq-train"), tiny_data_bin, "--user-dir", user_dir, "--arch", arch, *TINY, *CASES[case],
        "--share-all-embeddings", "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", "1e-3",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", "600", "--max-update", "6", "--save-interval-updates", "2",
        "--no-epoch-checkpoints", "--save-dir", save, "--cpu", "--num-workers", "0",
        "--no-progress-bar", "--log-interval", "1", "--seed", "3",
    ])
    assert "done training" in log
    avg = str(tmp_path / "averaged.pt")
    run([cli("ea-fairseq-average-checkpoints"), "--inputs", save,
         "--num-update-checkpoints", "2", "--output", avg])
    out = run([
        cli("fairseq-generate"), tiny_data_bin, "--user-dir", user_dir, "--path", avg,
        "--beam", "5", "--max-tokens", "2000", "--cpu", "--num-workers", "0",
    ])
    assert re.search(r"Generate test with beam=5: BLEU4 = \d+\.\d+", out), out[-2000:]
    assert len(re.findall(r"^H-\d+", out, flags=re.M)) == 24  # every test sentence translated
