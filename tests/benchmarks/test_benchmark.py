"""The benchmark script runs end to end and merges separate runs into one report.

Timings themselves are never asserted (a unit test is no place to time anything); what is
checked is that every requested measurement is made, side by side with its twin, and
reported as a ratio.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


#: one torch thread in the benchmark and its memory probes: the suite runs them beside other tests on
#: few cores, where a second OpenMP thread mostly spins (twice the CPU time for the same work); these
#: tests check what is measured and reported, never how fast
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def bench(out, *args):
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "benchmark.py"), "--quick", "--out", str(out),
                    "--beams", "1", "--batch-sizes", "2", *args], check=True, capture_output=True, text=True,
                   env=ONE_THREAD)


def numbers(tree):
    """Every number in a JSON tree."""
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in numbers(v)]
    if isinstance(tree, list):
        return [x for v in tree for x in numbers(v)]
    return [tree] if isinstance(tree, (int, float)) and not isinstance(tree, bool) else []


def check_mixed_precision_report(out, device, dtype):
    """A quick run of ea_transformer_lite in ``dtype`` on ``device`` wrote its own report,
    with every measurement finite and the setting recorded."""
    assert not (out / "benchmark.json").exists()  # the CPU float32 report is left alone
    report = json.loads((out / f"benchmark-{device}-{dtype}.json").read_text())
    (run,) = report["runs"]
    assert (run["machine"]["device"], run["machine"]["dtype"]) == (device, dtype)
    assert run["machine"]["torch"] == torch.__version__
    for section in ("training", "memory", "generation"):
        values = numbers(report[section]["ea_transformer_lite"])
        assert values and all(math.isfinite(v) for v in values), section
    training = report["training"]["ea_transformer_lite"]
    assert training["ratio"]["median"] > 0
    assert set(training["skipped_updates"]) == {"ea_transformer_lite", "transformer_lite"}
    assert report["memory"]["ea_transformer_lite"]["transformer_lite"]["step_peak_mib"] > 0
    md = (out / f"benchmark-{device}-{dtype}.md").read_text()
    assert f"higher is faster), {device} {dtype}" in md and "FP16Optimizer" in md
    assert "| ea_transformer_lite | transformer_lite |" in md
    assert "| ea_transformer_lite | 1000 | 1 | 2 |" in md
    return report


def test_benchmark_runs_and_appends(tmp_path):
    bench(tmp_path, "--only", "ran_all_lite")
    bench(tmp_path, "--only", "ea_transformer_lite", "--skip", "training", "memory", "--append",
          "--fairseq-reorder", "--profile")
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert [run["archs"] for run in report["runs"]] == [["ran_all_lite"], ["ea_transformer_lite"]]
    assert report["runs"][0]["machine"]["freed_memory_kept"] in (True, False)
    assert [run["machine"]["fairseq_reorder"] for run in report["runs"]] == [False, True]

    training = report["training"]["ran_all_lite"]
    assert training["ratio"]["median"] > 0 and len(training["batches"]) == 3
    assert set(training["tokens_per_s"]) == {"ran_all_lite", "transformer_lite"}
    memory = report["memory"]["ran_all_lite"]
    assert memory["ratio"] > 0 and memory["transformer_lite"]["step_peak_mib"] > 0

    for arch in ("ran_all_lite", "ea_transformer_lite"):
        (row,) = report["generation"][arch]
        assert (row["beam"], row["batch"]) == (1, 2)
        assert set(row["sentences_per_s"]) == {arch, "transformer_lite"}
        assert row["ratio"]["median"] > 0
    # the second run's scaling rows join the first's (read back from JSON)
    assert set(report["scaling"]) == {"ran_all_lite", "ea_transformer_lite", "transformer_lite"}

    # detected, per side: fairseq's fused call for the twin's self-attentions in training,
    # the unfused weights RAN needs in every attention
    paths = report["attention_paths"]
    assert set(paths) == {"ran_all_lite", "ea_transformer_lite"}
    for arch in paths:
        assert set(paths[arch][arch]) == {"training", "decoding"}
    twin = paths["ran_all_lite"]["transformer_lite"]
    assert twin["training"]["encoder self"].startswith("fused") and twin["training"]["decoder self"].startswith("fused")
    assert twin["decoding"]["decoder self"] == "unfused"  # incremental: fairseq's own path
    assert set(paths["ran_all_lite"]["ran_all_lite"]["training"].values()) == {"unfused"}

    # --profile: each side's operations by self time, for training updates and a beam search
    assert set(report["profile"]) == {"ea_transformer_lite"}
    profile = report["profile"]["ea_transformer_lite"]
    for name in ("ea_transformer_lite", "transformer_lite"):
        for phase in ("training", "generation"):
            table = profile[name][phase]
            assert table["what"] == "CPU operations" and table["calls"] > 0 and table["total_ms"] > 0
            assert 0 < len(table["top"]) <= 20 and any(r["name"].startswith("aten::") for r in table["top"])
            assert [r["ms"] for r in table["top"]] == sorted((r["ms"] for r in table["top"]), reverse=True)

    md = (tmp_path / "benchmark.md").read_text()
    assert "### Where the time goes: ea_transformer_lite vs transformer_lite" in md
    assert "### Attention path each side ran" in md and "| transformer_lite (twin of ran_all_lite) | " in md
    assert "| ran_all_lite | transformer_lite |" in md
    assert "| ea_transformer_lite | 1000 | 1 | 2 |" in md
    assert md.count("Run of ") == 2
    assert md.count("(`--fairseq-reorder`)") == 1


def benchmark_module(name="benchmark"):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    return benchmark


def _imported_after(*argv):
    """Which of torch/fairseq the benchmark's command line imported, and its output."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['benchmark.py', *{list(argv)!r}]\n"
            "try:\n"
            f"    runpy.run_path({str(REPO / 'benchmarks' / 'benchmark.py')!r}, run_name='__main__')\n"
            "except SystemExit as exc:\n"
            "    print('exit', exc.code)\n"
            "print('imported', [m for m in ('torch', 'fairseq', 'ea_fairseq') if m in sys.modules])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return proc.stdout.splitlines()[-1], proc


@pytest.fixture(scope="module")
def cuda_asked_for(tmp_path_factory):
    """``--device cuda`` where torch sees no CUDA device (None where it sees one): a command that
    measures, so it loads torch and the plugin before it refuses; one process for the two tests
    that read it."""
    if torch.cuda.is_available():
        return None
    out = tmp_path_factory.mktemp("cuda_out")
    last, proc = _imported_after("--device", "cuda", "--out", str(out))
    return last, proc, out


def test_help_answers_without_importing_torch(cuda_asked_for):
    last, proc = _imported_after("--help")
    assert last == "imported []", proc.stderr
    assert "--device {cpu,cuda}" in proc.stdout and "exit 0" in proc.stdout
    # a bad option is refused by the parser, before anything heavy is loaded
    last, proc = _imported_after("--only", "no_such_arch")
    assert last == "imported []" and "exit 2" in proc.stdout and "invalid choice" in proc.stderr
    # negative control: a command that measures loads torch and the plugin
    last, _, _ = cuda_asked_for or ("imported ['torch', 'fairseq', 'ea_fairseq']", None, None)
    assert last == "imported ['torch', 'fairseq', 'ea_fairseq']"


def test_interleaved_runs_alternate_which_side_goes_first():
    benchmark = benchmark_module("measure")
    calls = []
    times = benchmark.interleaved({"arch": lambda: calls.append("a"), "twin": lambda: calls.append("t")},
                                  repeats=4, warmup=0)
    assert "".join(calls) == "atta" * 2
    assert [len(v) for v in times.values()] == [4, 4]


def test_an_appended_run_replaces_only_the_generation_rows_it_measured():
    """A later run of an arch at one more batch size keeps the earlier run's other rows."""
    row = lambda vocab, beam, batch, ratio: {"vocab": vocab, "beam": beam, "batch": batch,  # noqa: E731
                                             "ratio": {"median": ratio}}
    earlier = [row(32000, 5, 1, 1.0), row(32000, 5, 32, 1.1), row(32000, 1, 1, 0.9)]
    later = [row(32000, 5, 128, 1.2), row(32000, 5, 32, 1.15)]
    merged = benchmark_module().merge_generation_rows(earlier, later)
    assert [(r["beam"], r["batch"], r["ratio"]["median"]) for r in merged] == [
        (5, 1, 1.0), (5, 32, 1.15), (5, 128, 1.2), (1, 1, 0.9)]


def test_bf16_on_cpu_trains_and_generates_in_its_own_report(tmp_path):
    bench(tmp_path, "--only", "ea_transformer_lite", "--skip", "scaling", "--dtype", "bf16")
    report = check_mixed_precision_report(tmp_path, "cpu", "bf16")
    # bf16 has no loss scaler: no update is ever skipped
    assert set(report["training"]["ea_transformer_lite"]["skipped_updates"].values()) == {0}


def test_cuda_is_refused_with_what_to_do_where_there_is_none(cuda_asked_for):
    if cuda_asked_for is None:
        pytest.skip("this machine has CUDA: nothing to refuse")
    _, proc, out = cuda_asked_for
    assert "exit 2" in proc.stdout  # argparse's usage error, before anything is measured
    assert "--device cuda: torch.cuda.is_available() is False" in proc.stderr
    assert "leave out --device" in proc.stderr
    assert not list(out.iterdir())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cuda_quick_run(tmp_path, dtype):
    bench(tmp_path, "--only", "ea_transformer_lite", "--skip", "scaling", "--device", "cuda", "--dtype", dtype)
    report = check_mixed_precision_report(tmp_path, "cuda", dtype)
    machine = report["runs"][0]["machine"]
    assert machine["device_name"] == torch.cuda.get_device_name() and machine["cuda"] == torch.version.cuda
    memory = report["memory"]["ea_transformer_lite"]
    for name in ("ea_transformer_lite", "transformer_lite"):
        assert memory[name]["peak_mib"] >= memory[name]["step_peak_mib"] > 0
    assert "; peak " in (tmp_path / f"benchmark-cuda-{dtype}.md").read_text()


def test_reports_are_named_by_device_and_dtype():
    benchmark = benchmark_module()
    assert benchmark.report_name("cpu", "fp32") == "benchmark"  # the report as it always was
    assert benchmark.report_name("cuda", "fp16") == "benchmark-cuda-fp16"
    # runs recorded before --device and --dtype existed ran on CPU in float32
    assert benchmark.setting({"machine": {"cpu": "x"}}) == ("cpu", "fp32")


class TinyTranslator(torch.nn.Module):
    """Stands for a fairseq model in ``train_step``: ``model(src, lengths, prev)[0]`` is logits."""

    def __init__(self, vocab=12, dim=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, src, lengths, prev):
        return (self.out(self.embed(prev) + self.embed(src).mean(1, keepdim=True)),)


def test_mixed_precision_updates_keep_float32_master_weights_and_skip_overflows():
    benchmark = benchmark_module("measure")
    torch.manual_seed(0)
    model = benchmark.place(TinyTranslator(), dtype="fp16")
    opt = benchmark.optimizer(model, dtype="fp16")
    data = (torch.randint(4, 12, (3, 5)), torch.full((3,), 5), torch.randint(4, 12, (3, 6)),
            torch.randint(4, 12, (3, 6)))
    before = model.out.weight.detach().clone()
    benchmark.train_step(model, opt, data, pad=1)
    assert opt.skipped_updates == 0 and not torch.equal(model.out.weight, before)
    assert model.out.weight.dtype == torch.float16
    assert all(p.dtype == torch.float32 for p in opt.fp32_params)
    # the model's weights are the float32 master weights, rounded
    assert torch.equal(model.out.weight, opt.fp32_params[-2].detach().half())

    opt.scaler.loss_scale = 1e38  # the scaled loss overflows: fairseq skips the update
    before = model.out.weight.detach().clone()
    benchmark.train_step(model, opt, data, pad=1)
    assert opt.skipped_updates == 1 and torch.equal(model.out.weight, before)
    assert opt.scaler.loss_scale == 5e37  # and halves the loss scale
