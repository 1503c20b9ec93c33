"""numpy values in checkpoints (fairseq's --eval-bleu keeps its BLEU counts in
extra_state['metrics']): numeric arrays and scalars load with their values and dtypes; every
other numpy value is refused in one line, nothing of it made."""
import numpy as np
import pytest
import torch
from fairseq import checkpoint_utils

from support.checkpoint_attacks import checkpoints, payload, trusted_state  # noqa: F401  (fixture)
from conftest import cli
from ea_fairseq.safety import no_code as safety
from ea_fairseq_cli import average_checkpoints as avg
from support.trained_checkpoints import USER_DIR, run


NUMERIC_NUMPY = {"counts": np.array([7, 5, 3, 1]), "sys_len": np.int64(9), "bleu": np.float64(12.5),
                 "half": np.array([[1.5, -2.0]], dtype=np.float16), "flags": np.array([True, False]),
                 "column": np.asfortranarray(np.arange(6, dtype=np.uint8).reshape(2, 3)), "zero_d": np.array(2.0),
                 "small": np.float32(0.25), "complex": np.complex64(1 - 2j), "empty": np.zeros((0, 3), np.int32)}


class _Crafted:
    """Pickled as the call ``func(*args)`` (as a crafted file spells a value)."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _with_numpy(src, dst, where, value):
    state = trusted_state(src)
    if where == "extra_state":
        state["extra_state"]["crafted"] = value
    else:
        setattr(state["cfg"]["model"], where, value)
    torch.save(state, dst)
    return dst


def test_numeric_numpy_values_outside_the_configuration_load(tmp_path, checkpoints, tiny_data_bin):
    """Arrays and scalars of booleans and numbers in extra_state load with their values and
    dtypes, through fairseq's loader (generate, the hub), the plugin's and averaging; the
    allow-list is gone after the load (torch alone refuses the file: negative control)."""
    path = _with_numpy(checkpoints["vanilla"], tmp_path / "c.pt", "extra_state", dict(NUMERIC_NUMPY))
    with pytest.raises(Exception, match="(?i)weights.only"):
        torch.load(path, weights_only=True)
    for state in (checkpoint_utils.load_checkpoint_to_cpu(str(path)), safety.load_checkpoint(str(path))):
        loaded = state["extra_state"]["crafted"]
        assert loaded.keys() == NUMERIC_NUMPY.keys()
        for key, value in NUMERIC_NUMPY.items():
            assert type(loaded[key]) is type(value) and loaded[key].dtype == value.dtype, key
            assert loaded[key].shape == value.shape and np.array_equal(loaded[key], value), key
    assert not [entry for entry in torch.serialization.get_safe_globals()
                if isinstance(entry, tuple) and entry[1].startswith("numpy")]
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": tiny_data_bin})
    assert models
    copy = tmp_path / "d.pt"
    copy.write_bytes(path.read_bytes())
    assert avg.main(["--inputs", str(path), str(copy), "--output", str(tmp_path / "a.pt")]) == 0
    assert np.array_equal(trusted_state(tmp_path / "a.pt")["extra_state"]["crafted"]["counts"],
                          NUMERIC_NUMPY["counts"])


class _Stated(_Crafted):
    """Pickled as ``func(*args)`` filled in with ``state`` (``BUILD``)."""

    def __init__(self, state, func, *args):
        super().__init__(func, *args)
        self.state = state

    def __reduce__(self):
        return self.func, self.args, self.state


def _array(shape, dtype, data):
    """A numpy array as numpy pickles one, with the state given."""
    return _Stated((1, shape, dtype, False, data), np._core.multiarray._reconstruct, np.ndarray, (0,), b"b")


def _live(check):
    """Negative control: numpy's own unpickling makes the value ``check`` describes."""
    return lambda path: check(trusted_state(path)["extra_state"]["crafted"])


HUGE = 1 << 40
# attack -> (where, value, the refusal names, negative control or None)
NUMPY_ATTACKS = {
    "object-array": ("extra_state", np.array([payload("x"), 1], dtype=object), "a numpy dtype 'O8'",
                     _live(lambda v: v.dtype == object)),
    "string-array": ("extra_state", np.array(["en", "de"]), "a numpy dtype 'U2'", _live(lambda v: v.dtype.kind == "U")),
    "structured-array": ("extra_state", np.zeros(2, dtype=[("a", "i8"), ("b", "f4")]), "a numpy dtype 'V12'",
                         _live(lambda v: v.dtype.names == ("a", "b"))),
    "string-scalar": ("extra_state", np.str_("de"), "a numpy dtype 'U2'", _live(lambda v: v == "de")),
    "ndarray-made-directly": ("extra_state", _Crafted(np.ndarray, (HUGE,), np.dtype("i8"), b"\0" * 8, 0, (0,)),
                              "a numpy.ndarray made directly", _live(lambda v: v.size == HUGE)),
    "huge-reconstruct": ("extra_state", _Crafted(np._core.multiarray._reconstruct, np.ndarray, (HUGE,), b"b"),
                         f"_reconstruct(numpy.ndarray, ({HUGE},), ...)", None),
    "huge-declared-array": ("extra_state", _array((HUGE,), np.dtype("i8"), b"\0" * 8),
                            f"a numpy array declaring {8 * HUGE} bytes (shape ({HUGE},), int64) over 8 bytes", None),
    "array-without-data": ("extra_state", _Crafted(np._core.multiarray._reconstruct, np.ndarray, (0,), b"b"),
                           "['crafted']: a numpy array without its data", None),
    "too-many-elements": ("extra_state", np.zeros(safety.LIMIT_STATE_NODES + 1, dtype=bool),
                          f"['crafted']: a numpy array declaring {safety.LIMIT_STATE_NODES + 1} elements", None),
    "array-in-cfg": ("dropout", np.array(0.1), "cfg.model.dropout: a numpy.ndarray value", None),
    "scalar-in-cfg": ("encoder_layers", np.int64(2), "cfg.model.encoder_layers: a numpy.int64 value", None),
}


@pytest.mark.parametrize("attack", sorted(NUMPY_ATTACKS))
def test_numpy_values_other_than_numeric_ones_outside_the_configuration_are_refused(tmp_path, checkpoints, attack):
    """Refused in one line naming the value, nothing of it made; where numpy's own unpickling
    makes it (negative control), the loader does not."""
    where, value, shown, control = NUMPY_ATTACKS[attack]
    path = _with_numpy(checkpoints["vanilla"], tmp_path / "c.pt", where, value)
    for load in (checkpoint_utils.load_checkpoint_to_cpu, safety.load_checkpoint):
        with pytest.raises(safety.UnsafeCheckpointError) as refusal:
            load(str(path))
        assert shown in str(refusal.value) and "Nothing in" in str(refusal.value), str(refusal.value)
        assert "\n" not in str(refusal.value)
    if control is not None:
        assert control(path)


def test_a_stored_dtype_state_does_not_reach_the_array(tmp_path, checkpoints):
    """A dtype's state (``__setstate__``) may flag int64 items as object pointers: the array
    is made with a dtype made afresh from its type code, the flags left behind (numpy's own
    unpickling keeps them: negative control, on the dtype alone)."""
    import pickle

    flagged = _Stated((3, "<", None, None, None, -1, -1, 0x3F), np.dtype, "i8", False, True)
    assert pickle.loads(pickle.dumps(flagged)).hasobject
    data = np.array([3, 1], dtype=np.int64)
    path = _with_numpy(checkpoints["vanilla"], tmp_path / "c.pt", "extra_state", _array((2,), flagged, data.tobytes()))
    loaded = safety.load_checkpoint(str(path))["extra_state"]["crafted"]
    assert type(loaded) is np.ndarray and not loaded.dtype.hasobject and loaded.dtype.flags == data.dtype.flags
    assert np.array_equal(loaded, data)


def test_fairseq_generate_refuses_an_object_array_in_one_line(tmp_path, tiny_data_bin, checkpoints):
    path = _with_numpy(checkpoints["vanilla"], tmp_path / "c.pt", "extra_state", np.array([None], dtype=object))
    code, out = run([cli("fairseq-generate"), tiny_data_bin, "--user-dir", USER_DIR, "--path", path,
                     "--beam", "2", "--cpu", "--max-len-b", "5"], expect_ok=False, cwd=tmp_path)
    assert code != 0 and "Traceback" not in out, out[-3000:]
    assert "a numpy dtype 'O8'" in out.strip().splitlines()[-1]
