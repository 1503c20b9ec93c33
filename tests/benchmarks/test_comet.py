"""COMET in ``ea-fairseq-bleu`` through its console script: BLEU and chrF always printed and
written, COMET unavailable said in one line with the real reason (exit status 3), offline
model ids refused in one line that shows ``--comet-model PATH``. The last test runs the real
unbabel-comet of a venv built from constraints-comet.txt (``scripts/setup_comet_env.sh``);
it is skipped unless ``EA_FAIRSEQ_COMET_VENV`` points to one."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
REFS = ["the cat sat on the mat", "a dog ran under the big house", "the small green house"]
HYPS = ["the cat sat on a mat", "a dog ran under the house", "the small green house"]


def _generate_output(tmp_path: Path) -> Path:
    gen = tmp_path / "generate-test.de-en.txt"
    gen.write_text("".join(f"S-{i}\tdie katze {i}\nT-{i}\t{r}\nH-{i}\t-0.1\t{h}\n"
                           for i, (r, h) in enumerate(zip(REFS, HYPS))), encoding="utf-8")
    return gen


def _bleu(bin_dir: Path, tmp_path: Path, *args, pythonpath=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # (nothing leaves this machine either way)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    gen = _generate_output(tmp_path)
    return subprocess.run([str(bin_dir / "ea-fairseq-bleu"), str(gen), "--mode", "iwslt",
                           "--out-prefix", str(tmp_path / "test.de-en"), *args],
                          capture_output=True, text=True, env=env, timeout=600)


def _stand_in(tmp_path: Path, body: str) -> Path:
    pkg = tmp_path / "site" / "comet"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    return tmp_path / "site"


def _assert_bleu_then_comet_line(res, tmp_path):
    lines = res.stdout.splitlines()
    assert res.returncode == 3, res.stderr
    assert any(line.startswith("tokenized BLEU") for line in lines[:-1])
    assert any(line.startswith("chrF") for line in lines[:-1])
    report = json.loads((tmp_path / "test.de-en.scores.json").read_text())
    assert {"tok", "chrf", "chrf++"} <= set(report["metrics"]) and "comet" not in report["metrics"]
    assert report["comet_unavailable"] in lines[-1]
    assert "Traceback" not in res.stderr
    return lines[-1]


def test_comet_not_installed_still_prints_bleu(tmp_path):
    if (BIN / "python").exists() and subprocess.run([str(BIN / "python"), "-c", "import comet"],
                                                    capture_output=True).returncode == 0:
        pytest.skip("unbabel-comet is installed in this venv")
    last = _assert_bleu_then_comet_line(_bleu(BIN, tmp_path, "--comet-model", "model.ckpt"), tmp_path)
    assert last.startswith("COMET: not scored: unbabel-comet is not installed")
    assert "scripts/setup_comet_env.sh" in last


def test_comet_import_error_is_the_real_one(tmp_path):
    """unbabel-comet present but broken (torchmetrics 0.10 on setuptools>=81): its own error,
    not "needs unbabel-comet"."""
    site = _stand_in(tmp_path, "import pkg_resources_gone_in_setuptools_81\n")
    res = _bleu(BIN, tmp_path, "--comet-model", "model.ckpt", pythonpath=site)
    last = _assert_bleu_then_comet_line(res, tmp_path)
    assert last.startswith("COMET: not scored: unbabel-comet is installed but does not import "
                           "(ModuleNotFoundError: No module named 'pkg_resources_gone_in_setuptools_81')")


def test_comet_model_id_offline_says_so_in_one_line(tmp_path):
    site = _stand_in(tmp_path, (
        "calls = []\n"
        "def download_model(model, saving_directory=None, local_files_only=False):\n"
        "    raise KeyError(f\"Model '{model}' not supported by COMET.\")\n"  # what comet says offline
        "def load_from_checkpoint(path):\n"
        "    raise AssertionError('never reached')\n"))
    res = _bleu(BIN, tmp_path, "--comet-model", "Unbabel/wmt22-comet-da", pythonpath=site)
    last = _assert_bleu_then_comet_line(res, tmp_path)
    assert "Unbabel/wmt22-comet-da is not in the local Hugging Face cache and cannot be downloaded here" in last
    assert "--comet-model PATH/checkpoints/model.ckpt" in last


def test_comet_scored_with_a_local_checkpoint(tmp_path):
    site = _stand_in(tmp_path, (
        "class _Out:\n"
        "    def __init__(self, s): self.scores = s\n"
        "class _Model:\n"
        "    def predict(self, data, batch_size=8, gpus=1):\n"
        "        return _Out([float(d['mt'] == d['ref']) for d in data])\n"
        "def load_from_checkpoint(path):\n"
        "    assert path.endswith('checkpoints/model.ckpt'), path\n"
        "    return _Model()\n"))
    snap = tmp_path / "hub" / "models--Unbabel--wmt22-comet-da" / "snapshots" / "abc"
    (snap / "checkpoints").mkdir(parents=True)
    (snap / "checkpoints" / "model.ckpt").write_text("ckpt")
    res = _bleu(BIN, tmp_path, "--comet-model", str(snap), pythonpath=site)  # the model's directory
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "COMET (Unbabel/wmt22-comet-da, mean of segment scores): 0.3333"
    report = json.loads((tmp_path / "test.de-en.scores.json").read_text())
    assert report["metrics"]["comet"]["model"] == "Unbabel/wmt22-comet-da"
    assert (tmp_path / "test.de-en.seg.comet").read_text().split() == ["0.0", "0.0", "1.0"]


@pytest.mark.skipif(not os.environ.get("EA_FAIRSEQ_COMET_VENV"),
                    reason="needs a venv with the comet extra from constraints-comet.txt: "
                           "bash scripts/setup_comet_env.sh, then EA_FAIRSEQ_COMET_VENV=.venv-comet")
def test_real_unbabel_comet_from_the_pinned_set(tmp_path):
    """The pinned set imports (numpy<2, torchmetrics 0.10 with a setuptools that has
    pkg_resources); offline, a model id is refused in one line and BLEU/chrF are printed."""
    venv_bin = Path(os.environ["EA_FAIRSEQ_COMET_VENV"]) / "bin"
    probe = subprocess.run([str(venv_bin / "python"), "-W", "ignore", "-c",
                            "import comet, numpy; print(comet.__version__, numpy.__version__)"],
                           capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split()[0] == "2.2.7"
    res = _bleu(venv_bin, tmp_path, "--comet-model", "Unbabel/wmt22-comet-da")
    last = _assert_bleu_then_comet_line(res, tmp_path)
    assert "cannot be downloaded here" in last and "does not import" not in last

    # a real COMET model (tiny, random, made here) scored end to end, offline
    model = tmp_path / "tiny-comet"
    driver = Path(__file__).parents[1] / "drivers" / "tiny_comet_model.py"
    made = subprocess.run([str(venv_bin / "python"), str(driver), str(model)], capture_output=True, text=True,
                          timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    res = _bleu(venv_bin, tmp_path, "--comet-model", str(model))  # the model's directory
    assert res.returncode == 0, res.stderr[-3000:]
    segments = [float(x) for x in (tmp_path / "test.de-en.seg.comet").read_text().split()]
    assert len(segments) == len(REFS)
    # independently: unbabel-comet's own API on the same triples (sources: the detokenized S lines)
    direct = subprocess.run([str(venv_bin / "python"), "-W", "ignore", "-c", (
        "import json, sys\n"
        "from comet import load_from_checkpoint\n"
        "m = load_from_checkpoint(sys.argv[1])\n"
        "data = json.loads(sys.argv[2])\n"
        "print(json.dumps([float(x) for x in m.predict(data, batch_size=16, gpus=0, progress_bar=False).scores]))"),
        str(model / "checkpoints" / "model.ckpt"),
        json.dumps([{"src": f"die katze {i}", "mt": h, "ref": r} for i, (h, r) in enumerate(zip(HYPS, REFS))])],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert direct.returncode == 0, direct.stderr[-3000:]
    assert segments == pytest.approx(json.loads(direct.stdout.splitlines()[-1]), abs=1e-6)
    mean = sum(segments) / len(segments)
    assert res.stdout.splitlines()[-1] == f"COMET ({model}, mean of segment scores): {mean:.4f}"
