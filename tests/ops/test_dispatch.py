"""The dispatcher of EA Eq. (4) (:mod:`ea_ops.dispatch`): one table of conditions, each
needed, every combination of facts where the rules say; the choice made once per
configuration and the switches taking effect; the backends' agreement on every call both
take, each a pure function of its arguments; and the operation's package importable
without fairseq or the plugin."""
import contextlib
import os
import subprocess
import sys

import pytest
import torch

from ea_ops import accelerators, dispatch, evolving_attention, library
from ea_ops import triton as gpu
from ea_ops.contract import EvolvingAttentionParams, StepState

HEADS = 4
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def kernel(cpu_accelerators_built):
    if not accelerators.enabled_by_environment():
        pytest.skip(f"{accelerators.ENV_SWITCH}=0: the reference runs everywhere")
    assert cpu_accelerators_built is not None, f"the CPU backend is not built ({library.COMMAND})"
    return cpu_accelerators_built


# A call each accelerated backend takes; and for every condition of the table, the one
# change of facts that breaks it (and nothing else).
BASE = {
    dispatch.CPU_FULL_PASS: dispatch.Call(
        device_type="cpu", dtype=torch.float32, accelerators_on=True, built=True, grad_enabled=True,
        return_maps=False, has_conv=True, kernel_size=3, layout="full", step=False, rows=6,
        mask_per_head=False, padded_query_rows=True, values=True, hand_on=True, unshared_values_batch=0),
    dispatch.CPU_STEP: dispatch.Call(
        device_type="cpu", dtype=torch.float64, accelerators_on=True, built=True, grad_enabled=False,
        return_maps=False, has_conv=True, kernel_size=3, layout="causal", step=True, rows=1,
        mask_per_head=False, padded_query_rows=False, values=True, hand_on=True, unshared_values_batch=0),
    dispatch.CPU_STEP_ATTEND: dispatch.Call(
        device_type="cpu", dtype=torch.float32, accelerators_on=True, built=True, grad_enabled=False,
        return_maps=False, has_conv=True, kernel_size=5, layout="rows", step=True, rows=1,
        mask_per_head=False, padded_query_rows=False, values=True, hand_on=False, unshared_values_batch=64),
    dispatch.TRITON_FULL_PASS: dispatch.Call(
        device_type="cuda", dtype=torch.float16, accelerators_on=True, built=False, grad_enabled=True,
        return_maps=False, has_conv=True, kernel_size=3, layout="causal", step=False, rows=6,
        mask_per_head=True, padded_query_rows=True, values=True, hand_on=True, unshared_values_batch=0,
        triton=True, triton_on_cpu=False, row_elements=gpu.MAX_ROW_ELEMENTS),
    dispatch.TRITON_STEP: dispatch.Call(
        device_type="cuda", dtype=torch.bfloat16, accelerators_on=True, built=False, grad_enabled=False,
        return_maps=False, has_conv=True, kernel_size=3, layout="rows", step=True, rows=1,
        mask_per_head=False, padded_query_rows=False, values=True, hand_on=True, unshared_values_batch=65,
        triton=True, triton_on_cpu=False, row_elements=gpu.MAX_ROW_ELEMENTS),
}
BREAK = {
    "accelerators switched on": dict(accelerators_on=False),
    "on a CPU": dict(device_type="cuda"),
    "float32 or float64": dict(dtype=torch.float16),
    "no intermediate maps asked for": dict(return_maps=True),
    "a map convolution": dict(has_conv=False),
    "the C++ extension built": dict(built=False),
    "autocast off": dict(autocast=True),
    "a decoding step": dict(step=False),
    "a full pass": dict(step=True),
    "autograd off": dict(grad_enabled=True),
    "one query row": dict(rows=2),
    "a kernel larger than 1x1": dict(kernel_size=1),
    "a shifted layout (causal or rows)": dict(layout="full"),
    "one mask for all heads": dict(mask_per_head=True),
    "no padded query rows": dict(padded_query_rows=True),
    "values given": dict(values=False),
    "A_logit not handed on": dict(hand_on=True),
    f"at most {dispatch.STEP_VALUES_MAX_BATCH} hypotheses with values of their own":
        dict(unshared_values_batch=dispatch.STEP_VALUES_MAX_BATCH + 1),
    "on CUDA (on a CPU: inside ea_ops.triton.interpret_on_cpu(), under Triton's interpreter)": dict(device_type="cpu"),
    "float16, bfloat16 or float32": dict(dtype=torch.float64),
    "triton installed (the triton extra)": dict(triton=False),
    f"at most {gpu.MAX_ROW_ELEMENTS} heads x keys a row (powers of two)": dict(row_elements=2 * gpu.MAX_ROW_ELEMENTS),
}
# where a call goes when one condition of its backend breaks
THEN = {
    dispatch.CPU_FULL_PASS: {"a full pass": dispatch.REFERENCE},  # a step of 6 rows: the reference
    dispatch.CPU_STEP: {"a decoding step": dispatch.CPU_FULL_PASS},  # the same call as a full pass
    dispatch.CPU_STEP_ATTEND: {
        "a decoding step": dispatch.CPU_FULL_PASS, "values given": dispatch.CPU_STEP,
        "A_logit not handed on": dispatch.CPU_STEP,
        f"at most {dispatch.STEP_VALUES_MAX_BATCH} hypotheses with values of their own": dispatch.CPU_STEP},
    dispatch.TRITON_FULL_PASS: {},  # a half-precision call on CUDA: the reference, whichever condition breaks
    dispatch.TRITON_STEP: {"a decoding step": dispatch.TRITON_FULL_PASS},  # the same call as a full pass
}


def test_the_table_lists_every_condition_this_test_breaks():
    names = {c.name for row in dispatch.TABLE.values() for c in row.conditions}
    assert names == set(BREAK)
    assert dispatch.TABLE[dispatch.REFERENCE].conditions == () and dispatch.PREFERENCE[-1] == dispatch.REFERENCE
    assert set(dispatch.PREFERENCE) == set(dispatch.TABLE) == set(BASE) | {dispatch.REFERENCE}


@pytest.mark.parametrize("backend", sorted(BASE))
def test_each_condition_alone_keeps_its_backend_from_a_call(backend):
    """The base call goes to ``backend``; breaking any one of its conditions sends it to the
    next backend that takes it (the reference where none does), and names that condition
    as the one refusal."""
    base = BASE[backend]
    assert dispatch.select(base) == backend and dispatch.refusals(base, backend) == []
    for condition in dispatch.TABLE[backend].conditions:
        broken = base._replace(**BREAK[condition.name])
        assert dispatch.refusals(broken, backend) == [condition.name]
        assert dispatch.select(broken) == THEN[backend].get(condition.name, dispatch.REFERENCE), condition.name


def expected_backend(c):
    """The dispatcher's rules, as the documentation states them (written apart from the table)."""
    if (c.accelerators_on and c.triton and (c.device_type == "cuda" or (c.device_type == "cpu" and c.triton_on_cpu))
            and c.dtype in (torch.float16, torch.bfloat16, torch.float32) and not c.return_maps and c.has_conv
            and c.row_elements <= gpu.MAX_ROW_ELEMENTS):
        if not c.step:
            return dispatch.TRITON_FULL_PASS
        if (not c.grad_enabled and c.rows == 1 and c.kernel_size > 1 and c.layout != "full" and not c.mask_per_head
                and not c.padded_query_rows):
            return dispatch.TRITON_STEP
    accelerated = (c.accelerators_on and c.built and c.device_type == "cpu" and not c.return_maps
                   and c.dtype in (torch.float32, torch.float64) and c.has_conv and not c.autocast)
    if not accelerated:
        return dispatch.REFERENCE
    if not c.step:
        return dispatch.CPU_FULL_PASS
    if (c.grad_enabled or c.rows != 1 or c.kernel_size == 1 or c.layout == "full" or c.mask_per_head
            or c.padded_query_rows):
        return dispatch.REFERENCE
    if c.values and not c.hand_on and c.unshared_values_batch <= dispatch.STEP_VALUES_MAX_BATCH:
        return dispatch.CPU_STEP_ATTEND
    return dispatch.CPU_STEP


def test_every_combination_of_facts_goes_where_the_rules_say():
    """All 2**16 combinations of the facts (two values each, one of them the accelerated
    backends' need; the Triton kernels' CPU switch and row width apart, in the table's own test)."""
    import itertools

    domains = [("cpu", "cuda"), (torch.float64, torch.bfloat16), (True, False), (True, False), (False, True),
               (False, True), (True, False), (3, 1), ("causal", "full"), (True, False), (1, 4), (False, True),
               (False, True), (True, False), (False, True), (0, 1000), (True, False)]
    seen = set()
    for facts in itertools.product(*domains):
        call = dispatch.Call(*facts)
        if not call.has_conv and call.kernel_size != 1:
            continue
        chosen = dispatch.select(call)
        assert chosen == expected_backend(call), call
        seen.add(chosen)
    assert seen == set(dispatch.PREFERENCE)


def random_call(kind, layout, kernel_size, dtype, g, bsz=3, heads=HEADS, src=7, tgt=5):
    """Arguments of one call of the operation: ``kind`` says which conditions it meets
    (a full pass's maps have ``tgt`` query rows)."""
    rows = 1 if kind.startswith("step") else tgt
    width = src
    logits = torch.randn(bsz, heads, rows, width, generator=g, dtype=dtype) * 2
    keys = torch.zeros(bsz, 1, 1, width, dtype=torch.bool)
    keys[1, ..., :2] = True
    masked = keys.expand(bsz, heads, 1, width).clone() if kind == "step-mask-per-head" else keys
    neutral = None
    if kind in ("full-padded-rows", "step-padded-rows"):
        padded = torch.zeros(bsz, rows, dtype=torch.bool)
        padded[2, 0] = True
        neutral = masked | padded[:, None, :, None]
    logits = logits.masked_fill(masked, float("-inf"))
    previous = torch.randn(bsz, heads, rows, width, generator=g, dtype=dtype)
    values = torch.randn(bsz * heads, width, 8, generator=g, dtype=dtype)
    torch.manual_seed(int(torch.randint(0, 1000, (1,), generator=g)))
    conv = torch.nn.Conv2d(heads, heads, kernel_size).to(dtype)
    params = EvolvingAttentionParams(0.3, 0.6, conv.weight.detach(), conv.bias.detach(), layout)
    earlier = torch.randn(bsz, heads, kernel_size - 1, width, generator=g, dtype=dtype)
    state = StepState(earlier, torch.tensor([2, 0, 1])) if kind.startswith("step") else None
    return logits, previous, masked, neutral, params, state, values


KINDS = ["full", "full-padded-rows", "step", "step-mask-per-head", "step-padded-rows"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["causal", "rows", "full"])
@pytest.mark.parametrize("kernel_size", [1, 3])
@pytest.mark.parametrize("attend", [False, True], ids=["A_logit", "weights"])
def test_both_backends_agree_wherever_both_may_run(kernel, kind, layout, kernel_size, attend):
    """For calls of every kind the conditions tell apart, the operation with accelerators
    on runs the backend the dispatcher names (seen at the backend's entry) and gives the
    reference's result and next state; its arguments, the input state included, are read,
    never changed."""
    if layout == "full" and kind.startswith("step") and kernel_size > 1:
        pytest.skip("an encoder self-attention does not decode step by step")
    g = torch.Generator().manual_seed(4)
    results = []
    for on in (True, False):
        logits, previous, masked, neutral, params, state, values = random_call(kind, layout, kernel_size,
                                                                               torch.float64, g.manual_seed(4))
        arguments = [logits, previous, masked, neutral, values] + ([] if state is None else list(state[:2]))
        kept = [None if x is None else x.clone() for x in arguments]
        hand_on = not attend
        ran = []
        with torch.no_grad(), contextlib.nullcontext() if on else accelerators.reference_only():
            call = dispatch.describe(logits, masked, neutral, params, state, values if attend else None, hand_on, False)
            with spy(ran):
                out = evolving_attention(logits, previous, masked, neutral, params, state=state,
                                         values=values if attend else None, hand_on=hand_on)
        assert ran == [dispatch.choose(call)]
        assert all(x is None or torch.equal(x, y) for x, y in zip(arguments, kept))
        if state is not None:
            assert (out.state is state) == (kernel_size == 1)  # a 1x1 kernel reads no earlier rows
        results.append((ran[0], out))
    (backend, got), (reference, want) = results
    assert reference == dispatch.REFERENCE
    expected = {("full", True): dispatch.CPU_FULL_PASS, ("full-padded-rows", True): dispatch.CPU_FULL_PASS,
                ("step", True): (dispatch.CPU_STEP_ATTEND if attend else dispatch.CPU_STEP)}
    shifted = layout != "full" and kernel_size > 1
    assert backend == expected.get((kind, kind.startswith("full") or shifted), dispatch.REFERENCE)
    compared = [(name, getattr(got, name), getattr(want, name)) for name in ("logits", "carried", "probs", "context")]
    if kind.startswith("step") and kernel_size > 1:
        # the rows the next step reads: each backend's own arithmetic, as its outputs are
        assert got.state.order is None
        compared.append(("state.rows", got.state.rows, want.state.rows))
    for name, x, y in compared:
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(torch.isneginf(x), torch.isneginf(y)), name
            finite = torch.isfinite(y)
            assert (x[finite] - y[finite]).abs().max() <= 1e-12 * (1 + y[finite].abs().max()), name


@contextlib.contextmanager
def spy(ran):
    """Record the backend that runs: each row's function, wrapped."""
    rows = dict(dispatch.TABLE)

    def recorded(name, row):
        def run(*args, **kwargs):
            ran.append(name)
            return row.run(*args, **kwargs)
        return row._replace(run=run)

    dispatch.TABLE.update({name: recorded(name, row) for name, row in rows.items()})
    try:
        yield
    finally:
        dispatch.TABLE.update(rows)


def test_a_decoding_step_is_a_function_of_its_state():
    """Replaying a step from the same state gives the same result and next state, for both
    backends (the operation keeps nothing between calls: the caller holds the state)."""
    for on in (True, False):
        with torch.no_grad(), contextlib.nullcontext() if on else accelerators.reference_only():
            logits, previous, masked, neutral, params, state, values = random_call(
                "step", "causal", 3, torch.float32, torch.Generator().manual_seed(5))
            first = evolving_attention(logits, previous, masked, None, params, state=state, values=values)
            again = evolving_attention(logits, previous, masked, None, params, state=state, values=values)
            assert torch.equal(first.probs, again.probs) and torch.equal(first.context, again.context)
            assert torch.equal(first.state.rows, again.state.rows)
            # the next step from the stored state: the kernel made once is reused
            third = evolving_attention(logits, previous, masked, None, params, state=first.state, values=values)
            assert third.state.kernel is first.state.kernel is not None


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("path", ["accelerated", "reference"])
def test_a_training_pass_writes_into_none_of_its_arguments(kernel, grad, path):
    """A full pass with autograd on (training) or off, padded query rows, a previous map,
    the weights asked for: the logits and every other argument as they were."""
    args = random_call("full-padded-rows", "causal", 3, torch.float32, torch.Generator().manual_seed(6))
    logits, previous, masked, neutral, params, _, values = args
    logits.requires_grad_(grad)
    kept = [x.detach().clone() for x in (logits, previous, masked, neutral, values)]
    with torch.set_grad_enabled(grad), accelerators.reference_only() if path == "reference" else contextlib.nullcontext():
        out = evolving_attention(logits, previous, masked, neutral, params, values=values, hand_on=True)
    if grad:
        out.context.sum().backward()
        assert logits.grad is not None
    assert all(torch.equal(x, y) for x, y in zip((logits, previous, masked, neutral, values), kept))


def test_the_backend_is_chosen_once_per_configuration_and_follows_the_switches(kernel, monkeypatch):
    """Calls of one configuration evaluate the table once; inside ``reference_only()`` the
    same call is another configuration (the reference runs), and after it the first choice
    again, without a new evaluation."""
    evaluated = []
    select = dispatch.select
    monkeypatch.setattr(dispatch, "select", lambda call: evaluated.append(call) or select(call))
    dispatch.forget()
    logits, previous, masked, neutral, params, state, values = random_call(
        "full", "full", 3, torch.float32, torch.Generator().manual_seed(7))
    ran = []
    with torch.no_grad(), spy(ran):
        for _ in range(3):
            evolving_attention(logits, previous, masked, neutral, params)
        assert ran == [dispatch.CPU_FULL_PASS] * 3 and len(evaluated) == 1
        with accelerators.reference_only():
            evolving_attention(logits, previous, masked, neutral, params)
        evolving_attention(logits, previous, masked, neutral, params)
    assert ran[3:] == [dispatch.REFERENCE, dispatch.CPU_FULL_PASS] and len(evaluated) == 2
    monkeypatch.undo()
    dispatch.forget()


def test_a_decoding_run_and_batches_of_any_length_are_a_handful_of_configurations(kernel, monkeypatch):
    """The keys of a decoding run grow every step and batches come in every length: the
    table is evaluated once per size the conditions tell apart (one query row or more,
    the Triton row's width in powers of two), not once per length."""
    evaluated = []
    select = dispatch.select
    monkeypatch.setattr(dispatch, "select", lambda call: evaluated.append(call) or select(call))
    dispatch.forget()
    g = torch.Generator().manual_seed(3)
    widths = set()
    with torch.no_grad():
        for kind, lengths in (("step", range(3, 41)), ("full", range(3, 31))):
            for src in lengths:
                logits, previous, masked, neutral, params, state, values = random_call(
                    kind, "causal", 3, torch.float32, g, src=src, tgt=src)
                evolving_attention(logits, previous, masked, neutral, params, state=state)
                widths.add((kind, gpu.row_elements(HEADS, src)))
    assert len(evaluated) == len(widths) < 12
    monkeypatch.undo()
    dispatch.forget()


def test_the_operations_package_imports_neither_fairseq_nor_the_plugin():
    """``import ea_ops`` (every module of it) and one call of the operation, in a fresh
    process: no fairseq, no ea_fairseq."""
    code = ("import pkgutil, sys, torch, ea_ops\n"
            "for m in pkgutil.iter_modules(ea_ops.__path__): __import__('ea_ops.' + m.name)\n"
            "p = ea_ops.EvolvingAttentionParams(0.5, 0.5, torch.randn(2, 2, 3, 3), None, 'causal')\n"
            "ea_ops.evolving_attention(torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4), None, None, p)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fairseq', 'ea_fairseq')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("layout", ["full", "causal"])
def test_a_call_under_autocast_runs_the_reference(kernel, layout):
    """Float32 maps under CPU autocast (bfloat16): the reference runs, its convolution in
    autocast's dtype, as it does inside ``reference_only()`` (the fused passes, which take
    the maps' dtype alone, would meet a bfloat16 convolution output)."""
    from conftest import cpu_autocast_supports

    if not cpu_autocast_supports(torch.bfloat16):
        pytest.skip("CPU autocast does not run bfloat16 here")
    logits, previous, masked, neutral, params, _, _ = random_call("full", layout, 3, torch.float32,
                                                                   torch.Generator().manual_seed(8))
    ran = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with spy(ran):
            got = evolving_attention(logits, previous, masked, neutral, params, hand_on=True)
        with accelerators.reference_only():
            want = evolving_attention(logits, previous, masked, neutral, params, hand_on=True)
    assert ran == [dispatch.REFERENCE]
    assert torch.equal(got.carried, want.carried) and torch.equal(got.logits, want.logits)


def test_a_call_on_a_device_autocast_does_not_know_goes_to_the_reference():
    """The meta device (shapes only, no values: a model's dry run) is no device of
    autocast's: the call's facts are gathered without asking autocast about it (which
    raises), and the reference takes the call."""
    params = EvolvingAttentionParams(0.5, 0.5, torch.randn(HEADS, HEADS, 3, 3, device="meta"), None, "causal")
    logits = torch.randn(2, HEADS, 3, 5, device="meta")
    call = dispatch.describe(logits, None, None, params, None, None, True, False)
    assert not call.autocast and dispatch.choose(call) == dispatch.REFERENCE


def test_a_mask_of_three_dimensions_that_differs_between_heads_is_per_head():
    """A (H, 1, S) mask broadcasts over the batch of (B, H, 1, S) logits and differs between
    heads: the decoding steps (one mask for all heads) must not take it; a (1, 1, S) mask
    and a (B, 1, 1, S) one are one mask for all heads."""
    params = EvolvingAttentionParams(0.5, 0.5, torch.randn(HEADS, HEADS, 3, 3), None, "rows")
    logits = torch.randn(2, HEADS, 1, 5)
    for masked, per_head in ((torch.zeros(HEADS, 1, 5, dtype=torch.bool), True),
                             (torch.zeros(1, 1, 5, dtype=torch.bool), False),
                             (torch.zeros(2, 1, 1, 5, dtype=torch.bool), False)):
        call = dispatch.describe(logits, masked, None, params, StepState(), None, False, False)
        assert call.mask_per_head == per_head, tuple(masked.shape)


@pytest.mark.parametrize("layout", ["full", "causal", "rows"])
def test_an_even_kernel_is_refused_with_a_message_by_every_backend(layout):
    """No layout's padding centres an even kernel: the operation refuses it in one line, in a
    full pass and a decoding step alike, instead of a backend's shape error or a result; an
    odd one runs (the control; the full layout, an encoder's, has no decoding steps)."""
    logits = torch.randn(2, HEADS, 1, 5)
    for k, state in ((4, None), (4, StepState()), (2, StepState())):
        params = EvolvingAttentionParams(0.5, 0.5, torch.randn(HEADS, HEADS, k, k), None, layout)
        with pytest.raises(ValueError, match=f"^the attention-map kernel size must be odd and >= 1, got {k}: "):
            evolving_attention(logits, None, None, None, params, state=state)
    params = EvolvingAttentionParams(0.5, 0.5, torch.randn(HEADS, HEADS, 3, 3), None, layout)
    state = None if layout == "full" else StepState()
    assert evolving_attention(logits, None, None, None, params, state=state).logits.shape == logits.shape


def test_a_cuda_call_that_misses_the_kernels_says_why_once_per_configuration(caplog):
    """A call on CUDA with a map convolution that the Triton kernels do not take (analysis
    asking for the maps; triton not installed) logs one line naming the conditions, once per
    configuration; a call the kernels take logs nothing."""
    on_kernels = BASE[dispatch.TRITON_FULL_PASS]
    analysis = on_kernels._replace(return_maps=True, triton=False)
    dispatch.forget()
    try:
        with caplog.at_level("INFO", logger=dispatch.__name__):
            chosen = [dispatch.choose(call) for call in (on_kernels, analysis, analysis, on_kernels)]
    finally:
        dispatch.forget()
    assert chosen == [dispatch.TRITON_FULL_PASS, dispatch.REFERENCE, dispatch.REFERENCE, dispatch.TRITON_FULL_PASS]
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1, lines
    assert "runs on reference, not the Triton kernels, for full passes with autograd in float16" in lines[0]
    assert "not no intermediate maps asked for; not triton installed" in lines[0], lines[0]
