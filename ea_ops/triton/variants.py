"""What the kernels' launches ask of a GPU's compiler, found on any machine (no GPU): each
launch keyed as Triton keys its compile cache for sm_90 (:class:`Launches`: the variants a
workload compiles), and each variant compiled for sm_90 with cuobjdump's resource count
(:func:`registers`: registers, stack and local memory; both tools ship in the triton wheel).

The one harness of ``benchmarks/triton_counts.py`` (an epoch's and a decode's variants and
their registers) and of the kernels' tests (``tests/ops/test_triton_guards.py``: variants;
``test_triton_registers_and_launches.py``, ``test_triton_step.py``: no spills), so that what
is compiled is what the backend launches, never a description of it written beside.
"""
import collections
import contextlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

#: the kernels, by module of this package
KERNELS = {"evolving_attention": ("_forward_kernel", "_backward_conv_kernel", "_backward_input_kernel"),
           "decoding_step": ("_step_kernel",)}
#: the arguments a kernel writes: zeroed where a launch is recorded instead of run
OUTPUTS = {"out_ptr", "carry_ptr", "rows_ptr", "dconv_ptr", "gin_ptr", "shares_ptr", "gx_ptr", "gp_ptr"}
ROOT = Path(__file__).resolve().parents[2]


def _binder(kernel):
    """Triton's binder of ``kernel`` for sm_90: arguments -> (bound, specialisation, options)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature
    # on a GPU the kernel itself; under the interpreter a JITFunction of its function, with its
    # options (do_not_specialize): either way the binder Triton keys that kernel's cache with
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    return create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))


class Launches:
    """Inside :meth:`recorded`, every launch of the kernels is keyed as Triton keys its compile
    cache for sm_90, recorded (``variants``: kernel -> {key: (specialisation, options)};
    ``launches``: kernel -> count; ``grids``: kernel -> grids) and not run: its output tensors
    are zeroed. With ``run``, it is run instead: ``run(kernel's name, launch)`` returns what
    ``launch()`` returns (a launch counter's hook)."""

    def __init__(self, run=None):
        self.run = run
        self.variants = collections.defaultdict(dict)
        self.launches = collections.Counter()
        self.grids = collections.defaultdict(set)

    @contextlib.contextmanager
    def recorded(self):
        saved = []
        for module_name, names in KERNELS.items():
            module = importlib.import_module(f"{__package__}.{module_name}")
            for name in names:
                kernel = getattr(module, name)
                saved.append((module, name, kernel))
                setattr(module, name, _Recorded(self, name, kernel))
        try:
            yield self
        finally:
            for module, name, kernel in saved:
                setattr(module, name, kernel)

    def count(self, name=None):
        return sum(len(keys) for kernel, keys in self.variants.items() if name in (None, kernel))

    def specialisations(self):
        """``[(module, kernel, specialisation, options)]`` of every variant recorded, as
        :func:`registers` takes them."""
        return [(_module_of(name), name, spec, options)
                for name, keys in self.variants.items() for spec, options in keys.values()]


class _Recorded:
    def __init__(self, launches, name, kernel):
        self.launches, self.name, self.kernel = launches, name, kernel
        self.binder = _binder(kernel)
        self.names = kernel.arg_names

    def __getitem__(self, grid):
        self.launches.grids[self.name].add(tuple(grid))

        def run(*args, **kwargs):
            _, specialization, options = self.binder(*args, **kwargs)
            key = (tuple(specialization), json.dumps(options, sort_keys=True))
            self.launches.variants[self.name].setdefault(key, (specialization, options))
            self.launches.launches[self.name] += 1
            if self.launches.run is not None:
                return self.launches.run(self.name, lambda: self.kernel[grid](*args, **kwargs))
            for name, arg in zip(self.names, args):
                if name in OUTPUTS and isinstance(arg, torch.Tensor):
                    arg.zero_()
        return run


def _module_of(name):
    return next(module for module, names in KERNELS.items() if name in names)


# Run in a process of its own: under the interpreter triton.jit makes interpreted functions,
# which the compiler does not take. One line in per variant, one line out.
COMPILE = """
import importlib, json, os, subprocess, sys, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
for line in sys.stdin:
    module, name, spec, options = json.loads(line)
    kernel = getattr(importlib.import_module("ea_ops.triton." + module), name)
    signature = {p: s[0] for p, s in zip(kernel.arg_names, spec)}
    constexprs = {(i,): s[1] for i, s in enumerate(spec) if s[0] == "constexpr"}
    attrs = {(i,): backend.parse_attr(s[1]) for i, s in enumerate(spec) if s[0] != "constexpr" and s[1]}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options)
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    fields = dict(f.split(":") for f in next(l for l in usage.splitlines() if "REG:" in l).split()[:5])
    print(json.dumps([name, fields]), flush=True)
"""


def registers(variants):
    """``[(module, kernel, specialisation, options)]`` (:meth:`Launches.specialisations`)
    compiled for sm_90 in a process without the interpreter: ``[(kernel, {REG, STACK, SHARED,
    LOCAL, ...})]``. A failed compile raises ``RuntimeError`` with the compiler's output's tail."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    lines = "".join(json.dumps([m, n, s, o], default=str) + "\n" for m, n, s, o in variants)
    try:
        done = subprocess.run([sys.executable, "-c", COMPILE], input=lines, capture_output=True, text=True,
                              env=env, timeout=600)
    except subprocess.TimeoutExpired:
        raise RuntimeError("compiling for sm_90 took over 600 s") from None
    if done.returncode != 0:
        raise RuntimeError(f"compiling for sm_90 failed: {done.stderr.strip()[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines()]
