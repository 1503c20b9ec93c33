"""The device suite (tests/device/test_device*.py): no tensor built from Python values or read back by
the plugin's code in a training or a decoding step (what would copy between host and device on
a GPU); on CUDA no host-device sync from the plugin's code in those steps, and what cuDNN's
default TF32 does to float32 EA maps (measured and written to the report)."""
import copy
import math
import os
import traceback
import warnings
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from fairseq import optim

from conftest import DEVICE, build_model, random_batch
import ea_fairseq
from support.device_support import (EVERY_FAMILY, SMALL, TOLERANCE, exact_float32, family_model,  # noqa: F401  (fixture)
                            needs_cuda, report)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest)


PACKAGE = os.path.dirname(os.path.abspath(ea_fairseq.__file__))
#: who made a call, by the file of the innermost frame outside torch (see :func:`call_site`)
OWNERS = {"plugin": PACKAGE, "harness": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
          "fairseq": os.path.dirname(os.path.dirname(os.path.abspath(optim.__file__)))}
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
#: TF32 as this process had it before the suite switched it off (PyTorch's default: cuDNN
#: convolutions in TF32, float32 matmuls not)
DEFAULT_TF32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


def call_site(stack, owners=None):
    """``(owner, "file:line")`` of the code that made a call: the innermost frame of ``stack``
    (``traceback.extract_stack()``, outermost first) outside torch and the warnings module,
    owned by the first of :data:`OWNERS` whose folder holds its file ("other" if none) -- a
    line of torch's own (``torch/cuda/__init__.py``) is its caller's, and a call the test
    harness makes around a step is the harness's, not the plugin's."""
    for frame in reversed(stack):
        path = os.path.abspath(frame.filename)
        if path.startswith(TORCH_DIR + os.sep) or os.path.basename(path) == "warnings.py":
            continue
        owner = next((o for o, folder in (owners or OWNERS).items() if path.startswith(folder + os.sep)), "other")
        return owner, f"{frame.filename}:{frame.lineno}"
    return "other", "?"


@contextmanager
def warning_sites(match: str):
    """Yields a list that gets :func:`call_site` of every warning whose message contains
    ``match``, raised while the context is open (each with the stack it was raised from)."""
    sites = []

    def show(message, category, filename, lineno, file=None, line=None):
        if match in str(message):
            sites.append(call_site(traceback.extract_stack()[:-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        yield sites


def synchronising_calls(fn):
    """:func:`call_site` of every synchronising CUDA call made while ``fn`` ran
    (``torch.cuda.set_sync_debug_mode("warn")``; a call inside a backward pass is reported
    at its ``.backward()``)."""
    torch.cuda.synchronize(DEVICE)
    with warning_sites("synchroniz") as sites:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def training_and_decoding_steps(model, src, lengths, prev):
    """A training step (forward, loss, backward) and six incremental decoding steps with a
    beam reorder: what fairseq's trainer and SequenceGenerator run of a model."""
    target = prev.roll(-1, 1)
    order = torch.tensor([2, 0, 1], device=DEVICE)

    def train_step():
        model.train()
        logits = model(src, lengths, prev)[0]
        F.cross_entropy(logits.float().view(-1, logits.size(-1)), target.reshape(-1)).backward()

    def decode():
        model.eval()
        with torch.no_grad():
            enc = model.encoder(src, src_lengths=lengths)
            state, tokens = {}, prev
            for t in range(prev.size(1)):
                if t == 3:
                    model.decoder.reorder_incremental_state_scripting(state, order)
                    enc = model.encoder.reorder_encoder_out(enc, order)
                    tokens = tokens.index_select(0, order)
                model.decoder(tokens[:, : t + 1], encoder_out=enc, incremental_state=state)

    return {"training step": train_step, "decoding": decode}


@needs_cuda("torch.cuda.set_sync_debug_mode")
@EVERY_FAMILY
def test_no_host_device_sync_in_a_training_or_decoding_step(dictionary, family):
    """No synchronising CUDA call made from the plugin's code in a training step or in
    decoding, and no more made from fairseq's than fairseq's ``transformer_lite`` makes in
    the same steps (fairseq's own, e.g. its encoder's ``if encoder_padding_mask.any()``, are
    reported, not counted against the plugin; the harness's and torch's own are neither)."""
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6, device=DEVICE)
    found = {}
    twin, _ = build_model("transformer_lite", *SMALL)
    for name, model in (("plugin", family_model(family)), ("twin", twin.to(DEVICE))):
        steps = training_and_decoding_steps(model, src, lengths, prev)
        for fn in steps.values():  # warm-up: lazy initialisation outside the check
            fn()
        found[name] = {step: synchronising_calls(fn) for step, fn in steps.items()}
    def made_by(owner, side, step):
        return [site for o, site in found[side][step] if o == owner]

    steps = list(found["plugin"])
    report("host-device syncs", family=family,
           plugins_code={step: made_by("plugin", "plugin", step) for step in steps},
           fairseqs_code_in_model_and_twin={step: [len(made_by("fairseq", side, step)) for side in found]
                                            for step in steps})
    for step in steps:
        ours = made_by("plugin", "plugin", step)
        assert not ours, f"{step} of {family}: synchronising CUDA calls at {ours}"
        fairseqs, twins = made_by("fairseq", "plugin", step), made_by("fairseq", "twin", step)
        assert len(fairseqs) <= len(twins), (step, fairseqs, twins)


#: what hands a value between host and device when the tensor lives on a GPU: a tensor built
#: from Python values (a host-to-device copy), a value read back (device-to-host, a sync)
HOST_DEVICE = {torch: ("tensor", "as_tensor"), torch.Tensor: ("item", "tolist", "__bool__", "cpu", "numpy")}


@contextmanager
def host_device_calls(owners=None):
    """Yields a list that gets :func:`call_site` of every call of :data:`HOST_DEVICE` while
    the context is open: on any device, what would copy between host and device on a GPU."""
    sites = []

    def watched(name, original):
        def call(*args, **kwargs):
            sites.append((name, *call_site(traceback.extract_stack()[:-1], owners)))
            return original(*args, **kwargs)
        return call

    originals = [(owner, name, getattr(owner, name)) for owner, names in HOST_DEVICE.items() for name in names]
    for owner, name, original in originals:
        setattr(owner, name, watched(name, original))
    try:
        yield sites
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


@EVERY_FAMILY
def test_no_value_crosses_between_host_and_device_in_the_plugins_steps(dictionary, family):
    """What the sync check sees on a GPU, seen on any device: in a training step and in
    decoding, the plugin's code builds no tensor from Python values and reads none back
    (``torch.tensor``, ``.item()``, ``bool(tensor)``, ...; fairseq's and the harness's own
    calls are not the plugin's)."""
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6, device=DEVICE)
    model = family_model(family)
    for step, fn in training_and_decoding_steps(model, src, lengths, prev).items():
        with host_device_calls() as sites:
            fn()
        ours = [f"{name} at {site}" for name, owner, site in sites if owner == "plugin"]
        assert not ours, f"{step} of {family}: {ours}"


def test_host_device_calls_and_sync_warnings_are_attributed_to_their_caller(dictionary, monkeypatch):
    """Negative controls of the two checks above: HC-SA's offsets built from its Python tuple
    in every call (compiled as the plugin's file) are the plugin's calls in a training step;
    a warning raised here is the harness's; a frame of torch's own is its caller's."""
    from ea_fairseq.modules import hard_coded_attention

    source = ("def position_logits(self, query_positions, *args):\n"
              "    self.head_offsets = torch.tensor(self.offsets, device=query_positions.device)\n"
              "    return ORIGINAL(self, query_positions, *args)\n")
    scope = {"torch": torch, "ORIGINAL": hard_coded_attention.HardCodedGaussianAttention.position_logits}
    exec(compile(source, hard_coded_attention.__file__, "exec"), scope)
    monkeypatch.setattr(hard_coded_attention.HardCodedGaussianAttention, "position_logits", scope["position_logits"])
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6, device=DEVICE)
    step = training_and_decoding_steps(family_model("hcsa-lite"), src, lengths, prev)["training step"]
    with host_device_calls() as sites:
        step()
    ours = [site for name, owner, site in sites if owner == "plugin" and name == "tensor"]
    assert len(ours) == 4 and all(site.startswith(hard_coded_attention.__file__) for site in ours), sites
    with warning_sites("synchroniz") as caught:
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("something else")
    assert [owner for owner, _ in caught] == ["harness"], caught
    here = traceback.extract_stack()
    frame = traceback.FrameSummary(os.path.join(TORCH_DIR, "cuda", "__init__.py"), 1270, "synchronize")
    plugin = traceback.FrameSummary(os.path.join(PACKAGE, "modules", "x.py"), 7, "forward")
    assert call_site([*here, frame])[0] == "harness"
    assert call_site([*here, plugin, frame]) == ("plugin", f"{plugin.filename}:7")


@needs_cuda("cuDNN's TF32")
def test_tf32_effect_on_float32_ea_maps_is_measured(dictionary):
    """EA-Lite's maps and logits in float32 against float64 with TF32 off, as this process
    had it by default (PyTorch's default: cuDNN's map convolutions in TF32) and everywhere;
    the largest differences go to the report. Asserted only: finite, and TF32 (10 mantissa
    bits) no further from float64 than the bf16 bound or ten times float32's own error."""
    from ea_fairseq.analysis.maps import AttentionCapture

    model = family_model("ea-lite")
    exact_model = copy.deepcopy(model).double()
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6, device=DEVICE)

    def maps(m):
        with torch.no_grad(), AttentionCapture(m) as capture:
            logits = m(src, lengths, prev)[0]
        found = {f"{attention}.{kind}": torch.stack([x.double().cpu() for x in layers])
                 for attention, kinds in capture.result().items() for kind, layers in kinds.items()
                 if all(x is not None for x in layers)}
        return {"logits": logits.double().cpu(), **found}

    exact = maps(exact_model)
    gaps = {}
    for setting, (matmul, cudnn) in {"off": (False, False), "default": DEFAULT_TF32, "all": (True, True)}.items():
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
        got = maps(model)
        gaps[setting] = {k: (got[k] - exact[k]).abs().max().item() for k in exact}
    report("TF32 vs float64: EA-Lite float32 maps and logits, largest |difference|",
           default_setting={"matmul": DEFAULT_TF32[0], "cudnn": DEFAULT_TF32[1]},
           **{s: max(g.values()) for s, g in gaps.items()}, per_map=gaps)
    assert all(math.isfinite(v) for g in gaps.values() for v in g.values()), gaps
    for setting in ("default", "all"):
        assert gaps[setting]["logits"] <= max(TOLERANCE[torch.bfloat16], 10 * gaps["off"]["logits"]), gaps
