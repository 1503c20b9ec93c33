"""Every architecture in bfloat16 and float16 on CPU: cast models and autocast.

Each family runs as a model cast to the low-precision dtype (``.to(dtype)``, what
``--fp16`` / ``--bf16`` do to the weights) and as a float32 model under
``torch.autocast("cpu", dtype)``. Training steps must stay finite, evaluation must stay
close to float32 with the same weights, incremental decoding (beam reorders included)
must equal the full pass, decoders must stay causal and beam search must give finite
scores. EA also gets trained-scale logits in float16 and a hub ``translate`` under
autocast.
"""
import contextlib
import copy
import os

import pytest
import torch
import torch.nn.functional as F
from fairseq.sequence_generator import SequenceGenerator

from conftest import (beam_reorder_gap, build_model, causality_gap, decoder_out,
                      incremental_logprobs, random_batch)
from ea_fairseq.modules import EvolvingAttention

SMALL = ("--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0.0",
         "--attention-dropout", "0.0")
RAN = ("--ran-max-positions", "32")
SYN = ("--synthesizer-max-positions", "32")
DROP = ("--drop-attention", "element", "--drop-attention-p", "0.3")
FAMILIES = {
    "transformer": ("transformer_lite", ()),
    "ea": ("ea_transformer_lite", ()),
    "pa": ("pa_transformer_lite", ()),
    "ran-e": ("ran_e_lite", RAN),
    "ran-d": ("ran_d_lite", RAN),
    "ran-all": ("ran_all_lite", RAN),
    "ea+dropattention": ("ea_transformer_lite", DROP),
    "ran-all+dropattention": ("ran_all_lite", RAN + DROP),
    "hcsa": ("hcsa_lite", ()),
    "syn-r": ("syn_r_lite", SYN),
    "syn-r+dropattention": ("syn_r_lite", SYN + DROP),
    "realformer": ("realformer_lite", ()),
    "resformer": ("resformer_lite", ()),
    "conv-transformer": ("conv_transformer_lite", ("--lsra-weight-dropout", "0.0")),
    "pa-conv-transformer": ("pa_conv_transformer_lite", ("--lsra-weight-dropout", "0.0")),
}
# families whose decoder self-attention is one of the plugin's mechanisms
DECODER_SIDE = ("ea", "ran-d", "ran-all", "ea+dropattention", "ran-all+dropattention", "hcsa", "syn-r",
                "syn-r+dropattention", "realformer", "resformer", "conv-transformer")
REORDERS = {"reorder": [1, 1, 3, 2], "sentence-finished": [3, 2]}

# Largest |difference| allowed between two computations of the same log-probs or logits
# in one low-precision dtype, or against float32 with the same weights. Measured over
# every family here, both as cast models and under autocast (torch 2.13, 2-layer lite
# models, |logits| up to ~5): log-probs vs float32 at most 0.031 (bf16) and 0.0075
# (fp16); incremental vs full pass, beam reorders included, at most 0.031 (bf16) and
# 0.0039 (fp16), i.e. two units in the last place of a logit in [2, 4). The bounds
# leave about three times that; a reorder or caching bug moves logits by ~1.
TOLERANCE = {torch.bfloat16: 0.1, torch.float16: 0.02}
# Causality: positions before t measured exactly unchanged (0.0) in every case, the
# position t itself moved by at least 1.59.
CAUSAL_SIGNAL = 5  # times the tolerance that position t must move


def cpu_autocast_supports(dtype) -> bool:
    """Whether CPU autocast runs matmuls in ``dtype`` (an unsupported dtype only warns
    and leaves autocast off)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.autocast("cpu", dtype=dtype):
                return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtype
        except RuntimeError:
            return False


class Precision:
    """A low-precision dtype, applied by casting the model or by autocast."""

    def __init__(self, dtype, autocast: bool):
        self.dtype, self.autocast = dtype, autocast
        self.tolerance = TOLERANCE[dtype]

    def prepare(self, model):
        return model if self.autocast else model.to(self.dtype)

    def context(self):
        return torch.autocast("cpu", dtype=self.dtype) if self.autocast else contextlib.nullcontext()


def precision_params():
    params = []
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        params.append(pytest.param(Precision(dtype, False), id=f"{name}-cast"))
        params.append(pytest.param(
            Precision(dtype, True), id=f"{name}-autocast",
            marks=pytest.mark.skipif(not cpu_autocast_supports(dtype),
                                     reason=f"this torch's CPU autocast does not support {dtype}")))
    return params


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: a second thread costs more in synchronisation than it saves,
    and far more on a busy machine (this module on 2 shared, loaded cores: 110 s with two
    threads, 21 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


PRECISION = pytest.mark.parametrize("precision", precision_params())
FAMILY = pytest.mark.parametrize("family", list(FAMILIES))


def family_model(family, seed=1):
    arch, extra = FAMILIES[family]
    return build_model(arch, *SMALL, *extra, seed=seed)[0]


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


@FAMILY
@PRECISION
def test_training_step_is_finite(dictionary, family, precision):
    model = precision.prepare(family_model(family)).train()
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6)
    torch.manual_seed(0)  # DropAttention's masks
    with precision.context():
        out = model(src, lengths, prev)[0]
        loss = F.cross_entropy(out.float().view(-1, out.size(-1)), prev.view(-1))
    assert out.dtype == precision.dtype
    assert torch.isfinite(out).all() and torch.isfinite(loss)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads
    assert not [n for n, g in grads.items() if not torch.isfinite(g).all()], "non-finite gradients"


@FAMILY
@PRECISION
def test_eval_logprobs_stay_close_to_float32(dictionary, family, precision):
    reference = family_model(family)
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6)
    expected = F.log_softmax(decoder_out(reference, src, lengths, prev), -1)
    model = reference if precision.autocast else precision.prepare(copy.deepcopy(reference))
    with precision.context():
        out = decoder_out(model, src, lengths, prev)
    assert out.dtype == precision.dtype
    gap = (F.log_softmax(out.float(), -1) - expected).abs().max().item()
    assert gap <= precision.tolerance, gap


@FAMILY
@PRECISION
def test_incremental_decoding_equals_full_pass(dictionary, family, precision):
    model = precision.prepare(family_model(family))
    src, lengths, prev = random_batch(dictionary, [5, 9, 3, 7], 8)
    with precision.context():
        full = decoder_out(model, src, lengths, prev)
        steps, _ = incremental_logprobs(model, src, lengths, prev)
        gaps = {"in order": (steps.float() - full.float()).abs().max().item()}
        for name, order in REORDERS.items():
            gaps[name] = beam_reorder_gap(model, dictionary, order)
    assert steps.dtype == precision.dtype
    assert all(gap <= precision.tolerance for gap in gaps.values()), gaps


@pytest.mark.parametrize("family", DECODER_SIDE)
@PRECISION
def test_decoder_is_causal(dictionary, family, precision):
    model = precision.prepare(family_model(family))
    with precision.context():
        gaps = {t: causality_gap(model, dictionary, t) for t in (1, 4, 9)}
    for t, (before, at) in gaps.items():
        assert before <= precision.tolerance, f"positions before {t} saw the future: {gaps}"
        assert at > CAUSAL_SIGNAL * precision.tolerance, f"position {t} did not see itself: {gaps}"


@FAMILY
@PRECISION
def test_beam_search_scores_are_finite(dictionary, family, precision):
    model = precision.prepare(family_model(family))
    hypos, _, _ = beam_search(model, dictionary, precision.context())
    assert_finite_beams(hypos)


AUTOCAST_DTYPES = pytest.mark.parametrize("dtype", [
    pytest.param(dtype, id=name, marks=pytest.mark.skipif(
        not cpu_autocast_supports(dtype), reason=f"this torch's CPU autocast does not support {dtype}"))
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))
])


@AUTOCAST_DTYPES
def test_ea_beam_search_under_autocast_equals_teacher_forcing(dictionary, dtype):
    """Regression: ``with torch.autocast('cpu', dtype=torch.bfloat16): hub.translate(...,
    beam=5)`` on an EA model raised ``RuntimeError: expected scalar type BFloat16 but found
    Float`` from the incremental map convolution (attention_map_conv.py). Beam 5 through
    SequenceGenerator is what ``translate`` runs; its scores must also be the teacher-forced
    scores under the same autocast."""
    model = family_model("ea")
    hypos, src, lengths = beam_search(model, dictionary, torch.autocast("cpu", dtype=dtype))
    assert_finite_beams(hypos)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        for i, sentence in enumerate(hypos):
            n = lengths[i].item()
            for h in sentence:
                tokens = h["tokens"].unsqueeze(0)
                prev = torch.cat([tokens.new_tensor([[dictionary.eos()]]), tokens[:, :-1]], 1)
                logits = model(src[i : i + 1, -n:], lengths[i : i + 1], prev)[0]
                lprobs = F.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1))[0, :, 0]
                assert (lprobs - h["positional_scores"]).abs().max() <= TOLERANCE[dtype]


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
