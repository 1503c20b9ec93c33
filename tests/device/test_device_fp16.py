"""The device suite (tests/device/test_device*.py): fp16 training through fairseq's ``FP16Optimizer``
from loss scale 128 as fairseq's transformer of the same size trains (gradients within one
halving of the loss scale of its, at most one more update skipped; a failure names the
overflowing gradients)."""
import pytest
import torch
import torch.nn.functional as F
from fairseq import optim
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from conftest import DEVICE, ON_CUDA, build_model, make_dictionary, parse
from support.device_support import EVERY_FAMILY, SMALL, exact_float32, family_model, twin_arch  # noqa: F401  (fixture)
from support.families import FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest)


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
    (a family of tests/support/families.py, or fairseq's ``transformer``/``transformer_lite``) cast
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
