"""What EA Eq. (4)'s full-pass Triton kernels (:mod:`ea_ops.triton.evolving_attention`) ask of a
GPU, checked on any machine, no GPU needed: compiled for sm_90 (Hopper) in the variants the
backend launches (recorded from its launches by :mod:`ea_ops.triton.variants`), they spill no
registers (what the interpreter cannot show, checked before a GPU ever runs them); and an EA-Lite training update on them launches at most 1.05x the
operations of its twin, transformer_lite (counted on a CPU under the interpreter). Their values
and gradients: tests/ops/test_triton_full_pass.py. The compiler harness
(:func:`compiles_without_spills`) and the launch counter (:class:`KernelLaunches`) are also
tests/ops/test_triton_step.py's.

As tests/ops/test_triton_full_pass.py: on CUDA compiled, on a CPU run in Triton's interpreter
(``bash scripts/test_triton.sh``), skipped elsewhere (the default suite).
"""
import os

import pytest
import torch
from torch._library.custom_ops import OPDEFS

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA: the kernels run in Triton's interpreter, bash scripts/test_triton.sh",
                allow_module_level=True)

from test_triton_full_pass import DEVICE, inputs, masks  # noqa: E402

from ea_ops.triton.operators import evolving_attention_triton  # noqa: E402
from ea_ops.triton.variants import Launches, registers  # noqa: E402


def compiles_without_spills(launches: Launches, kernels: int) -> None:
    """Every variant ``launches`` recorded (the kernels' real launches, keyed by Triton's binder
    for sm_90), compiled for sm_90 with cuobjdump's resource count (:func:`ea_ops.triton.variants.registers`):
    ``kernels`` variants, none with stack or local memory."""
    usage = registers(launches.specialisations())
    assert len(usage) == kernels, usage
    for name, fields in usage:
        assert fields["STACK"] == "0" and fields["LOCAL"] == "0", f"{name} spills registers: {fields}"


def test_the_kernels_compile_for_a_gpu_without_spilling_registers():
    """At EA-Lite's 4 heads and EA-Base's 8 in float16 (keys in blocks of 32: rows of any
    length), the full pass's variants the backend launches, forward and backward: decoder
    self-attention with every input (a previous map, bias, a mask per head, ``A_logit`` out,
    the map handed on) and an encoder's first layer (no previous map, no bias, the softmax's
    weights out)."""
    launches = Launches()
    with launches.recorded():
        for heads in (4, 8):
            for layout, every in (("causal", True), ("full", False)):
                logits, previous, weight, bias = inputs(heads, 40, 40, 3, torch.float16, previous=every, bias=every)
                masked, neutral = masks(layout, 40, 40, heads, per_head=every)
                out, carried = evolving_attention_triton(logits, previous, weight, bias, masked, neutral, 0.3,
                                                         0.6, layout, not every, every, None)
                (out.float().sum() + (carried.float().sum() if every else 0)).backward()
    compiles_without_spills(launches, 12)


class KernelLaunches:
    """What a training update launches on CUDA with the kernels, counted on any device: the
    non-view aten operations (``test_operation_counts.OperationCounter``) around them, and
    each of the kernels' launches as one; on a CPU the interpreter's own operations during a
    launch (its copies of the arguments) are not counted. The launches run, recorded by
    :class:`Launches` (``recorded()``: the block in which they are counted)."""

    NAMES = ("_forward_kernel", "_backward_conv_kernel", "_backward_input_kernel")

    def __init__(self):
        import test_operation_counts as counts

        class Counter(counts.OperationCounter):
            paused = active = False  # active: inside the counter's block (launches outside are not counted)

            def __enter__(self):
                self.active = True
                return super().__enter__()

            def __exit__(self, *exc):
                self.active = False
                return super().__exit__(*exc)

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if self.paused:
                    return func(*args, **(kwargs or {}))
                if func.namespace == "ea_ops":  # the kernels' operator: what it runs is counted, not itself
                    with self:
                        return OPDEFS[func._schema.name]._init_fn(*args, **(kwargs or {}))
                return super().__torch_dispatch__(func, types, args, kwargs)

        self.counter = Counter()
        self.recorded = Launches(run=self._counted).recorded

    def _counted(self, name, launch):
        counter = self.counter
        if not counter.active:
            return launch()
        counter.count, counter.all = counter.count + 1, counter.all + 1
        counter.ops["triton:" + name] += 1
        counter.paused = True
        try:
            return launch()
        finally:
            counter.paused = False


@pytest.mark.skipif(DEVICE != "cpu", reason="counted on a CPU, under Triton's interpreter")
def test_an_ea_lite_training_update_launches_at_most_5_percent_more_than_the_twin():
    """EA-Lite's training update (tests/attention/test_operation_counts.py's batch) with EA's Eq. 4 on the
    kernels, as on CUDA: at most 1.05x transformer_lite's non-view operations (its fused
    attention), 3 launches per EA attention. Negative control: the reference path's count
    (convolution, ReLU, mixes, masks and softmax as aten operations) exceeds the bound."""
    import test_operation_counts as counts
    from ea_ops import accelerators
    from ea_ops.triton import interpret_on_cpu

    with accelerators.reference_only():
        twin, reference = (counts.training_count(counts.build(family)) for family in ("transformer_lite", "EA-Lite"))
    launches = KernelLaunches()
    with interpret_on_cpu(), launches.recorded():
        fused = counts.training_count(counts.build("EA-Lite"), launches.counter)
    attentions = 18  # 6 encoder, 6 decoder self, 6 cross
    assert all(fused.ops["triton:" + name] == attentions for name in KernelLaunches.NAMES), fused.ops
    table = (f"transformer_lite {twin.count} ({twin.kernels()} less allocations), EA-Lite on the kernels "
             f"{fused.count} ({fused.kernels()}), on the reference path {reference.count} ({reference.kernels()})")
    assert fused.count <= 1.05 * twin.count, table
    assert reference.count > 1.05 * twin.count, table
