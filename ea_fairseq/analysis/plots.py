"""Figures (matplotlib, Agg backend: no display needed).

* :func:`plot_maps` -- heatmaps of one attention of one sentence, layers x heads, tokens
  on the axes (any kind of a dump: ``weights``, EA's ``convolution``/``dot_product``, ...).
* :func:`plot_kinds` -- one head, the weights beside the mechanism's maps (EA Fig. 11).
* :func:`plot_entropy` -- entropy per layer of several models on one figure.
* :func:`plot_js` -- the layer-by-layer Jensen-Shannon divergence matrices.
* :func:`plot_curves` -- learning curves of fairseq-train runs (:mod:`.curves`).
"""
import math
import os
from typing import TYPE_CHECKING, List, Mapping, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

if TYPE_CHECKING:
    from .maps import AttentionDump

from . import ATTENTIONS  # noqa: E402


def _save(fig, out: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _norm(values: np.ndarray, probabilities: bool):
    """Colour scale fitted to ``values``. Attention weights: 0 to the largest weight shown, on
    a square-root scale, so that a near-uniform head (every weight about 1/keys) is a mid tone
    and the structure of peaked heads stays visible. Signed maps (logits, convolution terms):
    symmetric around 0 up to the largest magnitude shown."""
    finite = np.abs(values[np.isfinite(values)])
    top = float(finite.max()) if finite.size else 0.0
    top = top or 1.0
    if probabilities:
        return matplotlib.colors.PowerNorm(gamma=0.5, vmin=0.0, vmax=top)
    return matplotlib.colors.Normalize(vmin=-top, vmax=top)


def _heatmap(ax, m, rows_tok, cols_tok, norm):
    cmap = "viridis" if isinstance(norm, matplotlib.colors.PowerNorm) else "RdBu_r"
    im = ax.imshow(m, cmap=cmap, norm=norm, aspect="auto")
    n_rows, n_cols = m.shape
    ax.set_xticks(range(n_cols))
    ax.set_yticks(range(n_rows))
    ax.set_xticklabels(cols_tok if len(cols_tok) == n_cols else range(1, n_cols + 1),
                       rotation=90, fontsize=6)
    ax.set_yticklabels(rows_tok if len(rows_tok) == n_rows else range(1, n_rows + 1), fontsize=6)
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


def _figure(n_rows: int, n_cols: int, shape):
    cell = max(1.7, 0.22 * max(shape))
    return plt.subplots(n_rows, n_cols, squeeze=False, layout="constrained",
                        figsize=(cell * n_cols + 1.2, cell * n_rows + 0.6))


def plot_maps(dump: "AttentionDump", sid: int, attention: str, kind: str = "weights",
              out: str = "maps.png", layers: Optional[Sequence[int]] = None,
              heads: Optional[Sequence[int]] = None, scale: str = "figure") -> str:
    """Grid of heatmaps (rows: layers, columns: heads); ``layers``/``heads`` are 1-based.
    ``scale``: one colour scale fitted to every panel shown (``figure``) or each panel fitted
    to its own values, with its own colour bar (``panel``)."""
    if scale not in ("figure", "panel"):
        raise ValueError(f"scale is 'figure' or 'panel', not {scale!r}")
    maps = dump.get(sid, attention, kind)  # (L, H, T, S)
    rows_tok, cols_tok = dump.axis_tokens(sid, attention)
    layers = list(layers) if layers else list(range(1, maps.shape[0] + 1))
    heads = list(heads) if heads else list(range(1, maps.shape[1] + 1))
    probabilities = kind == "weights"
    shown = maps[[l - 1 for l in layers]][:, [h - 1 for h in heads]]
    norm = _norm(shown, probabilities)
    fig, axes = _figure(len(layers), len(heads), maps.shape[2:])
    for r, layer in enumerate(layers):
        for c, head in enumerate(heads):
            ax = axes[r][c]
            m = maps[layer - 1, head - 1]
            im = _heatmap(ax, m, rows_tok, cols_tok, norm if scale == "figure" else _norm(m, probabilities))
            if scale == "panel":
                _colorbar(fig, im, ax, shrink=0.9, pad=0.02)
            if r == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if c == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=8)
    if scale == "figure":
        _colorbar(fig, im, axes, _label(kind), shrink=0.8)
    fig.suptitle(f"sentence {sid}: {attention} {_label(kind) if scale == 'panel' else kind}"
                 f"{', each panel on its own scale' if scale == 'panel' else ''}", fontsize=10)
    return _save(fig, out)


def plot_kinds(dump: "AttentionDump", sid: int, attention: str, head: int = 1,
               kinds: Optional[Sequence[str]] = None, out: str = "kinds.png",
               layers: Optional[Sequence[int]] = None) -> str:
    """EA Fig. 11 layout for one head: per layer, the attention weights beside the maps
    the mechanism reported (EA: ``logits`` = β·conv + (1-β)·input, ``convolution``,
    ``dot_product``). Each column has one colour scale fitted to its values, with its colour
    bar below it."""
    available = dump.sentences[sid].kinds[attention]
    kinds = [k for k in (kinds or available) if k in available]
    if not kinds:
        raise ValueError(f"none of the kinds is in the dump; {attention} has {available}")
    stacks = {k: dump.get(sid, attention, k) for k in kinds}
    stacks = {k: a for k, a in stacks.items() if a.ndim == 4}  # stacked (layers, heads, T, S)
    kinds = list(stacks)
    n_layers = next(iter(stacks.values())).shape[0]
    layers = list(layers) if layers else list(range(1, n_layers + 1))
    rows_tok, cols_tok = dump.axis_tokens(sid, attention)
    fig, axes = _figure(len(layers), len(kinds), next(iter(stacks.values())).shape[2:])
    for c, kind in enumerate(kinds):
        m = stacks[kind][[l - 1 for l in layers], head - 1]
        norm = _norm(m, kind == "weights")
        for r, layer in enumerate(layers):
            ax = axes[r][c]
            im = _heatmap(ax, m[r], rows_tok, cols_tok, norm)
            if r == 0:
                ax.set_title(kind, fontsize=9)
            if c == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=8)
        _colorbar(fig, im, axes[:, c], "weight (square-root scale)" if kind == "weights" else kind,
                  location="bottom", shrink=0.95, aspect=12, pad=0.02)
    fig.suptitle(f"sentence {sid}: {attention}, head {head}", fontsize=10)
    return _save(fig, out)


def _attentions(results: Mapping[str, Mapping[str, dict]]) -> List[str]:
    names = {a for r in results.values() for a in r}
    return sorted(names, key=lambda a: (ATTENTIONS.index(a) if a in ATTENTIONS else 9, a))


def plot_entropy(results: Mapping[str, Mapping[str, dict]], out: str = "entropy.png",
                 metric: str = "entropy") -> str:
    """``results``: ``{model: {attention: metrics}}`` (the ``metrics`` JSON); one panel per
    attention, one line per model."""
    attentions = _attentions(results)
    fig, axes = plt.subplots(1, len(attentions), squeeze=False, layout="constrained",
                             figsize=(4.2 * len(attentions), 3.4))
    for ax, attention in zip(axes[0], attentions):
        for model, per_attention in results.items():
            r = per_attention.get(attention)
            if r is None:
                continue
            layers = np.arange(1, r["layers"] + 1)
            ax.plot(layers, r[metric], marker="o", label=model)
        ax.set_title(attention)
        ax.set_xlabel("layer")
        ax.set_ylabel(f"{metric} (nats)" if metric == "entropy" else metric)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    return _save(fig, out)


def plot_js(results: Mapping[str, Mapping[str, dict]], out: str = "js.png") -> str:
    """One JS-divergence matrix per (model, attention), annotated."""
    panels = [(m, a, r) for m, per in results.items() for a, r in per.items()]
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, squeeze=False, layout="constrained",
                             figsize=(3.9 * cols, 3.5 * rows))
    vmax = max((max(max(row) for row in r["js"]) for _, _, r in panels if r["layers"]), default=1.0) or 1.0
    for ax, (model, attention, r) in zip(axes.flat, panels):
        js = np.array(r["js"])
        im = ax.imshow(js, cmap="magma_r", vmin=0.0, vmax=vmax)
        n = js.shape[0]
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        ax.set_xticklabels(range(1, n + 1))
        ax.set_yticklabels(range(1, n + 1))
        for i in range(n):
            for j in range(n):
                ax.text(j, i, f"{js[i, j]:.2g}", ha="center", va="center", fontsize=7,
                        color="white" if js[i, j] > 0.6 * vmax else "black")
        ax.set_title(f"{model}\n{attention}", fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel("layer")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.8, label="JS divergence (nats)")
    return _save(fig, out)


def plot_curves(runs: Mapping[str, Mapping[str, List[dict]]], out: str = "curves.png") -> str:
    """``runs``: ``{name: curves.parse_log(log)}``. Left: training loss per logging interval
    (line) and per epoch (circles), validation loss (squares), against updates; right, when a
    run logged it (``--eval-bleu``): validation BLEU."""
    with_bleu = any("bleu" in r for rec in runs.values() for tag, rs in rec.items()
                    if tag not in ("train", "train_inner") for r in rs)
    fig, axes = plt.subplots(1, 2 if with_bleu else 1, squeeze=False, layout="constrained",
                             figsize=(11 if with_bleu else 6.5, 4.2))
    loss_ax = axes[0][0]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (name, records) in enumerate(runs.items()):
        colour = colours[k % len(colours)]

        def points(tag, key):
            rs = [r for r in records.get(tag, []) if key in r and "num_updates" in r]
            return [r["num_updates"] for r in rs], [r[key] for r in rs]

        x, y = points("train_inner", "loss")
        if x:
            loss_ax.plot(x, y, color=colour, alpha=0.45, linewidth=1, label=f"{name}: train")
        x, y = points("train", "loss")
        if x:
            loss_ax.plot(x, y, "o", color=colour, markersize=4,
                         label=f"{name}: train, per epoch")
        for tag in records:
            if tag in ("train", "train_inner"):
                continue
            x, y = points(tag, "loss")
            if x:
                loss_ax.plot(x, y, "s--", color=colour, markersize=4, label=f"{name}: {tag}")
            x, y = points(tag, "bleu")
            if x and with_bleu:
                axes[0][1].plot(x, y, "s-", color=colour, markersize=4, label=f"{name}: {tag}")
    for ax in axes[0]:
        ax.xaxis.get_major_locator().set_params(integer=True)
    loss_ax.set_xlabel("updates")
    loss_ax.set_ylabel("loss (base 2)")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=7)
    if with_bleu:
        ax = axes[0][1]
        ax.set_xlabel("updates")
        ax.set_ylabel("validation BLEU (--eval-bleu)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out)
