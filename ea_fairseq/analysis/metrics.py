"""Layer-wise metrics of attention maps.

Every function takes attention *weights* (probabilities, rows summing to 1) with the
distribution on the last axis. Logarithms are natural (nats).

* :func:`attention_entropy` -- RAN paper Eq. (5), ``E = -sum_i A(x_t, x_i) log A(x_t, x_i)``
  per query ``x_t``; a layer's value averages it over heads and (non-padding) queries.
* :func:`js_divergence` -- Jensen-Shannon divergence (Lin, 1991) between the same query's
  distributions in two layers (RAN paper Fig. 7); between 0 and log 2.
* :func:`head_div` -- DropAttention Eq. (11), ``Div = ||A A^T - I||_F^2`` where row ``i``
  of ``A`` (heads x keys) is head ``i``'s attention vector for one query.
* :func:`head_disagreement` -- DropAttention Eq. (12),
  ``(1/h^2) sum_i sum_j A_i·A_j / (|A_i| |A_j|)``: the mean cosine similarity over all
  ordered head pairs *including* ``i = j``, as the equation is written (so 1/h for
  mutually orthogonal heads, 1 for identical heads). As the paper notes, larger Div and
  Disagreement mean *less* diverse heads.

:class:`LayerMetrics` accumulates them over batches, ignoring padded queries.
"""
import itertools
import logging
import math
import sys
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

import torch
from torch import Tensor

METRICS = ("entropy", "div", "disagreement")
JS_MODES = ("mean", "paired")


def attention_entropy(p: Tensor) -> Tensor:
    """RAN Eq. (5) over the last axis (``0 log 0 = 0``)."""
    p = p.double() if p.dtype == torch.float64 else p.float()
    return -torch.special.xlogy(p, p).sum(-1)


def js_divergence(p: Tensor, q: Tensor) -> Tensor:
    """Jensen-Shannon divergence over the last axis, in nats (``0 <= JS <= log 2``)."""
    p, q = p.float(), q.float()
    m = 0.5 * (p + q)
    kl_pm = (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)).sum(-1)
    kl_qm = (torch.special.xlogy(q, q) - torch.special.xlogy(q, m)).sum(-1)
    return (0.5 * (kl_pm + kl_qm)).clamp(min=0.0)


def head_div(a: Tensor) -> Tensor:
    """DropAttention Eq. (11) for ``a`` of shape (..., heads, keys): ``||A A^T - I||_F^2``."""
    a = a.float()
    gram = a @ a.transpose(-1, -2)
    eye = torch.eye(a.size(-2), dtype=a.dtype, device=a.device)
    return (gram - eye).pow(2).sum((-1, -2))


def head_disagreement(a: Tensor, eps: float = 1e-12) -> Tensor:
    """DropAttention Eq. (12) for ``a`` of shape (..., heads, keys)."""
    a = a.float()
    unit = a / a.norm(dim=-1, keepdim=True).clamp(min=eps)
    h = a.size(-2)
    return (unit @ unit.transpose(-1, -2)).sum((-1, -2)) / (h * h)


class LayerMetrics:
    """Accumulates per-layer metrics of one attention (e.g. ``encoder.self``) over batches.

    :meth:`update` takes the layers' weights, each (batch, heads, queries, keys), and a
    (batch, queries) mask of the real (non-padding) queries. Every metric is a mean over
    all real queries of the data (and over heads for entropy): sentences weigh by length.
    """

    def __init__(self, js_mode: str = "mean"):
        if js_mode not in JS_MODES:
            raise ValueError(f"js_mode must be one of {JS_MODES}, got {js_mode!r}")
        self.js_mode = js_mode
        self.layers = 0
        self.heads = 0
        self.queries = 0
        self.sums: Dict[str, List[float]] = {m: [] for m in METRICS}
        self.head_entropy: List[List[float]] = []
        self.js_sum: List[List[float]] = []

    def _start(self, layers: int, heads: int) -> None:
        self.layers, self.heads = layers, heads
        self.sums = {m: [0.0] * layers for m in METRICS}
        self.head_entropy = [[0.0] * heads for _ in range(layers)]
        self.js_sum = [[0.0] * layers for _ in range(layers)]

    @torch.no_grad()
    def update(self, weights: Sequence[Tensor], query_mask: Optional[Tensor] = None) -> None:
        if not weights:
            return
        bsz, heads, tgt, _ = weights[0].shape
        if self.layers == 0:
            self._start(len(weights), heads)
        elif (len(weights), heads) != (self.layers, self.heads):
            raise ValueError(
                f"got {len(weights)} layers x {heads} heads, expected {self.layers} x {self.heads}"
            )
        if query_mask is None:
            query_mask = torch.ones(bsz, tgt, dtype=torch.bool, device=weights[0].device)
        mask = query_mask.to(torch.bool)
        n = int(mask.sum())
        if n == 0:
            return
        self.queries += n
        per_query = []  # (n, heads, keys) per layer
        for i, w in enumerate(weights):
            rows = w.permute(0, 2, 1, 3)[mask]  # (n, heads, keys)
            per_query.append(rows)
            ent = attention_entropy(rows)  # (n, heads)
            self.sums["entropy"][i] += float(ent.sum())
            for h, v in enumerate(ent.sum(0).tolist()):
                self.head_entropy[i][h] += v
            self.sums["div"][i] += float(head_div(rows).sum())
            self.sums["disagreement"][i] += float(head_disagreement(rows).sum())
        for i, j in itertools.combinations(range(len(weights)), 2):
            if self.js_mode == "mean":
                js = js_divergence(per_query[i].mean(1), per_query[j].mean(1)).sum()
            else:
                js = js_divergence(per_query[i], per_query[j]).mean(1).sum()
            self.js_sum[i][j] += float(js)
            self.js_sum[j][i] += float(js)

    def result(self) -> Dict[str, object]:
        q = max(self.queries, 1)
        return {
            "layers": self.layers,
            "heads": self.heads,
            "queries": self.queries,
            "entropy": [s / (q * self.heads) for s in self.sums["entropy"]],
            "entropy_per_head": [[s / q for s in row] for row in self.head_entropy],
            "div": [s / q for s in self.sums["div"]],
            "disagreement": [s / q for s in self.sums["disagreement"]],
            "js": [[s / q for s in row] for row in self.js_sum],
            "js_mode": self.js_mode,
        }


class ModelMetrics:
    """:class:`LayerMetrics` for every attention of a model (``encoder.self`` ...)."""

    def __init__(self, js_mode: str = "mean"):
        self.js_mode = js_mode
        self.attentions: Dict[str, LayerMetrics] = {}

    def update(self, weights: Mapping[str, Sequence[Tensor]], query_masks: Mapping[str, Tensor]) -> None:
        for name, layers in weights.items():
            if name not in self.attentions:
                self.attentions[name] = LayerMetrics(self.js_mode)
            self.attentions[name].update(layers, query_masks.get(name))

    def result(self) -> Dict[str, Dict[str, object]]:
        return {name: m.result() for name, m in sorted(self.attentions.items(), key=_attention_order)}


def _attention_order(item):
    order = {"encoder.self": 0, "decoder.self": 1, "decoder.cross": 2}
    return order.get(item[0], 9), item[0]


def evaluate(model, task, dataset, hypothesis=False, beam=5, max_tokens=4000,
             max_sentences=None, limit=None, js_mode="mean", progress=True, desc="",
             max_len=(0.0, 200)):
    """Layer-wise metrics of ``model`` over ``dataset``, teacher-forced on the references
    (or on the best beam hypotheses), with a progress bar: ``{attention: result}``."""
    from tqdm import tqdm

    from .maps import (batch_indices, build_generator, capture, collate, query_masks, with_hypotheses,
                       within_positions)

    ids, skipped = within_positions(model, task, dataset, range(min(limit, len(dataset)) if limit else len(dataset)))
    if skipped:
        logging.getLogger(__name__).warning("%d sentences longer than the model's max_positions skipped",
                                            len(skipped))
    groups = batch_indices(dataset, ids, max_tokens, max_sentences)
    generator = build_generator(task, model, beam, *max_len) if hypothesis else None
    acc = ModelMetrics(js_mode)
    pad = task.target_dictionary.pad()
    for indices in tqdm(groups, desc=desc or "attention metrics", unit="batch", disable=not progress,
                        file=sys.stderr):
        sample = collate(dataset, indices)
        if generator is not None:
            sample = with_hypotheses(sample, generator, task)
        maps = capture(model, sample, mechanism_maps=False)
        acc.update({a: k["weights"] for a, k in maps.items() if "weights" in k},
                   query_masks(sample, pad))
    return acc.result()


# -- reports ---------------------------------------------------------------------------
def layer_rows(results: Mapping[str, Mapping[str, Mapping[str, object]]]) -> List[Dict[str, object]]:
    """Long-form rows ``model, attention, layer, entropy, div, disagreement``."""
    rows = []
    for model, attentions in results.items():
        for attention, r in attentions.items():
            for layer in range(r["layers"]):
                rows.append({
                    "model": model, "attention": attention, "layer": layer + 1,
                    "entropy": r["entropy"][layer], "div": r["div"][layer],
                    "disagreement": r["disagreement"][layer],
                })
    return rows


def js_rows(results) -> List[Dict[str, object]]:
    rows = []
    for model, attentions in results.items():
        for attention, r in attentions.items():
            for i in range(r["layers"]):
                for j in range(r["layers"]):
                    rows.append({"model": model, "attention": attention, "layer_a": i + 1,
                                 "layer_b": j + 1, "js": r["js"][i][j]})
    return rows


#: how to read the numbers, printed under them (docs/analysis.md, "metrics")
CAVEATS = (
    "How to read them: entropy is RAN's Eq. 5 in nats, over real queries, averaged over heads "
    "(log(keys) for uniform attention, so it grows with sentence length: compare models on the "
    "same set). Div = ||AA^T - I||_F^2 (DropAttention Eq. 11 as written) is dominated by its "
    "diagonal for spread-out attention and is not on the paper's scale: compare it between "
    "models, not with the paper. Disagreement (Eq. 12) sums over i = j too: larger means LESS "
    "diverse heads. JS divergence is at most log 2 = 0.6931; 0 on the diagonal."
)


def markdown(results, digits: int = 4) -> str:
    from tabulate import tabulate

    out = []
    table = [[r["model"], r["attention"], r["layer"], r["entropy"], r["div"], r["disagreement"]]
             for r in layer_rows(results)]
    out.append(tabulate(table, headers=["model", "attention", "layer", "entropy (nats)", "Div",
                                        "Disagreement"],
                        tablefmt="github", floatfmt=f".{digits}f"))
    out += ["", CAVEATS]
    for model, attentions in results.items():
        for attention, r in attentions.items():
            n = r["layers"]
            out.append("")
            out.append(f"Jensen-Shannon divergence between layers, {model} {attention} "
                       f"({r['js_mode']} over heads, nats, max log 2 = {math.log(2):.4f}):")
            out.append("")
            table = [[f"L{i + 1}"] + list(r["js"][i]) for i in range(n)]
            out.append(tabulate(table, headers=[""] + [f"L{j + 1}" for j in range(n)],
                                tablefmt="github", floatfmt=f".{digits}f"))
    return "\n".join(out) + "\n"


def write_csv(path: str, rows: Iterable[Mapping[str, object]]) -> None:
    import csv

    from ..safety.writers import replaced

    rows = list(rows)
    with replaced(path, "w", newline="") as f:
        if not rows:
            return
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
