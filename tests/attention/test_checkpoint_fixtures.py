"""Checkpoints written by ``fairseq-train`` with an earlier version of the plugin (one per
family, committed under ``tests/fixtures/checkpoints``; see its ``make_fixtures.py``) load
through fairseq's own loader, the plugin's guard included, and compute what they computed
then: the decoder's logits and the encoder's output for a left- and a right-padded source
batch with targets of different lengths, and fairseq's beam search (beam 3) on the
left-padded batch. The beam's tokens must be the same; every number must lie within the
rounding bound below of the stored one, on any CPU, with any backend (EA's CPU accelerator
and its reference both meet the same file) and any thread count.

Only the positions of real tokens are compared: what a model computes at a padded position
is read by nothing."""
import math
import os
from contextlib import nullcontext

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.sequence_generator import SequenceGenerator

import ea_fairseq  # noqa: F401  (registers the plugin's models, as --user-dir does)
from ea_ops import accelerators
from ea_fairseq.modules.evolving_attention import EvolvingAttention
from support.families import ACCELERATED_FIXTURES, FIXTURES as FIXTURE_FOLDERS

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "checkpoints")
FAMILIES = tuple(FIXTURE_FOLDERS)  # its folders (families.py: Family.fixture)
SOURCE_LENGTHS = (4, 7, 5)  # with the final </s>
TARGET_LENGTHS = (3, 6, 5)  # with the leading </s> of prev_output_tokens
BEAM, MAX_LEN_B = 3, 5
#: families whose outputs an accelerator computes: their reference is held to the same files
ACCELERATED = tuple(ACCELERATED_FIXTURES)

# The bound. IEEE 754 rounds each elementwise operation correctly, so two correct float32
# implementations of these models (another CPU's SIMD kernels, ATen's generic ones, EA's
# accelerator or its reference, another thread count) differ only where IEEE leaves a
# choice: the order of a reduction's additions, fused multiply-adds, the approximations of
# exp and log. Each such choice moves a result by about one rounding, at most u = eps/2 of
# the scale of the values, with either sign; n of them add up like a random walk, to about
# sqrt(n) u (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §2.8), and
# LayerNorm brings each sublayer back to the scale of the outputs, so that scale is the
# largest magnitude of the output compared. The fixtures' models are 2 + 2 layers of width
# 16 (FFN 32, 4 heads, at most 7 keys, 24 words): an output depends on about 2^10 roundings
# that may differ (a sum of k terms counting k - 1: about 150 per encoder layer, 230 per
# decoder layer, 70 for the output layer, 35 per attention for EA's 3x3 convolution over 4
# heads' maps): each implementation lies about sqrt(2^10) u = 32 u from the exact value, two
# of them up to 64 u = 32 eps times the scale apart. Measured (files written on an AMD
# EPYC, computed on an Intel Xeon with ATen's AVX-512 and generic kernels, both EA backends,
# 1 to 4 threads): at most a tenth of the bound; EA's alpha or beta 1 % larger moves the
# logits by 2 and 8 times the bound, the encoder's output by 12 and 32 times
# (test_a_real_change_is_seen).
ROUNDINGS = 2 ** 10  # that may differ between two implementations, per output (above)
EPS = torch.finfo(torch.float32).eps  # 2^-23, twice float32's unit roundoff u


def bound(want):
    """The largest difference allowed from the stored ``want`` (float32): see above."""
    return math.sqrt(ROUNDINGS) * EPS * float(want.abs().max())


def load(family):
    """The family's model and task, loaded as fairseq-generate loads them (the plugin's guard
    included)."""
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [os.path.join(FIXTURES, family, "checkpoint.pt")], arg_overrides={"data": FIXTURES, "source_lang": "src", "target_lang": "tgt"})
    return model.eval(), task


def batch(dictionary, left_pad: bool):
    """Fixed tokens (real words only, then </s>), padded on the left or the right; target
    prefixes start with </s> and are right-padded, as fairseq's collater builds them."""
    pad, eos, words = dictionary.pad(), dictionary.eos(), len(dictionary) - dictionary.nspecial

    def word(i):
        return dictionary.nspecial + (7 * i + 3) % words

    src = torch.full((len(SOURCE_LENGTHS), max(SOURCE_LENGTHS)), pad)
    prev = torch.full((len(TARGET_LENGTHS), max(TARGET_LENGTHS)), pad)
    for b, (n, m) in enumerate(zip(SOURCE_LENGTHS, TARGET_LENGTHS)):
        row = torch.tensor([word(5 * b + i) for i in range(n - 1)] + [eos])
        if left_pad:
            src[b, src.size(1) - n:] = row
        else:
            src[b, :n] = row
        prev[b, :m] = torch.tensor([eos] + [word(11 * b + i + 2) for i in range(m - 1)])
    return src, torch.tensor(SOURCE_LENGTHS), prev


def outputs(model, task):
    """name -> tensor: everything the fixtures pin."""
    dictionary = task.target_dictionary
    out = {}
    with torch.no_grad():
        for side, left_pad in (("left", True), ("right", False)):
            src, lengths, prev = batch(dictionary, left_pad)
            out[f"logits_{side}"] = model(src, lengths, prev)[0].float()
            out[f"encoder_{side}"] = model.encoder(src, src_lengths=lengths)["encoder_out"][0].float()
        src, lengths, _ = batch(dictionary, True)
        generator = SequenceGenerator([model], dictionary, beam_size=BEAM, max_len_a=0, max_len_b=MAX_LEN_B)
        hypos = generator.generate([model], {"net_input": {"src_tokens": src, "src_lengths": lengths}})
    width = max(len(h["tokens"]) for sent in hypos for h in sent)
    tokens = torch.full((len(hypos), BEAM, width), dictionary.pad())
    positional = torch.zeros(len(hypos), BEAM, width)
    for b, sent in enumerate(hypos):
        for k, h in enumerate(sent):
            tokens[b, k, : len(h["tokens"])] = h["tokens"]
            positional[b, k, : len(h["tokens"])] = h["positional_scores"]
    out["beam_tokens"] = tokens
    out["beam_scores"] = torch.stack([torch.stack([h["score"] for h in sent]) for sent in hypos])
    out["beam_positional_scores"] = positional
    return out


def real_positions(dictionary):
    """name -> boolean mask of the entries that belong to real tokens (None: all of them)."""
    masks = {}
    for side, left_pad in (("left", True), ("right", False)):
        src, _, prev = batch(dictionary, left_pad)
        masks[f"logits_{side}"] = prev.ne(dictionary.pad())  # (batch, target) rows of the logits
        masks[f"encoder_{side}"] = src.ne(dictionary.pad()).t()  # encoder_out is time-first
    return masks


def excess(expected, actual, dictionary):
    """name -> the largest difference on the real positions in units of the output's bound
    (above 1: outside it); for the beam's tokens 0 if they are equal, infinity if not."""
    masks = real_positions(dictionary)
    assert {n: (t.shape, t.dtype) for n, t in actual.items()} == {n: (t.shape, t.dtype) for n, t in expected.items()}
    ratios = {}
    for name, want in expected.items():
        got = actual[name]
        if name in masks:
            want, got = want[masks[name]], got[masks[name]]
        if not want.is_floating_point():
            ratios[name] = 0.0 if torch.equal(got, want) else math.inf
        else:
            largest = float((got - want).abs().max())
            ratios[name] = largest / bound(want) if largest else 0.0
    return ratios


def expected(family):
    return torch.load(os.path.join(FIXTURES, family, "expected.pt"), weights_only=True)


def assert_computes_as_written(family, reference=False):
    model, task = load(family)
    want = expected(family)
    assert set(want) == {"logits_left", "logits_right", "encoder_left", "encoder_right", "beam_tokens",
                         "beam_scores", "beam_positional_scores"}
    with accelerators.reference_only() if reference else nullcontext():
        got = outputs(model, task)
    ratios = excess(want, got, task.target_dictionary)
    assert {name: r for name, r in ratios.items() if r > 1} == {}, ratios


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_computes_what_it_computed_when_written(family):
    assert_computes_as_written(family)


@pytest.mark.parametrize("family", ACCELERATED)
def test_reference_backend_computes_what_it_computed_when_written(family):
    assert_computes_as_written(family, reference=True)


@pytest.mark.parametrize("name", ["alpha", "beta"])
def test_a_real_change_is_seen(name):
    """Negative control: EA's alpha (or beta) 1 % larger in every attention, and its decoder's
    logits and its encoder's output leave the bound; the beam keeps its tokens, so the numbers
    alone see the change."""
    model, task = load("ea")
    changed = 0
    for module in model.modules():
        if isinstance(module, EvolvingAttention) and getattr(module, name) > 0:
            setattr(module, name, getattr(module, name) * 1.01)
            changed += 1
    assert changed > 0
    ratios = excess(expected("ea"), outputs(model, task), task.target_dictionary)
    assert ratios["beam_tokens"] == 0.0
    assert min(ratios[n] for n in ("logits_left", "logits_right", "encoder_left", "encoder_right")) > 1, ratios
