"""The family table itself (tests/support/families.py): every family's perturbation moves every
mechanism parameter and scalar setting off its initial value, so the decoding properties
(test_decoding_properties.py) exercise each mechanism as trained, never at an identity.

A mechanism parameter is every parameter or buffer the family's fairseq twin (the
``transformer`` of the same size) does not have; a scalar setting is a float attribute of the
plugin's modules (:func:`families.settings`). A new family, or a new parameter or setting of a
mechanism, without a perturbation fails here with a line that says what to add.
"""
import fnmatch
import functools

import pytest
import torch

from conftest import build_model, decoder_out, random_batch
from ea_fairseq.models import building
from support.families import FAMILIES, LSRA_BRANCHES, Family, added_parameters, draw, module_name, settings, twin_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest)
SMALL = ("--encoder-layers", "2", "--decoder-layers", "1")  # PA predicts from the second layer on


@functools.lru_cache(maxsize=None)
def twin(arch: str):
    return build_model(arch, *SMALL)[0]


def snapshot(model):
    return {f"{module_name(model, m)}.{a}": v for m, a, v in settings(model)}


@functools.lru_cache(maxsize=None)
def perturbed(name: str):
    """(mechanism tensors and settings before, after) one perturbation of family ``name``."""
    family = FAMILIES[name]
    model, _ = build_model(*family.args(), *SMALL)
    before = ({n: t.clone() for n, t in family.mechanism_tensors(model, twin(family.twin)).items()}, snapshot(model))
    family.perturb(model, twin(family.twin), torch.Generator().manual_seed(0))
    return before, (family.mechanism_tensors(model, twin(family.twin)), snapshot(model))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_perturbation_moves_every_mechanism_parameter_and_setting(name):
    family = FAMILIES[name]
    (tensors, values), (moved, now) = perturbed(name)
    for pattern, _ in family.mechanism:  # no stale pattern: each names a parameter of this family
        assert any(fnmatch.fnmatchcase(n, pattern) for n in tensors), f"{name}: {pattern} names no parameter"
    assert set(moved) == set(tensors)
    still = [n for n, t in moved.items() if (t == tensors[n]).any()]
    assert not still, f"{name}: perturb() left these (in part) at their initial values: {still}"
    for key, value in values.items():
        if any(fnmatch.fnmatchcase(key, p) for p in family.held):
            assert now[key] == value, f"{name}: {key} is held at {value}, perturb() set {now[key]}"
        else:
            pairs = zip(value, now[key]) if isinstance(value, tuple) else [(value, now[key])]
            assert all(a != b for a, b in pairs), f"{name}: {key} stayed {now[key]}"


def test_every_mechanism_has_a_perturbed_setting_or_parameter():
    """Each family but fairseq's own has something to perturb, and the settings the
    mechanisms are known by are found on the modules (a renamed one would go unperturbed)."""
    found = {}
    for name in FAMILIES:
        (tensors, values), _ = perturbed(name)
        found[name] = {key.rsplit(".", 1)[1] for key in values} | set(tensors)
    expected = {"ea-lite": {"alpha", "beta"}, "pa-lite": {"alpha"}, "hcsa-lite": {"std"},
                "resformer-lite": {"lambdas"}, "dropattention-column": {"p", "window"}}
    for name, attributes in expected.items():
        assert attributes <= found[name], (name, found[name])
    # fairseq's transformer has none; RealFormer adds the previous logits as they are
    assert [name for name in FAMILIES if not found[name]] == ["vanilla", "realformer-lite"]


def test_a_new_setting_or_parameter_without_a_perturbation_is_named():
    """Negative controls: the table's errors say what to add."""
    with pytest.raises(KeyError, match="add it to SETTINGS"):
        draw("gamma", 0.5, torch.Generator())
    family = Family("ea_transformer_lite")  # its map convolutions unlisted
    with pytest.raises(KeyError, match="does not list: add its pattern"):
        family.perturb(build_model(family.arch, *SMALL)[0], twin("transformer_lite"), torch.Generator())


REDUCING = [name for name, f in FAMILIES.items() if f.reduces is not None]
SIZES = ("--encoder-layers", "--decoder-layers")


@pytest.mark.parametrize("name", REDUCING)
def test_reduces_to_its_twin(dictionary, name):
    """With ``Family.reduces``' options and its twin's weights, the family computes fairseq's
    transformer (float64, eval); perturbed as the decoding properties run it, it does not."""
    family = FAMILIES[name]
    options, sizes = list(family.reduces), ["--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0.0"]
    reduced_sizes = list(sizes)
    for flag in SIZES:  # a size among the options: the twin's too
        if flag in options:
            i = options.index(flag)
            reduced_sizes[reduced_sizes.index(flag) + 1] = options[i + 1]
            del options[i : i + 2]
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6)
    gaps = {}
    for case, size, extra in (("reduced", reduced_sizes, options), ("perturbed", sizes, ())):
        fairseq_twin, _ = build_model(family.twin, *size, dictionary=dictionary)
        model, _ = build_model(*family.args(), *size, *extra, dictionary=dictionary)
        if case == "perturbed":
            family.perturb(model, twin_model(family.twin, *size), torch.Generator().manual_seed(0))
        missing, unexpected = model.load_state_dict(fairseq_twin.state_dict(), strict=False)
        assert not unexpected and set(missing) <= set(family.mechanism_tensors(model, fairseq_twin))
        out = decoder_out(model.double(), src, lengths, prev)
        gaps[case] = (out - decoder_out(fairseq_twin.double(), src, lengths, prev)).abs().max().item()
    # float64, but fairseq's softmax computes in float32 (utils.softmax): ~1e-7
    assert gaps["reduced"] <= 1e-6, gaps
    if name != "dropattention-column":  # (in eval DropAttention is the attention as built)
        assert gaps["perturbed"] > 1e-3, gaps


#: (arch, options, twin) of every family, and of its mechanism at the papers' other sizes
COUNTED = {name: (f.arch, f.options, f.twin) for name, f in FAMILIES.items()}
COUNTED.update({f"{name}@{arch}": (arch, (), "transformer") for name, f in FAMILIES.items() for arch in f.paper_archs})


@functools.lru_cache(maxsize=None)
def meta_build(arch: str, *options: str):
    """(parameter count, state-dict names and shapes, args) of ``arch``, built on the meta device."""
    model, args = building.build_model(arch, *options, vocab=104, meta=True)
    return (sum(p.numel() for p in model.parameters()),
            [(k, tuple(v.shape)) for k, v in model.state_dict().items()], args)


@pytest.mark.parametrize("name", list(COUNTED))
def test_parameters_beyond_the_twin_are_the_papers(name):
    """Every family, at its sizes and at the papers': the parameters it has beyond fairseq's
    twin are those its papers describe (:func:`families.added_parameters`); a mechanism that
    adds none has the twin's state dict, name for name, shape for shape."""
    arch, options, twin_arch = COUNTED[name]
    count, state, args = meta_build(arch, *options)
    twin_count, twin_state, _ = meta_build(twin_arch)
    expected = added_parameters(args)
    if expected is None:  # LSRA: test_conv_transformer.py counts its kernels
        assert set(LSRA_BRANCHES) & set(FAMILIES[name.split("@")[0]].mechanism)
        return
    assert count - twin_count == expected
    if expected == 0:
        assert state == twin_state
