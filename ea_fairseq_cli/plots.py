"""Figures (matplotlib, Agg backend: no display needed).

* :func:`plot_maps` -- heatmaps of one attention of one sentence, layers x heads, tokens
  on the axes (any kind of a dump: ``weights``, EA's ``convolution``/``dot_product``, ...).
* :func:`plot_kinds` -- one head, the weights beside the mechanism's maps (EA Fig. 11).

The figures of numbers per layer and per update are in :mod:`.metric_plots`.
"""
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

if TYPE_CHECKING:
    from ea_fairseq.analysis.dumps import AttentionDump


logger = logging.getLogger(__name__)


_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9_.-]")
LIMIT_NAME_PART = 64


def figure_name(*parts) -> str:
    """The file name of a figure made of ``parts`` (sentence id, attention, kind, ...): in each,
    every character outside ``[A-Za-z0-9_.-]`` replaced by ``_``, dots stripped from its ends,
    cut to :data:`LIMIT_NAME_PART`; joined by ``_``, ``.png`` appended. Whatever the parts hold
    (``/``, ``..``, NUL, an absolute path, unicode), the result is one plain file name."""
    return "_".join(_NOT_IN_NAMES.sub("_", str(p))[:LIMIT_NAME_PART].strip(".") or "_" for p in parts) + ".png"


def figure_path(out_dir: str, *parts) -> str:
    """``out_dir``/:func:`figure_name` (``parts``): always a file directly in ``out_dir``."""
    name = figure_name(*parts)
    assert os.sep not in name and name not in (".", "..")  # (by construction)
    return os.path.join(out_dir, name)


def shown(value) -> str:
    """A value from an input file as a message shows it: its repr, cut to 100 characters."""
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


LIMIT_LABEL = 60  # characters of a token or name drawn on a figure


def _label_text(token: str) -> str:
    """A token or name from an input file as matplotlib draws it literally: ``$`` escaped (it
    would start math mode), characters that are not printable shown escaped, at most
    :data:`LIMIT_LABEL` characters."""
    text = str(token)
    text = text if text.isprintable() else repr(text)[1:-1]
    text = text if len(text) <= LIMIT_LABEL else text[:LIMIT_LABEL - 1] + "\u2026"
    return text.replace("$", r"\$")


def _save(fig, out: str) -> str:
    from ._safety import replaced

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    try:
        with replaced(out) as f:  # (a link planted under the figure's name replaced, not written through)
            fig.savefig(f, dpi=110, format=os.path.splitext(out)[1][1:].lower() or "png")
    finally:
        plt.close(fig)
    return out


LIMIT_PANELS = 256  # maps on one figure (a dump declares its layers x heads)
LIMIT_FIGURES = 500  # figures one ``plot maps``/``plot kinds`` draws from a dump


def check_panels(dump, rows: int, cols: int, what: str, options: str) -> None:
    """Refuse a figure of more than :data:`LIMIT_PANELS` panels (the dump's declaration is not
    a budget): one line naming the options that pick a subset."""
    if rows * cols > LIMIT_PANELS:
        from ea_fairseq.analysis.dumps import DumpError

        raise DumpError(f"{getattr(dump, 'path', 'the dump')}: {what}: {rows} x {cols} = {rows * cols:,} panels, "
                        f"more than the {LIMIT_PANELS} one figure holds; pick some with {options}")


def _norm(values: np.ndarray, probabilities: bool):
    """Colour scale fitted to ``values``. Attention weights: 0 to the largest weight shown, on
    a square-root scale, so that a near-uniform head (every weight about 1/keys) is a mid tone
    and the structure of peaked heads stays visible. A map of one sign (EA's convolution term
    β·ReLU(·) is never negative): linear from 0 to the largest magnitude shown, on a
    sequential colour map (:func:`_cmap`). Maps of both signs (logits, dot products):
    symmetric around 0 up to the largest magnitude shown, on a diverging one."""
    finite = values[np.isfinite(values)]
    top = float(np.abs(finite).max()) if finite.size else 0.0
    top = top or 1.0
    if probabilities:
        return matplotlib.colors.PowerNorm(gamma=0.5, vmin=0.0, vmax=top)
    if not finite.size or finite.min() >= 0:
        return matplotlib.colors.Normalize(vmin=0.0, vmax=top)
    if finite.max() <= 0:
        return matplotlib.colors.Normalize(vmin=-top, vmax=0.0)
    return matplotlib.colors.Normalize(vmin=-top, vmax=top)


def _cmap(norm) -> str:
    """The colour map of a scale made by :func:`_norm`: weights viridis; one sign, the half of
    the diverging map that sign has (reds above 0, blues below); both signs, red-white-blue."""
    if isinstance(norm, matplotlib.colors.PowerNorm):
        return "viridis"
    if norm.vmin >= 0:
        return "Reds"
    if norm.vmax <= 0:
        return "Blues_r"
    return "RdBu_r"


def _heatmap(ax, m, rows_tok, cols_tok, norm, row_labels: bool = True, col_labels: bool = True,
             offsets=(0, 0)):
    """One panel; token labels on the figure's outer panels only (``row_labels``/``col_labels``),
    or every fifth position where there is no room for tokens (``rows_tok``/``cols_tok`` None)."""
    im = ax.imshow(m, cmap=_cmap(norm), norm=norm, aspect="auto", interpolation="nearest")
    for axis, toks, show, offset, n in ((ax.xaxis, cols_tok, col_labels, offsets[1], m.shape[1]),
                                        (ax.yaxis, rows_tok, row_labels, offsets[0], m.shape[0])):
        if toks is not None:
            axis.set_ticks(range(n))
            axis.set_ticklabels([_label_text(t) for t in toks], fontsize=TOKEN_FONT,
                                rotation=90 if axis is ax.xaxis else 0)
        else:  # positions (1-based, in the sentence)
            axis.set_major_locator(matplotlib.ticker.FixedLocator(
                [i for i in range(n) if (i + offset + 1) % 5 == 0 or i == 0]))
            axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _, o=offset: f"{int(v) + o + 1}"))
            axis.set_tick_params(labelsize=TOKEN_FONT + 1)
    ax.tick_params(labelbottom=col_labels, labelleft=row_labels)
    return im


def _colorbar(fig, im, ax, label: str = "", **kwargs):
    bar = fig.colorbar(im, ax=ax, **kwargs)
    bar.ax.tick_params(labelsize=8)
    axis = bar.ax.xaxis if kwargs.get("location") == "bottom" else bar.ax.yaxis
    if isinstance(im.norm, matplotlib.colors.PowerNorm):  # ticks evenly spaced on the bar
        axis.set_major_locator(matplotlib.ticker.FixedLocator(
            [_round_down(im.norm.vmax * (k / 3) ** 2) for k in range(4)]))
        axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.2g}"))
    else:
        axis.set_major_locator(matplotlib.ticker.MaxNLocator(4))
    if label:
        bar.set_label(label, fontsize=8)
    return bar


def _round_down(v: float) -> float:
    """``v`` rounded down to two significant digits (a tick inside the colour bar)."""
    if v <= 0:
        return 0.0
    scale = 10 ** (1 - math.floor(math.log10(v)))
    return math.floor(v * scale) / scale


def _label(kind: str) -> str:
    return "weight (square-root colour scale)" if kind == "weights" else kind


# Figure size is bounded whatever the sentence length: a panel gives each token TOKEN_PITCH
# inches (6-point labels that do not overlap) and the figure stays within MAX_FIGURE; a longer
# sentence is cropped to the tokens that fit (a window: ``window_start``), which the title and
# the log say; a grid with too many panels for token labels shows positions instead.
TOKEN_FONT = 6
TOKEN_PITCH = 0.1
MAX_FIGURE = (16.0, 20.0)  # inches; at the 110 dpi of _save: 1760 x 2200 pixels
MIN_PANEL = 1.6
MIN_TOKENS = 8
MARGIN = (2.6, 2.6)  # inches around the grid: token labels, axis titles, colour bars, title
SIDES = {  # attention -> (queries, keys): what the rows and the columns of a map are
    "encoder.self": ("source tokens", "source tokens"),
    "decoder.self": ("target tokens (each row: the position predicting it)",
                     "decoder input (target shifted right, </s> first)"),
    "decoder.cross": ("target tokens (each row: the position predicting it)", "source tokens"),
}


@dataclass
class Window:
    """The part of a (queries x keys) map a figure shows, and the figure's size."""
    q: slice
    k: slice
    labelled: bool  # token labels (else every fifth position)
    figsize: Tuple[float, float]
    note: str  # what was cropped or left out, for the title and the log


def fit_window(n_rows: int, n_cols: int, n_queries: int, n_keys: int, start: int = 1) -> Window:
    """The tokens a grid of ``n_rows`` x ``n_cols`` panels can label readably within
    :data:`MAX_FIGURE`, from token ``start`` (1-based) on, and the figure size."""
    room_w = (MAX_FIGURE[0] - MARGIN[0]) / n_cols
    room_h = (MAX_FIGURE[1] - MARGIN[1]) / n_rows
    fit_k, fit_q = int(room_w // TOKEN_PITCH), int(room_h // TOKEN_PITCH)
    if n_queries == n_keys:  # self-attention: the same tokens on both axes, square panels
        fit_k = fit_q = min(fit_k, fit_q)
    if min(fit_k, fit_q) < MIN_TOKENS:
        note = (f"{n_rows}x{n_cols} panels leave no room for token labels: positions shown "
                "(fewer --layers/--heads for tokens)")
        return Window(slice(0, n_queries), slice(0, n_keys), False,
                      (MAX_FIGURE[0], min(MAX_FIGURE[1], MARGIN[1] + n_rows * room_w)), note)

    def window(n, fit):
        first = max(0, min(start - 1, n - fit))
        return slice(first, min(n, first + fit))

    q, k = window(n_queries, fit_q), window(n_keys, fit_k)
    shown_q, shown_k = q.stop - q.start, k.stop - k.start
    w = min(room_w, max(MIN_PANEL, shown_k * TOKEN_PITCH))
    h = min(room_h, max(MIN_PANEL, shown_q * TOKEN_PITCH))
    note = ""
    if (shown_q, shown_k) != (n_queries, n_keys):
        note = (f"cropped to fit: queries {q.start + 1}-{q.stop} of {n_queries}, keys {k.start + 1}-{k.stop} "
                f"of {n_keys} (--window-start N, or fewer --layers/--heads, shows others)")
    return Window(q, k, True, (round(n_cols * w + MARGIN[0], 2), round(n_rows * h + MARGIN[1], 2)), note)


def model_name(dump) -> str:
    """The architecture and checkpoint a dump was made with (``ea-fairseq-analysis dump``)."""
    meta = getattr(dump, "meta", None) or {}
    arch, ckpt = meta.get("arch"), meta.get("checkpoint")
    if not ckpt:
        return arch or "model not recorded in the dump"
    short = os.path.join(*os.path.normpath(ckpt).split(os.sep)[-2:])
    return f"{arch}, {short}" if arch else short


def layers_differ(stack: np.ndarray, factor: float = 3.0) -> bool:
    """Whether the layers (first axis) of ``stack`` span magnitudes more than ``factor`` apart,
    so that one colour scale would leave the smaller layers blank."""
    tops = []
    for layer in stack:
        finite = np.abs(layer[np.isfinite(layer)])
        if finite.size and finite.max() > 0:
            tops.append(float(finite.max()))
    return len(tops) > 1 and max(tops) > factor * min(tops)


def _tokens(toks, n, part: slice, labelled: bool):
    return list(toks[part]) if labelled and len(toks) == n else None


def _decorate(fig, dump, attention: str, title: str, note: str) -> None:
    queries, keys = SIDES.get(attention, ("queries", "keys"))
    fig.supylabel(f"queries: {queries}", fontsize=9)
    fig.supxlabel(f"keys: {keys}", fontsize=9)
    fig.suptitle(f"{_label_text(model_name(dump))}\n{title}" + (f"\n{note}" if note else ""), fontsize=10)
    if note:
        logger.warning("%s: %s", title, note)


def plot_maps(dump: "AttentionDump", sid: int, attention: str, kind: str = "weights",
              out: str = "maps.png", layers: Optional[Sequence[int]] = None,
              heads: Optional[Sequence[int]] = None, scale: str = "auto", window_start: int = 1) -> str:
    """Grid of heatmaps (rows: layers, columns: heads); ``layers``/``heads`` are 1-based.
    ``scale``: one colour scale for every panel shown (``figure``), one per layer with its
    colour bar at the row's end (``layer``), each panel its own (``panel``), or ``auto``:
    ``layer`` where a signed map's layers differ in magnitude more than threefold, else
    ``figure`` (weights, probabilities, keep one scale: comparable across layers).
    Long sentences are cropped to the tokens that fit, from ``window_start`` (1-based) on."""
    if scale not in ("auto", "figure", "layer", "panel"):
        raise ValueError(f"scale is 'auto', 'figure', 'layer' or 'panel', not {scale!r}")
    shape = dump.shape(sid, attention, kind)  # (L, H, T, S)
    rows_tok, cols_tok = dump.axis_tokens(sid, attention)
    layers = list(layers) if layers else list(range(1, shape[0] + 1))
    heads = list(heads) if heads else list(range(1, shape[1] + 1))
    check_panels(dump, len(layers), len(heads), f"sentence {sid} {attention} {kind}, layers x heads",
                 "--layers and --heads")
    probabilities = kind == "weights"
    win = fit_window(len(layers), len(heads), shape[2], shape[3], window_start)
    shown = dump.get(sid, attention, kind, ([l - 1 for l in layers], [h - 1 for h in heads], win.q, win.k))
    if scale == "auto":
        scale = "layer" if not probabilities and layers_differ(shown) else "figure"
    rtok = _tokens(rows_tok, shape[2], win.q, win.labelled)
    ctok = _tokens(cols_tok, shape[3], win.k, win.labelled)
    fig, axes = plt.subplots(len(layers), len(heads), squeeze=False, layout="constrained", figsize=win.figsize)
    norm = _norm(shown, probabilities)
    for r, layer in enumerate(layers):
        layer_norm = _norm(shown[r], probabilities)
        for c, head in enumerate(heads):
            ax = axes[r][c]
            m = shown[r, c]
            panel_norm = {"figure": norm, "layer": layer_norm}.get(scale) or _norm(m, probabilities)
            im = _heatmap(ax, m, rtok, ctok, panel_norm, row_labels=c == 0, col_labels=r == len(layers) - 1,
                          offsets=(win.q.start, win.k.start))
            if scale == "panel":
                _colorbar(fig, im, ax, shrink=0.9, pad=0.02)
            if r == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if c == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=8)
        if scale == "layer":
            _colorbar(fig, im, axes[r, :], shrink=0.9, pad=0.02)
    if scale == "figure":
        _colorbar(fig, im, axes, _label(kind), shrink=0.8)
    how = {"figure": "", "layer": ", each layer on its own colour scale",
           "panel": ", each panel on its own colour scale"}[scale]
    _decorate(fig, dump, attention, f"sentence {sid}: {attention} {_label(kind)}{how}", win.note)
    return _save(fig, out)


def plot_kinds(dump: "AttentionDump", sid: int, attention: str, head: int = 1,
               kinds: Optional[Sequence[str]] = None, out: str = "kinds.png",
               layers: Optional[Sequence[int]] = None, window_start: int = 1) -> str:
    """EA Fig. 11 layout for one head: per layer, the attention weights beside the maps
    the mechanism reported (EA: ``logits`` = β·conv + (1-β)·input, ``convolution``,
    ``dot_product``). The weights, and a signed map whose layers have magnitudes within a factor
    of three, share one colour scale per column, with its colour bar below it; otherwise (EA's
    convolution term grows with depth) each layer has its own scale and colour bar, and the
    column's title says so."""
    available = dump.sentences[sid].kinds[attention]
    kinds = [k for k in (kinds or available) if k in available]
    if not kinds:
        raise ValueError(f"none of the kinds is in the dump; {attention} has {available}")
    check_panels(dump, 1, len(kinds), f"sentence {sid} {attention}, kinds", "--kind")
    kinds = [k for k in kinds if len(dump.shape(sid, attention, k)) == 4]  # stacked (layers, heads, T, S)
    first = dump.shape(sid, attention, kinds[0])
    layers = list(layers) if layers else list(range(1, first[0] + 1))
    check_panels(dump, len(layers), len(kinds), f"sentence {sid} {attention}, layers x kinds", "--layers and --kind")
    rows_tok, cols_tok = dump.axis_tokens(sid, attention)
    win = fit_window(len(layers), len(kinds), first[2], first[3], window_start)
    rtok = _tokens(rows_tok, first[2], win.q, win.labelled)
    ctok = _tokens(cols_tok, first[3], win.k, win.labelled)
    fig, axes = plt.subplots(len(layers), len(kinds), squeeze=False, layout="constrained", figsize=win.figsize)
    for c, kind in enumerate(kinds):
        m = dump.get(sid, attention, kind, ([l - 1 for l in layers], [head - 1], win.q, win.k))[:, 0]
        probabilities = kind == "weights"
        per_layer = not probabilities and layers_differ(m)
        label = "weight (square-root scale)" if probabilities else kind
        for r, layer in enumerate(layers):
            ax = axes[r][c]
            im = _heatmap(ax, m[r], rtok, ctok, _norm(m[r] if per_layer else m, probabilities),
                          row_labels=c == 0, col_labels=r == len(layers) - 1,
                          offsets=(win.q.start, win.k.start))
            if per_layer:
                _colorbar(fig, im, ax, shrink=0.9, pad=0.02)
            if r == 0:
                ax.set_title(f"{kind}\n(each layer on its own scale)" if per_layer else kind, fontsize=9)
            if c == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=8)
        if not per_layer:
            _colorbar(fig, im, axes[:, c], label, location="bottom", shrink=0.95, aspect=12, pad=0.02)
    _decorate(fig, dump, attention, f"sentence {sid}: {attention}, head {head}", win.note)
    return _save(fig, out)
