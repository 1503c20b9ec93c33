"""The CPU accelerator of EA Eq. (4) (fused C++ passes and decoding step): the reference's
values and gradients on every shape below, clear failures, a private build, a fallback;
the dispatcher's table, condition by condition, and the backends' agreement on every call
both take."""
import contextlib
import logging
import os
import subprocess
import sys

import pytest
import torch
from fairseq.modules import MultiheadAttention
from torch.utils._python_dispatch import TorchDispatchMode

from ea_fairseq import accelerators
from ea_fairseq.accelerators.cpu import build
from ea_fairseq.accelerators.cpu import evolving_attention as cpu_ea
from ea_fairseq.modules import AttentionMapCarrier, EvolvingAttention
from ea_fairseq.modules.evolving_attention_op import evolving_attention
from ea_fairseq.ops import evolving_attention_dispatch as dispatch
from ea_fairseq.ops.evolving_attention_types import EvolvingAttentionParams, StepState

HEADS = 4


@pytest.fixture(scope="module")
def kernel():
    if not accelerators.enabled_by_environment():
        pytest.skip(f"{accelerators.ENV_SWITCH}=0: the reference runs everywhere")
    ext = build.extension()
    assert ext is not None, "the CPU accelerators did not build (C++ compiler, ninja)"
    return ext


def ea_attention(layout, kernel_size, alpha, dtype, seed=0, hand_on=True):
    torch.manual_seed(seed)
    attn = EvolvingAttention(16, HEADS, self_attention=layout == "causal",
                             encoder_decoder_attention=layout == "rows", slot="self", alpha=alpha, beta=0.4,
                             kernel_size=kernel_size, conv_layout=layout, hand_on=hand_on)
    attn.attach(AttentionMapCarrier())
    with torch.no_grad():  # large weights and biases of both signs: every tap and the ReLU matter
        attn.conv.weight.normal_()
        attn.conv.bias.normal_()
    return attn.to(dtype)


def decode(attn, steps, bsz, src_len, padded, dtype, accelerated, reorder_at=None, weights=False):
    """Feed random step logits (fairseq's -inf on padded keys) and previous-layer maps to
    the operation, through the accelerator (checked to be the dispatcher's choice) or the
    reference; return every step's A_logit (handed on), or with ``weights`` the pair
    (softmax, value product) (encoder-decoder values shared by beams of 5 where the batch
    allows). Beams are reordered once, as in beam search."""
    g = torch.Generator().manual_seed(1)
    state, outs = StepState(), []
    want = (dispatch.CPU_STEP_ATTEND if weights else dispatch.CPU_STEP) if accelerated else dispatch.REFERENCE
    with torch.no_grad(), contextlib.nullcontext() if accelerated else accelerators.reference_only():
        for t in range(steps):
            if t == reorder_at:
                state = state.reordered(torch.arange(bsz).flip(0).roll(1))
            width = t + 1 if attn.conv.layout == "causal" else src_len
            logits = torch.randn(bsz, HEADS, 1, width, generator=g, dtype=dtype) * 3
            masked = None
            if padded:  # the first keys of every other sentence, the last one included, are
                keys = torch.zeros(bsz, width, dtype=torch.bool)  # padding (left-padded sources)
                keys[(bsz - 1) % 2 :: 2, : min(2, width - 1)] = True
                masked = keys[:, None, None, :]
                logits.masked_fill_(masked, float("-inf"))
            previous = torch.randn(bsz, HEADS, 1, width, generator=g, dtype=dtype)
            beams = 5 if layout_shares_values(attn) and bsz % 5 == 0 else 1
            v = None
            if weights:
                v = torch.randn(bsz // beams * HEADS, width, attn.head_dim, generator=g, dtype=dtype)
            args = (logits, previous if attn.alpha > 0 else None, masked, None, attn.params())
            call = dispatch.describe(logits, masked, None, attn.params(), state, v, not weights, False)
            assert dispatch.choose(call) == want, dispatch.refusals(call, want)
            out = evolving_attention(*args, state=state, values=v, hand_on=not weights)
            state = out.state
            outs.append((out.probs.clone(), out.context.clone()) if weights else out.logits.clone())
    return outs


def layout_shares_values(attn):
    return attn.conv.layout == "rows"


@pytest.mark.parametrize("layout", ["causal", "rows"])
@pytest.mark.parametrize("kernel_size", [3, 5])
@pytest.mark.parametrize("alpha", [0.0, 0.3])
@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "padded-keys"])
@pytest.mark.parametrize("bsz", [1, 7, 300], ids=["b1", "b7", "b300-threads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float", "double"])
@pytest.mark.parametrize("weights", [False, True], ids=["A_logit", "softmax"])
def test_accelerated_step_equals_the_reference(kernel, monkeypatch, layout, kernel_size, alpha,
                                              padded, bsz, dtype, weights):
    """A_logit (handed on to the next layer) or, when no layer reads it, the weights and
    the value product (at every batch size here, above the size where decoding uses it too)."""
    monkeypatch.setattr(dispatch, "STEP_VALUES_MAX_BATCH", 10**6)
    attn = ea_attention(layout, kernel_size, alpha, dtype, hand_on=not weights)
    steps, src_len = 6, 9
    got = decode(attn, steps, bsz, src_len, padded, dtype, True, reorder_at=3, weights=weights)
    want = decode(attn, steps, bsz, src_len, padded, dtype, False, reorder_at=3, weights=weights)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    for g, w in zip(got, want):
        if weights:  # masked keys weigh exactly 0, rows sum to 1; then the value products
            (g, g_context), (w, w_context) = g, w
            assert torch.equal(g == 0, w == 0)
            assert (g.sum(-1) - 1).abs().max() <= tol
            assert g_context.shape == w_context.shape == (1, bsz, 16)
            assert (g_context - w_context).abs().max() <= tol * w_context.abs().max()
        assert g.shape == w.shape and g.dtype == dtype
        assert torch.equal(torch.isneginf(g), torch.isneginf(w))
        finite = torch.isfinite(w)
        assert finite.any() and (g[finite] - w[finite]).abs().max() <= tol * w[finite].abs().max()
    if padded:
        last = got[-1][0] if weights else got[-1]
        assert (last[-1] == 0).any() if weights else torch.isneginf(last[-1]).any()


@pytest.mark.parametrize("layout,beams,fused_above_limit", [
    ("rows", 1, False),   # encoder values per hypothesis (beam 1): torch's matmul above the limit
    ("rows", 5, True),    # encoder values shared by a sentence's beams
    ("causal", 1, True),  # decoder self-attention
])
def test_which_large_steps_take_torch_softmax_and_matmul(kernel, layout, beams, fused_above_limit):
    attn = ea_attention(layout, 3, 0.0, torch.float32, hand_on=False)
    limit = dispatch.STEP_VALUES_MAX_BATCH // beams * beams
    for bsz, fused_values in ((limit, True), (limit + beams, fused_above_limit)):
        logits = torch.randn(bsz, HEADS, 1, 6)
        v = torch.randn(bsz // beams * HEADS, 6, attn.head_dim)
        with torch.no_grad(), SoftmaxSeen() as seen:
            out = evolving_attention(logits, None, None, None, attn.params(), state=StepState(), values=v)
        assert out.context.shape == (1, bsz, 16)
        assert seen.softmax != fused_values  # torch's softmax where the kernel does not fuse


class SoftmaxSeen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.softmax = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.softmax |= func is torch.ops.aten._softmax.default
        return func(*args, **(kwargs or {}))


def cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def test_the_step_loops_build_follows_the_cpu_and_the_switch(kernel):
    if os.environ.get("EA_FAIRSEQ_PORTABLE_KERNELS") == "1":
        assert kernel.step_loops_build() == "portable"
    elif {"avx2", "fma"} <= cpu_flags():
        assert kernel.step_loops_build() == "avx2"


def test_portable_step_loops_equal_the_pytorch_path(kernel):
    """CPUs without AVX2 + FMA run the portable build of the step's loops: forced here in a
    fresh process (the build is chosen when the kernel loads), the comparison with the
    PyTorch path must hold there too."""
    if os.environ.get("EA_FAIRSEQ_PORTABLE_KERNELS") == "1":
        pytest.skip("this process runs the portable build already")
    env = dict(os.environ, EA_FAIRSEQ_PORTABLE_KERNELS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "step_loops_build or (accelerated_step_equals and b7 and not no-padding)"],
        env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_bad_input_is_refused_with_a_message(kernel):
    weight = torch.zeros(HEADS, HEADS, 3, 3)
    with pytest.raises(RuntimeError, match=r"logits must be \(B, H, 1, S\)"):
        kernel.evolving_attention_step(torch.zeros(2, HEADS, 2, 5), None, None, None, weight,
                                       None, 0.0, 0.1, 1)
    with pytest.raises(RuntimeError, match="earlier rows must be"):
        kernel.evolving_attention_step(torch.zeros(2, HEADS, 1, 5), None,
                                       torch.zeros(2, HEADS, 2, 6), None, weight, None, 0.0, 0.1, 2)
    with pytest.raises(RuntimeError, match="of the logits' dtype"):
        kernel.evolving_attention_step(torch.zeros(2, HEADS, 1, 5), None, None, None,
                                       weight.double(), None, 0.0, 0.1, 1)
    with pytest.raises(RuntimeError, match=r"values must be \(B_kv \* H, S, head_dim\)"):
        kernel.evolving_attention_step(torch.zeros(6, HEADS, 1, 5), None, None, None, weight,
                                       None, 0.0, 0.1, 1, torch.zeros(4 * HEADS, 5, 8))
    earlier = torch.zeros(3, HEADS, 2, 5)  # rows of 3 hypotheses, read in beam search's new order
    with pytest.raises(RuntimeError, match=r"order\[1\] = 3 does not index the 3 cached hypotheses"):
        kernel.evolving_attention_step(torch.zeros(2, HEADS, 1, 5), None, earlier, None, weight,
                                       None, 0.0, 0.1, 1, None, torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="one entry per hypothesis"):
        kernel.evolving_attention_step(torch.zeros(2, HEADS, 1, 5), None, earlier, None, weight,
                                       None, 0.0, 0.1, 1, None, torch.tensor([0, 1, 2]))


def test_an_unbuildable_kernel_falls_back_with_a_warning(monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp

    def no_ninja(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp, "load", no_ninja)
    monkeypatch.setattr(build, "_state", {"module": None, "tried": False})
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.extension() is None
        assert build.extension() is None  # tried once per process, warned once
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "pip install ninja" in warnings[0].getMessage()
    assert "Ninja is required" in warnings[0].getMessage()
    assert not dispatch.accelerated_dtype("cpu", torch.float32)


def test_the_switch_runs_the_reference_everywhere():
    code = ("import torch, ea_fairseq; from ea_fairseq.ops import evolving_attention_dispatch as d; "
            "print(d.accelerated_dtype('cpu', torch.float32))")
    for value, want in (("0", "False"), ("1", "True")):
        env = dict(os.environ, **{accelerators.ENV_SWITCH: value})
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(__file__)), timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert want in proc.stdout.strip().splitlines()[-1]


def test_the_build_is_private_to_this_copy_and_named_after_its_sources(kernel, tmp_path, monkeypatch):
    name = build.extension_name()
    assert name.startswith("ea_fairseq_cpu_") and name == build.extension_name()
    # the same name as before the library was loaded (torch appends to the flags it is given)
    assert os.path.dirname(kernel.__file__) == build.build_directory(name)
    assert build.build_directory(name).startswith(os.path.join(build.HERE, "_build"))
    # what build.ninja names is in the name: another compiler, another copy of the package,
    # torch as another path names it (a linked venv)
    from torch.utils import cpp_extension

    for change in (lambda m: m.setenv("CXX", "clang++"), lambda m: m.setattr(build, "HERE", str(tmp_path)),
                   lambda m: m.setattr(cpp_extension, "TORCH_LIB_PATH", str(tmp_path / "lib"))):
        with monkeypatch.context() as m:
            change(m)
            assert build.extension_name() != name
    source = tmp_path / "evolving_attention.cpp"
    source.write_text(open(build.SOURCES[0]).read() + "\n// changed\n")
    monkeypatch.setattr(build, "SOURCES", [str(source)])
    assert build.extension_name() != name  # a changed source is a new build


def test_the_package_reached_through_a_link_loads_the_same_build(kernel, tmp_path):
    """``--user-dir`` naming a link to this package (as the recipes' walk-through does) loads
    the library already built: no compile, the build's files untouched. A path through the
    link in ``build.ninja`` would make ninja compile again, and the next process that takes
    the real path once more. The process has no compiler on its PATH (pip's ninja the build
    finds itself), so a compile fails at once instead of passing slowly."""
    directory = build.build_directory(build.extension_name())

    def built():  # not torch's lock file, which another process loading the library may hold
        return {f: os.stat(os.path.join(directory, f)).st_mtime_ns for f in os.listdir(directory)
                if f == "build.ninja" or f.endswith((".o", ".so"))}

    files = built()
    assert "build.ninja" in files and len(files) == 3
    (tmp_path / "ea_fairseq").symlink_to(os.path.dirname(os.path.dirname(build.HERE)))
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "import ea_fairseq\n"
            "from ea_fairseq.accelerators.cpu import build\n"
            "assert ea_fairseq.__file__.startswith(sys.argv[1]), ea_fairseq.__file__\n"
            "print(build.HERE)\n"
            "print(build.extension() is not None)")
    try:
        import ninja  # noqa: F401  (pip's: the build puts its directory on PATH)
        path = "/nonexistent"
    except ImportError:  # a system ninja, found beside the compiler
        path = os.environ["PATH"]
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          env=dict(os.environ, PATH=path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [build.HERE, "True"], proc.stderr[-2000:]
    assert built() == files


# -- full passes (training): the fused functions around the convolution ------------------
def full_pass(attn, logits, previous, masked, query_padding, use_kernel):
    """A_logit and the gradients of a weighted sum of it w.r.t. logits, previous map,
    kernel and bias, through the accelerator or the reference."""
    logits = logits.clone().requires_grad_()
    previous = previous.clone().requires_grad_()
    attn.conv.zero_grad()
    carrier = attn.attention_maps
    with carrier.scope(), contextlib.nullcontext() if use_kernel else accelerators.reference_only():
        carrier.hand_on("self", previous)
        out = attn.transform_logits(logits.clone(), masked, query_padding, None)
    finite = torch.isfinite(out)
    weights = torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out)
    (out.masked_fill(~finite, 0) * weights).sum().backward()
    return out.detach(), logits.grad, previous.grad, attn.conv.weight.grad.clone(), attn.conv.bias.grad.clone()


@pytest.mark.parametrize("layout", ["full", "causal", "rows"])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7])
@pytest.mark.parametrize("beta", [0.1, 0.6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float", "double"])
def test_accelerated_full_pass_equals_the_reference_with_gradients(kernel, layout, alpha, beta, dtype):
    attn = ea_attention(layout, 3, alpha, dtype)
    attn.beta = beta
    g = torch.Generator().manual_seed(2)
    bsz, tgt, src = 5, 6, 7 if layout == "rows" else 6
    logits = torch.randn(bsz, HEADS, tgt, src, generator=g, dtype=dtype) * 2
    previous = torch.randn(bsz, HEADS, tgt, src, generator=g, dtype=dtype)
    keys = torch.zeros(bsz, src, dtype=torch.bool)
    keys[1::2, :2] = True  # left-padded sentences
    masked = keys[:, None, None, :]
    query_padding = None
    if layout == "causal":
        masked = masked | torch.ones(tgt, src, dtype=torch.bool).triu(1)[None, None]
    if layout != "rows":  # self-attention: padded query rows are neutral too
        query_padding = keys[:, :tgt]
    logits = logits.masked_fill(masked, float("-inf"))
    got = full_pass(attn, logits, previous, masked, query_padding, True)
    want = full_pass(attn, logits, previous, masked, query_padding, False)
    assert torch.equal(torch.isneginf(got[0]), torch.isneginf(want[0]))
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for name, x, y in zip(("A_logit", "dlogits", "dprevious", "dweight", "dbias"), got, want):
        if name == "dprevious" and alpha == 0.0:
            assert x is None and y is None
            continue
        x, y = x.masked_fill(~torch.isfinite(y), 0), y.masked_fill(~torch.isfinite(y), 0)
        assert (x - y).abs().max() <= tol * (1 + y.abs().max()), name
    assert got[1].abs().sum() > 0 and got[3].abs().sum() > 0


def test_fused_functions_pass_gradcheck(kernel):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    previous = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    neutral = torch.zeros(2, 1, 1, 5, dtype=torch.bool)
    neutral[1, ..., :2] = True
    assert torch.autograd.gradcheck(
        lambda x, p: cpu_ea.EvolvingAttentionInput.apply(x, p, neutral.expand(x.shape), 0.3),
        (logits, previous))
    conv = torch.randn(2, 3, 6, 7, generator=g, dtype=torch.float64).to(
        memory_format=torch.channels_last).requires_grad_()
    a_input = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    for masked in (neutral.expand(a_input.shape), None):
        assert torch.autograd.gradcheck(
            lambda a, c: cpu_ea.ConvolutionResidual.apply(a, c, masked, 0.4).masked_fill(neutral, 0),
            (a_input, conv))


# -- the dispatcher: one table of conditions, each needed, and the backends' agreement -----
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
}
BREAK = {
    "accelerators switched on": dict(accelerators_on=False),
    "on a CPU": dict(device_type="cuda"),
    "float32 or float64": dict(dtype=torch.float16),
    "no intermediate maps asked for": dict(return_maps=True),
    "a map convolution": dict(has_conv=False),
    "the C++ extension built": dict(built=False),
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
}
# where a call goes when one condition of its backend breaks
THEN = {
    dispatch.CPU_FULL_PASS: {"a full pass": dispatch.REFERENCE},  # a step of 6 rows: the reference
    dispatch.CPU_STEP: {"a decoding step": dispatch.CPU_FULL_PASS},  # the same call as a full pass
    dispatch.CPU_STEP_ATTEND: {
        "a decoding step": dispatch.CPU_FULL_PASS, "values given": dispatch.CPU_STEP,
        "A_logit not handed on": dispatch.CPU_STEP,
        f"at most {dispatch.STEP_VALUES_MAX_BATCH} hypotheses with values of their own": dispatch.CPU_STEP},
}


def test_the_table_lists_every_condition_this_test_breaks():
    names = {c.name for conditions in dispatch.TABLE.values() for c in conditions}
    assert names == set(BREAK)
    assert dispatch.TABLE[dispatch.REFERENCE] == () and dispatch.PREFERENCE[-1] == dispatch.REFERENCE
    assert set(dispatch.PREFERENCE) == set(dispatch.TABLE) == set(BASE) | {dispatch.REFERENCE}


@pytest.mark.parametrize("backend", sorted(BASE))
def test_each_condition_alone_keeps_its_backend_from_a_call(backend):
    """The base call goes to ``backend``; breaking any one of its conditions sends it to the
    next backend that takes it (the reference where none does), and names that condition
    as the one refusal."""
    base = BASE[backend]
    assert dispatch.select(base) == backend and dispatch.refusals(base, backend) == []
    for condition in dispatch.TABLE[backend]:
        broken = base._replace(**BREAK[condition.name])
        assert dispatch.refusals(broken, backend) == [condition.name]
        assert dispatch.select(broken) == THEN[backend].get(condition.name, dispatch.REFERENCE), condition.name


def expected_backend(c):
    """The dispatcher's rules, as the documentation states them (written apart from the table)."""
    accelerated = (c.accelerators_on and c.built and c.device_type == "cpu" and not c.return_maps
                   and c.dtype in (torch.float32, torch.float64) and c.has_conv)
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
    """All 2**15 combinations of the facts (two values each, one of them the accelerated
    backends' need)."""
    import itertools

    domains = [("cpu", "cuda"), (torch.float64, torch.bfloat16), (True, False), (True, False), (False, True),
               (False, True), (True, False), (3, 1), ("causal", "full"), (True, False), (1, 4), (False, True),
               (False, True), (True, False), (False, True), (0, 1000)]
    seen = set()
    for facts in itertools.product(*domains):
        call = dispatch.Call(*facts)
        if not call.has_conv and call.kernel_size != 1:
            continue
        chosen = dispatch.select(call)
        assert chosen == expected_backend(call), call
        seen.add(chosen)
    assert seen == set(dispatch.PREFERENCE)


def random_call(kind, layout, kernel_size, dtype, g, bsz=3, heads=HEADS, src=7):
    """Arguments of one call of the operation: ``kind`` says which conditions it meets."""
    rows = 1 if kind.startswith("step") else 5
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
    reference's result and next state; the input state is read, never changed."""
    if layout == "full" and kind.startswith("step") and kernel_size > 1:
        pytest.skip("an encoder self-attention does not decode step by step")
    g = torch.Generator().manual_seed(4)
    results = []
    for on in (True, False):
        logits, previous, masked, neutral, params, state, values = random_call(kind, layout, kernel_size,
                                                                               torch.float64, g.manual_seed(4))
        kept = None if state is None else state.rows.clone()
        hand_on = not attend
        ran = []
        with torch.no_grad(), contextlib.nullcontext() if on else accelerators.reference_only():
            call = dispatch.describe(logits, masked, neutral, params, state, values if attend else None, hand_on, False)
            with spy(ran):
                out = evolving_attention(logits, previous, masked, neutral, params, state=state,
                                         values=values if attend else None, hand_on=hand_on)
        assert ran == [dispatch.choose(call)]
        if state is not None:
            assert torch.equal(state.rows, kept)  # a NamedTuple of tensors: the rows are the only content
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
    """Record the backend that runs: the operation calls each by its module attribute."""
    from ea_fairseq.modules import evolving_attention_op as op

    originals = (cpu_ea.full_pass, cpu_ea.step, op.evolving_attention_reference)

    def full_pass(*args, **kwargs):
        ran.append(dispatch.CPU_FULL_PASS)
        return originals[0](*args, **kwargs)

    def step(*args, **kwargs):
        values = args[5] if len(args) > 5 else kwargs.get("values")
        ran.append(dispatch.CPU_STEP_ATTEND if values is not None else dispatch.CPU_STEP)
        return originals[1](*args, **kwargs)

    def reference(*args, **kwargs):
        ran.append(dispatch.REFERENCE)
        return originals[2](*args, **kwargs)

    cpu_ea.full_pass, cpu_ea.step, op.evolving_attention_reference = full_pass, step, reference
    try:
        yield
    finally:
        cpu_ea.full_pass, cpu_ea.step, op.evolving_attention_reference = originals


def test_a_decoding_step_is_a_function_of_its_state():
    """Replaying a step from the same state gives the same result and next state, for both
    backends (the operation keeps nothing between calls: the caller holds the state)."""
    for on in (True, False):
        with torch.no_grad(), contextlib.nullcontext() if on else accelerators.reference_only():
            logits, previous, masked, neutral, params, state, values = random_call(
                "step", "causal", 3, torch.float32, torch.Generator().manual_seed(5))
            first = evolving_attention(logits.clone(), previous, masked, None, params, state=state, values=values)
            again = evolving_attention(logits.clone(), previous, masked, None, params, state=state, values=values)
            assert torch.equal(first.probs, again.probs) and torch.equal(first.context, again.context)
            assert torch.equal(first.state.rows, again.state.rows)
            # the next step from the stored state: the kernel made once is reused
            third = evolving_attention(logits.clone(), previous, masked, None, params, state=first.state,
                                       values=values)
            assert third.state.kernel is first.state.kernel is not None
