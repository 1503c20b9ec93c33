"""Parameters and FLOPs of a built model, counted analytically from its modules.

The count walks the encoder and the decoder of a fairseq encoder-decoder model and asks
a *counter* for each module it meets (:func:`register_counter`); a counter returns
:class:`Counts`, the work of one forward pass of one sentence of ``src_len`` source and
``tgt_len`` target tokens (teacher-forced; every query sees all its keys, the causal
decoder map is counted in full, as the dense kernels compute it). Nothing is hard-coded
per architecture: a new mechanism (PA, RAN, ...) registers a counter for its attention
class and is counted wherever it is used.

Work is kept in categories (:data:`CATEGORIES`); a :class:`Convention` weighs them.
``table5`` is the convention that reproduces EA Table 5: FLOPs are twice the
*multiplications* of the forward pass -- multiply-accumulates of matrix products and
convolutions, elementwise multiplications, one per layer-norm element and one per
attention weight fairseq averages over heads -- while additions, softmax, activations,
embeddings and the output projection onto the vocabulary are free. These are the counts
of a multiplication-counting profiler such as ``torchprofile`` (from the authors of
Lite Transformer, whose Transformer-Lite Table 5 uses), doubled. See
``docs/analysis.md`` for how each Table 5 entry compares.
"""
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch.nn as nn
from fairseq.modules import LearnedPositionalEmbedding, MultiheadAttention, SinusoidalPositionalEmbedding

from ea_ops.map_conv import AttentionMapConv
from ..modules.attention_maps import LogitMapAttention
from ..modules.evolving_attention import EvolvingAttention
from ..modules.long_short_range_attention import LightweightConvBranch
from ..modules.predictive_attention import PredictiveAttention
from ..modules.position_attention import PositionAttention
from ..modules.recurrent_attention import RecurrentAttentionMatrices
from ..modules.value_residual import ValueResidualProjection

#: kinds of work a counter reports (all as multiply counts)
CATEGORIES: Dict[str, str] = {
    "linear": "multiply-accumulates of linear layers (weights only; bias additions free)",
    "attention": "multiply-accumulates of the attention products QK^T and AV",
    "map_conv": "multiply-accumulates of convolutions over attention maps (full k x k kernel)",
    "sequence_conv": "multiply-accumulates of convolutions over the sequence (LSRA's lightweight "
                     "convolution: k per channel and position)",
    "elementwise": "elementwise multiplications (query scaling, embedding scale, map mixing)",
    "norm": "layer-norm elements (one multiply each)",
    "weights_mean": "attention weights averaged over heads (fairseq returns them from every "
                    "decoder layer at inference)",
    "output_projection": "multiply-accumulates of the projection onto the vocabulary",
    "input_independent": "work that does not depend on the input (RAN's attention matrices "
                         "for the sentence's rows; a decoding run computes them once)",
}

#: parameter names that are not counted in "non-embedding" parameters (EA Table 5)
EMBEDDING_PARAMETERS = ("embed_tokens", "output_projection", "embed_positions")


@dataclass(frozen=True)
class Convention:
    name: str
    weights: Dict[str, float]
    description: str

    def flops(self, counts: "Counts") -> float:
        return sum(self.weights.get(k, 0.0) * v for k, v in counts.items())


CONVENTIONS: Dict[str, Convention] = {
    "table5": Convention(
        "table5",
        {k: 2.0 for k in ("linear", "attention", "map_conv", "sequence_conv", "elementwise", "norm",
                          "weights_mean")},
        "2 x multiplications: MACs of linear layers, attention products, map and sequence convolutions, "
        "elementwise multiplications, layer-norm elements, head-averaged attention weights; "
        "no embeddings, no output projection, additions/softmax/activations free",
    ),
    "matmul": Convention(
        "matmul",
        {k: 2.0 for k in ("linear", "attention", "map_conv", "sequence_conv")},
        "2 x MACs of matrix products and convolutions only (torch.utils.flop_counter's "
        "convention), no output projection",
    ),
}


class Counts(dict):
    """``{category: multiplications}`` that add up."""

    def add(self, category: str, amount: float) -> "Counts":
        if category not in CATEGORIES:
            raise KeyError(f"unknown FLOPs category {category!r}; known: {sorted(CATEGORIES)}")
        self[category] = self.get(category, 0) + amount
        return self

    def __iadd__(self, other):
        for k, v in other.items():
            self.add(k, v)
        return self


@dataclass
class Context:
    """Where a module sits: which stack, how many query and source tokens it sees."""

    stack: str  # "encoder" or "decoder"
    tokens: int  # positions this stack computes (queries of its self-attention)
    src_tokens: int  # encoder positions (keys of encoder-decoder attention)
    #: per-stack scratch space for counters (e.g. which slots already handed on a map)
    state: Dict[str, object] = field(default_factory=dict)


Counter = Callable[[nn.Module, Context, "Walker"], Counts]
_COUNTERS: Dict[type, Counter] = {}


def register_counter(cls: type):
    """Register ``fn(module, ctx, walker) -> Counts`` for ``cls`` and its subclasses
    (the most derived registration wins). A counter that wants its children counted
    generically calls ``walker.visit(child, ctx)``."""

    def wrap(fn: Counter) -> Counter:
        _COUNTERS[cls] = fn
        return fn

    return wrap


def counter_for(module: nn.Module) -> Optional[Counter]:
    for cls in type(module).__mro__:
        if cls in _COUNTERS:
            return _COUNTERS[cls]
    return None


class Walker:
    """Visits a module tree, dispatching to registered counters."""

    def __init__(self):
        #: modules with parameters of their own that no counter covered
        self.uncounted: List[str] = []

    def visit(self, module: nn.Module, ctx: Context, name: str = "") -> Counts:
        counter = counter_for(module)
        if counter is not None:
            return counter(module, ctx, self)
        counts = Counts()
        if any(True for _ in module.parameters(recurse=False)):
            self.uncounted.append(f"{ctx.stack}.{name} ({type(module).__name__})")
        for child_name, child in module.named_children():
            counts += self.visit(child, ctx, f"{name}.{child_name}" if name else child_name)
        return counts


# -- counters for the building blocks ------------------------------------------------------
@register_counter(nn.Linear)
def count_linear(module: nn.Linear, ctx: Context, walker: Walker) -> Counts:
    return Counts().add("linear", ctx.tokens * module.in_features * module.out_features)


@register_counter(nn.LayerNorm)
def count_layer_norm(module: nn.LayerNorm, ctx: Context, walker: Walker) -> Counts:
    return Counts().add("norm", ctx.tokens * math.prod(module.normalized_shape))


@register_counter(nn.Embedding)
@register_counter(LearnedPositionalEmbedding)
@register_counter(SinusoidalPositionalEmbedding)
def count_lookup(module, ctx, walker) -> Counts:
    return Counts()  # table lookups

def attention_shape(module: MultiheadAttention, ctx: Context) -> Tuple[int, int]:
    """(queries, keys) of an attention module in its context."""
    tgt = ctx.tokens
    src = tgt if module.self_attention or not module.encoder_decoder_attention else ctx.src_tokens
    src += int(getattr(module, "bias_k", None) is not None) + int(bool(getattr(module, "add_zero_attn", False)))
    return tgt, src


@register_counter(MultiheadAttention)
@register_counter(LogitMapAttention)
def count_attention(module: MultiheadAttention, ctx: Context, walker: Walker) -> Counts:
    """fairseq's attention: projections, QK^T, AV, query scaling, returned weights."""
    tgt, src = attention_shape(module, ctx)
    counts = Counts()
    for proj, tokens in ((module.q_proj, tgt), (module.k_proj, src), (module.v_proj, src),
                         (module.out_proj, tgt)):
        counts.add("linear", tokens * proj.in_features * proj.out_features)
    counts.add("attention", 2 * module.num_heads * tgt * src * module.head_dim)
    counts.add("elementwise", tgt * module.num_heads * module.head_dim)  # q *= scaling
    if module.encoder_decoder_attention:
        counts.add("weights_mean", tgt * src)
    counts += count_value_residual(module.v_proj, src, ctx)
    return counts


def count_value_residual(v_proj: nn.Module, tokens: int, ctx: Context) -> Counts:
    """ResFormer's λ1·V_1 + λ2·V_n: two products per value element, from the second layer
    of the stack on (the first hands its values on)."""
    counts = Counts()
    if isinstance(v_proj, ValueResidualProjection):
        handed_on = ctx.state.setdefault("values_handed_on", set())
        if v_proj.slot in handed_on:
            counts.add("elementwise", 2 * tokens * v_proj.out_features)
        handed_on.add(v_proj.slot)
    return counts


@register_counter(LightweightConvBranch)
def count_lightweight_conv(module: LightweightConvBranch, ctx: Context, walker: Walker) -> Counts:
    """LSRA's convolution branch: input and output linears, k taps per channel and position
    (the kernel's softmax is over H·k weights, free)."""
    counts = walker.visit(module.linear_in, ctx)
    counts += walker.visit(module.linear_out, ctx)
    return counts.add("sequence_conv", ctx.tokens * module.input_size * module.kernel_size)


def count_map_conv(conv: AttentionMapConv, tgt: int, src: int) -> Counts:
    """One convolution of a ``heads x tgt x src`` map to a map of the same size."""
    out_elements = conv.out_channels * tgt * src
    counts = Counts().add("map_conv", out_elements * conv.in_channels * math.prod(conv.kernel_size))
    if conv.layout == "causal":
        counts.add("elementwise", conv.weight.numel())  # the kernel's masked taps
    return counts


@register_counter(PredictiveAttention)
def count_predictive_attention(module: PredictiveAttention, ctx: Context, walker: Walker) -> Counts:
    """PA Eq. (4): fairseq's attention, then (after the first block) the prediction CNN
    on the previous block's logits and the α mix (two products per map entry)."""
    counts = count_attention(module, ctx, walker)
    if module.predictor is not None:
        tgt, src = attention_shape(module, ctx)
        for conv in module.predictor:
            counts += count_map_conv(conv, tgt, src)
        counts.add("elementwise", 2 * module.num_heads * tgt * src)
    return counts


@register_counter(PositionAttention)
def count_position_attention(module: PositionAttention, ctx: Context, walker: Walker) -> Counts:
    """RAN, HC-SA, Syn-R: no query/key projections and no QK^T; values, AV and the output
    projection (their logits do not depend on the input: no work per token)."""
    tgt = src = ctx.tokens
    counts = Counts()
    for proj in (module.v_proj, module.out_proj):
        counts.add("linear", tgt * proj.in_features * proj.out_features)
    counts.add("attention", module.num_heads * tgt * src * module.head_dim)
    counts += count_value_residual(module.v_proj, tgt, ctx)
    return counts


@register_counter(RecurrentAttentionMatrices)
def count_recurrent_matrices(module: RecurrentAttentionMatrices, ctx: Context, walker: Walker) -> Counts:
    """RAN Eqs. 3-4 for the rows one sentence needs (as a full pass computes them; a
    decoding run computes them once, for all its steps)."""
    heads, rows, width = module.initial.size(0), ctx.tokens, module.max_positions
    per_step = heads * rows * width * module.transition.in_features
    if module.layer_norm is not None:
        per_step += heads * rows * width
    return Counts().add("input_independent", module.num_layers * per_step)


@register_counter(EvolvingAttention)
def count_evolving_attention(module: EvolvingAttention, ctx: Context, walker: Walker) -> Counts:
    """EA Eq. (4): fairseq's attention, then the α skip connection (two products per map
    entry, from the second layer on: the first has no previous map), the convolution and
    the β mix (two products per entry). Counted from the equations, not from how a kernel
    evaluates them (``torch.lerp`` needs one product; a shifted convolution may compute
    border rows it crops)."""
    counts = count_attention(module, ctx, walker)
    tgt, src = attention_shape(module, ctx)
    entries = module.num_heads * tgt * src
    handed_on = ctx.state.setdefault("ea_handed_on", set())
    if module.alpha > 0.0 and module.slot in handed_on:
        counts.add("elementwise", 2 * entries)  # α·prev + (1-α)·cur
    if module.conv is not None:
        counts += count_map_conv(module.conv, tgt, src)
        counts.add("elementwise", 2 * entries)  # β·ReLU(conv) + (1-β)·A_input
    if module.hand_on_maps:
        handed_on.add(module.slot)
    return counts


# -- whole models ------------------------------------------------------------------------
def _stack_counts(stack: nn.Module, ctx: Context, walker: Walker) -> Counts:
    counts = Counts()
    embed_dim = getattr(getattr(stack, "embed_tokens", None), "embedding_dim", None)
    if embed_dim is not None and getattr(stack, "embed_scale", 1.0) not in (1.0, None):
        counts.add("elementwise", ctx.tokens * embed_dim)  # embed_scale * embed_tokens(x)
    for name, child in stack.named_children():
        if name == "output_projection":
            if child is not None:
                out = Counts().add(
                    "output_projection", ctx.tokens * child.in_features * child.out_features
                )
                counts += out
            continue
        counts += walker.visit(child, ctx, name)
    return counts


@dataclass
class ModelCount:
    name: str
    params: int  # non-embedding parameters
    counts: Dict[str, Counts]  # per stack
    uncounted: List[str]
    src_len: int
    tgt_len: int

    @property
    def total(self) -> Counts:
        total = Counts()
        for c in self.counts.values():
            total += c
        return total

    def flops(self, convention: str = "table5", with_output_projection: bool = False) -> float:
        conv = CONVENTIONS[convention]
        flops = conv.flops(self.total)
        if with_output_projection:
            flops += 2 * self.total.get("output_projection", 0)
        return flops


def non_embedding_params(model: nn.Module) -> int:
    """Parameters outside token embeddings, positions and the output projection (Table 5)."""
    return sum(
        p.numel() for n, p in model.named_parameters()
        if not any(part in n for part in EMBEDDING_PARAMETERS)
    )


def count_model(model: nn.Module, src_len: int = 30, tgt_len: int = 30, name: str = "") -> ModelCount:
    """Count one teacher-forced forward pass of ``src_len`` source / ``tgt_len`` target tokens."""
    walker = Walker()
    counts = {
        "encoder": _stack_counts(model.encoder, Context("encoder", src_len, src_len), walker),
        "decoder": _stack_counts(model.decoder, Context("decoder", tgt_len, src_len), walker),
    }
    return ModelCount(name, non_embedding_params(model), counts, walker.uncounted, src_len, tgt_len)


def plugin_architectures() -> List[str]:
    """fairseq's ``transformer`` plus every architecture this plugin registers."""
    from fairseq.models import ARCH_CONFIG_REGISTRY

    archs = [
        name for name, fn in ARCH_CONFIG_REGISTRY.items()
        if getattr(fn, "__module__", "").startswith("ea_fairseq.")
    ]
    return ["transformer"] + sorted(archs)


#: EA paper Table 5 (En-De FLOPs at 30 source / 30 target tokens), for comparison
PAPER_TABLE5: Dict[str, Tuple[str, float, float]] = {
    "transformer_lite": ("Transformer-Lite", 2.48e6, 158.31e6),
    "ea_transformer_lite": ("EA-Transformer-Lite", 2.49e6, 163.46e6),
    "transformer": ("Transformer-Base", 44.14e6, 2.68e9),
    "ea_transformer_base": ("EA-Transformer-Base", 44.15e6, 2.70e9),
}


def human(n: Optional[float], unit_digits: int = 2) -> str:
    """``158.31M`` / ``2.68G`` (the paper's format); '' for None."""
    if n is None:
        return ""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.{unit_digits}f}{suffix}"
    return f"{n:.0f}"


def report_rows(results: List[ModelCount], conventions: Iterable[str] = ("table5", "matmul"),
                with_output_projection: bool = False) -> List[Dict[str, object]]:
    rows = []
    for r in results:
        paper = PAPER_TABLE5.get(r.name)
        row = {
            "model": r.name,
            "paper_name": paper[0] if paper else "",
            "params": r.params,
            "paper_params": paper[1] if paper else None,
        }
        for conv in conventions:
            row[f"flops_{conv}"] = r.flops(conv, with_output_projection)
        row["paper_flops"] = paper[2] if paper else None
        rows.append(row)
    return rows


def _ordered(results: List[ModelCount]) -> List[ModelCount]:
    """Table 5's rows first, in the paper's order, then the others by name."""
    paper = list(PAPER_TABLE5)
    return sorted(results, key=lambda r: (paper.index(r.name) if r.name in paper else len(paper), r.name))


def _match(ours: float, paper: Optional[float]) -> str:
    """Does ``ours`` print as the paper's number? Else the difference in its unit."""
    if not paper:
        return ""
    if human(ours) == human(paper):
        return "yes"
    scale, unit = (1e9, "G") if abs(paper) >= 1e9 else (1e6, "M")
    return f"no ({(ours - paper) / scale:+.2f}{unit}, {100 * (ours / paper - 1):+.2f}%)"


def markdown_report(results: List[ModelCount], conventions: Iterable[str] = ("table5", "matmul"),
                    with_output_projection: bool = False) -> str:
    from tabulate import tabulate

    conventions = list(conventions)
    results = _ordered(results)
    rows = report_rows(results, conventions, with_output_projection)
    headers = ["architecture", "params (ours)", "params (paper)"]
    headers += [f"FLOPs {c} (ours)" for c in conventions] + ["FLOPs (paper)"]
    headers += [f"{c} = paper" for c in conventions]
    table = []
    for row in rows:
        name = row["model"] + (f" ({row['paper_name']})" if row["paper_name"] else "")
        table.append(
            [name, human(row["params"]), human(row["paper_params"])]
            + [human(row[f"flops_{c}"]) for c in conventions]
            + [human(row["paper_flops"])]
            + [_match(row[f"flops_{c}"], row["paper_flops"]) for c in conventions]
        )
    lens = {(r.src_len, r.tgt_len) for r in results}
    out = [tabulate(table, headers=headers, tablefmt="github"), ""]
    out.append(
        "Params: non-embedding (without " + ", ".join(EMBEDDING_PARAMETERS) + "). "
        + "FLOPs: one sentence of "
        + ", ".join(f"{s} source / {t} target tokens" for s, t in sorted(lens))
        + (", output projection included." if with_output_projection else ".")
    )
    for c in conventions:
        out.append(f"- `{c}`: {CONVENTIONS[c].description}.")
    fixed = [(r.name, r.total.get("input_independent", 0)) for r in results]
    fixed = [f"{n} {human(2 * v)}" for n, v in fixed if v]
    if fixed:
        out.append("- not in the FLOPs: input-independent attention matrices (RAN), computed once "
                   "per batch; 2 x their multiplications for the sentence's rows: " + ", ".join(fixed))
    uncounted = sorted({u for r in results for u in r.uncounted})
    if uncounted:
        out.append("- not counted (no counter registered): " + ", ".join(uncounted))
    return "\n".join(out) + "\n"


def breakdown(result: ModelCount) -> Dict[str, Dict[str, float]]:
    """``{stack: {category: multiplications}}`` for the JSON report."""
    return {stack: dict(c) for stack, c in result.counts.items()}
