#!/usr/bin/env bash
# Set up the pinned environment (idempotent; from scratch on a fresh clone) and run the
# test suite, then EA's own tests once more with its PyTorch reference alone
# (EA_FAIRSEQ_ACCELERATORS=0: no accelerator, as on a device none is registered for), then
# the stored-output and exactness tests once more on ATen's generic CPU kernels (below). The
# only accelerator is EA's, in float32/float64 on CPU; the decoding properties of every
# family already run with it and without it (tests/attention/test_decoding_properties.py).
# Extra arguments go to every pytest run, e.g. `bash scripts/test.sh -k causal`.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup_env.sh"
venv="${EA_FAIRSEQ_VENV:-$repo/.venv}"
cd "$repo"
export PYTHONDONTWRITEBYTECODE=1
# The CPU backend's C++ extension is built ahead (a minute on a fresh checkout, then ninja finds
# it up to date): a forward pass never compiles, and without it the PyTorch reference runs.
"$venv/bin/python" -m ea_ops.build
# One pytest-xdist worker per core (EA_FAIRSEQ_TEST_WORKERS=0: all in this process), each test file
# in one worker so its module fixtures are built once, handed out in collection order, where
# tests/conftest.py puts the end-to-end files first (HEAVY_FIRST) so both workers finish
# together; conftest.py also gives each worker and the commands it starts their share of the
# cores' threads.
"$venv/bin/python" -m pytest -q -p no:cacheprovider -rs -n "${EA_FAIRSEQ_TEST_WORKERS:-auto}" \
  --dist loadfile --no-loadscope-reorder "$@" tests
echo "[test] EA's tests with its reference implementation alone" >&2
EA_FAIRSEQ_ACCELERATORS=0 "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" \
  tests/attention/test_ea_exactness.py tests/attention/test_ea_model.py \
  tests/attention/test_ea_equation.py
# The tests that compare with stored outputs or hold two computations equal, once more with
# ATEN_CPU_CAPABILITY=default: ATen's generic kernels instead of the AVX2/AVX-512 ones the
# first run picked for this CPU (other summation orders, no vector exp/log), so that no bound
# or equality holds only on the instruction set of the machine it was written on. EA's C++
# CPU accelerator is its own code and runs as before; only ATen's kernels change.
echo "[test] stored outputs and exactness on ATen's generic CPU kernels" >&2
ATEN_CPU_CAPABILITY=default "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  -n "${EA_FAIRSEQ_TEST_WORKERS:-auto}" --dist loadfile "$@" \
  tests/attention/test_checkpoint_fixtures.py tests/attention/test_ea_exactness.py \
  tests/attention/test_ea_equation.py \
  tests/attention/test_attention_module.py tests/attention/test_families.py::test_reduces_to_its_twin \
  tests/attention/test_baseline_drop_attention.py::test_without_the_flag_it_is_fairseqs_transformer \
  tests/attention/test_decoding_properties.py::test_incremental_equals_full_pass_with_beam_reorders \
  tests/ops/test_dispatch.py::test_both_backends_agree_wherever_both_may_run \
  tests/ops/test_accelerator_cpu.py::test_accelerated_full_pass_equals_the_reference_with_gradients
