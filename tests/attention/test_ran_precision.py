"""RAN in half precision, bfloat16 and autocast, and under fairseq's fp16 optimizers."""
import contextlib
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fairseq import optim
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from conftest import build_model, make_dictionary, parse, random_batch
from support.families import FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")  # small models: a second thread only spins
SMALL = ("--encoder-layers", "3", "--decoder-layers", "3", "--dropout", "0.0",
         "--attention-dropout", "0.0", "--ran-max-positions", "32")
ARCHS = [FAMILIES[name].arch for name in ("ran-e-lite", "ran-d-lite", "ran-all-lite")]
#: mode -> (conversion of the model or None, autocast dtype or None, low-precision dtype)
MODES = {
    "half": ("half", None, torch.float16),
    "bfloat16": ("bfloat16", None, torch.bfloat16),
    "autocast-bf16": (None, torch.bfloat16, torch.bfloat16),
    "autocast-fp16": (None, torch.float16, torch.float16),  # CPU autocast takes float16 too
}


def ran_parameters(model):
    return {n: p for n, p in model.named_parameters() if ".recurrent_matrices." in n}


def test_ran_parameters_stay_float32_through_conversions():
    """fairseq's --fp16 / --bf16 convert the model with .half() / .bfloat16() (fairseq's
    Trainer, generate.py); RAN's matrices keep their float32 values, bit for bit."""
    model, _ = build_model("ran_all_lite", *SMALL)
    original = {n: p.detach().clone() for n, p in ran_parameters(model).items()}
    assert len(original) == 2 * 5  # A_0, W, b, layer-norm weight and bias of each stack
    for convert, dtype in ((lambda m: m.half(), torch.float16), (lambda m: m.bfloat16(), torch.bfloat16),
                           (lambda m: m.to(torch.float16), torch.float16),
                           (lambda m: m.to(dtype=torch.bfloat16), torch.bfloat16),
                           (lambda m: m.float(), torch.float32)):
        convert(model)
        for name, p in model.named_parameters():
            if name in original:
                assert p.dtype == torch.float32 and torch.equal(p, original[name]), name
            else:
                assert p.dtype == dtype, name
    model.half()
    state = model.state_dict()
    assert state["encoder.recurrent_matrices.initial"].dtype == torch.float32
    assert state["encoder.embed_tokens.weight"].dtype == torch.float16
    model.double()  # a conversion to more precision applies
    assert all(p.dtype == torch.float64 for p in model.parameters())


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_low_precision_matrices_and_gradients(dictionary, arch, mode):
    """Each RAN arch in fp16 and bf16 (converted, or under CPU autocast): the matrices equal
    the float32 model's bit for bit; training gradients finite, RAN's in float32. (Outputs
    and gradients against float64, and decoding, in every precision: test_device.py and
    test_decoding_properties.py.)"""
    convert, autocast_dtype, low = MODES[mode]
    reference, _ = build_model(arch, *SMALL)
    model, _ = build_model(arch, *SMALL)
    if convert is not None:
        getattr(model, convert)()

    def region():
        return torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()

    src, lengths, prev = random_batch(dictionary, [5, 9, 3, 7], 8)  # left-padded sources
    for stack, ref_stack in ((model.encoder, reference.encoder), (model.decoder, reference.decoder)):
        if getattr(stack, "recurrent_matrices", None) is not None:
            with region():
                got = stack.recurrent_matrices(8)
            assert all(torch.equal(a, b) for a, b in zip(got, ref_stack.recurrent_matrices(8)))

    model.train()
    with region():
        out = model(src, lengths, prev)[0]
    assert out.dtype == low and torch.isfinite(out).all()
    F.cross_entropy(out.float().reshape(-1, out.size(-1)), prev.reshape(-1), reduction="sum").backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    ran = ran_parameters(model)
    assert ran and all(p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0 for p in ran.values())


def coherent_batch(dictionary, sentences=48, length=31, seed=0):
    """About 1.5k tokens of a learnable task (the target is the mapped, reversed source),
    one sentence repeated: every sentence wants the same attention pattern, so the batch
    adds their gradients of RAN's shared matrices coherently, as real data does for the
    positional patterns RAN learns. Same-length sentences, as fairseq batches them."""
    rng = random.Random(seed)
    vocab = len(dictionary)
    half = dictionary.nspecial + (vocab - dictionary.nspecial) // 2
    words = [rng.randrange(dictionary.nspecial, half) for _ in range(length)]
    target = [w - dictionary.nspecial + half for w in reversed(words)] + [dictionary.eos()]
    src = torch.tensor([words + [dictionary.eos()]] * sentences)
    tgt = torch.tensor([target] * sentences)
    prev = torch.cat([tgt[:, -1:], tgt[:, :-1]], dim=1)  # eos first, as fairseq shifts targets
    return {
        "net_input": {"src_tokens": src, "src_lengths": torch.full((sentences,), length + 1),
                      "prev_output_tokens": prev},
        "target": tgt, "ntokens": tgt.numel(), "nsentences": sentences,
    }


FP16_TRAINING = ("--encoder-layers", "3", "--decoder-layers", "3", "--encoder-ffn-embed-dim", "160",
                 "--decoder-ffn-embed-dim", "160", "--dropout", "0.0", "--attention-dropout", "0.0")


@pytest.mark.parametrize("arch,wrapper,extra", [
    ("ran_all_lite", "memory-efficient", ("--memory-efficient-fp16",)),
    ("ran_all_lite", "fp32-master-copy", ()),
    ("syn_r_lite", "fp32-master-copy", ()),
], ids=["MemoryEfficientFP16Optimizer", "FP16Optimizer", "syn_r-FP16Optimizer"])
def test_fp16_optimizers_train_ran_without_overflow(arch, wrapper, extra, monkeypatch):
    """fairseq's trainer refuses --fp16 on CPU, so its two fp16 optimizers are driven
    here as its train_step drives them: loss scale 128 (fairseq's default), label-smoothed
    loss summed over ~1.5k tokens, 2 updates. RAN's matrices sum their gradients over
    every sentence, head, row and layer (about 1.4k on the first update here, past fp16's
    65504 at scale 128; the vocabulary's size barely moves them, the time it costs in
    fp16 on a CPU grows with it); kept in float32, they cannot overflow. The Random
    Synthesizer's logits (one matrix per layer, in the model's dtype) sum theirs over the
    sentences only."""
    d = make_dictionary(204)
    model, _ = build_model(arch, *FP16_TRAINING, dictionary=d)
    args = parse(arch, *FP16_TRAINING, "--fp16", "--fp16-init-scale", "128",
                 "--optimizer", "adam", "--lr", "0.0005", "--clip-norm", "0.0", *extra)
    cfg = convert_namespace_to_omegaconf(args)
    model.half().train()
    params = [p for p in model.parameters() if p.requires_grad]
    if wrapper == "memory-efficient":
        optimizer = optim.MemoryEfficientFP16Optimizer.build_optimizer(cfg, params)
    else:
        # the flat fp32 master copy (fairseq's default) is made on torch.cuda.current_device();
        # CPU tensors have device index None
        monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
        optimizer = optim.FP16Optimizer.build_optimizer(cfg, params)
    criterion = LabelSmoothedCrossEntropyCriterion(SimpleNamespace(target_dictionary=d),
                                                   sentence_avg=False, label_smoothing=0.1)
    sample = coherent_batch(d)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(2):
        optimizer.zero_grad()
        loss, sample_size, _ = criterion(model, sample)
        optimizer.backward(loss)
        optimizer.multiply_grads(1.0 / sample_size)
        grad_norm = optimizer.clip_grad_norm(0.0)  # raises OverflowError on inf/nan grads
        assert torch.isfinite(grad_norm)
        optimizer.step()
    assert optimizer.scaler.loss_scale == 128
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    if arch.startswith("ran"):
        assert model.encoder.recurrent_matrices.initial.dtype == torch.float32


def test_mixed_precision_caveats_are_named(monkeypatch):
    import fairseq.utils

    from ea_fairseq.modules.recurrent_attention import mixed_precision_caveats

    assert mixed_precision_caveats(parse("ran_all_lite", "--fp16")) == []
    assert mixed_precision_caveats(parse("ran_all_lite", "--memory-efficient-fp16")) == []  # no apex here
    monkeypatch.setattr(fairseq.utils, "multi_tensor_l2norm_available", True)
    (note,) = mixed_precision_caveats(parse("ran_all_lite", "--memory-efficient-fp16"))
    assert "multi_tensor_l2norm" in note
    (note,) = mixed_precision_caveats(parse("ran_all_lite", "--bf16", "--ddp-backend", "legacy_ddp",
                                            "--distributed-world-size", "2"))
    assert "legacy_ddp" in note
