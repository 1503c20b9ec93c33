"""The command-line tools as a user meets them: ``--help`` answers without importing torch or
fairseq, nothing below WARNING on stderr (fairseq's import sets the root logger to DEBUG),
``--tensorboard-logdir`` writes event files, and learning curves from real fairseq-train
logs (``--log-format json`` and ``simple``)."""
import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, cli
from ea_fairseq_cli import curves

TOOLS = ("ea-fairseq-bleu", "ea-fairseq-compare", "ea-fairseq-average-checkpoints", "ea-fairseq-analysis",
         "ea-fairseq-options")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env(**extra):
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra)


@pytest.mark.parametrize("tool", TOOLS)
def test_help_imports_neither_torch_nor_fairseq(tool):
    """``--help`` of every console tool: no torch, no fairseq, no tensorboardX hint (the
    modules a process imports are what ``-X importtime`` lists)."""
    start = time.perf_counter()
    proc = subprocess.run([cli(tool), "--help"], capture_output=True, text=True,
                          env=_env(PYTHONPROFILEIMPORTTIME="1"), cwd=REPO)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0 and proc.stdout.startswith("usage: " + tool)
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert imported and not imported & {"torch", "fairseq", "matplotlib", "sacrebleu"}, sorted(imported)
    assert "tensorboardX" not in proc.stderr
    print(f"{tool} --help: {elapsed:.2f} s")


def test_importing_the_plugin_leaves_the_root_logger_alone():
    code = ("import logging; import ea_fairseq; from fairseq.models import ARCH_MODEL_REGISTRY; "
            "print(logging.getLogger().level, 'ea_transformer_lite' in ARCH_MODEL_REGISTRY)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(logging.WARNING), "True"]
    assert proc.stderr == ""  # no tensorboardX hint, no INFO


def _fake_dump(path):
    """A dump as ``ea-fairseq-analysis dump`` writes it (two layers, four heads, one head
    near-uniform), without a model."""
    rng = np.random.default_rng(0)
    tokens = {"source": ["a", "b@@", "c", "d", "e", "f", "</s>"], "target": ["x", "y", "z", "w", "</s>"]}
    tokens["decoder_input"] = ["</s>"] + tokens["target"][:-1]
    arrays, kinds = {}, {}
    for attention, (t, s) in {"encoder.self": (7, 7), "decoder.self": (5, 5), "decoder.cross": (5, 7)}.items():
        logits = rng.normal(size=(2, 4, t, s)).astype("float32")
        logits[:, 1] *= 0.02
        e = np.exp(logits - logits.max(-1, keepdims=True))
        arrays[f"0/{attention}/weights"] = (e / e.sum(-1, keepdims=True)).astype("float32")
        arrays[f"0/{attention}/logits"] = logits
        arrays[f"0/{attention}/convolution"] = 40 * logits
        kinds[attention] = ["weights", "logits", "convolution"]
    meta = {"format": "ea_fairseq.analysis dump v1", "sentences": [{"id": 0, **tokens, "maps": kinds}]}
    arrays["meta.json"] = np.array(json.dumps(meta))
    np.savez_compressed(path, **arrays)


def test_plot_writes_nothing_below_warning_to_stderr(tmp_path):
    _fake_dump(tmp_path / "d.npz")
    for args in (["maps", str(tmp_path / "d.npz"), "--kind", "all"], ["kinds", str(tmp_path / "d.npz")]):
        proc = subprocess.run([cli("ea-fairseq-analysis"), "plot", *args, "--out-dir", str(tmp_path / "fig")],
                              capture_output=True, text=True, env=_env(), cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stderr == "", proc.stderr[:2000]
    pngs = sorted(os.listdir(tmp_path / "fig"))
    assert len(pngs) == 9 + 3
    for name in pngs:
        assert (tmp_path / "fig" / name).read_bytes()[:8] == PNG_MAGIC


@pytest.fixture(scope="module")
def train_logs(tiny_data_bin, tmp_path_factory):
    """Two tiny fairseq-train runs side by side (2 epochs, 2 updates each, --eval-bleu):
    --log-format json with --tensorboard-logdir, and --log-format simple."""
    root = tmp_path_factory.mktemp("train_logs")
    common = [cli("fairseq-train"), tiny_data_bin, "--user-dir", os.path.join(REPO, "ea_fairseq"),
              "--arch", "transformer_lite", "--encoder-layers", "1", "--decoder-layers", "1",
              "--share-all-embeddings", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "2000",
              "--max-epoch", "2", "--no-save", "--cpu", "--num-workers", "0", "--seed", "1", "--log-interval", "1",
              "--eval-bleu", "--eval-bleu-args", '{"beam": 1, "max_len_b": 8}', "--eval-bleu-detok", "space"]
    runs = {"json": ["--log-format", "json", "--tensorboard-logdir", str(root / "tb")],
            "simple": ["--log-format", "simple"]}
    procs = {}
    for name, extra in runs.items():
        (root / name).mkdir()
        log = open(root / name / "train.log", "w")
        # Each run owns its save dir: fairseq-train probes it (writes and removes
        # <save-dir>/dummy) even with --no-save, so two runs sharing one race.
        save = ["--save-dir", str(root / name / "checkpoints")]
        procs[name] = (subprocess.Popen(common + extra + save, stdout=log, stderr=subprocess.STDOUT,
                                        env=_env(), cwd=root / name), log)
    for name, (proc, log) in procs.items():
        assert proc.wait(timeout=600) == 0, (root / name / "train.log").read_text()[-3000:]
        log.close()
    return root


def test_tensorboard_logdir_writes_event_files(train_logs):
    for subset in ("train", "train_inner", "valid"):
        events = list((train_logs / "tb" / subset).glob("events.out.tfevents.*"))
        assert len(events) == 1, subset
        data = events[0].read_bytes()
        assert b"loss" in data  # the scalars' tags are stored as plain strings
    assert b"bleu" in next((train_logs / "tb" / "valid").glob("events.out.tfevents.*")).read_bytes()


@pytest.mark.parametrize("fmt", ["json", "simple"])
def test_parse_real_fairseq_train_logs(train_logs, fmt):
    records = curves.parse_log(str(train_logs / fmt / "train.log"))
    assert [r["num_updates"] for r in records["train_inner"]] == [1.0, 2.0, 3.0, 4.0]
    assert [(r["epoch"], r["num_updates"]) for r in records["train"]] == [(1.0, 2.0), (2.0, 4.0)]
    assert [(r["epoch"], r["num_updates"]) for r in records["valid"]] == [(1.0, 2.0), (2.0, 4.0)]
    assert all(r["loss"] > 0 and "bleu" in r for r in records["valid"])
    assert records["train"][1]["loss"] < records["train_inner"][0]["loss"]


def test_json_and_simple_logs_hold_the_same_numbers(train_logs):
    """Same seed, same data: both formats give the same statistics (to their printed digits)."""
    a = curves.parse_log(str(train_logs / "json" / "train.log"))
    b = curves.parse_log(str(train_logs / "simple" / "train.log"))
    for kind in ("train_inner", "train", "valid"):
        assert [round(r["loss"], 2) for r in a[kind]] == [round(r["loss"], 2) for r in b[kind]], kind


def test_curves_plot_from_logs(train_logs, tmp_path):
    out = tmp_path / "curves.png"
    proc = subprocess.run([cli("ea-fairseq-analysis"), "plot", "curves", str(train_logs / "json" / "train.log"),
                           str(train_logs / "simple" / "train.log"), "-o", str(out)],
                          capture_output=True, text=True, env=_env(), cwd=REPO)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert out.read_bytes()[:8] == PNG_MAGIC and proc.stdout.strip() == f"wrote {out}"
    (tmp_path / "other.log").write_text("not a training log\n")
    proc = subprocess.run([cli("ea-fairseq-analysis"), "plot", "curves", str(tmp_path / "other.log"), "-o", str(out)],
                          capture_output=True, text=True, env=_env(), cwd=REPO)
    assert proc.returncode == 1 and proc.stderr.strip().endswith("SAVE_DIR/train.log)")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("show", ["", "1"])
def test_known_warnings_of_fairseqs_stack_are_ignored_and_others_shown(show, monkeypatch):
    """Each known warning, as its library words it, is not shown; any other warning, of the
    same category and the same libraries, is (negative control); EA_FAIRSEQ_SHOW_WARNINGS=1
    shows them all."""
    import warnings

    from ea_fairseq import known_warnings

    monkeypatch.setenv("EA_FAIRSEQ_SHOW_WARNINGS", show)
    emitted = [
        (UserWarning, "hydra.experimental.initialize() is no longer experimental. Use hydra.initialize()"),
        (UserWarning, "hydra.experimental.compose() is no longer experimental. Use hydra.compose()"),
        (DeprecationWarning, "\nThe version_base parameter is not specified.\nHydra will assume defaults"),
        (UserWarning, "In 'config': Usage of deprecated keyword in package header '# @package _group_'."),
        (UserWarning, "\n'config' is validated against ConfigStore schema with the same name.\nThis behavior"),
        (UserWarning, "\nThe strict flag in the compose API is deprecated.\nSee https://hydra.cc/docs"),
        (UserWarning, "'pin_memory' argument is set as true but no accelerator is found, then device pinned"),
        (FutureWarning, "`torch.cuda.amp.autocast(args...)` is deprecated. Please use `torch.amp.autocast('cuda', "
                        "args...)` instead."),
        (UserWarning, "Support for mismatched key_padding_mask and attn_mask is deprecated. Use same type for both "
                      "instead."),
    ]
    others = [(UserWarning, "hydra.compose() got an unknown override"), (UserWarning, "pin_memory is slow"),
              (FutureWarning, "`torch.cuda.amp.autocast` keeps its dtype"), (UserWarning, "Support for masks")]
    with warnings.catch_warnings(record=True) as caught:  # the filters installed are undone on exit
        warnings.simplefilter("always")
        known_warnings.install()
        for category, message in emitted + others:
            warnings.warn(message, category)
    assert [str(w.message) for w in caught] == [m for _, m in (emitted if show else []) + others]
