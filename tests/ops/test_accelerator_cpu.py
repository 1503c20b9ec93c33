"""The CPU backend of EA Eq. (4) (fused C++ passes and decoding step): the reference's
values and gradients on every shape below, clear failures, a private build made ahead, the
reference with a warning where there is none. (The dispatcher's table and the backends'
agreement on every call both take: test_dispatch.py.)"""
import contextlib
import logging
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ea_fairseq.modules import EvolvingAttention, layer_maps
from ea_ops import accelerators, build, dispatch, evolving_attention, library
from ea_ops import cpu as cpu_ea
from ea_ops.contract import EvolvingAttentionParams, StepState

HEADS = 4


@pytest.fixture(scope="module")
def kernel():
    if not accelerators.enabled_by_environment():
        pytest.skip(f"{accelerators.ENV_SWITCH}=0: the reference runs everywhere")
    ext = library.extension()
    assert ext is not None, f"the CPU backend is not built ({library.COMMAND}: a C++ compiler, ninja)"
    return ext


def ea_attention(layout, kernel_size, alpha, dtype, seed=0, hand_on=True):
    torch.manual_seed(seed)
    attn = EvolvingAttention(16, HEADS, self_attention=layout == "causal",
                             encoder_decoder_attention=layout == "rows", slot="self", alpha=alpha, beta=0.4,
                             kernel_size=kernel_size, conv_layout=layout, hand_on=hand_on)
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


@pytest.fixture
def step_values_at_any_batch(monkeypatch):
    """The CPU step computes the weights at every batch size (the dispatcher's cached
    choices forgotten where its constant changes)."""
    monkeypatch.setattr(dispatch, "STEP_VALUES_MAX_BATCH", 10**6)
    dispatch.forget()
    yield
    monkeypatch.undo()
    dispatch.forget()


@pytest.mark.parametrize("layout", ["causal", "rows"])
@pytest.mark.parametrize("kernel_size", [3, 5])
@pytest.mark.parametrize("alpha", [0.0, 0.3])
@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "padded-keys"])
@pytest.mark.parametrize("bsz", [1, 7, 300], ids=["b1", "b7", "b300-threads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float", "double"])
@pytest.mark.parametrize("weights", [False, True], ids=["A_logit", "softmax"])
def test_accelerated_step_equals_the_reference(kernel, step_values_at_any_batch, layout, kernel_size, alpha,
                                              padded, bsz, dtype, weights):
    """A_logit (handed on to the next layer) or, when no layer reads it, the weights and
    the value product (at every batch size here, above the size where decoding uses it too)."""
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


def test_an_unbuilt_extension_runs_the_reference_and_says_how_to_build_it(monkeypatch, caplog):
    """A checkout whose extension is not built (another copy of the sources: another name)
    compiles nothing in a forward pass: the reference runs, and one warning names the
    command that builds it."""
    if not accelerators.enabled_by_environment():
        pytest.skip(f"{accelerators.ENV_SWITCH}=0: the extension is never looked for")
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("compiled in a forward pass"))
    monkeypatch.setattr(library, "HERE", "/nonexistent/ea_ops")
    monkeypatch.setattr(library, "_state", {"module": None, "tried": False})
    params = EvolvingAttentionParams(0.3, 0.5, torch.randn(HEADS, HEADS, 3, 3), None, "full")
    logits = torch.randn(2, HEADS, 5, 5)
    ran = []
    monkeypatch.setitem(dispatch.TABLE, dispatch.REFERENCE, dispatch.TABLE[dispatch.REFERENCE]._replace(
        run=lambda *a, **k: ran.append(1) or dispatch.reference.evolving_attention_reference(*a, **k)))
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        for _ in range(2):
            out = evolving_attention(logits, logits, None, None, params)
    assert ran == [1, 1] and library.status() is False and torch.isfinite(out.logits).all()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not built" in warnings[0] and "python -m ea_ops.build" in warnings[0]
    assert not dispatch.accelerated_dtype("cpu", torch.float32)


def test_calls_no_cpu_backend_can_take_never_look_for_the_extension(monkeypatch, caplog):
    """A call on CUDA, in float16 or with the switch off goes where it goes without the
    extension being looked for: no load, no warning where it could not run anyway."""
    monkeypatch.setattr(library, "HERE", "/nonexistent/ea_ops")  # nothing built: a lookup would warn
    monkeypatch.setattr(library, "_state", {"module": None, "tried": False})
    base = dispatch.Call(device_type="cpu", dtype=torch.float32, accelerators_on=True, built=None,
                         grad_enabled=True, return_maps=False, has_conv=True, kernel_size=3, layout="full",
                         step=False, rows=6, mask_per_head=False, padded_query_rows=False, values=False,
                         hand_on=True, unshared_values_batch=0)
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        for change in (dict(device_type="cuda"), dict(dtype=torch.float16), dict(accelerators_on=False)):
            assert dispatch.choose(base._replace(**change)) not in (dispatch.CPU_FULL_PASS, dispatch.CPU_STEP,
                                                                    dispatch.CPU_STEP_ATTEND)
        assert library.status() is None and not caplog.records
        assert dispatch.choose(base) == dispatch.REFERENCE and library.status() is False  # looked for once
    assert len(caplog.records) == 1


def test_a_failed_build_is_one_line_that_says_what_it_needs(tmp_path, monkeypatch):
    """The build command without a compiler: a one-line error naming what it needs, exit 1."""
    monkeypatch.setattr(library, "HERE", str(tmp_path))  # another name: nothing built there
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    with pytest.raises(build.BuildError, match=r"did not build \(.*no-compiler.*not found\); it needs a C\+\+ compiler"):
        build.build()


def test_the_switch_runs_the_reference_everywhere():
    code = "import torch; from ea_ops import dispatch as d; print(d.accelerated_dtype('cpu', torch.float32))"
    for value, want in (("0", "False"), ("1", "True")):
        env = dict(os.environ, **{accelerators.ENV_SWITCH: value})
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert want in proc.stdout.strip().splitlines()[-1]


def test_the_build_is_private_to_this_copy_and_named_after_its_sources(kernel, tmp_path, monkeypatch):
    name = library.extension_name()
    assert name.startswith("ea_ops_cpu_") and name == library.extension_name()
    assert os.path.dirname(kernel.__file__) == library.build_directory(name)
    assert library.build_directory(name).startswith(os.path.join(library.HERE, "_build"))
    # what build.ninja names is in the name: another compiler, another copy of the package,
    # torch as another path names it (a linked venv)
    from torch.utils import cpp_extension

    for change in (lambda m: m.setenv("CXX", "clang++"), lambda m: m.setattr(library, "HERE", str(tmp_path)),
                   lambda m: m.setattr(cpp_extension, "TORCH_LIB_PATH", str(tmp_path / "lib"))):
        with monkeypatch.context() as m:
            change(m)
            assert library.extension_name() != name
    source = tmp_path / "evolving_attention.cpp"
    source.write_text(open(library.SOURCES[0]).read() + "\n// changed\n")
    monkeypatch.setattr(library, "SOURCES", [str(source)])
    assert library.extension_name() != name  # a changed source is a new build


def test_the_package_reached_through_a_link_loads_and_builds_the_same_library(kernel, tmp_path):
    """The package imported through a link loads the library already built, and its build
    command finds it up to date: no compile, the build's files untouched. (A path through
    the link in ``build.ninja`` would make ninja compile again, and the next process that
    takes the real path once more.) The process has no compiler on its PATH (pip's ninja the
    build finds itself), so a compile fails at once instead of passing slowly."""
    directory = library.build_directory(library.extension_name())

    def built():  # not torch's lock file, which another process loading the library may hold
        return {f: os.stat(os.path.join(directory, f)).st_mtime_ns for f in os.listdir(directory)
                if f == "build.ninja" or f.endswith((".o", ".so"))}

    files = built()
    assert "build.ninja" in files and len(files) == 3
    (tmp_path / "ea_ops").symlink_to(library.HERE)
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "import ea_ops\n"
            "from ea_ops import build, library\n"
            "assert ea_ops.__file__.startswith(sys.argv[1]), ea_ops.__file__\n"
            "print(library.HERE)\n"
            "print(library.extension() is not None)\n"
            "print(build.build() == library.library_path())")
    try:
        import ninja  # noqa: F401  (pip's: the build puts its directory on PATH)
        path = "/nonexistent"
    except ImportError:  # a system ninja, found beside the compiler
        path = os.environ["PATH"]
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          env=dict(os.environ, PATH=path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [library.HERE, "True", "True"], proc.stderr[-2000:]
    assert built() == files


# -- full passes (training): the fused functions around the convolution ------------------
def full_pass(attn, logits, previous, masked, query_padding, use_kernel):
    """A_logit and the gradients of a weighted sum of it w.r.t. logits, previous map,
    kernel and bias, through the accelerator or the reference."""
    logits = logits.clone().requires_grad_()
    previous = previous.clone().requires_grad_()
    attn.conv.zero_grad()
    with layer_maps(attn, previous={"self": previous}, wanted=("self",)), \
            contextlib.nullcontext() if use_kernel else accelerators.reference_only():
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


def test_a_library_cut_short_runs_the_reference_and_is_built_again(kernel, tmp_path, monkeypatch, caplog):
    """A library that ends before its segments (a link that did not finish, a copy cut short)
    would crash the process when loaded (SIGBUS), not raise: it is not loaded (the reference
    runs, one warning says why and names the build command), and the build command builds
    it again where ninja would find it newer than its sources. Negative control: the
    complete library is not cut short, and neither is a file that is no ELF (which fails to
    load with an ImportError)."""
    complete = open(kernel.__file__, "rb").read()
    assert not library.cut_short(kernel.__file__)
    monkeypatch.setattr(library, "HERE", str(tmp_path))
    monkeypatch.setattr(library, "_state", {"module": None, "tried": False})
    name = library.extension_name()
    path = os.path.join(library.directories(name)[0], name + library.LIBRARY_SUFFIX)
    os.makedirs(os.path.dirname(path))
    for end in (4, 63, len(complete) // 3, len(complete) - 1):
        with open(path, "wb") as f:
            f.write(complete[:end])
        assert library.cut_short(path), end
    with open(str(tmp_path / "text"), "wb") as f:
        f.write(b"not a library")
    assert not library.cut_short(str(tmp_path / "text"))
    params = EvolvingAttentionParams(0.3, 0.5, torch.randn(HEADS, HEADS, 3, 3), None, "full")
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        out = evolving_attention(torch.randn(2, HEADS, 5, 5), None, None, None, params)
    assert library.status() is False and torch.isfinite(out.logits).all()
    assert [r.getMessage() for r in caplog.records if "cut short" in r.getMessage() and library.COMMAND in r.getMessage()]
    dispatch.forget()
    commands = []
    monkeypatch.setattr(build.subprocess, "run", lambda argv, **kw: commands.append(argv) or subprocess.CompletedProcess(
        argv, 1, "", "stopped"))
    open(os.path.join(os.path.dirname(path), "build.ninja"), "w").close()
    with pytest.raises(build.BuildError):
        build.build()
    assert not os.path.exists(path) and commands[0][0] == sys.executable  # torch's first build, not ninja's check
