"""Left-padded targets (fairseq's ``--left-pad-target``): a padded leading decoder position
sees only masked keys. Every attention family gives such a row zero weights
(``ea_ops.softmax``), so nothing non-finite reaches the real positions,
the loss or any gradient -- in training, in decoding steps fed a left-padded prefix, in
every dtype, through fairseq-train and fairseq's SequenceGenerator."""
import math
import os
import re
import subprocess

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from conftest import cli, make_dictionary
from ea_ops import accelerators
from ea_ops import softmax as ms
from support.families import ANCHORED, FAMILIES, LSRA_BRANCHES, PLUGIN_DECODERS, build_perturbed

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = ("--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0.0", "--attention-dropout", "0.0",
         "--activation-dropout", "0.0")
#: every family with a mechanism that test_device.py anchors to float64, plus DropAttention on a
#: decoder's own logit-map path
ALL = {name: (FAMILIES[name].arch, FAMILIES[name].options)
       for name in [n for n in ANCHORED if FAMILIES[n].roles] + ["dropattention-element-decoder"]}
#: every family's real positions are independent of padding placed before them: the
#: mechanisms see padding as neutral zeros (EA's encoder-decoder map convolution, which
#: reads the target rows above a row, the padded target rows too) and count positions per
#: sentence
PADDING_INVARIANT = list(ALL)


def left_padded_batch(d, lengths=(6, 4, 2), src_len=7, seed=0):
    """A source batch and left-padded decoder inputs of the given target lengths."""
    g = torch.Generator().manual_seed(seed)
    bsz, width = len(lengths), max(lengths)
    src = torch.randint(d.nspecial, len(d), (bsz, src_len), generator=g)
    src[:, -1] = d.eos()
    prev = torch.full((bsz, width), d.pad(), dtype=torch.long)
    for i, n in enumerate(lengths):
        prev[i, width - n:] = torch.randint(d.nspecial, len(d), (n,), generator=g)
        prev[i, width - n] = d.eos()
    return src, torch.full((bsz,), src_len), prev


def model_for(name, *extra):
    """Family ``name``, perturbed as the decoding properties run it (families.py)."""
    return build_perturbed(name, *SMALL, *extra, dictionary=make_dictionary())[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_masked_softmax_zero_rows_where_plain_softmax_is_nan(dtype):
    """The negative control: torch.softmax of a row of -inf is NaN, and so is its gradient;
    the plugin's softmax gives that row zero weights and zero gradient, and is
    torch.softmax (in at least float32) on every other row."""
    logits = torch.tensor([[1.0, -math.inf, 0.5], [-math.inf, -math.inf, -math.inf]], dtype=dtype)
    plain = logits.float().softmax(-1)
    assert torch.isnan(plain[1]).all()
    x = logits.clone().requires_grad_()
    probs = ms.masked_softmax(x, ms.fully_masked_rows(torch.isneginf(logits)))
    assert probs.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(probs[1], torch.zeros(3, dtype=probs.dtype))
    torch.testing.assert_close(probs[0], logits[0].to(probs.dtype).softmax(-1), rtol=0, atol=0)
    (probs * torch.arange(3.0, dtype=probs.dtype)).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.equal(x.grad[1], torch.zeros(3, dtype=dtype))


def finite_training_step(model, src, lengths, prev):
    model.train()
    out = model(src, lengths, prev)[0]
    real = prev.ne(model.decoder.dictionary.pad())
    loss = -out.float().log_softmax(-1)[real].mean()
    loss.backward()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    return torch.isfinite(out[real]).all().item() and torch.isfinite(loss).item(), bad


@pytest.mark.parametrize("family", list(ALL))
def test_training_step_finite_with_left_padded_targets(family):
    d = make_dictionary()
    model = model_for(family)
    finite, bad = finite_training_step(model, *left_padded_batch(d))
    assert finite and not bad, (family, bad[:5])


def test_without_zero_rows_left_padded_targets_give_nan(monkeypatch):
    """Negative control: the same step with the plain softmax (no zero rows) is not finite."""
    plain = ms.masked_softmax
    monkeypatch.setattr(ms, "masked_softmax", lambda logits, empty=None: plain(logits, None))
    d = make_dictionary()
    finite, bad = finite_training_step(model_for("realformer-lite"), *left_padded_batch(d))
    assert not finite or bad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", ["ea-lite", "ran-all-lite", "hcsa-lite", "syn-r-lite", "resformer-lite"])
def test_finite_in_every_dtype(family, dtype):
    """fp64 (the CPU accelerator's other dtype), and the fp16/bf16 casts of fairseq's
    --fp16/--bf16 and autocast."""
    d = make_dictionary()
    model = model_for(family).to(dtype)
    finite, bad = finite_training_step(model, *left_padded_batch(d))
    assert finite and not bad, (family, dtype, bad[:5])
    model = model_for(family)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        finite, bad = finite_training_step(model, *left_padded_batch(d))
    assert finite and not bad, (family, "autocast", bad[:5])


def padding_gap(model, d):
    """Largest gap between a sentence's real positions in the left-padded batch and the
    sentence decoded alone, unpadded (log-probabilities)."""
    src, lengths, prev = left_padded_batch(d)
    gaps = []
    with torch.no_grad():
        batch = model(src, lengths, prev)[0].log_softmax(-1)
        for i in range(prev.size(0)):
            real = prev[i].ne(d.pad())
            alone = model(src[i : i + 1], lengths[i : i + 1], prev[i : i + 1, real])[0].log_softmax(-1)
            gaps.append((batch[i, real] - alone[0]).abs().max().item())
    return max(gaps)


@pytest.mark.parametrize("family", PADDING_INVARIANT)
def test_real_positions_as_without_padding(family):
    assert padding_gap(model_for(family).eval(), make_dictionary()) <= 1e-5


def test_ea_cross_map_without_the_target_padding_leaks(monkeypatch):
    """Negative control: EA's encoder-decoder convolution not told the target padding (the
    decoder layer's hand-on skipped) reads the padded rows above the first real ones."""
    model = model_for("ea-lite").eval()
    for layer in model.decoder.layers:
        monkeypatch.setattr(layer, "hands_target_padding", False)
    assert padding_gap(model, make_dictionary()) > 1e-3


#: the families whose decoder self-attention is the plugin's and decodes (the others, and
#: LSRA's attention branch, decode with fairseq's own unfused attention, which gives a
#: padded step's row NaN itself, as fairseq's transformer does)
DECODERS = [n for n in ALL if n in PLUGIN_DECODERS and FAMILIES[n].decoding
            and not set(LSRA_BRANCHES) & set(FAMILIES[n].mechanism)]


@pytest.mark.parametrize("family", DECODERS)
def test_decoding_steps_over_left_padded_prefix(family):
    """A decoding run fed a left-padded prefix token by token (its padded steps see no key):
    finite, on the reference and the CPU accelerator alike; without positional embeddings
    (fairseq's incremental positions count the padding) the logit-map families equal the
    full pass at the real positions."""
    d = make_dictionary()
    model = model_for(family, "--no-token-positional-embeddings").eval()
    src, lengths, prev = left_padded_batch(d)
    with torch.no_grad():
        full = model(src, lengths, prev)[0].log_softmax(-1)
        encoder_out = model.encoder(src, lengths)
        for reference in (False, True):
            state, steps = {}, []
            with accelerators.reference_only() if reference else torch.no_grad():
                for t in range(prev.size(1)):
                    steps.append(model.decoder(prev[:, : t + 1], encoder_out=encoder_out,
                                               incremental_state=state)[0][:, -1].log_softmax(-1))
            steps = torch.stack(steps, 1)
            real = prev.ne(d.pad())
            assert torch.isfinite(steps[real]).all(), family
            if family.startswith(("ea-", "realformer", "resformer", "dropattention", "conv-", "pa-")):
                torch.testing.assert_close(steps[real], full[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["ea-lite", "ran-d-lite", "hcsa-lite"])
def test_generator_with_left_padded_prefix(family):
    """fairseq's SequenceGenerator with prefix tokens from left-padded targets (what
    fairseq-generate --prefix-size gives with --left-pad-target: the generator forces the
    prefix's real tokens): finite scores, the real prefix tokens kept."""
    d = make_dictionary()
    model = model_for(family).eval()
    src, lengths, prev = left_padded_batch(d)
    generator = SequenceGenerator([model], d, beam_size=3, max_len_b=8)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    prefix = torch.tensor([[7, 8, 9], [d.pad(), 10, 11], [d.pad(), d.pad(), 12]])
    hypos = generator.generate([model], sample, prefix_tokens=prefix)
    for sentence, forced in zip(hypos, prefix):
        for hypo in sentence:
            assert torch.isfinite(hypo["positional_scores"]).all() and math.isfinite(hypo["score"])
            tokens = hypo["tokens"][:3]  # (a free step may have ended the hypothesis early)
            real = forced[: tokens.numel()].ne(d.pad())
            assert torch.equal(tokens[real], forced[: tokens.numel()][real])


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("arch", [FAMILIES[name].arch for name in ("ea-lite", "hcsa-lite")])
def test_fairseq_train_with_left_pad_target(tmp_path, tiny_data_bin, arch):
    """fairseq-train --left-pad-target, three updates (fairseq stops with "gradients are
    Nan/Inf" on a non-finite gradient): every logged loss and gradient norm finite."""
    proc = subprocess.run([
        cli("fairseq-train"), tiny_data_bin, "--user-dir", os.path.join(REPO, "ea_fairseq"),
        "--arch", arch, "--encoder-layers", "2", "--decoder-layers", "2", "--left-pad-target",
        "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "400", "--max-update", "3",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--no-save", "--disable-validation", "--num-workers", "0", "--no-progress-bar",
        "--log-format", "simple", "--log-interval", "1", "--seed", "2", "--cpu",
    ], capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    for name in ("loss", "gnorm"):
        values = re.findall(rf"\b{name}[= ]([-+]?(?:\d[\d.e+-]*|nan|inf))", log)
        assert len(values) >= 3 and all(math.isfinite(float(v)) for v in values), (name, values)


@pytest.mark.parametrize("layout", ["causal", "rows"])
def test_fused_decoding_step_gives_a_keyless_row_zero_weights(layout):
    """The CPU accelerator's fused step (softmax and value product in C++) on a hypothesis
    whose every key is masked: zero weights and context, as the reference gives (which
    torch.softmax alone would make NaN); the other hypotheses as the reference."""
    from fairseq.modules import MultiheadAttention

    from ea_fairseq.modules import EvolvingAttention
    from ea_ops import evolving_attention
    from ea_ops import dispatch
    from ea_ops.contract import StepState

    torch.manual_seed(0)
    attn = EvolvingAttention(16, 4, self_attention=layout == "causal", encoder_decoder_attention=layout == "rows",
                             slot="self", alpha=0.0, beta=0.4, kernel_size=3, conv_layout=layout, hand_on=False)
    masked = torch.zeros(3, 1, 1, 5, dtype=torch.bool)
    masked[1] = True  # hypothesis 1 sees no key
    empty = ms.fully_masked_rows(masked)
    logits = torch.randn(3, 4, 1, 5).masked_fill(masked, float("-inf"))
    v = torch.randn(3 * 4, 5, 4)
    outs = []
    with torch.no_grad():
        for reference in (False, True):
            with accelerators.reference_only() if reference else torch.no_grad():
                outs.append(evolving_attention(logits.clone(), None, masked, None, attn.params(),
                                               state=StepState(), values=v, empty=empty))
    fused, ref = outs
    with torch.no_grad():  # the accelerator took the call (not a fallback to the reference)
        call = dispatch.describe(logits, masked, None, attn.params(), StepState(), v, False, False)
        assert dispatch.select(call._replace(accelerators_on=True, built=True)) == dispatch.CPU_STEP_ATTEND
    assert torch.equal(fused.probs[1], torch.zeros_like(fused.probs[1]))
    assert torch.equal(fused.context[:, 1], torch.zeros_like(fused.context[:, 1]))
    torch.testing.assert_close(fused.probs, ref.probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.context, ref.context, rtol=1e-5, atol=1e-6)
