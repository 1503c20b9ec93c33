"""Figure file names are never taken from a dump as they are: ``ea-fairseq-analysis plot maps/kinds``
refuses a dump whose sentence ids, attentions or kinds are not those ``dump`` writes, and
makes every name from checked parts (:func:`ea_fairseq_cli.plots.figure_name`), so a hostile dump
writes nothing outside ``--out-dir``. Tokens and model names are drawn as text, never as
matplotlib's math."""
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ea_fairseq.analysis.dumps import META_KEY
from ea_fairseq_cli import analysis as analysis_cli
from ea_fairseq_cli import plots


def write_dump(path, sid=0, attention="encoder.self", kind="weights", tokens=("a", "b", "c"), **meta):
    sentence = {"id": sid, "source": list(tokens), "decoder_input": list(tokens), "target": list(tokens),
                "maps": {attention: [kind]}}
    text = json.dumps({"format": "ea_fairseq.analysis dump v1", "sentences": [sentence], **meta})
    arrays = {f"{sid}/{attention}/{kind}": np.full((1, 1, 3, 3), 1 / 3, np.float32), META_KEY: np.array(text)}
    with open(path, "wb") as f:  # (a name numpy would not rewrite)
        np.savez(f, **arrays)
    return str(path)


def files_under(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


HOSTILE = {
    "kind: parent directories": dict(kind="../../../escaped"),
    "kind: an absolute path": dict(kind="/tmp/ea_fairseq_absolute_escape"),
    "attention: parent directories": dict(attention="x/../../../escaped"),
    "sentence id: a path": dict(sid="../escaped"),
    "kind: NUL": dict(kind="weights\x00../x"),
    "kind: very long": dict(kind="k" * 5000),
    "kind: unicode separators": dict(kind="w\u2215\u2044..\uff0fx"),
    "sentence id: a bool": dict(sid=True),
}


def test_the_names_a_dump_held_were_paths_out_of_the_folder(tmp_path):
    """Negative control: the figure name the plot command made as ``s{id}_{attention}_{kind}.png``
    under ``--out-dir`` leaves it for such a dump."""
    out = str(tmp_path / "figs")
    for case in ("kind: parent directories", "attention: parent directories"):
        values = dict(dict(sid=0, attention="encoder.self", kind="weights"), **HOSTILE[case])
        name = os.path.join(out, f"s{values['sid']}_{values['attention']}_{values['kind']}.png")
        assert not os.path.normpath(name).startswith(out + os.sep), case


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_dump_is_refused_in_one_line_and_nothing_is_written(tmp_path, case):
    dump = write_dump(tmp_path / "dump.npz", **HOSTILE[case])
    before = files_under(tmp_path)
    for what in ("maps", "kinds"):
        with pytest.raises(SystemExit) as stop:
            analysis_cli.main(["plot", what, dump, "--out-dir", str(tmp_path / "figs")])
        message = str(stop.value.code)
        assert message.startswith(f"ea-fairseq-analysis plot {what}: error:") and "\n" not in message, message
        assert "make the dump again" in message.lower() and len(message) < 600, message
    assert files_under(tmp_path) == before
    assert not os.path.exists("/tmp/ea_fairseq_absolute_escape.png")


def test_a_dump_as_dump_writes_it_is_plotted_under_its_name(tmp_path, monkeypatch):
    """Negative control of the refusal: names as ``dump`` writes them, tokens holding matplotlib's
    math markers (``$...$``) and a checkpoint path holding them, plot as before; drawn as math,
    such a token stops the plot with matplotlib's parse error."""
    dump = write_dump(tmp_path / "dump.npz", sid=3, kind="weights", tokens=("$x$", r"$\frac{$", "c" * 10 ** 6 + "\n"),
                      checkpoint="/m/$\\undefinedmacro$/c.pt", arch="ea_transformer_lite")
    assert analysis_cli.main(["plot", "maps", dump, "--out-dir", str(tmp_path / "figs")]) == 0
    assert files_under(tmp_path / "figs") == ["s3_encoder.self_weights.png"]
    monkeypatch.setattr(plots, "_label_text", lambda token: token)
    with pytest.raises(ValueError):
        analysis_cli.main(["plot", "maps", dump, "--out-dir", str(tmp_path / "math")])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=300), st.integers()), min_size=1, max_size=4))
def test_a_figure_name_is_one_plain_file_name_whatever_its_parts(parts):
    name = plots.figure_name(*parts)
    assert name.endswith(".png") and not name.startswith(".")
    assert set(name) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
    assert len(name) <= len(parts) * (plots.LIMIT_NAME_PART + 1) + 4
    out = os.path.join(os.sep, "out")
    assert os.path.dirname(os.path.normpath(plots.figure_path(out, *parts))) == out
    plain = [p for p in parts if isinstance(p, int) or (p and set(p) <= set("abcdefgh0123456789_-") and len(p) < 64)]
    if len(plain) == len(parts):  # plain parts are kept as they are
        assert name == "_".join(map(str, parts)) + ".png"


def write_declared(path, shape, data: bytes = b""):
    """A dump whose weights member declares ``shape`` (float32) and holds ``data``."""
    import io
    import zipfile

    sentence = {"id": 0, "source": ["a"], "decoder_input": ["a"], "target": ["a"], "maps": {"encoder.self": ["weights"]}}
    with zipfile.ZipFile(path, "w") as zf:
        meta = io.BytesIO()
        np.lib.format.write_array(meta, np.array(json.dumps({"sentences": [sentence]})))
        zf.writestr(META_KEY + ".npy", meta.getvalue())
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
        zf.writestr("0/encoder.self/weights.npy", header.getvalue() + data)
    return str(path)


@pytest.mark.parametrize("shape, data", [((64, 64, 4096, 4096), b""), ((1, 1, 2, 2), b"\0" * 4)])
def test_a_map_that_declares_more_than_it_holds_is_refused_before_numpy_allocates_it(tmp_path, shape, data):
    dump = write_declared(tmp_path / "dump.npz", shape, data)
    with pytest.raises(SystemExit) as stop:
        analysis_cli.main(["plot", "maps", dump, "--out-dir", str(tmp_path / "figs")])
    message = str(stop.value.code)
    assert "declares a " + "x".join(map(str, shape)) in message and "\n" not in message, message
    assert not os.path.exists(tmp_path / "figs") or files_under(tmp_path / "figs") == []
    # negative control: numpy itself allocates the declared array first, then finds the data short
    with pytest.raises((ValueError, MemoryError)):
        np.load(dump)["0/encoder.self/weights"]


def test_labels_from_input_are_plain_one_line_and_short():
    for token in ("c" * 10 ** 6, "a\nb\x1b[2J", "$\\frac{$", "plain"):
        label = plots._label_text(token)
        assert label.isprintable() and len(label) <= plots.LIMIT_LABEL + 2 * label.count("$")
    assert plots._label_text("plain") == "plain" and plots._label_text("$5") == r"\$5"
