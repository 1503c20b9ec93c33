"""What EA's Triton kernels (:mod:`ea_ops.triton`) refuse, and what they ask Triton to compile:
arguments the kernels would read or write beyond (a previous map, weights, bias or masks of
other shapes) refused in one line before any launch, through the full pass, its backward and
the decoding step; empty maps (no sentences, no rows, no keys) give empty results and zero
gradients without a launch; a second derivative is refused; the launch grid is one axis
(sentences x row tiles: no 65,535-sentence limit); and the integer arguments are not
specialised, so one compiled variant takes every length and stride (keyed with Triton's own
binder for sm_90, as its compile cache keys it, by :mod:`ea_ops.triton.variants`, with which
``benchmarks/triton_counts.py`` counts an epoch's variants).

As tests/ops/test_triton_full_pass.py: on CUDA compiled, on a CPU run in Triton's interpreter
(``bash scripts/test_triton.sh``), skipped elsewhere (the default suite).
"""

import pytest
import torch
# first: skips this file where that one is skipped (no triton; a CPU without the interpreter)
from test_triton_full_pass import DEVICE, inputs, masks

from ea_ops import EvolvingAttentionParams
from ea_ops.contract import StepState
from ea_ops.triton import decoding_step, evolving_attention, operators
from ea_ops.triton.operators import evolving_attention_triton
from ea_ops.triton.variants import Launches

HEADS, T, S = 3, 5, 6


def run(logits, previous, weight, bias, masked=None, neutral=None, layout="full", softmax=False):
    return evolving_attention_triton(logits, previous, weight, bias, masked, neutral, 0.3, 0.6, layout,
                                     softmax, True, None)


def draw(*shape):
    return torch.randn(*shape, device=DEVICE).requires_grad_()


MISSHAPEN = {
    "a previous map of one sentence fewer keys": dict(previous=(2, HEADS, T, S - 1)),
    "a previous map that does not broadcast": dict(previous=(3, HEADS, T, S)),
    "weights of more heads": dict(weight=(HEADS + 1, HEADS + 1, 3, 3)),
    "weights of fewer heads": dict(weight=(HEADS - 1, HEADS - 1, 3, 3)),
    "a bias of more heads": dict(bias=(HEADS + 1,)),
    "a mask of another length": dict(mask=(2, 1, 1, S + 1)),
}


@pytest.mark.parametrize("case", MISSHAPEN)
def test_arguments_the_kernels_would_read_beyond_are_refused_in_one_line(case):
    shapes = dict(logits=(2, HEADS, T, S), previous=(2, HEADS, T, S), weight=(HEADS, HEADS, 3, 3), bias=(HEADS,),
                  mask=(2, 1, 1, S))
    shapes.update(MISSHAPEN[case])
    logits, previous, weight, bias = (draw(*shapes[name]) for name in ("logits", "previous", "weight", "bias"))
    mask = torch.zeros(shapes["mask"], dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError) as refused:
        run(logits, previous, weight, bias, mask, mask)
    message = str(refused.value)
    assert message.startswith("EA's Triton kernels: ") and "\n" not in message, message
    if "mask" not in case:  # the step too (its mask: one row of keys)
        params = EvolvingAttentionParams(0.3, 0.6, weight, bias, "causal")
        with torch.no_grad(), pytest.raises(ValueError, match="EA's Triton kernels: "):
            operators.step(logits[:, :, :1], previous[:, :, :1], None, None, params, state=StepState())
    # negative control: the same call with every shape right runs
    run(draw(2, HEADS, T, S), draw(1, HEADS, T, S), draw(HEADS, HEADS, 3, 3), draw(HEADS),
        torch.zeros(2, 1, 1, S, dtype=torch.bool, device=DEVICE), None)


@pytest.mark.parametrize("empty", [(0, HEADS, T, S), (2, HEADS, 0, S), (2, HEADS, T, 0)])
def test_an_empty_map_gives_empty_results_and_zero_gradients_without_a_launch(empty, monkeypatch):
    monkeypatch.setattr(evolving_attention, "_forward_kernel", None)  # a launch would fail
    monkeypatch.setattr(evolving_attention, "_backward_conv_kernel", None)
    logits, previous, weight, bias = draw(*empty), draw(*empty), draw(HEADS, HEADS, 3, 3), draw(HEADS)
    out, carried = run(logits, previous, weight, bias, softmax=True)
    assert out.shape == carried.shape == empty
    (out.sum() + carried.sum()).backward()
    assert logits.grad.shape == empty and previous.grad.shape == empty
    assert not weight.grad.any() and not bias.grad.any()
    if empty[3] == 0:
        monkeypatch.setattr(decoding_step, "_step_kernel", None)
        params = EvolvingAttentionParams(0.3, 0.6, weight, bias, "rows")
        with torch.no_grad():
            done = operators.step(logits[:, :, :1], None, None, None, params, state=StepState())
        assert done.a_logit.shape == (2, HEADS, 1, 0) and done.state.rows.shape == (2, HEADS, 2, 0)


def test_a_second_derivative_is_refused():
    logits, previous, weight, bias = inputs(HEADS, T, S, 3, torch.float32)
    out, _ = run(logits, previous, weight, bias)
    grad, = torch.autograd.grad(out.square().sum(), logits, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


@pytest.mark.skipif(DEVICE != "cpu", reason="keyed on a CPU, with Triton's binder for sm_90")
def test_one_compiled_variant_takes_every_length_and_the_grid_is_one_axis():
    launches = Launches()
    with launches.recorded():
        # rows and keys divisible by 16 and not, one, shorter and longer than a block of keys
        for tgt_len, src_len in ((9, 17), (16, 32), (17, 31), (1, 100), (64, 5), (130, 1)):
            logits, previous, weight, bias = inputs(HEADS, tgt_len, src_len, 3, torch.float16)
            masked, neutral = masks("rows", tgt_len, src_len, HEADS)
            out, carried = run(logits, previous, weight, bias, masked, neutral, layout="rows", softmax=True)
            (out.sum() + carried.float().sum()).backward()
    assert {name: len(keys) for name, keys in launches.variants.items()} == {
        "_forward_kernel": 1, "_backward_conv_kernel": 1, "_backward_input_kernel": 1}, launches.variants
    assert all(len(grid) == 1 for grids in launches.grids.values() for grid in grids), launches.grids


@pytest.mark.skipif(DEVICE != "cpu", reason="keyed on a CPU, with Triton's binder for sm_90")
def test_a_decoding_run_of_100_steps_compiles_four_variants():
    """Decoder self-attention's keys grow by one every step: the step's row is padded to a
    power of two of at least decoding_step.MIN_KEYS keys, and nothing else of a step is
    specialised, so 100 steps make four variants: the first step (no earlier rows), then one
    for each of 32, 64 and 128 keys."""
    launches = Launches()
    weight, bias = draw(HEADS, HEADS, 3, 3), draw(HEADS)
    params = EvolvingAttentionParams(0.3, 0.6, weight, bias, "causal")
    state = StepState()
    with torch.no_grad(), launches.recorded():
        for keys in range(1, 101):
            logits, previous = torch.randn(10, HEADS, 1, keys), torch.randn(10, HEADS, 1, keys)
            masked = torch.zeros(10, 1, 1, keys, dtype=torch.bool)
            state = operators.step(logits, previous, masked, masked, params, state=state).state
            state = state.reordered(torch.arange(10).flip(0))
    assert len(launches.variants["_step_kernel"]) == 4, launches.variants
