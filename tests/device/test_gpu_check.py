"""scripts/gpu_check.sh's own logic, without a GPU and without the suite: its interpreter is a
stand-in (``$PYTHON``) that answers as torch, pytest and the benchmark would, so what is
checked is what the script does with their results -- the two files it leaves, the report's
failures and interrupted phases, the time limits, the exit status. (The script on the real
suite: its dry run on a CPU, in benchmarks/README.md's words.)"""
import os
import subprocess
import sys
import tarfile
import time

from conftest import REPO

SCRIPT = os.path.join(REPO, "scripts", "gpu_check.sh")

#: the stand-in interpreter: the report runs in the real one; "pytest" writes JUnit XML as
#: pytest does -- the fairseq-train/-generate part two failed pairs, the other part starts a
#: test and waits until it is interrupted (SIGINT), then writes what ran, as pytest does
STAND_IN = f"""#!/usr/bin/env bash
if [ "$1" = - ] && [ $# -eq 1 ]; then cat >/dev/null; echo "python stand-in"; exit 0; fi
if [ "$1" = - ]; then exec {sys.executable} "$@"; fi
if [ "$1" = -c ]; then case "$2" in *cuda.is_available*) echo 0;; *) exit 1;; esac; exit 0; fi
xml=; k=
for a in "$@"; do case "$a" in --junitxml=*) xml="${{a#--junitxml=}}";; esac; done
while [ $# -gt 0 ]; do [ "$1" = -k ] && k="$2"; shift; done
echo "$k" >>"$(dirname "$xml")/selections"
case "$k" in
  train_and_generate*)
    cat >"$xml" <<'EOF'
<testsuites><testsuite><testcase name="test_train_and_generate_in_low_precision"><failure message="2 of 23 pairs failed:&#10;ea-lite fp16: fairseq-generate: error: refused&#10;vanilla fp16: fairseq-train: error: overflow&#10;&#10;details"/></testcase><testcase name="test_train_and_generate_side_by_side_on_the_test_device"/></testsuite></testsuites>
EOF
    exit 1;;
  *)
    trap 'echo "<testsuites><testsuite><testcase name=\\"test_quick\\"/><testcase name=\\"test_skipped\\"><skipped message=\\"needs CUDA\\"/></testcase></testsuite></testsuites>" >"$xml"; exit 2' INT
    echo "tests/device/test_device.py::test_quick PASSED"
    echo "tests/device/test_device.py::test_slow[ea-lite] "
    for _ in $(seq 600); do sleep 0.1; done;;
esac
"""


def test_gpu_check_leaves_a_report_and_an_archive_and_keeps_its_time_limit(tmp_path):
    """The suite's 'rest' process reaches the time limit (GPU_CHECK_SECONDS=25: the phase
    gets 10 s) and is interrupted; the other reports two failed command-line pairs. OUT then
    holds the report and the archive only; the report names the failed pairs, the test
    that was running at the limit and the skip reason; the archive holds every log; the
    exit status is the suite's."""
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(stand_in), GPU_CHECK_SECONDS="25", GPU_CHECK_K="ea-lite")
    began = time.monotonic()
    proc = subprocess.run(["bash", SCRIPT, str(out)], capture_output=True, text=True, env=env, timeout=120)
    took = time.monotonic() - began
    assert proc.returncode == 1, proc.stderr
    assert took < 25 + 10, took  # the budget, and the report and the archive after it
    assert sorted(os.listdir(out)) == ["gpu_check-logs.tar.gz", "gpu_check.md"]
    report = (out / "gpu_check.md").read_text()
    assert "2 passed, 1 failed, 0 errors, 1 skipped" in report, report
    assert "(the suite's 'rest' process reached its time limit while running " \
           "tests/device/test_device.py::test_slow[ea-lite])" in report, report
    assert "* FAILED test_train_and_generate_in_low_precision: 2 of 23 pairs failed:" in report, report
    assert "  * ea-lite fp16: fairseq-generate: error: refused\n  * vanilla fp16: fairseq-train: error: overflow\n" \
        in report, report
    assert "details" not in report and "* skipped 1: needs CUDA" in report, report
    assert "the benchmark needs CUDA" in report, report
    with tarfile.open(out / "gpu_check-logs.tar.gz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
        selections = tar.extractfile("gpu_check-logs/selections").read().decode().split("\n")
    assert {"environment.txt", "suite-cli.log", "suite-cli.xml", "suite-rest.log", "suite-rest.xml",
            "report.log"} <= names, names
    assert sorted(filter(None, selections)) == ["not train_and_generate and (ea-lite)",
                                                "train_and_generate and (ea-lite)"], selections
