"""What one attention call runs, traced (benchmarks/call_trace.py) for every family: the
research code's path never meets the loader's guards, and after the first call of a kind the
backend is not chosen again (no condition of ea_ops.dispatch evaluated per call, which a GPU
would pay for on the host at every layer and step)."""
import pytest

from support.families import FAMILIES
from support.quality_support import benchmarks_module

SIZES = ("--encoder-layers", "2", "--decoder-layers", "2")  # a second layer: the maps handed between layers
GUARDS = ("ea_fairseq/safety/", "ea_fairseq/errors.py", "ea_fairseq/side_effects.py", "ea_fairseq/hydra_checks.py")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_an_attention_call_runs_no_guard_and_chooses_no_backend_again(name):
    trace = benchmarks_module("call_trace")
    family = FAMILIES[name]
    measured = trace.measure(*family.args(), *SIZES)
    assert measured["encoder self-attention"], "the encoder's first self-attention was not traced"
    for kind, calls in measured.items():
        if kind == "decoding step" and not family.decoding:
            continue
        assert calls, f"{kind}: nothing traced"
        files = {path.replace("\\", "/") for path, _, _ in calls}
        assert not [f for f in files if any(g in f for g in GUARDS)], f"{kind}: the loader's code runs"
        chosen_again = [q for path, _, q in calls if path.endswith("ea_ops/dispatch.py") and q != "choose"
                        and not q.startswith(("describe", "autocast_on"))]
        assert not chosen_again, f"{kind}: the backend is chosen again: {chosen_again}"
