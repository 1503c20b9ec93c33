"""The device suite (tests/device/test_device*.py): self-consistency on the test device -- EA and PA
switched off equal fairseq's transformer in every precision, DropAttention's masks drawn on the
device drop at rate p, EA's map convolutions are one public ``F.conv2d`` each."""
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, ON_CUDA, build_model, decoder_out, random_batch
from support.device_support import DTYPES, REDUCTION, SMALL, exact_float32, family_model  # noqa: F401  (fixture)
from ea_ops import accelerators
from ea_fairseq.modules import AttentionMapConv
from ea_fairseq.modules.drop_attention import DropAttention
from support.families import FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest)


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
