"""The attention figures as a reader sees them: bounded pixel size whatever the sentence length,
token labels that do not overlap, axis titles, the model and checkpoint in the title, what was
cropped said in the figure and the log, and per-layer colour scales where a map's layers differ
in magnitude (EA's convolution term). Through ``ea-fairseq-analysis plot`` on a dump file."""
import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from ea_fairseq_cli import plots
from ea_fairseq.analysis.dumps import META_KEY

BIN = Path(sys.executable).parent
DPI = 110  # plots._save
MAX_PX = (plots.MAX_FIGURE[0] * DPI, plots.MAX_FIGURE[1] * DPI)


def write_dump(path: Path, n_src: int, n_tgt: int, layers: int = 6, heads: int = 4, more=()) -> dict:
    """A dump as ``ea-fairseq-analysis dump`` writes it: decoder.cross weights, and EA's
    convolution term growing tenfold per layer; sentence 0 of ``n_src``/``n_tgt`` tokens, then one
    per ``(n_src, n_tgt)`` of ``more``."""
    rng = np.random.default_rng(0)
    meta = {"format": "ea_fairseq.analysis dump v1", "arch": "ea_transformer_lite",
            "checkpoint": "/runs/iwslt/ea_seed1/checkpoint_best.pt", "sentences": []}
    arrays = {}
    for sid, (ns, nt) in enumerate([(n_src, n_tgt), *more]):
        logits = rng.normal(size=(layers, heads, nt, ns))
        weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        conv = np.stack([rng.normal(size=(heads, nt, ns)) * 10.0 ** (l - 3) for l in range(layers)])
        target = [f"tgt{i}" for i in range(nt)]
        meta["sentences"].append({"id": sid, "source": [f"src{i}" for i in range(ns)], "target": target,
                                  "decoder_input": ["</s>"] + target[:-1],
                                  "maps": {"decoder.cross": ["weights", "convolution", "logits"]}})
        arrays.update({f"{sid}/decoder.cross/weights": weights.astype(np.float32),
                       f"{sid}/decoder.cross/convolution": conv.astype(np.float32),
                       f"{sid}/decoder.cross/logits": logits.astype(np.float32)})
    np.savez_compressed(path, **{META_KEY: np.array(json.dumps(meta)), **arrays})
    return meta


def test_maps_figures_are_bounded_and_say_what_they_crop(tmp_path):
    """35- and 200-token sentences through ``ea-fairseq-analysis plot maps``: at most
    MAX_FIGURE at 110 dpi, and the log names the crop."""
    write_dump(tmp_path / "maps.npz", 35, 33, more=[(200, 198)])
    proc = subprocess.run([str(BIN / "ea-fairseq-analysis"), "plot", "maps", str(tmp_path / "maps.npz"),
                           "--out-dir", str(tmp_path / "fig")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pngs = [line[len("wrote "):] for line in proc.stdout.splitlines() if line.startswith("wrote ")]
    assert [Path(p).name for p in pngs] == ["s0_decoder.cross_weights.png", "s1_decoder.cross_weights.png"]
    for png in pngs:
        height, width = matplotlib.image.imread(png).shape[:2]
        assert width <= MAX_PX[0] and height <= MAX_PX[1]
    for tokens in (35, 200):
        assert f"of {tokens - 2}, keys 1-" in proc.stderr and f"of {tokens} (--window-start N" in proc.stderr


@pytest.mark.parametrize("tokens", [35, 200])
def test_figure_labels_tokens_readably_with_titles(tmp_path, monkeypatch, tokens):
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, out: figures.append(fig) or out)
    write_dump(tmp_path / "maps.npz", tokens, tokens + 3)
    from ea_fairseq.analysis.dumps import AttentionDump

    dump = AttentionDump(str(tmp_path / "maps.npz"))
    plots.plot_maps(dump, 0, "decoder.cross")
    plots.plot_kinds(dump, 0, "decoder.cross")
    for fig in figures:
        fig.canvas.draw()
        w, h = fig.get_size_inches()
        assert w <= plots.MAX_FIGURE[0] and h <= plots.MAX_FIGURE[1]
        title = fig._suptitle.get_text()
        assert "ea_transformer_lite, ea_seed1/checkpoint_best.pt" in title.splitlines()[0]
        assert f"queries 1-" in title and f"of {tokens + 3}" in title  # the crop, in the figure
        assert fig._supxlabel.get_text() == "keys: source tokens"
        assert fig._supylabel.get_text().startswith("queries: target tokens")
        panels = [ax for ax in fig.axes if ax.images and ax.get_subplotspec() is not None]
        left = [ax for ax in panels if ax.get_subplotspec().is_first_col()]
        bottom = [ax for ax in panels if ax.get_subplotspec().is_last_row()]
        rows = [t.get_text() for t in left[0].get_yticklabels() if t.get_visible() and t.get_text()]
        cols = [t.get_text() for t in bottom[0].get_xticklabels() if t.get_visible() and t.get_text()]
        assert rows == [f"tgt{i}" for i in range(len(rows))] and len(rows) >= plots.MIN_TOKENS
        assert cols == [f"src{i}" for i in range(len(cols))] and len(cols) >= plots.MIN_TOKENS
        # readable: 6-point labels, one token apart at least their own height (no overlap)
        for ax, axis in ((left[0], "y"), (bottom[0], "x")):
            ticks = ax.get_yticks() if axis == "y" else ax.get_xticks()
            pts = ax.transData.transform([(t, t) for t in ticks[:2]])
            pitch_px = abs(pts[1][1] - pts[0][1]) if axis == "y" else abs(pts[1][0] - pts[0][0])
            size = (ax.get_yticklabels() if axis == "y" else ax.get_xticklabels())[0].get_fontsize()
            assert size >= 6 and pitch_px >= size * fig.dpi / 72
        inner = [ax for ax in panels if not ax.get_subplotspec().is_first_col()]
        assert inner and not any(t.get_visible() and t.get_text() for ax in inner for t in ax.get_yticklabels())


def test_a_figure_reads_the_part_of_a_map_it_draws_as_the_map_holds_it(tmp_path):
    """The layers, heads and crop a figure draws are read alone (``AttentionDump.get``'s part), in
    the order the options give them, repeated or past the map's end: the whole map's values."""
    from ea_fairseq.analysis.dumps import AttentionDump

    write_dump(tmp_path / "maps.npz", 30, 20)
    dump = AttentionDump(str(tmp_path / "maps.npz"))
    whole = dump.get(0, "decoder.cross", "convolution")  # (6, 4, 20, 30)
    for layers, heads, q, k in (([5, 0, 2], [3, 3, 1], slice(4, 17), slice(9, 30)),
                                ([0], [0], slice(0, 20), slice(0, 30)), ([1], [-1], slice(19, 40), slice(29, 50))):
        part = dump.get(0, "decoder.cross", "convolution", (layers, heads, q, k))
        np.testing.assert_array_equal(part, whole[layers][:, heads][:, :, q, k])


def test_short_sentence_is_not_cropped_and_window_start_moves_the_crop(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, out: figures.append(fig) or out)
    from ea_fairseq.analysis.dumps import AttentionDump

    write_dump(tmp_path / "short.npz", 7, 5, layers=2, heads=2)
    plots.plot_maps(AttentionDump(str(tmp_path / "short.npz")), 0, "decoder.cross")
    fig = figures.pop()
    assert "cropped" not in fig._suptitle.get_text()
    assert [t.get_text() for t in fig.axes[2].get_xticklabels()] == [f"src{i}" for i in range(7)]
    write_dump(tmp_path / "long.npz", 200, 200)
    plots.plot_maps(AttentionDump(str(tmp_path / "long.npz")), 0, "decoder.cross", window_start=101)
    fig = figures.pop()
    first = [ax for ax in fig.axes if ax.images][0]
    assert first.get_yticklabels()[0].get_text() == "tgt100"
    assert "queries 101-" in fig._suptitle.get_text()


def test_kinds_convolution_column_gets_a_scale_per_layer(tmp_path, monkeypatch):
    """EA's convolution term grows tenfold per layer: one shared scale would leave the first
    layers blank; each layer gets its own scale (and colour bar). The weights keep one."""
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, out: figures.append(fig) or out)
    from ea_fairseq.analysis.dumps import AttentionDump

    write_dump(tmp_path / "maps.npz", 12, 10)
    dump = AttentionDump(str(tmp_path / "maps.npz"))
    plots.plot_kinds(dump, 0, "decoder.cross")
    fig = figures.pop()
    by_col = {}
    for ax in fig.axes:
        if ax.images and ax.get_subplotspec() is not None:
            by_col.setdefault(ax.get_subplotspec().colspan.start, []).append(ax.images[0].norm.vmax)
    conv = np.array(by_col[1])
    assert np.all(conv[1:] / conv[:-1] > 5)  # each layer fitted to its own values
    assert len(set(by_col[0])) == 1  # the weights: one scale for the column
    assert "each layer on its own scale" in [ax for ax in fig.axes if ax.images][1].get_title()
    # negative control: the same figure under one column scale leaves layer 1 at 1/1000 of it
    conv_map = dump.get(0, "decoder.cross", "convolution")[:, 0]
    assert np.abs(conv_map[0]).max() / np.abs(conv_map).max() < 1e-3
    # maps of the convolution term: auto picks a scale per layer, weights keep one
    plots.plot_maps(dump, 0, "decoder.cross", "convolution")
    fig = figures.pop()
    assert "each layer on its own colour scale" in fig._suptitle.get_text()
    plots.plot_maps(dump, 0, "decoder.cross", "weights")
    fig = figures.pop()
    assert len({ax.images[0].norm for ax in fig.axes if ax.images}) == 1
