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
  within a bound derived from the same precision's reference on CPU (:func:`derived_bound`);
* fp16 training through fairseq's ``FP16Optimizer`` at loss scale 128 with no update skipped;
* on CUDA: ``fairseq-train --fp16/--bf16/--amp`` then ``fairseq-generate --fp16`` with no update
  skipped, no host-device sync from the plugin's code in a training or a decoding step, and
  what cuDNN's default TF32 does to float32 EA maps (measured and written to the report).

``EA_FAIRSEQ_DEVICE_REPORT=<file>`` appends the measurements (JSON lines) to ``<file>``.
"""
import copy
import json
import math
import os
import re
import subprocess
import sys
import warnings
from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.nn.functional as F
from fairseq import optim
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from conftest import DEVICE, ON_CUDA, REPO, build_model, cli, decoder_out, make_dictionary, parse, random_batch, randomize_convs
import ea_fairseq
from ea_fairseq import accelerators
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
# How far the device may be from float64: FUDGE times as far as the same precision's
# reference implementation on CPU is (PyTorch's SDPA tests do the same), and never less
# than FUDGE units in the last place of the largest float64 value (a zero CPU error would
# otherwise demand bit-identical results from another device). The device's kernels round
# in another order (float32) and accumulate half-precision products in float32 where the
# CPU reference may not, so its error is of the reference's size: FUDGE leaves room for
# that, and a wrong tap, mask or gradient (errors of the order of the values) still fails.
FUDGE = {torch.float32: 5.0, torch.float16: 3.0, torch.bfloat16: 3.0}


def derived_bound(low: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> float:
    """FUDGE x max(|low-precision CPU reference - float64|, one ulp of max|float64|)."""
    ulp = torch.finfo(dtype).eps * exact.abs().max().item()
    return FUDGE[dtype] * max((low.double() - exact).abs().max().item(), ulp)


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


def runs_the_reference(dtype, autocast_dtype) -> bool:
    """Whether the device's run is the CPU reference's own computation: on a CPU device, for
    a model cast to a dtype no CPU accelerator takes (then it is not repeated)."""
    if DEVICE.type != "cpu" or autocast_dtype is not None:
        return False
    from ea_fairseq.ops import evolving_attention_dispatch as dispatch

    return not dispatch.accelerated_dtype(DEVICE.type, dtype)


@EVERY_FAMILY
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_outputs_and_gradients_match_float64_on_cpu(dictionary, family, precision):
    """The device's logits and every parameter's gradient against a float64 CPU model with
    the same (rounded) weights, within :func:`derived_bound` of the same precision's
    reference implementation on CPU (accelerators off; on a CPU device in float32 the
    accelerator is what runs, so it is held to the reference here as well)."""
    dtype, autocast_dtype = PRECISIONS[precision]
    low = autocast_dtype or dtype
    model = family_model(family, dtype, device="cpu")
    g = torch.Generator().manual_seed(5)
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6)
    target = torch.randint(dictionary.nspecial, len(dictionary), prev.shape, generator=g)
    batch = (src, lengths, prev, target)
    masks = []
    with same_drop_masks(masks, record=True):
        out, grads = outputs_and_gradients(copy.deepcopy(model).to(DEVICE), batch, DEVICE, autocast_dtype)
    with accelerators.reference_only():
        if runs_the_reference(dtype, autocast_dtype):
            ref_out, ref_grads = out, grads
        else:
            with same_drop_masks(masks, record=False):
                ref_out, ref_grads = outputs_and_gradients(model, batch, torch.device("cpu"), autocast_dtype)
        with same_drop_masks(masks, record=False):
            exact_out, exact_grads = outputs_and_gradients(model.double(), batch, torch.device("cpu"))
    if "drop" in family:
        assert masks and any(m.any() for m in masks), "DropAttention dropped nothing: the check would not see it"
    assert exact_grads.keys() == grads.keys() == ref_grads.keys()
    assert torch.isfinite(out).all()
    failures = {}
    for name, got, ref, exact in [("logits", out, ref_out, exact_out)] + [
            (n, grads[n], ref_grads[n], exact_grads[n]) for n in exact_grads]:
        gap, bound = (got - exact).abs().max().item(), derived_bound(ref, exact, low)
        if not gap <= bound:  # also catches NaN
            failures[name] = f"{gap:.3g} > {bound:.3g}"
    assert not failures, failures


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
    from ea_fairseq.modules import attention_map_conv

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


@EVERY_FAMILY
def test_fp16_training_skips_no_update_at_loss_scale_128(family):
    """fairseq's ``--fp16`` update, driven as its trainer drives it, on the device: the model
    cast with ``.half()``, ``FP16Optimizer`` (float32 master weights, flat on CUDA as by
    default; per parameter on CPU, ``--fp16-no-flatten-grads``, as flattening needs CUDA)
    built from fairseq-train's own options, dynamic loss scale starting at 128 (fairseq's
    default), label-smoothed loss summed over a :data:`FP16_BATCH`, :data:`FP16_UPDATES` updates:
    none may overflow (the loss scale stays 128), every parameter moves and stays finite."""
    d = make_dictionary()
    arch, options = FAMILIES[family].arch, FAMILIES[family].options
    extra = ("--fp16", "--fp16-init-scale", "128", "--optimizer", "adam", "--lr", "0.0005", "--clip-norm", "0.0",
             *(() if ON_CUDA else ("--fp16-no-flatten-grads",)))
    cfg = convert_namespace_to_omegaconf(parse(arch, *SMALL, *options, *extra))
    model = family_model(family, torch.float16, DEVICE).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optim.FP16Optimizer.build_optimizer(cfg, params)
    src, lengths, prev, tgt = (t.to(DEVICE) for t in coherent_batch(d, *FP16_BATCH))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for update in range(FP16_UPDATES):
        optimizer.zero_grad()
        lprobs = F.log_softmax(model(src, lengths, prev)[0].float(), dim=-1)
        nll = -lprobs.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        loss = (0.9 * nll + 0.1 * -lprobs.mean(-1)).sum()
        optimizer.backward(loss)
        optimizer.multiply_grads(1.0 / tgt.numel())
        try:
            grad_norm = optimizer.clip_grad_norm(0.0)  # fairseq's overflow check
        except OverflowError as err:
            pytest.fail(f"update {update} skipped for an fp16 overflow at loss scale 128: {err}")
        assert torch.isfinite(grad_norm)
        optimizer.step()
    assert optimizer.scaler.loss_scale == 128
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, unchanged


# -- command-line tools (CUDA: fairseq's trainer runs --fp16/--bf16/--amp only there) -------
TINY = ["--encoder-layers", "2", "--decoder-layers", "2"]
CLI_CASES = [(family, "fp16") for family in ANCHORED] + [
    (family, precision) for family in ("ea-lite", "pa-lite", "ran-all-lite") for precision in ("bf16", "amp")]
# fairseq's parser makes --bf16 imply --tpu (torch_xla); this driver runs fairseq-train's
# own --bf16 path on the GPU instead (see its docstring)
BF16_TRAIN = [sys.executable, os.path.join(REPO, "tests", "drivers", "train_bf16_without_tpu.py")]


def run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


@needs_cuda("fairseq-train --fp16/--bf16/--amp")
@pytest.mark.parametrize("family,precision", CLI_CASES)
def test_train_and_generate_in_low_precision(tmp_path, tiny_data_bin, family, precision):
    """fairseq-train in the precision (4 updates, loss scale 128 for fp16 and amp: none may be
    skipped for an overflow, so the logged loss scale stays 128), then fairseq-generate
    --fp16 with beam 5 translates every test sentence with finite scores."""
    arch, options = FAMILIES[family].arch, FAMILIES[family].options
    save = str(tmp_path / "ckpt")
    user_dir = os.path.join(REPO, "ea_fairseq")
    train = [cli("fairseq-train")] if precision != "bf16" else BF16_TRAIN
    log = run([
        *train, tiny_data_bin, "--user-dir", user_dir, "--arch", arch, *TINY, *options,
        "--share-all-embeddings", "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", "1e-3",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", "600", "--max-update", "4", "--no-epoch-checkpoints", "--save-dir", save,
        "--num-workers", "0", "--no-progress-bar", "--log-format", "simple", "--log-interval", "1",
        "--seed", "3", f"--{precision}", *(("--fp16-init-scale", "128") if precision != "bf16" else ()),
    ])
    assert "done training" in log
    assert "gradient overflow detected" not in log and "AMP: skipping this batch" not in log
    losses = re.findall(r"\bloss[= ]([-+]?(?:\d[\d.e+-]*|nan|inf))", log)  # not "loss_scale"
    assert losses and all(math.isfinite(float(x)) for x in losses), losses
    if precision != "bf16":
        scales = re.findall(r"\bloss_scale[= ]([\d.e+-]+)", log)
        assert scales and all(float(s) == 128 for s in scales), scales
    out = run([
        cli("fairseq-generate"), tiny_data_bin, "--user-dir", user_dir,
        "--path", os.path.join(save, "checkpoint_last.pt"), "--fp16", "--beam", "5",
        "--required-batch-size-multiple", "1", "--max-tokens", "2000", "--num-workers", "0",
    ])
    assert re.search(r"Generate test with beam=5: BLEU4 = \d+\.\d+", out), out[-2000:]
    scores = re.findall(r"^H-\d+\t(\S+)\t", out, flags=re.M)
    assert len(scores) == 24  # every test sentence translated
    assert all(math.isfinite(float(s)) for s in scores), scores


# -- CUDA only: host-device syncs, TF32 ------------------------------------------------------
PACKAGE = os.path.dirname(os.path.abspath(ea_fairseq.__file__))
#: TF32 as this process had it before the suite switched it off (PyTorch's default: cuDNN
#: convolutions in TF32, float32 matmuls not)
DEFAULT_TF32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


def synchronising_calls(fn):
    """The Python lines that made a synchronising CUDA call while ``fn`` ran
    (``torch.cuda.set_sync_debug_mode("warn")``; a call inside a backward pass is reported
    at its ``.backward()``)."""
    torch.cuda.synchronize(DEVICE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


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
    """No synchronising CUDA call from the plugin's files in a training step or in decoding,
    and no more synchronising calls in all than fairseq's ``transformer_lite`` makes in the
    same steps (fairseq's own, e.g. its encoder's ``if encoder_padding_mask.any()``, are
    reported, not counted against the plugin)."""
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6, device=DEVICE)
    found = {}
    twin, _ = build_model("transformer_lite", *SMALL)
    for name, model in (("plugin", family_model(family)), ("twin", twin.to(DEVICE))):
        steps = training_and_decoding_steps(model, src, lengths, prev)
        for fn in steps.values():  # warm-up: lazy initialisation outside the check
            fn()
        found[name] = {step: synchronising_calls(fn) for step, fn in steps.items()}
    report("host-device syncs", family=family, **found)
    for step, calls in found["plugin"].items():
        ours = [c for c in calls if c.startswith(PACKAGE)]
        assert not ours, f"{step} of {family}: synchronising CUDA calls at {ours}"
        assert len(calls) <= len(found["twin"][step]), (step, calls, found["twin"][step])


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
