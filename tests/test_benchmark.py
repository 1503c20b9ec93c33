"""The benchmark script runs end to end and merges separate runs into one report.

Timings themselves are never asserted (a unit test is no place to time anything); what is
checked is that every requested measurement is made, side by side with its twin, and
reported as a ratio.
"""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bench(out, *args):
    subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--quick", "--out", str(out),
                    "--beams", "1", "--batch-sizes", "2", *args], check=True, capture_output=True, text=True)


def test_benchmark_runs_and_appends(tmp_path):
    bench(tmp_path, "--only", "ran_all_lite")
    bench(tmp_path, "--only", "ea_transformer_lite", "--skip", "training", "memory", "--append",
          "--fairseq-reorder")
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

    md = (tmp_path / "benchmark.md").read_text()
    assert "| ran_all_lite | transformer_lite |" in md
    assert "| ea_transformer_lite | 1000 | 1 | 2 |" in md
    assert md.count("Run of ") == 2
    assert md.count("(`--fairseq-reorder`)") == 1


def benchmark_module():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import benchmark
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return benchmark


def test_interleaved_runs_alternate_which_side_goes_first():
    benchmark = benchmark_module()
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
