"""The kernels as ``torch.library`` operators (:mod:`ea_ops.triton.operators`): torch's own
check of a custom operator (``torch.library.opcheck``: its schema, its fake implementation
against the real one, its autograd registration, AOT autograd's dynamic-shape trace) for the
full pass in each layout and for the decoding step with and without a state; ``torch.compile``
taking EA's operation whole (``fullgraph=True``: no graph break from the dispatcher to the
kernels; a full pass forward and backward, a decoding step) with the eager call's values and
gradients; and, on CUDA, a CUDA graph capturing a training step's forward and backward and
replaying it on new inputs.

As tests/ops/test_triton_full_pass.py: on CUDA compiled, on a CPU run in Triton's interpreter
(``bash scripts/test_triton.sh``), skipped elsewhere (the default suite).
"""
import pytest
import torch
# first: skips this file where that one is skipped (no triton; a CPU without the interpreter)
from test_triton_full_pass import DEVICE, inputs, masks

from ea_ops import EvolvingAttentionParams, StepState, dispatch, evolving_attention
from ea_ops.triton import interpret_on_cpu

HEADS, T, S, D = 3, 5, 6, 4


@pytest.mark.parametrize("layout, softmax, hand_on, previous, bias", [
    ("full", True, True, "broadcast", True), ("causal", False, True, "given", False),
    ("rows", True, False, None, True)])
def test_the_operator_passes_torchs_own_checks(layout, softmax, hand_on, previous, bias):
    logits, prev, weight, b = inputs(HEADS, T, S, 3, torch.float32, previous is not None, bias)
    if previous == "broadcast":  # one map for the batch: autograd sums its gradient back
        prev = prev[:1].detach().requires_grad_()
    masked, neutral = masks(layout, T, S, HEADS)
    torch.library.opcheck(torch.ops.ea_ops.triton_full_pass.default,
                          (logits, prev, weight, b, masked, neutral, 0.3, 0.6, layout, softmax, hand_on, None))


def test_the_backwards_operator_passes_torchs_own_checks_on_strided_arguments():
    """Its fake results are the real ones in shape, dtype and strides (contiguous, as the kernels
    write them) where the arguments are views: permuted logits, a transposed weight, a bias
    that is every other entry, a previous map that broadcasts."""
    g = torch.Generator().manual_seed(3)

    def drawn(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    logits, weight = drawn(2, S, HEADS, T).permute(0, 2, 3, 1), drawn(HEADS, HEADS, 3, 3).transpose(0, 1)
    masked, neutral = masks("full", T, S, HEADS)
    probs, grad = torch.softmax(drawn(2, HEADS, T, S), -1), drawn(2, HEADS, T, S)
    torch.library.opcheck(torch.ops.ea_ops.triton_full_pass_backward.default,
                          (grad, grad, logits, drawn(1, HEADS, T, S), weight, drawn(2 * HEADS)[::2], masked, neutral,
                           probs, 0.3, 0.6, "full", True, None))


@pytest.mark.parametrize("layout, with_state", [("causal", True), ("rows", False)])
def test_the_steps_operator_passes_torchs_own_checks(layout, with_state):
    logits, previous, weight, bias = (t.detach() for t in inputs(HEADS, 1, S, 3, torch.float32))
    earlier = torch.randn(2, HEADS, 2, S - 1, device=DEVICE) if with_state else None
    order = torch.tensor([1, 0], device=DEVICE) if with_state else None
    masked = masks(layout, 1, S, HEADS)[0][:, :1, -1:]
    for softmax, hand_on in ((True, False), (False, True)):
        torch.library.opcheck(torch.ops.ea_ops.triton_step.default, (logits, previous, earlier, order, masked, weight,
                                                                     bias, 0.3, 0.6, layout, softmax, hand_on))


def test_torch_compile_takes_a_decoding_step_whole():
    logits, previous, weight, bias = (t.detach() for t in inputs(HEADS, 1, S, 3, torch.float32))
    state = StepState(torch.randn(2, HEADS, 2, S - 1, device=DEVICE), torch.tensor([1, 0], device=DEVICE))
    values = torch.randn(2 * HEADS, S, D, device=DEVICE)
    params = EvolvingAttentionParams(0.3, 0.6, weight, bias, "causal")

    def decode(logits, previous, rows, order):
        out = evolving_attention(logits, previous, None, None, params, state=StepState(rows, order), values=values)
        return out.context, out.state.rows

    with torch.no_grad(), interpret_on_cpu():
        call = dispatch.describe(logits, None, None, params, state, values, False, False)
        assert dispatch.choose(call) == dispatch.TRITON_STEP
        eager = decode(logits, previous, *state[:2])
        compiled = torch.compile(decode, backend="aot_eager", fullgraph=True)(logits, previous, *state[:2])
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def attend(logits, previous, weight, bias, masked, values):
    out = evolving_attention(logits, previous, masked, None, EvolvingAttentionParams(0.3, 0.6, weight, bias, "causal"),
                             values=values, hand_on=True)
    return out.context, out.carried


def test_torch_compile_takes_the_operation_whole_forward_and_backward():
    """fullgraph=True: a graph break anywhere between the operation and the kernels fails the
    compile. The graph holds the operator (recorded by the backend), and the compiled call gives
    the eager call's values and gradients, bit for bit (the same kernels in the same order)."""
    logits, previous, weight, bias = inputs(HEADS, T, S, 3, torch.float32)
    masked, _ = masks("causal", T, S, HEADS)
    values = torch.randn(2 * HEADS, S, D, device=DEVICE)
    leaves = (logits, previous, weight, bias)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    with interpret_on_cpu():
        call = dispatch.describe(logits, masked, None, EvolvingAttentionParams(0.3, 0.6, weight, bias, "causal"),
                                 None, values, True, False)
        assert dispatch.choose(call) == dispatch.TRITON_FULL_PASS
        results = []
        for run in (attend, torch.compile(attend, backend=backend, fullgraph=True)):
            context, carried = run(*leaves, masked, values)
            grads = torch.autograd.grad((context * torch.arange(context.numel(), device=DEVICE).view_as(context)).sum()
                                        + carried.square().sum(), leaves)
            results.append((context, carried, *grads))
    assert len(graphs) == 1 and "ea_ops.triton_full_pass" in graphs[0], graphs
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")
def test_a_cuda_graph_captures_forward_and_backward_and_replays_them_on_new_inputs():
    logits, previous, weight, bias = inputs(HEADS, T, S, 3, torch.float16)
    masked, _ = masks("causal", T, S, HEADS)
    values = torch.randn(2 * HEADS, S, D, device=DEVICE, dtype=torch.float16)
    leaves = (logits, previous, weight, bias)

    def step():
        context, carried = attend(*leaves, masked, values)
        return (context, carried, *torch.autograd.grad(context.float().sum() + carried.float().sum(), leaves))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up: compiled kernels, allocator pools
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for leaf in leaves:
            leaf.copy_(torch.randn_like(leaf))
    graph.replay()
    want = step()
    for got, expected in zip(captured, want):
        assert torch.equal(got, expected)
