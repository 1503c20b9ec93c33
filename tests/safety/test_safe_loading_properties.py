"""The loading guard on any configuration (hypothesis): loading refuses it or yields plain data."""
import argparse
import ast
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.checkpoint_attacks import checkpoints, trusted_state  # noqa: F401  (fixture)
from ea_fairseq.safety import no_code as safety


# -- property: whatever the configuration holds, loading refuses it or yields plain data ----
LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6),
    st.sampled_from(["${oc.env:HOME}", "a${x}", "${oc.create:{a: 1}}", "[10, 20]", "(0.9, 0.98)", "True",
                     "[(512, 3)] * 2", "__import__('os').getcwd()", "{'a': 1}", "1e999"]),
    st.binary(max_size=3), st.binary(max_size=3).map(bytearray), st.just(torch.Size([2])), st.just(torch.zeros(1)))
FIELDS = ["adaptive_softmax_cutoff", "adam_betas", "left_pad_source", "xformers_att_config", "arch", "x", "y"]


def _containers(value, seen=None):
    seen = set() if seen is None else seen
    if id(value) in seen or not isinstance(value, (list, tuple, dict, argparse.Namespace)):
        return []
    seen.add(id(value))
    children = vars(value).values() if isinstance(value, argparse.Namespace) else (
        value.values() if isinstance(value, dict) else value)
    found = [value] if not isinstance(value, tuple) else []
    for child in list(children):
        found += _containers(child, seen)
    return found


@st.composite
def configurations(draw):
    """Random nesting of plain and other values; then references between the containers
    (shared, and cycles), and sometimes a chain of doubled references."""
    tree = draw(st.recursive(LEAVES, lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=4)), kids, max_size=4),
        st.dictionaries(st.sampled_from(FIELDS), kids, max_size=3).map(lambda d: argparse.Namespace(**d))),
        max_leaves=25))
    holders = _containers(tree)
    for _ in range(draw(st.integers(0, 4)) if holders else 0):
        target, ref = draw(st.sampled_from(holders)), draw(st.sampled_from(holders + [tree]))
        if isinstance(target, list):
            target.append(ref)
        elif isinstance(target, dict):
            target[draw(st.sampled_from(FIELDS))] = ref
        else:
            setattr(target, draw(st.sampled_from(FIELDS)), ref)
    for _ in range(draw(st.integers(0, 1)) * draw(st.integers(1, 45))):
        tree = [tree, tree]
    return tree


def _is_plain(value, seen) -> bool:
    if type(value) in (type(None), bool, int, float):
        return True
    if type(value) is str:
        return "${" not in value
    if id(value) in seen:
        return True
    seen.add(id(value))
    if type(value) in (list, tuple):
        return all(_is_plain(v, seen) for v in value)
    if type(value) in (dict, argparse.Namespace):
        items = vars(value).items() if type(value) is argparse.Namespace else value.items()
        for key, v in items:
            if key in safety.EVALUATED_FIELDS and type(v) is str:
                ast.literal_eval(v)  # text written from a literal: a literal again
            if not (_is_plain(key, seen) and _is_plain(v, seen)):
                return False
        return True
    return False


@pytest.fixture(scope="module")
def base_state(checkpoints):
    state = trusted_state(checkpoints["vanilla"])  # its configuration and weights, no optimizer state
    return {key: state[key] for key in ("args", "cfg", "model", "optimizer_history", "extra_state")}


@settings(max_examples=40, deadline=2000, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(value=configurations(), field=st.sampled_from(FIELDS[:4] + ["encoder_layers_to_keep"]),
       section=st.sampled_from(["model", "task"]))
def test_any_configuration_is_refused_or_loads_as_plain_data(base_state, tmp_path_factory, value, field, section):
    state = dict(base_state, cfg=dict(base_state["cfg"]))
    if section == "model":
        state["cfg"]["model"] = argparse.Namespace(**vars(base_state["cfg"]["model"]))
        setattr(state["cfg"]["model"], field, value)
    else:
        state["cfg"]["task"] = dict(base_state["cfg"]["task"], **{field: value})
    path = tmp_path_factory.getbasetemp() / "property.pt"
    torch.save(state, path)
    start = time.perf_counter()
    try:
        loaded = safety.load_checkpoint(str(path))
    except safety.CheckpointError:
        pass
    else:
        assert _is_plain(loaded["cfg"], set())
        assert loaded["model"] is not None
    assert time.perf_counter() - start < 5  # a hang, not a slow machine
