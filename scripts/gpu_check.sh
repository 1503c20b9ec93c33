#!/usr/bin/env bash
# One-command check of a GPU machine: the device suite (tests/test_device.py and the decoding
# properties, tests/test_decoding_properties.py) on the GPU, then
# the GPU benchmark in fp16 and bf16 (EA-Lite, EA-Base, RAN-ALL against their fairseq twins),
# and one report, OUT_DIR/gpu_check.md, with every log beside it. Sized to finish in under
# 10 minutes on one modern GPU (reduced repeats; the full benchmark is benchmarks/benchmark.py).
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# Runs with the interpreter named by $PYTHON, else `python3` (on an offline GPU image: the one
# the wheels were installed into, see the README's GPU section), and the checkout first on
# PYTHONPATH. Without CUDA the suite runs on the CPU (its CUDA-only tests skip, saying why)
# and the report says the benchmark needs CUDA. Exit status: the suite's.
set -uo pipefail

die() { echo "gpu_check: $*" >&2; exit 2; }
[ $# -eq 1 ] || die "usage: bash scripts/gpu_check.sh OUT_DIR"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || die "no '$PY' on PATH (set PYTHON=/path/to/python)"
mkdir -p "$1" || die "cannot create $1"
OUT="$(cd "$1" && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export EA_FAIRSEQ_DEVICE_REPORT="$OUT/device_measurements.jsonl"
rm -f "$EA_FAIRSEQ_DEVICE_REPORT" "$OUT"/suite-*.xml "$OUT"/benchmark-cuda-*.{json,md}
start=$(date +%s)

"$PY" - >"$OUT/environment.txt" 2>&1 <<'EOF'
import platform, sys
import torch
import fairseq
import ea_fairseq
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version())
print("fairseq", fairseq.__version__, "ea_fairseq", ea_fairseq.__file__)
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        print(f"cuda:{i}", torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
else:
    print("no CUDA device: the suite runs on the CPU")
EOF
[ $? -eq 0 ] || { cat "$OUT/environment.txt" >&2; die "the environment does not import (see $OUT/environment.txt)"; }
cuda=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")

# The suite in three processes side by side: the fairseq-train/-generate runs (subprocesses,
# CUDA only) in fp16 and in the other precisions, and everything else.
pytest_args=(-p no:cacheprovider -rfEs --durations=15 tests/test_device.py tests/test_decoding_properties.py)
cli=test_train_and_generate_in_low_precision
limit=$([ "$cuda" = 1 ] && echo 300 || echo 1200)  # on a CPU: every test runs there, no benchmark
timeout "$limit" "$PY" -m pytest "${pytest_args[@]}" -k "$cli and fp16" --junitxml="$OUT/suite-cli-fp16.xml" \
  >"$OUT/suite-cli-fp16.log" 2>&1 &
fp16_pid=$!
timeout "$limit" "$PY" -m pytest "${pytest_args[@]}" -k "$cli and not fp16" --junitxml="$OUT/suite-cli-other.xml" \
  >"$OUT/suite-cli-other.log" 2>&1 &
other_pid=$!
timeout "$limit" "$PY" -m pytest "${pytest_args[@]}" -k "not $cli" --junitxml="$OUT/suite-rest.xml" \
  >"$OUT/suite-rest.log" 2>&1
rest_rc=$?
wait "$fp16_pid"
fp16_rc=$?
wait "$other_pid"
other_rc=$?
cli_rc=0  # 5: no test selected
for rc in "$fp16_rc" "$other_rc"; do [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || cli_rc=$rc; done
echo "gpu_check: device suite done ($(( $(date +%s) - start )) s)" >&2

bench_rcs=()
if [ "$cuda" = 1 ]; then
  for dtype in fp16 bf16; do
    timeout 120 "$PY" benchmarks/benchmark.py --device cuda --dtype "$dtype" \
      --only ea_transformer_lite ea_transformer_base ran_all --beams 5 --batch-sizes 1 32 128 \
      --skip scaling --training-repeats 3 --generation-repeats 2 --out "$OUT" >"$OUT/bench-$dtype.log" 2>&1
    bench_rcs+=("$dtype:$?")
  done
fi

"$PY" - "$OUT" "$cuda" "$(( $(date +%s) - start ))" "$rest_rc" "$cli_rc" "${bench_rcs[@]}" <<'EOF'
"""Write OUT/gpu_check.md from the suite's JUnit XML, its measurements and the benchmark reports."""
import json, os, sys
import xml.etree.ElementTree as ET

out, cuda, seconds, rest_rc, cli_rc, *bench = sys.argv[1:]
lines = ["# GPU check", "", f"Wall time: {seconds} s. Logs and raw files: `{out}`.", "", "## Environment", "", "```"]
lines += open(os.path.join(out, "environment.txt")).read().rstrip().splitlines() + ["```", ""]

counts = {"passed": 0, "failure": 0, "error": 0, "skipped": 0}
failed, skipped = [], {}
for part in ("rest", "cli-fp16", "cli-other"):
    path = os.path.join(out, f"suite-{part}.xml")
    if not os.path.exists(path):
        failed.append(f"(the suite's '{part}' process wrote no report: see suite-{part}.log)")
        continue
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name")
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        counts[outcome] += 1
        if outcome in ("failure", "error"):
            message = (case.find(outcome).get("message") or "").splitlines()
            failed.append(f"{name}: {message[0][:300] if message else outcome}")
        elif outcome == "skipped":
            reason = case.find("skipped").get("message") or ""
            skipped[reason] = skipped.get(reason, 0) + 1
lines += ["## Device suite (`tests/test_device.py`, `tests/test_decoding_properties.py`)", "",
          f"{counts['passed']} passed, {counts['failure']} failed, {counts['error']} errors, "
          f"{counts['skipped']} skipped (pytest exit status {rest_rc}, and {cli_rc} for the "
          "fairseq-train/-generate runs; 124: timed out).", ""]
lines += [f"* FAILED {f}" for f in failed] + ([""] if failed else [])
lines += [f"* skipped {n}: {reason}" for reason, n in skipped.items()] + ([""] if skipped else [])

path = os.path.join(out, "device_measurements.jsonl")
if os.path.exists(path):
    lines += ["### Measurements", ""]
    for row in map(json.loads, open(path)):
        row.pop("per_map", None)
        lines.append(f"* {row.pop('measurement')}: `{json.dumps(row)}`")
    lines.append("")

lines += ["## Benchmark (fp16, bf16; reduced repeats)", ""]
if cuda != "1":
    lines += ["Not run: the benchmark needs CUDA (torch sees no CUDA device here).", ""]
for item in bench:
    dtype, rc = item.split(":")
    md = os.path.join(out, f"benchmark-cuda-{dtype}.md")
    if rc == "0" and os.path.exists(md):
        lines += [open(md).read().replace("\n## ", "\n### "), ""]
    else:
        lines += [f"{dtype}: exit status {rc} (124: timed out); see bench-{dtype}.log.", ""]
with open(os.path.join(out, "gpu_check.md"), "w") as f:
    f.write("\n".join(lines))
print("\n".join(lines))
EOF
[ "$rest_rc" -eq 0 ] && [ "$cli_rc" -eq 0 ]
