"""The device suite (tests/device/test_device*.py): every attention family on the test device, anchored to
float64 on CPU.

The device is ``EA_FAIRSEQ_TEST_DEVICE`` (``cpu``, ``cuda``, ``cuda:1``, ...), by default CUDA
where torch sees it and the CPU otherwise, so every test here runs on every CI machine and a
GPU's first run spends its time on the GPU, not on the tests. What needs CUDA itself
(fairseq-train's ``--fp16``/``--bf16``/``--amp``, ``torch.cuda.set_sync_debug_mode``, cuDNN's
TF32) carries the ``cuda`` marker and is skipped elsewhere with the reason.

Checked per family of tests/support/families.py and per precision (the decoding properties --
causality, incremental == full pass, batch invariance, beam search -- run on the same device
in test_decoding_properties.py):

* outputs and gradients on the device against a float64 CPU model with the same weights,
  no further than fairseq's transformer is on the same device in the same precision
  (:func:`anchor_failures`);
* fp16 training through fairseq's ``FP16Optimizer`` from loss scale 128 as fairseq's transformer
  of the same size trains: gradients within one halving of the loss scale of its, at most one
  more update skipped (a failure names the overflowing gradients);
* no tensor built from Python values or read back by the plugin's code in a training or a
  decoding step (what would copy between host and device on a GPU);
* on CUDA: ``fairseq-train --fp16/--bf16/--amp`` then ``fairseq-generate --fp16`` with no update
  skipped, all pairs side by side (the runner itself runs on every device, in float32), no
  host-device sync from the plugin's code in a training or a decoding step, and what cuDNN's
  default TF32 does to float32 EA maps (measured and written to the report).

This file holds the anchor to float64; test_device_self_consistency.py, test_device_fp16.py,
test_device_cli.py and test_device_host_sync.py the rest; device_support.py what they share.
"""
import copy
from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, build_model, random_batch
from support.device_support import EVERY_FAMILY, SMALL, cast, exact_float32, family_model, twin_arch  # noqa: F401  (fixture)
from ea_ops import accelerators
from ea_fairseq.modules import AttentionMapConv
from ea_fairseq.modules.drop_attention import DropAttention

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest)


# -- the anchor: outputs and gradients against float64 on CPU ---------------------------
#: precision -> (the model's dtype, autocast dtype or None)
PRECISIONS = {"fp32": (torch.float32, None), "fp16": (torch.float16, None), "bf16": (torch.bfloat16, None),
              "autocast-fp16": (torch.float32, torch.float16), "autocast-bf16": (torch.float32, torch.bfloat16)}
# How far the device may be from float64: no further than fairseq's own transformer (the
# family's twin, at its size) is on the same device, in the same precision, on the same
# inputs -- FUDGE times as far, as PyTorch's SDPA tests hold a kernel to the math path's
# error in the same dtype -- and never less than FUDGE units in the last place. Each error
# is in units of its tensor's scale (the logits: their largest |value|; a gradient: the
# model's largest gradient entry, since a gradient of exactly zero, a key projection's
# bias, has no scale of its own): the logits against the twin's logits, every gradient
# against the twin's worst gradient (the plugin's parameters have no one-to-one twin: RAN's
# matrices, EA's convolutions). The device's kernels (the twin's fused attention, the
# plugin's unfused one) round in their own order; FUDGE leaves room for that, and a wrong
# beta, a dropped scale or (in float32) a gradient 1% off still fails
# (test_the_float64_anchor_fails_a_defective_model).
FUDGE = 5.0
#: fairseq's transformer itself must be this close to float64 (units of its scale, times the
#: precision's machine epsilon) for its error to be a yardstick
YARDSTICK = 64


def anchor_batch(dictionary):
    g = torch.Generator().manual_seed(5)
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6)
    target = torch.randint(dictionary.nspecial, len(dictionary), prev.shape, generator=g)
    return src, lengths, prev, target


@contextmanager
def same_drop_masks(masks: list, record: bool):
    """DropAttention's random masks: recorded as the device draws them, then replayed in the
    same order on the reference models (the same modules ask for them in the same order)."""
    draw = DropAttention.drop_mask
    queue = list(masks)

    def recorded(self, shape, device):
        mask = draw(self, shape, device)
        masks.append(mask.cpu())
        return mask

    def replayed(self, shape, device):
        assert queue, "a reference model asked for more DropAttention masks than the device drew"
        mask = queue.pop(0)
        assert mask.shape == torch.Size([shape[0], shape[1], mask.shape[2], shape[3]]), (mask.shape, shape)
        return mask.to(device)

    DropAttention.drop_mask = recorded if record else replayed
    try:
        yield
    finally:
        DropAttention.drop_mask = draw
    assert record or not queue, f"{len(queue)} recorded DropAttention masks were not asked for"


def outputs_and_gradients(model, batch, device, autocast_dtype=None):
    """Training-mode logits and the parameters' gradients of the summed token NLL (fairseq's
    criterion: log-softmax in float32, float64 for the float64 model), all as float64 on CPU."""
    src, lengths, prev, target = (t.to(device) for t in batch)
    model.train()
    model.zero_grad(set_to_none=True)
    context = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    with context:
        logits = model(src, lengths, prev)[0]
    lprobs = F.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    F.nll_loss(lprobs.view(-1, lprobs.size(-1)), target.view(-1), reduction="sum").backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().double().cpu(), grads


def errors_from_float64(model, precision, batch, tamper=None):
    """``model`` (float32, on the CPU) run on the device in ``precision`` against its float64
    copy on the CPU (reference implementations): ``{tensor: |device - float64| at its
    largest, in units of the tensor's scale}`` for ``"logits"`` and every parameter's
    gradient. ``tamper(model)`` changes the device's copy only (the negative controls)."""
    dtype, autocast_dtype = PRECISIONS[precision]
    device_model = cast(copy.deepcopy(model), dtype).to(DEVICE)
    if tamper:
        tamper(device_model)
    masks = []
    with same_drop_masks(masks, record=True):
        out, grads = outputs_and_gradients(device_model, batch, DEVICE, autocast_dtype)
    with accelerators.reference_only(), same_drop_masks(masks, record=False):
        exact_out, exact_grads = outputs_and_gradients(copy.deepcopy(model).double(), batch, torch.device("cpu"))
    if any(isinstance(m, DropAttention) and m.p > 0 for m in model.modules()):
        assert masks and any(m.any() for m in masks), "DropAttention dropped nothing: the check would not see it"
    assert exact_grads.keys() == grads.keys()
    scale = max(g.abs().max().item() for g in exact_grads.values())
    found = {"logits": (out - exact_out).abs().max().item() / exact_out.abs().max().item()}
    found.update({n: (grads[n] - exact_grads[n]).abs().max().item() / scale for n in exact_grads})
    return found


def yardstick_errors(twin: str, precision: str, dictionary) -> dict:
    """fairseq's ``twin`` on the device in ``precision`` against float64 (computed once per
    twin and precision): ``{"logits": its logits' error, "gradients": its worst gradient's}``,
    after checking that it is a yardstick (within :data:`YARDSTICK` epsilons of float64)."""
    key = (twin, precision)
    if key not in _YARDSTICKS:
        model, _ = build_model(twin, *SMALL)
        found = errors_from_float64(model.eval(), precision, anchor_batch(dictionary))
        low = PRECISIONS[precision][1] or PRECISIONS[precision][0]
        limit = YARDSTICK * torch.finfo(low).eps
        far = {n: f"{e:.3g}" for n, e in found.items() if not e <= limit}
        assert not far, f"fairseq's {twin} in {precision} is further than {limit:.3g} from float64: {far}"
        _YARDSTICKS[key] = {"logits": found.pop("logits"), "gradients": max(found.values())}
    return _YARDSTICKS[key]


_YARDSTICKS = {}


def anchor_failures(family: str, precision: str, dictionary, tamper=None) -> dict:
    """The tensors (logits, gradients) of ``family`` on the device in ``precision`` that are
    further from float64 than FUDGE times its twin's (see :data:`FUDGE`): ``{name: why}``."""
    model = family_model(family, device="cpu")
    found = errors_from_float64(model, precision, anchor_batch(dictionary), tamper)
    yardstick = yardstick_errors(twin_arch(family), precision, dictionary)
    low = PRECISIONS[precision][1] or PRECISIONS[precision][0]
    failures = {}
    for name, error in found.items():
        twin = yardstick["logits" if name == "logits" else "gradients"]
        bound = FUDGE * max(twin, torch.finfo(low).eps)
        if not error <= bound:  # also catches NaN
            failures[name] = f"{error:.3g} > {FUDGE:g} x {twin:.3g} (the twin's)"
    return failures


@EVERY_FAMILY
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_outputs_and_gradients_match_float64_on_cpu(dictionary, family, precision):
    """The device's logits and every parameter's gradient against a float64 CPU model with
    the same (rounded) weights: no further than FUDGE times fairseq's transformer (the
    family's twin) on the same device in the same precision (see :data:`FUDGE`; the
    accelerator, where one applies, runs on the device as it does in training). For
    ``vanilla`` (fairseq's transformer: the twin itself) what is checked is the yardstick,
    within :data:`YARDSTICK` epsilons of float64."""
    failures = anchor_failures(family, precision, dictionary)
    assert not failures, failures


def scale_evolving_beta(model, factor=0.8):
    from ea_fairseq.modules.evolving_attention import EvolvingAttention

    attentions = [m for m in model.modules() if isinstance(m, EvolvingAttention)]
    assert attentions
    for m in attentions:
        m.beta *= factor


def drop_query_scaling(model):
    from ea_fairseq.modules.evolving_attention import EvolvingAttention

    for m in model.modules():
        if isinstance(m, EvolvingAttention):
            m.scaling = 1.0


def skew_a_map_convolution_gradient(model, factor=1.01):
    conv = next(m for m in model.modules() if isinstance(m, AttentionMapConv))
    conv.weight.register_hook(lambda grad: grad * factor)


DEFECTS = {"beta x 0.8": scale_evolving_beta, "query scaling dropped": drop_query_scaling,
           "a map convolution's gradient x 1.01": skew_a_map_convolution_gradient}


@pytest.mark.parametrize("precision,defect", [("fp32", d) for d in DEFECTS] + [
    ("fp16", "beta x 0.8"), ("fp16", "query scaling dropped"), ("autocast-bf16", "query scaling dropped")])
def test_the_float64_anchor_fails_a_defective_model(dictionary, precision, defect):
    """Negative control of :func:`anchor_failures`: EA-Lite with a defect on the device (the
    float64 model is right) fails -- in every precision where the defect is larger than
    the precision's rounding (a gradient 1% off is smaller than fp16's, and is caught in
    float32, which every family runs)."""
    assert not anchor_failures("ea-lite", precision, dictionary)
    failures = anchor_failures("ea-lite", precision, dictionary, tamper=DEFECTS[defect])
    assert failures, f"{defect} passed the float64 anchor in {precision}"
    if defect.startswith("a map"):
        assert list(failures) == ["encoder.layers.0.self_attn.conv.weight"], failures
    else:
        assert "logits" in failures, failures
