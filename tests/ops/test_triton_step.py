"""EA Eq. (4)'s Triton decoding step (:mod:`ea_ops.triton.decoding_step`, the dispatcher's
``TRITON_STEP``) against the float64 reference's step and the full pass: decoder
self-attention (causal, keys growing every step) and encoder-decoder attention (rows, an
odd source length), padded keys (rows whose every key is masked), beam reorders between
steps, the first step from ``StepState()``, A_logit and the weights with and without the
map handed on, float32/float16/bfloat16; beam orders of any strides (int32 or int64), a previous
map that broadcasts, masks that are not bool refused; its purity; an EA-Lite model decoding step by step
on it as its full pass computes; its operation count per decoding step against the twin's;
and its compilation for a GPU.

As ``tests/ops/test_triton_full_pass.py`` (whose bounds it uses; its compiler harness and launch
counter: ``tests/ops/test_triton_registers_and_launches.py``'s): on CUDA compiled, on a CPU run in
Triton's interpreter (``bash scripts/test_triton.sh``), skipped elsewhere (the default suite).
"""
import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA: the kernels run in Triton's interpreter, bash scripts/test_triton.sh",
                allow_module_level=True)

from ea_ops import EvolvingAttentionParams, accelerators, dispatch, evolving_attention  # noqa: E402
from ea_ops.contract import StepState  # noqa: E402
from ea_ops.softmax import fully_masked_rows  # noqa: E402
from ea_ops.triton import MAX_ROW_ELEMENTS, decoding_step, interpret_on_cpu, operators  # noqa: E402
from ea_ops.triton.variants import Launches  # noqa: E402
from test_triton_full_pass import DEVICE, bound, close  # noqa: E402
from test_triton_registers_and_launches import KernelLaunches, compiles_without_spills  # noqa: E402

SENTENCES, BEAMS, HEADS, K, HEAD_DIM = 2, 2, 3, 3, 4
BSZ = SENTENCES * BEAMS
# per step: (values given: the weights, else A_logit; the finite A_logit handed on)
MODES = [(False, False), (True, True), (False, True), (True, False)]
OUTPUTS = ("logits", "carried", "probs", "context")


def on_kernels():
    """The operation's CPU calls on the Triton kernels (interpreted); on CUDA, as it is."""
    return interpret_on_cpu()


class Decoding:
    """A decoding run of one attention, step by step, and what it should give: the drawn
    inputs of every step, each hypothesis's history (its rows of logits, previous map and
    key mask, in beam search's order) for the full pass, and beam search's reorders
    (within each sentence's beams, a beam may be taken twice)."""

    def __init__(self, layout, dtype, steps=4, src_len=7, previous=True, bias=True, seed=0):
        self.layout, self.dtype, self.steps, self.src_len = layout, dtype, steps, src_len
        self.g = torch.Generator().manual_seed(seed)
        weight = self.draw(HEADS, HEADS, K, K, scale=0.5)
        self.params = EvolvingAttentionParams(0.3, 0.6, weight, self.draw(HEADS, scale=0.5) if bias else None, layout)
        self.previous = previous
        # key padding: hypothesis 1's first two keys (a left-padded source, or target: its first
        # two decoder steps see only padded keys)
        self.padding = torch.zeros(BSZ, src_len if layout == "rows" else steps, dtype=torch.bool)
        self.padding[1, :2] = True

    def draw(self, *shape, scale=1.0):
        return (torch.randn(*shape, generator=self.g) * scale).to(DEVICE, self.dtype)

    def keys(self, t):
        return self.src_len if self.layout == "rows" else t + 1

    def order(self):
        beams = torch.randint(0, BEAMS, (BSZ,), generator=self.g)
        return (torch.arange(BSZ) // BEAMS * BEAMS + beams).to(DEVICE)

    def inputs(self, t):
        keys = self.keys(t)
        logits = self.draw(BSZ, HEADS, 1, keys)
        previous = self.draw(BSZ, HEADS, 1, keys) if self.previous else None
        masked = self.padding[:, None, None, :keys].to(DEVICE)
        values = self.draw(SENTENCES * HEADS if self.layout == "rows" else BSZ * HEADS, keys, HEAD_DIM)
        return logits, previous, masked, values


def wide(params):
    return params._replace(weight=params.weight.double(), bias=None if params.bias is None else params.bias.double())


def full_pass(history, params, values, hand_on):
    """The float64 full pass over each hypothesis's rows so far: its last row's outputs."""
    logits, previous, masked = history
    keys = logits.size(-1)
    if params.layout == "causal":
        masked = masked | torch.ones(keys, keys, dtype=torch.bool, device=masked.device).triu(1)
    out = evolving_attention(logits, previous, masked, None, wide(params),
                             values=None if values is None else values.double(),
                             empty=None if values is None else fully_masked_rows(masked), hand_on=hand_on)
    last = {"logits": None if out.logits is None else out.logits[:, :, -1:],
            "carried": None if out.carried is None else out.carried[:, :, -1:],
            "probs": None if out.probs is None else out.probs[:, :, -1:],
            "context": None if out.context is None else out.context[-1:]}
    return last


def grown(history, rows, keys):
    """``history`` (B, H|1, t, S') with ``rows`` (B, H|1, 1, S) below it, widened to S keys."""
    if history is None:
        return rows
    return torch.cat([torch.nn.functional.pad(history, (0, keys - history.size(-1))), rows], dim=2)


def decode(run: Decoding, check_full_pass=True):
    """Run the steps on the kernels, and at each step hold its outputs and its next state to
    (1) the float64 reference's step from the same state (the kernels' own, reordered),
    within the precision's bound; (2) with ``check_full_pass``, the float64 full pass over
    the hypotheses' histories, within the bound plus the state's one rounding to its dtype;
    and the float64 reference's own chain of steps to that full pass (1e-12). Every
    argument is left as it was; the next state is a new tensor."""
    state, wide_state, history = StepState(), StepState(), (None, None, None)
    terms = 2 * HEADS * K * K + run.src_len + run.steps
    relative = bound(run.dtype, terms)
    for t in range(run.steps):
        if t > 0:
            order = run.order()
            state, wide_state = state.reordered(order), wide_state.reordered(order)
            history = tuple(None if h is None else h.index_select(0, order) for h in history)
        attend, hand_on = MODES[t % len(MODES)]
        logits, previous, masked, values = run.inputs(t)
        keys = logits.size(-1)
        history = (grown(history[0], logits.double(), keys),
                   grown(history[1], previous.double(), keys) if previous is not None else None,
                   grown(history[2], masked, keys))
        arguments = [logits, previous, masked, values, run.params.weight, run.params.bias, *state[:2]]
        kept = [None if x is None else x.clone() for x in arguments]
        chosen = []
        with torch.no_grad(), on_kernels():
            call = dispatch.describe(logits, masked, None, run.params, state, values if attend else None,
                                     hand_on, False)
            chosen.append(dispatch.choose(call))
            got = evolving_attention(logits, previous, masked, None, run.params, state=state,
                                     values=values if attend else None,
                                     empty=fully_masked_rows(masked) if attend else None, hand_on=hand_on)
        assert chosen == [dispatch.TRITON_STEP]
        assert all(x is None or torch.equal(x, y) for x, y in zip(arguments, kept)), "an argument was written"
        rows = got.state.rows
        assert rows.shape == (BSZ, HEADS, K - 1, keys) and rows.dtype == run.dtype and got.state.order is None
        assert all(x is None or rows.data_ptr() != x.data_ptr() for x in arguments), "the state is a new tensor"
        with torch.no_grad(), accelerators.reference_only():
            here = StepState(None if state.rows is None else state.rows.double(), state.order)
            step = evolving_attention(logits.double(), None if previous is None else previous.double(), masked,
                                      None, wide(run.params), state=here,
                                      values=values.double() if attend else None,
                                      empty=fully_masked_rows(masked) if attend else None, hand_on=hand_on)
            chain = evolving_attention(logits.double(), None if previous is None else previous.double(), masked,
                                       None, wide(run.params), state=wide_state,
                                       values=values.double() if attend else None,
                                       empty=fully_masked_rows(masked) if attend else None, hand_on=hand_on)
            wide_state = chain.state
            whole = full_pass(history, run.params, values if attend else None, hand_on)
        for name in OUTPUTS:
            x, y, z, w = getattr(got, name), getattr(step, name), getattr(chain, name), whole[name]
            assert (x is None) == (y is None) == (z is None) == (w is None), name
            if x is None:
                continue
            assert x.dtype == (torch.float32 if name == "probs" else run.dtype), name
            assert torch.equal(x.isneginf(), y.isneginf()) and torch.equal(z.isneginf(), w.isneginf()), name
            close(x, y, relative, f"step {t}: {name} against the reference's step")
            close(z, w, 1e-12, f"step {t}: {name} of the reference's steps against its full pass")
            if check_full_pass:
                # the kernels' state holds A_input rounded to the maps' dtype once more
                close(x, w, relative + bound(run.dtype, 0), f"step {t}: {name} against the full pass")
        close(rows, step.state.rows, relative, f"step {t}: the next state against the reference's")
        state = got.state
    return state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["causal", "rows"])
def test_steps_equal_the_reference_step_and_the_full_pass(layout, dtype):
    decode(Decoding(layout, dtype))


def test_first_layer_without_bias():
    decode(Decoding("causal", torch.float32, previous=False, bias=False, steps=3, seed=1))


def test_the_comparison_bites(monkeypatch):
    """Negative controls: a kernel that ignores the beam order (reads hypothesis n's own
    earlier rows), and one that reads the rows layout's taps for the causal one, fail."""
    launch = decoding_step._step_kernel

    class Mutant:
        def __init__(self, **changes):
            self.changes = changes

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launch[grid](*args, **{**kwargs, **self.changes})

    for changes in (dict(HAS_ORDER=False), dict(CAUSAL=False, C0=K // 2)):
        monkeypatch.setattr(decoding_step, "_step_kernel", Mutant(**changes))
        with pytest.raises(AssertionError):
            decode(Decoding("causal", torch.float32, steps=3, src_len=5), check_full_pass=False)
    monkeypatch.undo()


def test_an_order_that_indexes_no_cached_hypothesis_gives_nan_not_another_row():
    run = Decoding("rows", torch.float32)
    logits, previous, masked, values = run.inputs(0)
    earlier = run.draw(BSZ, HEADS, K - 1, run.src_len)
    order = torch.tensor([0, 1, BSZ, -1], device=DEVICE)
    with torch.no_grad(), on_kernels():
        out = evolving_attention(logits, previous, masked, None, run.params, state=StepState(earlier, order),
                                 values=values, empty=fully_masked_rows(masked))
    assert out.probs[:2].isfinite().all() and out.probs[2:].isnan().all()
    assert out.state.rows[:2].isfinite().all() and out.state.rows[2:].isnan().all()


def test_a_state_that_fits_no_step_is_refused_with_a_message():
    run = Decoding("rows", torch.float32)
    logits, previous, masked, _ = run.inputs(0)
    for rows, order in ((run.draw(BSZ, HEADS, K, run.src_len), None),
                        (run.draw(BSZ, HEADS, K - 1, run.src_len + 1), None),
                        (run.draw(BSZ, HEADS, K - 1, run.src_len), torch.zeros(BSZ + 1, dtype=torch.long)),
                        (run.draw(BSZ, HEADS, K - 1, run.src_len), torch.zeros(BSZ)),  # index_select's refusal
                        (run.draw(BSZ, HEADS, K - 1, run.src_len), torch.zeros(BSZ, dtype=torch.int16))):
        with torch.no_grad(), pytest.raises(ValueError, match="StepState.reordered"):
            operators.step(logits, previous, masked, masked, run.params, state=StepState(rows, order))


def test_an_ea_model_decodes_step_by_step_as_its_full_pass_computes(monkeypatch):
    """An EA-Lite model (two decoder layers, the decoder's maps handed on: α > 0), beam 2 over
    two left-padded sentences, beam reorders between steps, every decoder EA attention's step
    on the kernel: each step's output distribution is the full pass's over the hypotheses'
    prefixes, within 4x the float32 reference step's distance to the float64 full pass
    (plus a few float32 ulps where both are exact)."""
    import copy

    from conftest import build_model, make_dictionary, random_batch
    from support.families import FAMILIES

    dictionary = make_dictionary()
    model = build_model("ea_transformer_lite", "--ea-alpha", "0.5", "--ea-beta", "0.5", "--ea-decoder-alpha", "0.3",
                        "--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0",
                        "--attention-dropout", "0", dictionary=dictionary)[0]
    FAMILIES["ea-lite"].perturbed(model, "--encoder-layers", "2", "--decoder-layers", "2")
    model.to(DEVICE).eval()
    double = copy.deepcopy(model).double()
    src, lengths, _ = random_batch(dictionary, [5, 3], 2, seed=1)
    src, lengths = src.to(DEVICE), lengths.to(DEVICE)
    beams = torch.arange(SENTENCES, device=DEVICE).repeat_interleave(BEAMS)
    g = torch.Generator().manual_seed(2)
    steps = 4
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (BSZ, steps), generator=g).to(DEVICE)
    tokens[:, 0] = dictionary.eos()
    orders = [None] + [(beams * BEAMS + torch.randint(0, BEAMS, (BSZ,), generator=g).to(DEVICE))
                       for _ in range(steps - 1)]
    chosen = []
    choose = dispatch.choose
    monkeypatch.setattr(dispatch, "choose", lambda call: chosen.append(choose(call)) or chosen[-1])

    def incremental(context):
        outs, state, prefix = [], {}, tokens
        with torch.no_grad():
            with accelerators.reference_only():
                encoder_out = model.encoder.reorder_encoder_out(model.encoder(src, lengths), beams)
            for t in range(steps):
                if t > 0:
                    model.decoder.reorder_incremental_state_scripting(state, orders[t])
                    prefix = prefix.index_select(0, orders[t])
                with context():
                    outs.append(model.decoder(prefix[:, : t + 1], encoder_out, incremental_state=state)[0][:, -1])
        return outs

    def full_passes():
        outs, prefix = [], tokens
        with torch.no_grad(), accelerators.reference_only():
            encoder_out = double.encoder.reorder_encoder_out(double.encoder(src, lengths), beams)
            for t in range(steps):
                if t > 0:
                    prefix = prefix.index_select(0, orders[t])
                outs.append(double.decoder(prefix[:, : t + 1], encoder_out)[0][:, -1])
        return outs

    want = full_passes()
    reference = incremental(accelerators.reference_only)
    chosen.clear()
    kernels = incremental(on_kernels)
    decoder_attentions = 4  # 2 self, 2 cross
    assert chosen.count(dispatch.TRITON_STEP) == decoder_attentions * steps, chosen
    ulps = 16 * torch.finfo(torch.float32).eps
    for t, (got, ref, w) in enumerate(zip(kernels, reference, want)):
        scale = w.abs().max().item()
        error, allowed = (got - w).abs().max().item(), 4 * (ref - w).abs().max().item() + ulps * scale
        assert error <= allowed, f"step {t}: {error:.3g} > {allowed:.3g}"


@pytest.mark.skipif(DEVICE != "cpu", reason="counted on a CPU, under Triton's interpreter")
def test_an_ea_lite_decoding_step_launches_no_more_than_the_twins():
    """EA-Lite's beam-search decoding step (tests/attention/test_operation_counts.py's step) with Eq. 4
    on the kernel, as on CUDA: at most transformer_lite's non-view operations, one launch per
    EA attention. Negative control: the reference path's count (the convolution, ReLU, β mix,
    the cached rows' reorder and concatenation, the softmax and masks as aten operations)
    exceeds it."""
    import test_operation_counts as counts

    with accelerators.reference_only():
        twin, reference = (counts.decoding_step_count(counts.build(family))
                           for family in ("transformer_lite", "EA-Lite"))
    launches = KernelLaunches()
    with interpret_on_cpu(), launches.recorded():
        fused = counts.decoding_step_count(counts.build("EA-Lite"), launches.counter)
    attentions = 12  # 6 decoder self, 6 cross
    assert fused.ops["triton:_step_kernel"] == attentions, fused.ops
    table = (f"transformer_lite {twin.count} ({twin.kernels()} less allocations), EA-Lite on the kernel "
             f"{fused.count} ({fused.kernels()}), on the reference path {reference.count} ({reference.kernels()})")
    print(table)
    assert fused.count <= twin.count, table
    assert reference.count > twin.count, table


def test_the_kernel_compiles_for_a_gpu_without_spilling_registers():
    """At EA-Base's 8 heads, the step's variants the backend launches at the widest rows it
    takes, compiled for sm_90: decoder self-attention at 256 keys with every input (float16: a
    previous map, the earlier rows in a beam order, bias, the weights out, the map handed on)
    and encoder-decoder attention's first step at the widest row the dispatcher gives it
    (float32, ``MAX_ROW_ELEMENTS // 8`` keys, no previous map)."""
    launches = Launches()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad(), launches.recorded():
        for layout, keys, dtype, every in (("causal", 256, torch.float16, True),
                                           ("rows", MAX_ROW_ELEMENTS // 8, torch.float32, False)):
            def draw(*shape):
                return torch.randn(*shape, generator=g).to(DEVICE, dtype)

            params = EvolvingAttentionParams(0.3, 0.6, draw(8, 8, K, K), draw(8), layout)
            state = StepState(draw(BSZ, 8, K - 1, keys - 1), torch.arange(BSZ, device=DEVICE).flip(0)) \
                if every else StepState()
            masked = torch.zeros(BSZ, 1, 1, keys, dtype=torch.bool, device=DEVICE)
            operators.step(draw(BSZ, 8, 1, keys), draw(BSZ, 8, 1, keys) if every else None, masked, masked,
                               params, state=state, values=draw(BSZ * 8, keys, HEAD_DIM), hand_on=every)
    compiles_without_spills(launches, 2)


def test_an_order_of_any_strides_and_integer_dtype_reads_the_hypotheses_it_names():
    """Beam search's order as StepState keeps it (a strided view, int32 or int64): hypothesis n
    continues cached hypothesis order[n], as the reference's index_select reads it."""
    run = Decoding("rows", torch.float32)
    logits, previous, masked, _ = run.inputs(0)
    earlier = run.draw(BSZ, HEADS, K - 1, run.src_len)
    spread = torch.tensor([3, 0, 3, 0, 1, 0, 0, 0], device=DEVICE)
    relative = bound(torch.float32, 2 * HEADS * K * K)
    for order in (spread[::2], spread[::2].int()):
        with torch.no_grad(), on_kernels():
            got = evolving_attention(logits, previous, masked, None, run.params, state=StepState(earlier, order),
                                     hand_on=True)
        with torch.no_grad(), accelerators.reference_only():
            want = evolving_attention(logits.double(), previous.double(), masked, None, wide(run.params),
                                      state=StepState(earlier.double(), order), hand_on=True)
        close(got.carried, want.carried, relative, f"{order.dtype} order of strides {order.stride()}")
        close(got.state.rows, want.state.rows, relative, f"{order.dtype} order: the next state")


def test_a_previous_map_that_broadcasts_is_read_as_the_reference_reads_it():
    """A previous map (1, H, 1, S) broadcast over the hypotheses, as the reference's α mix
    broadcasts it: no hypothesis reads beyond it."""
    run = Decoding("causal", torch.float32)
    logits, previous, masked, _ = run.inputs(2)
    earlier = run.draw(BSZ, HEADS, K - 1, logits.size(-1) - 1)
    previous = previous[:1].clone()
    with torch.no_grad(), on_kernels():
        got = evolving_attention(logits, previous, masked, None, run.params, state=StepState(earlier), hand_on=True)
    with torch.no_grad(), accelerators.reference_only():
        want = evolving_attention(logits.double(), previous.double(), masked, None, wide(run.params),
                                  state=StepState(earlier.double()), hand_on=True)
    close(got.carried, want.carried, bound(torch.float32, 2 * HEADS * K * K), "a broadcast previous map")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_a_mask_that_is_not_bool_is_refused_with_a_message(dtype):
    """As the reference and the CPU backends: a mask is a bool tensor (a float mask's bytes
    are no mask)."""
    run = Decoding("rows", torch.float32)
    logits, previous, masked, values = run.inputs(0)
    with torch.no_grad(), on_kernels(), pytest.raises(ValueError, match="bool"):
        evolving_attention(logits, previous, masked.to(dtype), None, run.params, state=StepState())
