"""The device suite: every attention family on the test device, anchored to float64 on CPU.

The device is ``EA_FAIRSEQ_TEST_DEVICE`` (``cpu``, ``cuda``, ``cuda:1``, ...), by default CUDA
where torch sees it and the CPU otherwise, so every test here runs on every CI machine and a
GPU's first run spends its time on the GPU, not on the tests. What needs CUDA itself
(fairseq-train's ``--fp16``/``--bf16``/``--amp``, ``torch.cuda.set_sync_debug_mode``, cuDNN's
TF32) carries the ``cuda`` marker and is skipped elsewhere with the reason.

Checked per family of tests/families.py and per precision (the decoding properties --
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

``EA_FAIRSEQ_DEVICE_REPORT=<file>`` appends the measurements (JSON lines) to ``<file>``.
"""
import copy
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
import warnings
from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.nn.functional as F
from fairseq import optim
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from conftest import DEVICE, ON_CUDA, REPO, THREADS, build_model, cli, decoder_out, make_dictionary, parse, random_batch, randomize_convs
import ea_fairseq
from ea_ops import accelerators
from ea_fairseq.modules import AttentionMapConv
from ea_fairseq.modules.drop_attention import DropAttention
from families import ANCHORED, FAMILIES


def needs_cuda(what: str):
    """Marks a test ``cuda`` and skips it, saying why, where the test device is not CUDA."""
    def mark(test):
        return pytest.mark.cuda(pytest.mark.skipif(not ON_CUDA, reason=f"{what} needs CUDA (the test device is "
                                                                       f"{DEVICE})")(test))
    return mark


SMALL = ("--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0.0", "--attention-dropout", "0.0",
         "--activation-dropout", "0.0")

# Two computations of the same logits on the device (float32: TF32 is switched off below;
# kernels still pick a reduction order per shape; the bounds of test_decoding_properties.py)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 0.02, torch.bfloat16: 0.1}
# EA/PA switched off vs fairseq's transformer: float64 as on CPU (test_ea_exactness.py)
REDUCTION = {torch.float64: 1e-6, **TOLERANCE}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                                 ids=["fp32", "fp16", "bf16"])
EVERY_FAMILY = pytest.mark.parametrize("family", ANCHORED)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest)


@pytest.fixture(autouse=True)
def exact_float32():
    """float32 means float32: no TF32 in matmuls or in cuDNN's (EA's, PA's) convolutions."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = cudnn


def report(name: str, **values):
    """A measurement: printed, and appended to ``$EA_FAIRSEQ_DEVICE_REPORT`` when set."""
    line = json.dumps({"measurement": name, "device": str(DEVICE),
                       "device_name": torch.cuda.get_device_name(DEVICE) if ON_CUDA else "cpu", **values})
    print(line)
    path = os.environ.get("EA_FAIRSEQ_DEVICE_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def cast(model, dtype):
    """As fairseq's ``--fp16``/``--bf16`` cast a model (``.half()``/``.bfloat16()``)."""
    return {torch.float16: model.half, torch.bfloat16: model.bfloat16, torch.float32: model.float,
            torch.float64: model.double}[dtype]()


def family_model(family, dtype=torch.float32, device=DEVICE, *extra):
    model, _ = build_model(*FAMILIES[family].args(), *SMALL, *extra)
    randomize_convs(model)
    return cast(model, dtype).to(device).eval()


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


def twin_arch(family: str) -> str:
    """fairseq's own transformer at the family's size: the yardstick of its precision."""
    return "transformer" if FAMILIES[family].arch.endswith("_base") else "transformer_lite"


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


# -- self-consistency on the device -----------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp64", "fp32", "fp16", "bf16"])
@pytest.mark.parametrize("family,off", [
    ("ea-lite", ("--ea-alpha", "0", "--ea-beta", "0", "--ea-decoder-alpha", "0", "--ea-no-encoder-conv",
                 "--ea-no-decoder-conv", "--ea-no-cross-conv")),
    ("pa-lite", ("--pa-alpha", "0")),
], ids=["ea", "pa"])  # RAN has no query/key projections: no vanilla model to reduce to
def test_switched_off_equals_fairseq_transformer(dictionary, family, off, dtype):
    """Same weights, same output as fairseq's own TransformerModel on the device (whose
    self-attention takes torch's fused attention kernels there)."""
    model, _ = build_model(FAMILIES[family].arch, *SMALL, *off)
    vanilla, _ = build_model("transformer_lite", *SMALL)
    missing, unexpected = model.load_state_dict(vanilla.state_dict(), strict=False)
    assert not unexpected and all(".predictor." in k for k in missing)
    model.to(device=DEVICE, dtype=dtype), vanilla.to(device=DEVICE, dtype=dtype)
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6, device=DEVICE)
    gap = (decoder_out(model, src, lengths, prev) - decoder_out(vanilla, src, lengths, prev)).abs().max().item()
    assert gap <= REDUCTION[dtype], gap


@pytest.mark.parametrize("mode,window", [("column", 2), ("element", 3)])
def test_drop_attention_masks_drawn_on_the_device_drop_at_rate_p(mode, window):
    """DropAttention's windowed masks as the device draws them: the rate 1-(1-p/w)^w of its
    docstring (about p), whole windows of consecutive keys, the same keys in every row for
    column mode."""
    p = 0.3
    drop = DropAttention(mode, p, window).train()
    torch.manual_seed(0)
    mask = drop.drop_mask((8, 4, 16, 64), DEVICE)
    assert mask.device.type == DEVICE.type
    expected = 1 - (1 - p / window) ** window
    assert abs(mask.float().mean().item() - expected) < 0.02, (mask.float().mean().item(), expected)
    runs = torch.diff(torch.nn.functional.pad(mask.int(), (1, 1)), dim=-1)
    starts, ends = (runs == 1).nonzero()[:, -1], (runs == -1).nonzero()[:, -1]
    at_end = ends == mask.size(-1)  # a window clipped at the end of the sentence
    assert ((ends - starts)[~at_end] >= window).all()
    assert mask.size(2) == (1 if mode == "column" else 16)


@DTYPES
def test_ea_map_convolution_is_one_public_conv2d_per_attention_and_step(dictionary, monkeypatch, dtype):
    """EA's map convolutions go through ``F.conv2d`` (cuDNN on CUDA, autocast-aware), one
    call per attention in a full pass and per attention and step in decoding; ATen's
    private direct convolutions (``torch._C._nn.thnn_conv2d`` and kin: slow im2col kernels
    on CUDA, outside autocast) are never called. On CPU the C++ accelerator replaces the
    convolution in float32, so there the reference runs: the path a GPU takes."""
    from ea_ops import map_conv as attention_map_conv

    def refuse(name):
        def private(*args, **kwargs):
            raise AssertionError(f"EA's map convolution called the private ATen op {name}")
        return private

    private_ops = {name: getattr(torch._C._nn, name) for name in dir(torch._C._nn)
                   if "conv" in name and name.startswith(("thnn_", "slow_"))}
    for name, op in private_ops.items():
        monkeypatch.setattr(torch._C._nn, name, refuse(name))
    for name, value in list(vars(attention_map_conv).items()):  # an op bound at import
        if any(value is op for op in private_ops.values()):
            monkeypatch.setattr(attention_map_conv, name, refuse(f"{name} (torch._C._nn)"))

    model = family_model("ea-lite", dtype)
    # the map convolution of the attention running now (EA's operation convolves with the
    # module's kernel without calling the module, so the attention owning it is watched)
    active, calls = [], []

    def watch(attention, conv):
        def enter(module, inputs):
            active.append(conv)

        def leave(module, inputs, output):
            active.pop()

        attention.register_forward_pre_hook(enter)
        attention.register_forward_hook(leave)

    for m in model.modules():
        for child in m.children():
            if isinstance(child, AttentionMapConv):
                watch(m, child)
    public = F.conv2d

    def counted(input, weight, *args, **kwargs):
        calls.append((active[-1] if active else None, input.device.type, input.dtype))
        return public(input, weight, *args, **kwargs)

    monkeypatch.setattr(F, "conv2d", counted)

    def callers():
        assert all(device == DEVICE.type and dt == dtype for _, device, dt in calls), calls
        found = sorted(id(m) for m, _, _ in calls)
        calls.clear()
        return found

    encoder_convs = sorted(id(m) for m in model.encoder.modules() if isinstance(m, AttentionMapConv))
    decoder_convs = sorted(id(m) for m in model.decoder.modules() if isinstance(m, AttentionMapConv))
    assert len(encoder_convs) == 2 and len(decoder_convs) == 4
    src, lengths, prev = random_batch(dictionary, [5, 9], 6, device=DEVICE)
    with torch.no_grad(), (nullcontext() if ON_CUDA else accelerators.reference_only()):
        encoder_out = model.encoder(src, src_lengths=lengths)
        assert callers() == encoder_convs
        state = {}
        for t in range(prev.size(1)):
            if t == 3:  # a beam reorder between steps
                order = torch.tensor([1, 0], device=DEVICE)
                model.decoder.reorder_incremental_state_scripting(state, order)
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, order)
                prev = prev.index_select(0, order)
            model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
            assert callers() == decoder_convs, f"decoding step {t}"


# -- fp16 training through fairseq's FP16Optimizer ---------------------------------------
def coherent_batch(dictionary, sentences, length=31):
    """One learnable sentence repeated: every sentence pushes the gradients the same way, so
    they add up as a real batch's positional patterns do (the case where a sum over
    sentences, heads and layers could overflow fp16)."""
    g = torch.Generator().manual_seed(0)
    vocab, nspecial = len(dictionary), dictionary.nspecial
    half = nspecial + (vocab - nspecial) // 2
    words = torch.randint(nspecial, half, (length,), generator=g)
    target = torch.cat([(words - nspecial + half).flip(0), torch.tensor([dictionary.eos()])])
    src = torch.cat([words, torch.tensor([dictionary.eos()])]).repeat(sentences, 1)
    tgt = target.repeat(sentences, 1)
    prev = torch.cat([tgt[:, -1:], tgt[:, :-1]], dim=1)  # eos first, as fairseq shifts targets
    return src, torch.full((sentences,), length + 1), prev, tgt


#: (sentences, length): about 1.5k tokens, as fairseq's batches; on a CPU, whose
#: half-precision matmuls are slow, 36 (the code path; RAN's overflow margin at 1.5k tokens
#: is held on CPU by test_ran_precision.py)
FP16_BATCH = (48, 31) if ON_CUDA else (4, 8)
#: updates at loss scale 128: the first, and those after the optimizer has moved the weights
FP16_UPDATES = 3 if ON_CUDA else 2


def fp16_updates(family_or_arch, updates=FP16_UPDATES, tamper=None):
    """fairseq's ``--fp16`` update, driven as its trainer drives it, on the device: the model
    (a family of tests/families.py, or fairseq's ``transformer``/``transformer_lite``) cast
    with ``.half()``, ``FP16Optimizer`` (float32 master weights, flat on CUDA as by default;
    per parameter on CPU, ``--fp16-no-flatten-grads``, as flattening needs CUDA) built from
    fairseq-train's own options, dynamic loss scale starting at 128 (fairseq's default),
    label-smoothed loss summed over a :data:`FP16_BATCH`; an update whose gradients overflow
    is skipped, as the trainer skips it. Returns ``(skipped, model, before)``: ``{update:
    the parameters whose fp16 gradient was not finite}``, the model, its weights before."""
    d = make_dictionary()
    family = FAMILIES.get(family_or_arch)
    arch, options = (family.arch, family.options) if family else (family_or_arch, ())
    extra = ("--fp16", "--fp16-init-scale", "128", "--optimizer", "adam", "--lr", "0.0005", "--clip-norm", "0.0",
             *(() if ON_CUDA else ("--fp16-no-flatten-grads",)))
    cfg = convert_namespace_to_omegaconf(parse(arch, *SMALL, *options, *extra))
    if family:
        model = family_model(family_or_arch, torch.float16, DEVICE).train()
    else:
        model = build_model(arch, *SMALL)[0].half().to(DEVICE).train()
    if tamper:
        tamper(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optim.FP16Optimizer.build_optimizer(cfg, params)
    src, lengths, prev, tgt = (t.to(DEVICE) for t in coherent_batch(d, *FP16_BATCH))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    skipped = {}
    for update in range(updates):
        optimizer.zero_grad()
        lprobs = F.log_softmax(model(src, lengths, prev)[0].float(), dim=-1)
        nll = -lprobs.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        loss = (0.9 * nll + 0.1 * -lprobs.mean(-1)).sum()
        optimizer.backward(loss)
        optimizer.multiply_grads(1.0 / tgt.numel())
        try:
            grad_norm = optimizer.clip_grad_norm(0.0)  # fairseq's overflow check
        except OverflowError:  # fairseq has halved the loss scale; the trainer skips the update
            skipped[update] = [n for n, p in model.named_parameters()
                               if p.grad is not None and not torch.isfinite(p.grad).all()]
            continue
        assert torch.isfinite(grad_norm)
        optimizer.step()
    return skipped, model, before


def largest_fp16_gradient(model, batch):
    """``(|gradient| at its largest, the parameter's name)`` of ``model`` (cast to fp16) on
    ``batch`` at loss scale 1, before any update: the headroom fp16's range leaves it."""
    src, lengths, prev, tgt = (t.to(DEVICE) for t in batch)
    model.zero_grad(set_to_none=True)
    lprobs = F.log_softmax(model(src, lengths, prev)[0].float(), dim=-1)
    nll = -lprobs.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    (0.9 * nll + 0.1 * -lprobs.mean(-1)).sum().backward()
    found = max((p.grad.float().abs().max().item(), n) for n, p in model.named_parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    return found


#: each twin's (skipped updates, largest fp16 gradient), computed once per twin
_TWIN_UPDATES = {}
#: how much larger than the twin's a family's largest fp16 gradient may be: one halving of the
#: loss scale (fairseq's dynamic scaler halves it at an overflow), so at most one more update skipped
HEADROOM = 2.0


def fp16_beyond_the_twin(family, tamper=None) -> list:
    """What fairseq's ``--fp16`` training (:func:`fp16_updates`) of ``family`` does that its
    twin's (fairseq's transformer at its size, same batch, same scale) does not, one line
    each: a largest gradient more than :data:`HEADROOM` times the twin's (it needs a smaller
    loss scale by more than one halving), more skipped updates than the twin's plus one
    (each naming the parameters whose fp16 gradient overflowed). Also checks that every
    parameter of the family moved and stayed finite."""
    twin = twin_arch(family)
    batch = coherent_batch(make_dictionary(), *FP16_BATCH)
    if twin not in _TWIN_UPDATES:
        skipped, model, _ = fp16_updates(twin)
        _TWIN_UPDATES[twin] = (skipped, largest_fp16_gradient(build_model(twin, *SMALL)[0].half().to(DEVICE), batch))
    twin_skipped, (twin_peak, twin_name) = _TWIN_UPDATES[twin]
    model = family_model(family, torch.float16, DEVICE)
    if tamper:
        tamper(model)
    peak, name = largest_fp16_gradient(model, batch)
    skipped, model, before = fp16_updates(family, tamper=tamper)
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
    if len(skipped) < FP16_UPDATES:
        unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
        assert not unchanged, unchanged
    found = []
    if not peak <= HEADROOM * twin_peak:
        found.append(f"largest fp16 gradient {name} {peak:.3g}: {peak / twin_peak:.2f} x fairseq's {twin}'s "
                     f"({twin_name} {twin_peak:.3g}), more than {HEADROOM:g} x")
    if len(skipped) > len(twin_skipped) + 1:
        found += [f"update {update} skipped for an fp16 overflow at loss scale {128 / 2 ** i:g} (fairseq's {twin} "
                  f"skipped {sorted(twin_skipped)}): non-finite gradients of "
                  f"{', '.join(names[:8]) or '(none in fp16: the float32 master copy)'}"
                  f"{f' and {len(names) - 8} more' if len(names) > 8 else ''}"
                  for i, (update, names) in enumerate(sorted(skipped.items()))]
    return found


@EVERY_FAMILY
def test_fp16_training_skips_no_update_at_loss_scale_128(family):
    """:func:`fp16_updates` for :data:`FP16_UPDATES` updates from loss scale 128 as fairseq's
    transformer of the family's size (its twin) does on the same batch: the family's largest
    fp16 gradient at most :data:`HEADROOM` times the twin's, and at most one more update
    skipped than the twin (where the twin skips none and the family's gradients are no
    larger, none: the loss scale stays 128); every parameter moves and stays finite; a
    failure names the gradients that overflowed."""
    beyond = fp16_beyond_the_twin(family)
    assert not beyond, "\n".join(beyond)


def test_an_overflowing_gradient_is_named():
    """Negative control: one EA map convolution's gradient scaled past fp16's range
    overflows in every update of EA-Lite, and the failure names that parameter."""
    def overflow(model):
        conv = model.encoder.layers[0].self_attn.conv
        conv.weight.register_hook(lambda grad: grad * 1e9)

    beyond = fp16_beyond_the_twin("ea-lite", tamper=overflow)
    assert len(beyond) == 1 + FP16_UPDATES, beyond
    assert beyond[0].startswith("largest fp16 gradient encoder.layers.0.self_attn.conv.weight inf:"), beyond
    assert beyond[1].startswith("update 0 skipped for an fp16 overflow at loss scale 128"), beyond
    assert all(line.endswith("non-finite gradients of encoder.layers.0.self_attn.conv.weight")
               for line in beyond[1:]), beyond


# -- command-line tools (CUDA: fairseq's trainer runs --fp16/--bf16/--amp only there) -------
TINY = ["--encoder-layers", "2", "--decoder-layers", "2"]
CLI_CASES = [(family, "fp16") for family in ANCHORED] + [
    (family, precision) for family in ("ea-lite", "pa-lite", "ran-all-lite") for precision in ("bf16", "amp")]
# fairseq's parser makes --bf16 imply --tpu (torch_xla); this driver runs fairseq-train's
# own --bf16 path on the GPU instead (see its docstring)
BF16_TRAIN = [sys.executable, os.path.join(REPO, "tests", "drivers", "train_bf16_without_tpu.py")]


#: fairseq-train + fairseq-generate pairs running at once: each process mostly waits on its
#: own start-up (imports) and the tiny models leave the GPU idle, so the cores set the pace
#: (conftest's THREADS threads each)
CLI_WORKERS = max(1, (os.cpu_count() or 1) // THREADS)


def run(cmd, timeout=600):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:  # the command, then its output's end (its error last)
        raise AssertionError(f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


def train_and_generate(family, precision, data_bin, save, extra=()):
    """fairseq-train in the precision (``fp32``, ``fp16``, ``bf16``, ``amp``; 4 updates, loss
    scale 128 for fp16 and amp: none may be skipped for an overflow, so the logged loss
    scale stays 128), then fairseq-generate (``--fp16`` after low-precision training) with
    beam 5 translates every test sentence with finite scores; on a CPU test device both
    with ``--cpu``. Raises AssertionError saying what failed, with the command."""
    arch, options = FAMILIES[family].arch, FAMILIES[family].options
    user_dir = os.path.join(REPO, "ea_fairseq")
    device = () if ON_CUDA else ("--cpu",)
    low = precision != "fp32"
    train = [cli("fairseq-train")] if precision != "bf16" else BF16_TRAIN
    log = run([
        *train, data_bin, "--user-dir", user_dir, "--arch", arch, *TINY, *options, *extra, *device,
        "--share-all-embeddings", "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", "1e-3",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", "600", "--max-update", "4", "--no-epoch-checkpoints", "--save-dir", save,
        "--num-workers", "0", "--no-progress-bar", "--log-format", "simple", "--log-interval", "1",
        "--seed", "3", *((f"--{precision}",) if low else ()),
        *(("--fp16-init-scale", "128") if precision in ("fp16", "amp") else ()),
    ], timeout=300)
    assert "done training" in log, log[-2000:]
    assert "gradient overflow detected" not in log and "AMP: skipping this batch" not in log, log[-2000:]
    losses = re.findall(r"\bloss[= ]([-+]?(?:\d[\d.e+-]*|nan|inf))", log)  # not "loss_scale"
    assert losses and all(math.isfinite(float(x)) for x in losses), losses
    if precision in ("fp16", "amp"):
        scales = re.findall(r"\bloss_scale[= ]([\d.e+-]+)", log)
        assert scales and all(float(s) == 128 for s in scales), scales
    out = run([
        cli("fairseq-generate"), data_bin, "--user-dir", user_dir, *device,
        "--path", os.path.join(save, "checkpoint_last.pt"), *(("--fp16",) if low else ()), "--beam", "5",
        "--required-batch-size-multiple", "1", "--max-tokens", "2000", "--num-workers", "0",
    ], timeout=300)
    assert re.search(r"Generate test with beam=5: BLEU4 = \d+\.\d+", out), out[-2000:]
    scores = re.findall(r"^H-\d+\t(\S+)\t", out, flags=re.M)
    assert len(scores) == 24, out[-2000:]  # every test sentence translated
    assert all(math.isfinite(float(s)) for s in scores), scores


def train_and_generate_side_by_side(cases, data_bin, tmp_path, workers=CLI_WORKERS):
    """:func:`train_and_generate` of every ``(family, precision[, extra options])`` in
    ``cases``, ``workers`` at a time: ``{case: what failed}`` for the cases that failed (also
    reported, with each failure's error line and the time taken, as a measurement)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(index, case):
        family, precision, *extra = case
        try:
            train_and_generate(family, precision, data_bin, str(tmp_path / f"{index}-{family}-{precision}"),
                               *extra)
        except (AssertionError, subprocess.TimeoutExpired) as err:
            return f"{family} {precision}: {err}"
        return None

    began = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(one, range(len(cases)), cases))
    failures = {case: result for case, result in zip(cases, results) if result}
    report("fairseq-train/-generate pairs", pairs=len(cases), side_by_side=workers,
           seconds=round(time.monotonic() - began, 1),
           failed={" ".join(case[:2]): last_error_line(why) for case, why in failures.items()})
    return failures


@needs_cuda("fairseq-train --fp16/--bf16/--amp")
def test_train_and_generate_in_low_precision(tmp_path, tiny_data_bin):
    """:func:`train_and_generate` for every family in fp16 and EA, PA and RAN in bf16 and
    amp (:data:`CLI_CASES`), :data:`CLI_WORKERS` pairs at a time; every failure is listed."""
    failures = train_and_generate_side_by_side(CLI_CASES, tiny_data_bin, tmp_path)
    assert not failures, "\n".join([f"{len(failures)} of {len(CLI_CASES)} pairs failed:"] + [
        f"{case[0]} {case[1]}: {last_error_line(why)}" for case, why in failures.items()]) + "\n\n" + "\n\n".join(
        failures.values())


def last_error_line(text: str) -> str:
    """The line of a failed command's output that says why (its last line naming an error)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if re.search(r"error|refused|exception", line, flags=re.I)]
    return (named or lines or ["?"])[-1][:240]


def test_train_and_generate_side_by_side_on_the_test_device(tmp_path, tiny_data_bin):
    """The runner of the test above in float32 (fairseq-train's low precisions need CUDA):
    EA-Lite (at width 32: what is tested is the runner) trains and translates, and a case
    whose training fails (an alpha fairseq-train refuses) is reported with its command and
    error while the other runs beside it."""
    small = ("--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
             "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2")
    cases = [("ea-lite", "fp32", small), ("ea-lite", "fp32", ("--ea-alpha", "2"))]
    failures = train_and_generate_side_by_side(cases, tiny_data_bin, tmp_path, workers=2)
    assert list(failures) == [cases[1]], failures
    assert "fairseq-train" in failures[cases[1]] and "--ea-alpha 2" in failures[cases[1]], failures
    assert "must lie in [0, 1]" in last_error_line(failures[cases[1]]), failures


# -- CUDA only: host-device syncs, TF32 ------------------------------------------------------
PACKAGE = os.path.dirname(os.path.abspath(ea_fairseq.__file__))
#: who made a call, by the file of the innermost frame outside torch (see :func:`call_site`)
OWNERS = {"plugin": PACKAGE, "harness": os.path.dirname(os.path.abspath(__file__)),
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
