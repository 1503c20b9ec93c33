"""What EA Eq. (4)'s full-pass Triton kernels (:mod:`ea_ops.triton.evolving_attention`) ask of a
GPU, checked on any machine, no GPU needed: compiled for sm_90 (Hopper) in the variants the
backend launches, they spill no registers (what the interpreter cannot show, checked before a
GPU ever runs them); and an EA-Lite training update on them launches at most 1.05x the
operations of its twin, transformer_lite (counted on a CPU under the interpreter). Their values
and gradients: tests/ops/test_triton_full_pass.py. The compiler harness
(:func:`compiles_without_spills`) and the launch counter (:class:`KernelLaunches`) are also
tests/ops/test_triton_step.py's.

As tests/ops/test_triton_full_pass.py: on CUDA compiled, on a CPU run in Triton's interpreter
(``bash scripts/test_triton.sh``), skipped elsewhere (the default suite).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA: the kernels run in Triton's interpreter, bash scripts/test_triton.sh",
                allow_module_level=True)

from test_triton_full_pass import DEVICE  # noqa: E402

# Compiled in a process of its own: under the interpreter, triton.jit makes interpreted
# functions, which the compiler does not take. For sm_90 with cuobjdump's resource count
# (both ship in the triton wheel), every kernel in the variants the backend launches, at
# EA-Base's 8 heads (keys in blocks of 32, for rows of any length): no registers spilled to local memory.
SM90 = textwrap.dedent("""
    import json, os, subprocess, tempfile, triton
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

    def report(label, kernel, pointers, constants, warps):
        \"\"\"Compile ``kernel`` for sm_90 (``pointers``: argument types, None for an absent one;
        ``constants``: the constexprs) and print ``label`` and cuobjdump's resource count.\"\"\"
        signature, values = {}, {}
        for i, name in enumerate(kernel.arg_names):
            if name in constants or (name in pointers and pointers[name] is None):
                signature[name], values[(i,)] = "constexpr", constants.get(name)
            else:
                signature[name] = pointers.get(name, "fp32" if name in ("alpha", "beta") else "i32")
        compiled = triton.compile(ASTSource(kernel, signature, values), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps})
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True)
        os.unlink(f.name)
        line = next(l for l in usage.stdout.splitlines() if "REG:" in l)
        print(label, json.dumps(dict(field.split(":") for field in line.split()[:5])))
""")
COMPILE = textwrap.dedent("""
    from ea_ops.triton import evolving_attention as ea
    block_h, block_t, block_s, warps = ea.blocks(8)
    shape = dict(BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_S=block_s, K=3)

    def build(kernel, pointers, constants):
        report(kernel.__name__, kernel, pointers, constants, warps)

    maps = dict(x_ptr="*fp16", p_ptr="*fp16", w_ptr="*fp16", bias_ptr="*fp16", m_ptr="*u8", n_ptr="*u8")
    first = dict(maps, p_ptr=None, bias_ptr=None)  # masks: always read (a zero byte without one)
    every = dict(HAS_PREV=True, HAS_BIAS=True, NEUTRAL_PER_HEAD=False)
    none = dict(HAS_PREV=False, HAS_BIAS=False, NEUTRAL_PER_HEAD=False)
    causal = dict(shape, R0=2, C0=2, CAUSAL=True)
    full = dict(shape, R0=1, C0=1, CAUSAL=False)
    build(ea._forward_kernel, dict(maps, out_ptr="*fp16", carry_ptr="*fp16"),
          dict(causal, **dict(every, NEUTRAL_PER_HEAD=True), SOFTMAX=False, HAND_ON=True))
    build(ea._forward_kernel, dict(first, out_ptr="*fp32", carry_ptr=None),
          dict(full, **none, SOFTMAX=True, HAND_ON=False))
    backward = dict(dconv_ptr="*fp32", gin_ptr="*fp32", shares_ptr="*fp32")
    build(ea._backward_conv_kernel, dict(maps, probs_ptr=None, gout_ptr="*fp16", gcarry_ptr="*fp16", **backward),
          dict(causal, **every, SOFTMAX=False, HAS_GOUT=True, HAS_GCARRY=True))
    build(ea._backward_conv_kernel, dict(first, probs_ptr="*fp32", gout_ptr="*fp32", gcarry_ptr=None, **backward),
          dict(full, **none, SOFTMAX=True, HAS_GOUT=True, HAS_GCARRY=False))
    build(ea._backward_input_kernel,
          dict(w_ptr="*fp16", n_ptr="*u8", dconv_ptr="*fp32", gin_ptr="*fp32", gx_ptr="*fp16", gp_ptr="*fp16"),
          dict(causal, HAS_PREV=True))
""")


def compiles_without_spills(code: str, kernels: int) -> None:
    """``code`` (a program that calls :data:`SM90`'s ``report`` once per kernel it compiles for
    sm_90) run without the interpreter: ``kernels`` lines, none with stack or local memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", SM90 + code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == kernels, done.stdout
    for line in lines:
        name, usage = line.split(" ", 1)
        usage = json.loads(usage)
        assert usage["STACK"] == "0" and usage["LOCAL"] == "0", f"{name} spills registers: {usage}"


def test_the_kernels_compile_for_a_gpu_without_spilling_registers():
    compiles_without_spills(COMPILE, 5)


class KernelLaunches:
    """What a training update launches on CUDA with the kernels, counted on any device: the
    non-view aten operations (``test_operation_counts.OperationCounter``) around them, and
    each of the kernels' launches as one; on a CPU the interpreter's own operations during a
    launch (its copies of the arguments) are not counted."""

    NAMES = ("_forward_kernel", "_backward_conv_kernel", "_backward_input_kernel")

    def __init__(self, monkeypatch, kernels=None, names=NAMES):
        """``names``: the kernels of module ``kernels`` (the full pass's by default) counted."""
        import test_operation_counts as counts
        if kernels is None:
            from ea_ops.triton import evolving_attention as kernels

        outer = self

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
                return super().__torch_dispatch__(func, types, args, kwargs)

        class Counted:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):
                launch = self.kernel[grid]

                def run(*args, **kwargs):
                    counter = outer.counter
                    if not counter.active:
                        return launch(*args, **kwargs)
                    counter.count, counter.all = counter.count + 1, counter.all + 1
                    counter.ops["triton:" + self.name] += 1
                    counter.paused = True
                    try:
                        return launch(*args, **kwargs)
                    finally:
                        counter.paused = False
                return run

        for name in names:
            monkeypatch.setattr(kernels, name, Counted(getattr(kernels, name), name))
        self.counter = Counter()


@pytest.mark.skipif(DEVICE != "cpu", reason="counted on a CPU, under Triton's interpreter")
def test_an_ea_lite_training_update_launches_at_most_5_percent_more_than_the_twin(monkeypatch):
    """EA-Lite's training update (tests/attention/test_operation_counts.py's batch) with EA's Eq. 4 on the
    kernels, as on CUDA: at most 1.05x transformer_lite's non-view operations (its fused
    attention), 3 launches per EA attention. Negative control: the reference path's count
    (convolution, ReLU, mixes, masks and softmax as aten operations) exceeds the bound."""
    import test_operation_counts as counts
    from ea_ops import accelerators
    from ea_ops.triton import interpret_on_cpu

    with accelerators.reference_only():
        twin, reference = (counts.training_count(counts.build(family)) for family in ("transformer_lite", "EA-Lite"))
    launches = KernelLaunches(monkeypatch)
    with interpret_on_cpu():
        fused = counts.training_count(counts.build("EA-Lite"), launches.counter)
    attentions = 18  # 6 encoder, 6 decoder self, 6 cross
    assert all(fused.ops["triton:" + name] == attentions for name in KernelLaunches.NAMES), fused.ops
    table = (f"transformer_lite {twin.count} ({twin.kernels()} less allocations), EA-Lite on the kernels "
             f"{fused.count} ({fused.kernels()}), on the reference path {reference.count} ({reference.kernels()})")
    assert fused.count <= 1.05 * twin.count, table
    assert reference.count > 1.05 * twin.count, table
