"""The decoding properties, once for every family x precision x backend (tests/support/families.py).

For each family that decodes (``Family.decoding``), perturbed (``Family.perturb``: every
mechanism parameter and scalar setting off its initial value), in each of its precisions (a model cast
to float16/bfloat16 as ``--fp16``/``--bf16`` cast it, or a float32 model under
``torch.autocast``), on the device under test (``EA_FAIRSEQ_TEST_DEVICE``, conftest.py), and,
where a CPU accelerator applies (``Family.accelerator``, float32 on a CPU device), once with it
and once with the PyTorch reference alone (``accelerators.reference_only``):

* causality: changing the target tokens from position t on moves nothing before t, and
  does move position t;
* incremental decoding == the full pass, in order and under the beam reorders fairseq's
  SequenceGenerator makes (within a sentence, a finished sentence dropped, two reorders
  before one step);
* batch invariance: a sentence alone == the same sentence in a batch whose sources are
  left-padded (fairseq's default) or right-padded (``--left-pad-source False``);
* beam search (beam 5 through fairseq's SequenceGenerator): every hypothesis' per-token
  scores are a teacher-forced full pass's, all finite.

Negative control: a mutant variant that reads its initial β, or its layer norm's initial
scale, while decoding step by step fails the incremental check on the perturbed model (and
passes it unperturbed: why the families are perturbed). The checks' other negative controls
(a leaking convolution, a map without its padding) live with the mechanism they break
(test_ea_exactness.py, test_left_padded_targets.py).
"""
import contextlib
import fnmatch

import pytest
import torch
import torch.nn.functional as F
from fairseq.sequence_generator import SequenceGenerator

from conftest import (DEVICE, batch_invariance_gap, beam_reorder_gap, build_model, causality_gap, cpu_autocast_supports,
                      decoder_out, incremental_logprobs, make_dictionary, random_batch)
from ea_ops import accelerators
from ea_ops import dispatch
from support.families import DECODING, FAMILIES, build_perturbed, settings, twin_model

SMALL = ("--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0.0", "--attention-dropout", "0.0",
         "--activation-dropout", "0.0")
#: precision -> (the model's dtype, autocast dtype or None)
PRECISIONS = {"fp32": (torch.float32, None), "fp16": (torch.float16, None), "bf16": (torch.bfloat16, None),
              "autocast-fp16": (torch.float32, torch.float16), "autocast-bf16": (torch.float32, torch.bfloat16)}
# Largest |difference| between two computations of the same logits or log-probs in one
# precision. float32: one decoding step vs a full pass, one sentence vs a padded batch pick
# other reduction orders (~1e-6 on CPU; a GPU's kernels more); bfloat16/float16: measured over
# every family, cast and under autocast, at most 0.031 (bf16) and 0.0039 (fp16), i.e. two
# units in the last place of a logit in [2, 4). A cache, reorder or padding bug moves ~1.
TOLERANCE = {torch.float32: 1e-4 if DEVICE.type == "cuda" else 1e-5, torch.float16: 0.02, torch.bfloat16: 0.1}
# positions before t do not depend on later tokens at all: 0 up to float32 noise
CAUSAL = {torch.float32: 1e-6, torch.float16: 0.02, torch.bfloat16: 0.1}
ACCELERATED_DTYPES = ("fp32",)


def cases():
    for name in DECODING:
        family = FAMILIES[name]
        for precision in family.dtypes:
            _, autocast_dtype = PRECISIONS[precision]
            marks = ()
            if autocast_dtype is not None and DEVICE.type == "cpu" and not cpu_autocast_supports(autocast_dtype):
                marks = pytest.mark.skip(reason=f"this torch's CPU autocast does not support {autocast_dtype}")
            accelerated = family.accelerator and precision in ACCELERATED_DTYPES and DEVICE.type == "cpu"
            for backend in (("accelerated", "reference") if accelerated else ("default",)):
                yield pytest.param((name, precision, backend), marks=marks, id=f"{name}-{precision}-{backend}")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest)


@pytest.fixture(scope="module", params=list(cases()))
def setting(request, one_thread):
    """(model, tolerance, causal bound, autocast context, the dtype it computes in) of one
    case, perturbed; built once for the case's tests (pytest runs them one after the other),
    the backend chosen for all of them."""
    family, precision, backend = request.param
    dtype, autocast_dtype = PRECISIONS[precision]
    if backend == "accelerated" and not dispatch.accelerated_dtype("cpu", torch.float32):
        pytest.skip("no CPU accelerator here (switched off, or not built): the reference case runs it")
    model, _ = build_perturbed(family, *SMALL, dictionary=make_dictionary())
    model = model.to(device=DEVICE, dtype=dtype).eval()
    low = autocast_dtype or dtype
    autocast = torch.autocast(DEVICE.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with accelerators.reference_only() if backend == "reference" else contextlib.nullcontext():
        yield model, TOLERANCE[low], CAUSAL[low], autocast, low


def test_decoder_is_causal(dictionary, setting):
    model, tolerance, causal, autocast, _ = setting
    with autocast:
        gaps = {t: causality_gap(model, dictionary, t, device=DEVICE) for t in (1, 4, 9)}
    for t, (before, at) in gaps.items():
        assert before <= causal, f"positions before {t} saw the future: {gaps}"
        assert at > max(1e-3, 5 * tolerance), f"position {t} did not see itself: {gaps}"


def assert_incremental_equals_full(model, dictionary, tolerance, low=torch.float32):
    """Incremental decoding equals the full pass within ``tolerance``: in order, and under
    the beam reorders SequenceGenerator makes (within a sentence, a finished sentence
    dropped, two reorders before one step); the outputs are in ``low``."""
    src, lengths, prev = random_batch(dictionary, [5, 9, 3, 7], 8, device=DEVICE)
    full = decoder_out(model, src, lengths, prev)
    steps, _ = incremental_logprobs(model, src, lengths, prev)
    gaps = {"in order": (steps.float() - full.float()).abs().max().item()}
    for name, order in (("reorder", [1, 1, 3, 2]), ("sentence-finished", [3, 2]),
                        ("two-reorders-before-a-step", [[1, 1, 3, 2], [1, 0, 2, 2]])):
        gaps[name] = beam_reorder_gap(model, dictionary, order, device=DEVICE)
    assert full.dtype == steps.dtype == low  # cast or autocast, the precision really ran
    assert all(gap <= tolerance for gap in gaps.values()), f"incremental decoding != the full pass: {gaps}"


def test_incremental_equals_full_pass_with_beam_reorders(dictionary, setting):
    model, tolerance, _, autocast, low = setting
    with autocast:
        assert_incremental_equals_full(model, dictionary, tolerance, low)


def test_batch_invariance_with_left_and_right_padding(dictionary, setting):
    model, tolerance, _, autocast, _ = setting
    with autocast:
        gaps = {side: batch_invariance_gap(model, dictionary, device=DEVICE, left_pad=side == "left")
                for side in ("left", "right")}
    assert all(gap <= tolerance for gap in gaps.values()), gaps


def test_beam_search_scores_equal_teacher_forcing(dictionary, setting):
    """Beam 5 through fairseq's SequenceGenerator (what fairseq-generate and hub ``translate``
    run): every hypothesis' per-token scores, finite, equal a teacher-forced full pass's."""
    model, tolerance, _, autocast, _ = setting
    src, lengths, _ = random_batch(dictionary, [6, 9, 4], 1, device=DEVICE)
    generator = SequenceGenerator([model], dictionary, beam_size=5, max_len_b=12)
    checked = 0
    with torch.no_grad(), autocast:
        hypos = generator.forward({"net_input": {"src_tokens": src, "src_lengths": lengths}})
        for i, sentence in enumerate(hypos):
            assert len(sentence) == 5
            n = lengths[i].item()
            # the 5 hypotheses teacher-forced in one batch, targets right-padded as in training
            width = max(len(h["tokens"]) for h in sentence)
            tokens = torch.full((5, width), dictionary.pad(), dtype=torch.long, device=DEVICE)
            for j, h in enumerate(sentence):
                assert torch.isfinite(h["positional_scores"]).all() and torch.isfinite(h["score"]).all()
                tokens[j, : len(h["tokens"])] = h["tokens"]
            prev = torch.cat([tokens.new_full((5, 1), dictionary.eos()), tokens[:, :-1]], 1)
            logits = model(src[i : i + 1, -n:].expand(5, -1), lengths[i : i + 1].expand(5), prev)[0]
            lprobs = F.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1))[..., 0]
            for j, h in enumerate(sentence):
                gap = (lprobs[j, : len(h["tokens"])] - h["positional_scores"].float()).abs().max().item()
                assert gap <= max(tolerance, 1e-4), (j, gap)  # the generator's own float32 log-softmax
                checked += 1
    assert checked == 15


def skipping_while_decoding(model, skipped: str) -> None:
    """Make ``model``'s decoder a mutant variant: while it decodes step by step, its mechanism
    parameters and scalar settings whose names match ``skipped`` have their values from when
    the mutant was made (its scale or β skipped as decoding wrote it); its full pass is the model's."""
    decoder = model.decoder
    tensors = {n: t for n, t in decoder.named_parameters(prefix="decoder") if fnmatch.fnmatchcase(n, skipped)}
    initial = {n: t.detach().clone() for n, t in tensors.items()}
    attributes = [(m, a, v) for m, a, v in settings(decoder)
                  if fnmatch.fnmatchcase(f"decoder.{next(k for k, x in decoder.named_modules() if x is m)}.{a}",
                                         skipped)]
    assert tensors or attributes, f"{skipped} names nothing of the decoder"

    class SkipsWhileDecoding(type(decoder)):
        def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
            if incremental_state is None:
                return super().forward(prev_output_tokens, encoder_out=encoder_out, **kwargs)
            current = {n: t.detach().clone() for n, t in tensors.items()}
            values = [getattr(m, a) for m, a, _ in attributes]
            with torch.no_grad():
                for n, t in tensors.items():
                    t.copy_(initial[n])
            for m, a, v in attributes:
                setattr(m, a, v)
            try:
                return super().forward(prev_output_tokens, encoder_out=encoder_out,
                                       incremental_state=incremental_state, **kwargs)
            finally:
                with torch.no_grad():
                    for n, t in tensors.items():
                        t.copy_(current[n])
                for (m, a, _), v in zip(attributes, values):
                    setattr(m, a, v)

    decoder.__class__ = SkipsWhileDecoding


@pytest.mark.parametrize("family,skipped", [("ea-lite", "decoder.*.beta"),
                                            ("ran-d-lite", "decoder.recurrent_matrices.layer_norm.weight")])
def test_a_mutant_that_skips_its_scale_while_decoding_fails_the_check(dictionary, family, skipped):
    """Negative control of the incremental check: unperturbed, the mutant's initial values
    are the model's and it passes; perturbed (as every family here is), it is caught."""
    f = FAMILIES[family]
    model, _ = build_model(*f.args(), *SMALL, dictionary=dictionary)
    model = model.to(DEVICE).eval()
    skipping_while_decoding(model, skipped)
    assert_incremental_equals_full(model, dictionary, TOLERANCE[torch.float32])
    f.perturb(model, twin_model(f.twin, *SMALL), torch.Generator().manual_seed(3))
    with pytest.raises(AssertionError, match="incremental decoding != the full pass") as caught:
        assert_incremental_equals_full(model, dictionary, TOLERANCE[torch.float32])
    print(f"{family}, {skipped} skipped while decoding: {caught.value}")
