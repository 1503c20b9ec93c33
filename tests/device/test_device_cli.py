"""The device suite (tests/device/test_device*.py): fairseq-train then fairseq-generate on the test
device, pairs side by side; on CUDA in fp16/bf16/amp with no update skipped (fairseq's trainer
runs --fp16/--bf16/--amp only there), elsewhere the runner itself in float32."""
import math
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import ON_CUDA, REPO, THREADS, cli
from support.device_support import exact_float32, needs_cuda, report  # noqa: F401  (fixture)
from support.families import ANCHORED, FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest)


TINY = ["--encoder-layers", "2", "--decoder-layers", "2"]
CLI_CASES = [(family, "fp16") for family in ANCHORED] + [
    (family, precision) for family in ("ea-lite", "pa-lite", "ran-all-lite") for precision in ("bf16", "amp")]
# fairseq's parser makes --bf16 imply --tpu (torch_xla); this driver runs fairseq-train's
# own --bf16 path on the GPU instead (see its docstring)
BF16_TRAIN = [sys.executable, os.path.join(REPO, "tests", "drivers", "train_bf16_without_tpu.py")]


#: fairseq-train + fairseq-generate pairs running at once: each process mostly waits on its
#: own start-up (imports) and the tiny models leave the GPU idle, so the cores set the pace
#: (conftest's THREADS threads each)
CLI_WORKERS = max(1, (os.cpu_count() or 1) // THREADS)


def run(cmd, timeout=600):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:  # the command, then its output's end (its error last)
        raise AssertionError(f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


def train_and_generate(family, precision, data_bin, save, extra=()):
    """fairseq-train in the precision (``fp32``, ``fp16``, ``bf16``, ``amp``; 4 updates, loss
    scale 128 for fp16 and amp: none may be skipped for an overflow, so the logged loss
    scale stays 128), then fairseq-generate (``--fp16`` after low-precision training) with
    beam 5 translates every test sentence with finite scores; on a CPU test device both
    with ``--cpu``. Raises AssertionError saying what failed, with the command."""
    arch, options = FAMILIES[family].arch, FAMILIES[family].options
    user_dir = os.path.join(REPO, "ea_fairseq")
    device = () if ON_CUDA else ("--cpu",)
    low = precision != "fp32"
    train = [cli("fairseq-train")] if precision != "bf16" else BF16_TRAIN
    log = run([
        *train, data_bin, "--user-dir", user_dir, "--arch", arch, *TINY, *options, *extra, *device,
        "--share-all-embeddings", "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", "1e-3",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", "600", "--max-update", "4", "--no-epoch-checkpoints", "--save-dir", save,
        "--num-workers", "0", "--no-progress-bar", "--log-format", "simple", "--log-interval", "1",
        "--seed", "3", *((f"--{precision}",) if low else ()),
        *(("--fp16-init-scale", "128") if precision in ("fp16", "amp") else ()),
    ], timeout=300)
    assert "done training" in log, log[-2000:]
    assert "gradient overflow detected" not in log and "AMP: skipping this batch" not in log, log[-2000:]
    losses = re.findall(r"\bloss[= ]([-+]?(?:\d[\d.e+-]*|nan|inf))", log)  # not "loss_scale"
    assert losses and all(math.isfinite(float(x)) for x in losses), losses
    if precision in ("fp16", "amp"):
        scales = re.findall(r"\bloss_scale[= ]([\d.e+-]+)", log)
        assert scales and all(float(s) == 128 for s in scales), scales
    out = run([
        cli("fairseq-generate"), data_bin, "--user-dir", user_dir, *device,
        "--path", os.path.join(save, "checkpoint_last.pt"), *(("--fp16",) if low else ()), "--beam", "5",
        "--required-batch-size-multiple", "1", "--max-tokens", "2000", "--num-workers", "0",
    ], timeout=300)
    assert re.search(r"Generate test with beam=5: BLEU4 = \d+\.\d+", out), out[-2000:]
    scores = re.findall(r"^H-\d+\t(\S+)\t", out, flags=re.M)
    assert len(scores) == 24, out[-2000:]  # every test sentence translated
    assert all(math.isfinite(float(s)) for s in scores), scores


def train_and_generate_side_by_side(cases, data_bin, tmp_path, workers=CLI_WORKERS):
    """:func:`train_and_generate` of every ``(family, precision[, extra options])`` in
    ``cases``, ``workers`` at a time: ``{case: what failed}`` for the cases that failed (also
    reported, with each failure's error line and the time taken, as a measurement)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(index, case):
        family, precision, *extra = case
        try:
            train_and_generate(family, precision, data_bin, str(tmp_path / f"{index}-{family}-{precision}"),
                               *extra)
        except (AssertionError, subprocess.TimeoutExpired) as err:
            return f"{family} {precision}: {err}"
        return None

    began = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(one, range(len(cases)), cases))
    failures = {case: result for case, result in zip(cases, results) if result}
    report("fairseq-train/-generate pairs", pairs=len(cases), side_by_side=workers,
           seconds=round(time.monotonic() - began, 1),
           failed={" ".join(case[:2]): last_error_line(why) for case, why in failures.items()})
    return failures


@needs_cuda("fairseq-train --fp16/--bf16/--amp")
def test_train_and_generate_in_low_precision(tmp_path, tiny_data_bin):
    """:func:`train_and_generate` for every family in fp16 and EA, PA and RAN in bf16 and
    amp (:data:`CLI_CASES`), :data:`CLI_WORKERS` pairs at a time; every failure is listed."""
    failures = train_and_generate_side_by_side(CLI_CASES, tiny_data_bin, tmp_path)
    assert not failures, "\n".join([f"{len(failures)} of {len(CLI_CASES)} pairs failed:"] + [
        f"{case[0]} {case[1]}: {last_error_line(why)}" for case, why in failures.items()]) + "\n\n" + "\n\n".join(
        failures.values())


def last_error_line(text: str) -> str:
    """The line of a failed command's output that says why (its last line naming an error)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if re.search(r"error|refused|exception", line, flags=re.I)]
    return (named or lines or ["?"])[-1][:240]


def test_train_and_generate_side_by_side_on_the_test_device(tmp_path, tiny_data_bin):
    """The runner of the test above in float32 (fairseq-train's low precisions need CUDA):
    EA-Lite (at width 32: what is tested is the runner) trains and translates, and a case
    whose training fails (an alpha fairseq-train refuses) is reported with its command and
    error while the other runs beside it."""
    small = ("--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
             "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2")
    cases = [("ea-lite", "fp32", small), ("ea-lite", "fp32", ("--ea-alpha", "2"))]
    failures = train_and_generate_side_by_side(cases, tiny_data_bin, tmp_path, workers=2)
    assert list(failures) == [cases[1]], failures
    assert "fairseq-train" in failures[cases[1]] and "--ea-alpha 2" in failures[cases[1]], failures
    assert "must lie in [0, 1]" in last_error_line(failures[cases[1]]), failures
