"""Figures of numbers (matplotlib, Agg backend, as :mod:`.plots`):

* :func:`plot_entropy` -- entropy per layer of several models on one figure.
* :func:`plot_js` -- the layer-by-layer Jensen-Shannon divergence matrices.
* :func:`plot_curves` -- learning curves of fairseq-train runs (:mod:`.curves`).
"""
import math
from typing import List, Mapping

import numpy as np

from . import ATTENTIONS, plots
from .plots import plt


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
            ax.plot(layers, r[metric], marker="o", label=plots._label_text(model))
        ax.set_title(attention)
        ax.set_xlabel("layer")
        ax.set_ylabel(f"{metric} (nats)" if metric == "entropy" else metric)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    return plots._save(fig, out)


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
        ax.set_title(f"{plots._label_text(model)}\n{attention}", fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel("layer")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.8, label="JS divergence (nats)")
    return plots._save(fig, out)


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
        colour, name = colours[k % len(colours)], plots._label_text(name)

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
    return plots._save(fig, out)
