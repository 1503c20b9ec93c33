"""EA in float16 and under autocast: what only EA's map convolution meets.

Every family's training outputs and gradients in bfloat16/float16 (cast and under autocast)
are held to float64 in test_device.py; its decoding properties (causality, incremental ==
full pass, beam search == teacher forcing) in every precision in test_decoding_properties.py.
Here: a hub ``translate`` of EA under CPU autocast (a reported crash of the incremental map
convolution; EA's beam search == teacher forcing under autocast is a decoding property), and
EA with trained-scale logits in float16.
"""
import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
from fairseq.sequence_generator import SequenceGenerator

from conftest import build_model, cpu_autocast_supports, decoder_out, random_batch
from ea_fairseq.modules import EvolvingAttention

SMALL = ("--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0.0",
         "--attention-dropout", "0.0")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest)


def beam_search(model, dictionary, context, beam=5):
    """fairseq's SequenceGenerator (what fairseq-generate and hub ``translate`` run) under
    ``context``; returns the hypotheses and the source batch."""
    model.eval()
    src, lengths, _ = random_batch(dictionary, [6, 9, 4], 1)
    generator = SequenceGenerator([model], dictionary, beam_size=beam, max_len_b=12)
    with torch.no_grad(), context:
        hypos = generator.forward({"net_input": {"src_tokens": src, "src_lengths": lengths}})
    return hypos, src, lengths


def assert_finite_beams(hypos, beam=5):
    assert len(hypos) == 3 and all(len(sentence) == beam for sentence in hypos)
    for sentence in hypos:
        for h in sentence:
            assert torch.isfinite(h["score"]).all() and torch.isfinite(h["positional_scores"]).all(), h


def test_ea_hub_translate_under_bf16_autocast(tmp_path, dictionary):
    """The reported crash as a user meets it: a hub model's ``translate`` under autocast."""
    from fairseq.models.transformer import TransformerModel

    if not cpu_autocast_supports(torch.bfloat16):
        pytest.skip("this torch's CPU autocast does not support bfloat16")
    model, args = build_model("ea_transformer_lite", *SMALL, "--source-lang", "src",
                              "--target-lang", "tgt", dictionary=dictionary)
    for lang in ("src", "tgt"):
        dictionary.save(os.path.join(tmp_path, f"dict.{lang}.txt"))
    torch.save({"args": args, "model": model.state_dict(), "extra_state": {"train_iterator": None},
                "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "none",
                                       "lr_scheduler_state": {}, "num_updates": 0}]},
               os.path.join(tmp_path, "model.pt"))
    hub = TransformerModel.from_pretrained(str(tmp_path), checkpoint_file="model.pt",
                                           data_name_or_path=str(tmp_path))
    sentences = ["w5 w6 w7 w8 w9", "w1 w2"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        translations = hub.translate(sentences, beam=5, max_len_a=0, max_len_b=10)
        hypos = hub.generate([hub.encode(s) for s in sentences], beam=5, max_len_a=0, max_len_b=10)
    assert len(translations) == 2 and all(isinstance(t, str) for t in translations)
    assert all(torch.isfinite(h["score"]) for sentence in hypos for h in sentence)


@pytest.mark.parametrize("decoder_alpha", ["0", "0.3"], ids=["paper-decoder", "decoder-maps-handed-on"])
def test_ea_fp16_stays_finite_with_trained_scale_logits(dictionary, monkeypatch, decoder_alpha):
    """Trained EA models have attention logits of tens (|logits| ~ 30-80), not the ~2 of a
    fresh model: scale the query and key projections until the maps entering the
    convolutions reach that size, then train and decode in float16. Outputs, gradients,
    scores and every map a convolution reads (full passes and decoding steps, cached rows
    included) must be finite."""
    model = build_model("ea_transformer_lite", *SMALL, "--ea-alpha", "0.5", "--ea-beta", "0.5",
                        "--ea-decoder-alpha", decoder_alpha)[0]
    conv_inputs = []  # what every map convolution reads (the reference's or an accelerator's)
    conv2d = F.conv2d  # every map convolution, the reference's and the accelerator's
    monkeypatch.setattr(F, "conv2d",
                        lambda maps, *a, **k: conv_inputs.append(maps.detach()) or conv2d(maps, *a, **k))
    src, lengths, prev = random_batch(dictionary, [3, 9, 6], 7)

    def largest_map_entry():
        conv_inputs.clear()
        decoder_out(model, src, lengths, prev)
        return max(x.abs().max().item() for x in conv_inputs)

    scale = (60.0 / largest_map_entry()) ** 0.5  # the logits are bilinear in q and k
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, EvolvingAttention):
                for proj in (m.q_proj, m.k_proj):
                    proj.weight.mul_(scale)
                    proj.bias.mul_(scale)
    assert 30 <= largest_map_entry() <= 80  # float32, before the cast

    model.half().train()
    conv_inputs.clear()
    out = model(src, lengths, prev)[0]
    F.cross_entropy(out.float().view(-1, out.size(-1)), prev.view(-1)).backward()
    assert torch.isfinite(out).all()
    assert len(conv_inputs) == 6  # 2 encoder, 2 decoder, 2 encoder-decoder attentions
    assert all(x.dtype == torch.float16 and torch.isfinite(x).all() for x in conv_inputs)
    assert not [n for n, p in model.named_parameters()
                if p.grad is not None and not torch.isfinite(p.grad).all()], "non-finite gradients"

    conv_inputs.clear()
    hypos, _, _ = beam_search(model, dictionary, contextlib.nullcontext())
    assert_finite_beams(hypos)
    assert len(conv_inputs) > 6 and all(torch.isfinite(x).all() for x in conv_inputs)
