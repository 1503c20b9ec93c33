"""The commands a test starts run with its worker's share of the cores (tests/conftest.py):
more OpenMP threads than that spin while they wait for a core the other worker holds."""
import subprocess
import sys

from conftest import THREADS


def test_a_started_command_takes_the_workers_share_of_the_cores():
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                          capture_output=True, text=True, check=True)
    assert int(proc.stdout) == THREADS
