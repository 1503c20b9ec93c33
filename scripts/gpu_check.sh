#!/usr/bin/env bash
# One-command check of a GPU machine: the device suite (tests/device/test_device*.py, the
# decoding properties, tests/attention/test_decoding_properties.py, and EA's Triton kernels
# against the float64 reference with their guards and compiled variants, tests/ops/test_triton_*.py,
# skipped without triton) on the GPU, then the GPU benchmark in fp16 and bf16 with reduced repeats
# (EA-Lite, EA-Base, RAN-ALL against their fairseq twins; in fp16 also their profile: the
# top CUDA kernels of each model and its twin, `--profile`). It leaves two files in OUT_DIR,
# whatever happens (a GPU machine may return only a few files):
#
#   OUT_DIR/gpu_check.md             the report: environment, every failure, measurements, benchmark
#   OUT_DIR/gpu_check-logs.tar.gz    every log and raw file (pytest logs and JUnit XML, the suite's
#                                    measurements, the benchmark's JSON and reports)
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# Fits in GPU_CHECK_SECONDS (default 460: under 8 minutes with the report and the archive): each
# phase gets a time limit within what is left, and a phase that reaches it is interrupted
# (SIGINT: pytest still writes what ran) and the report says so. GPU_CHECK_K='EXPR' narrows
# the suite to the tests pytest's -k EXPR selects (a quick dry run). Runs with the interpreter
# named by $PYTHON, else `python3` (on an offline GPU image: the one the wheels were installed
# into, see benchmarks/README.md), and the checkout first on PYTHONPATH. Without CUDA the suite
# runs on the CPU (its CUDA-only tests skip, saying why) and the report says the benchmark needs
# CUDA. Exit status: the suite's.
set -uo pipefail

die() { echo "gpu_check: $*" >&2; exit 2; }
[ $# -eq 1 ] || die "usage: bash scripts/gpu_check.sh OUT_DIR"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || die "no '$PY' on PATH (set PYTHON=/path/to/python)"
BUDGET="${GPU_CHECK_SECONDS:-460}"
[[ "$BUDGET" =~ ^[0-9]+$ ]] || die "GPU_CHECK_SECONDS must be a number of seconds, got '$BUDGET'"
SELECT="${GPU_CHECK_K:-}"
mkdir -p "$1" || die "cannot create $1"
OUT="$(cd "$1" && pwd)"
LOGS="$OUT/gpu_check-logs"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
rm -rf "$LOGS" "$OUT/gpu_check.md" "$OUT/gpu_check-logs.tar.gz"
mkdir -p "$LOGS" || die "cannot create $LOGS"
export EA_FAIRSEQ_DEVICE_REPORT="$LOGS/device_measurements.jsonl"
start=$(date +%s)
suite_rc=2  # until the suite has run
cli_rc=2
bench_rcs=()
cuda=0

# seconds a phase may take: at most $1, and never past the budget less $2 seconds kept for
# what follows it (at least 10)
limit() {
  local left=$(( BUDGET - ($(date +%s) - start) - $2 ))
  (( left < $1 )) && echo $(( left > 10 ? left : 10 )) || echo "$1"
}

# Whatever happens: the report from what is there, then every log into the archive.
finish() {
  "$PY" - "$LOGS" "$OUT/gpu_check.md" "$cuda" "$(( $(date +%s) - start ))" "$suite_rc" "$cli_rc" \
    "${bench_rcs[@]}" <<'EOF' >"$LOGS/report.log" 2>&1 || echo "gpu_check: the report failed, see report.log in the archive" >&2
"""Write the report from the suite's JUnit XML, its measurements and the benchmark reports."""
import json, os, sys
import xml.etree.ElementTree as ET

logs, report, cuda, seconds, suite_rc, cli_rc, *bench = sys.argv[1:]
lines = ["# GPU check", "", f"Wall time: {seconds} s. Every log and raw file: `gpu_check-logs.tar.gz`.", "",
         "## Environment", "", "```"]
env = os.path.join(logs, "environment.txt")
lines += (open(env).read().rstrip().splitlines() if os.path.exists(env) else ["(not written)"]) + ["```", ""]

def status(rc):
    return {"0": "passed", "1": "failures", "5": "no test selected", "124": "interrupted at its time limit",
            "2": "did not run or was interrupted"}.get(rc, f"exit status {rc}")

counts = {"passed": 0, "failure": 0, "error": 0, "skipped": 0}
failed, skipped = [], {}
for part, rc in (("rest", suite_rc), ("cli", cli_rc)):
    log = os.path.join(logs, f"suite-{part}.log")
    if rc == "124" and os.path.exists(log):  # pytest -v: a test's line ends with its outcome
        running = [line.split()[0] for line in open(log, errors="replace") if line.startswith("tests/")
                   and not any(o in line for o in ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS"))]
        failed.append(f"(the suite's '{part}' process reached its time limit while running "
                      f"{running[-1] if running else 'a test: see its log'})")
    path = os.path.join(logs, f"suite-{part}.xml")
    if not os.path.exists(path):
        failed.append(f"(the suite's '{part}' process wrote no report: see suite-{part}.log)")
        continue
    try:
        cases = list(ET.parse(path).getroot().iter("testcase"))
    except ET.ParseError as err:
        failed.append(f"(the suite's '{part}' report does not parse: {err}; see suite-{part}.log)")
        continue
    for case in cases:
        name = case.get("name")
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        counts[outcome] += 1
        if outcome in ("failure", "error"):
            message = (case.find(outcome).get("message") or outcome).split("\n\n")[0].splitlines()
            failed.append(f"{name}: {message[0][:300]}")
            failed += [f"  * {line[:300]}" for line in message[1:40]]
        elif outcome == "skipped":
            reason = case.find("skipped").get("message") or ""
            skipped[reason] = skipped.get(reason, 0) + 1
lines += ["## Device suite (`tests/device/test_device*.py`, `tests/attention/test_decoding_properties.py`, "
          "`tests/ops/test_triton_*.py`)", "",
          f"{counts['passed']} passed, {counts['failure']} failed, {counts['error']} errors, "
          f"{counts['skipped']} skipped (pytest: {status(suite_rc)}; the fairseq-train/-generate "
          f"runs: {status(cli_rc)}).", ""]
lines += [f"* FAILED {f}" if not f.startswith("  ") else f for f in failed] + ([""] if failed else [])
lines += [f"* skipped {n}: {reason}" for reason, n in skipped.items()] + ([""] if skipped else [])

path = os.path.join(logs, "device_measurements.jsonl")
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
    md = os.path.join(logs, f"benchmark-cuda-{dtype}.md")
    if rc == "0" and os.path.exists(md):
        lines += [open(md).read().replace("\n## ", "\n### "), ""]
    else:
        lines += [f"{dtype}: {status(rc)}; see bench-{dtype}.log.", ""]
with open(report, "w") as f:
    f.write("\n".join(lines))
print("\n".join(lines))
EOF
  tar -czf "$OUT/gpu_check-logs.tar.gz" -C "$OUT" "$(basename "$LOGS")" && rm -rf "$LOGS" ||
    echo "gpu_check: could not archive $LOGS" >&2
  echo "gpu_check: $OUT/gpu_check.md, $OUT/gpu_check-logs.tar.gz ($(( $(date +%s) - start )) s)" >&2
}
trap finish EXIT
trap 'exit 130' INT TERM

timeout 60 "$PY" - >"$LOGS/environment.txt" 2>&1 <<'EOF'
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
[ $? -eq 0 ] || { cat "$LOGS/environment.txt" >&2; die "the environment does not import (see environment.txt)"; }
cuda=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")

# The suite in two processes side by side: the fairseq-train/-generate pairs (one test that
# runs them side by side itself) and everything else (on a GPU machine in 4 pytest-xdist
# workers where it is installed). On a GPU the two benchmark runs follow it: 200 s of the
# budget are kept for them and the report.
pytest_args=(-p no:cacheprovider -v -rfEs --durations=20
             tests/device/test_device*.py tests/attention/test_decoding_properties.py
             tests/ops/test_triton_*.py)
only="${SELECT:+ and ($SELECT)}"
xdist=$([ "$cuda" = 1 ] && "$PY" -c "import xdist" 2>/dev/null && echo "-n 4")
suite_limit=$(limit 250 $([ "$cuda" = 1 ] && echo 200 || echo 20))
timeout -s INT -k 30 "$suite_limit" "$PY" -m pytest "${pytest_args[@]}" -k "train_and_generate$only" \
  --junitxml="$LOGS/suite-cli.xml" >"$LOGS/suite-cli.log" 2>&1 &
cli_pid=$!
# shellcheck disable=SC2086
timeout -s INT -k 30 "$suite_limit" "$PY" -m pytest "${pytest_args[@]}" -k "not train_and_generate$only" $xdist \
  --junitxml="$LOGS/suite-rest.xml" >"$LOGS/suite-rest.log" 2>&1
suite_rc=$?
wait "$cli_pid"
cli_rc=$?
echo "gpu_check: device suite done ($(( $(date +%s) - start )) s)" >&2

if [ "$cuda" = 1 ]; then
  for dtype in fp16 bf16; do
    timeout -s INT -k 10 "$(limit 120 $([ "$dtype" = fp16 ] && echo 90 || echo 20))" "$PY" benchmarks/benchmark.py \
      --device cuda --dtype "$dtype" --only ea_transformer_lite ea_transformer_base ran_all --beams 5 \
      --batch-sizes 1 32 128 --skip scaling --training-repeats 3 --generation-repeats 2 --out "$LOGS" \
      $([ "$dtype" = fp16 ] && echo --profile) >"$LOGS/bench-$dtype.log" 2>&1
    bench_rcs+=("$dtype:$?")
  done
fi

# passed, or (a narrowed dry run) nothing selected
{ [ "$suite_rc" -eq 0 ] || [ "$suite_rc" -eq 5 ]; } && { [ "$cli_rc" -eq 0 ] || [ "$cli_rc" -eq 5 ]; }
