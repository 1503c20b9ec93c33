"""Recurrent AtteNtion (RAN), RAN paper §2 (Eqs. 3-4), replacing dot-product self-attention.

A stack (encoder or decoder) owns learnable *Initial Attention Matrices* ``A_0`` of shape
``heads x L x L`` (``L = --ran-max-positions``) and one *Recurrent Transition Module*
shared by all heads and layers (:class:`RecurrentAttentionMatrices`)::

    Â_l = LN(tanh(W · A_(l-1) + b))      (Eq. 3; W acts along the key axis)
    A_l = Â_l + A_(l-1)                   (Eq. 4)

The l-th RAN layer of the stack attends with ``softmax(A_l[pos_q, pos_k] + masks)`` over
its value projection (:class:`RecurrentAttention`): no query/key projections, no
token-to-token products. As in the authors' code, the first RAN layer already uses
``A_1 = A_0 + Rec(A_0)``. Positions are counted per sentence the way fairseq's positional
embeddings count them (padding skipped), so left-padded sources index the matrices from
their first real token.

The matrices do not depend on the input. Row ``t`` of ``A_l`` depends only on row ``t``
of ``A_(l-1)``, so a full pass computes just the rows its longest sentence needs (with
autograd: the graph to ``A_0`` and the transition intact). Nothing derived from the
weights is kept between passes, so no change of the weights (an optimizer step, a
``load_state_dict``, or ``p.data`` surgery, which no version counter sees) can leave a
stale copy behind. A decoding run keeps the rows it computed, and each layer its causal
softmax of them, in fairseq's incremental state: computed at its first step (16 rows,
doubled whenever a step goes past them), reused by its later steps, gone with the run.

Precision. ``A_0``, ``W``, ``b`` and the layer norm get the largest gradients of the
model: each entry sums over every sentence of the batch, and the transition's also over
heads, rows and layers (ran_all_lite, a 1.5k-token batch: up to 1080 against at most 283
elsewhere; x128, fairseq's initial loss scale, far past fp16's 65504). So they stay in float32
whatever the model's dtype (``.half()``, ``.bfloat16()`` and ``.to(dtype)`` move them
but keep float32), ``A_l`` is computed in float32 with autocast off, the per-sentence
logits and their softmax are float32 -- the batch sum of their gradient is done in
float32 -- and the weights are cast to the values' dtype only for the value product.
fairseq's FP16Optimizer (float32 master copies) and MemoryEfficientFP16Optimizer (which
steps each parameter in float32 and writes it back in its own dtype) both take such a
model; :func:`mixed_precision_caveats` names the fairseq paths that do not.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor

from .position_attention import (PositionAttention, full_precision, matrix_logits,  # noqa: F401
                                 sentence_logits, sentence_positions)


@with_incremental_state
class RecurrentAttentionMatrices(nn.Module):
    """``A_0`` and the recurrent transition of one stack; yields ``A_1 .. A_n`` (Eqs. 3-4)."""

    #: rows a decoding run computes at its first step; doubled whenever a step needs more
    first_decoding_rows = 16

    def __init__(self, heads: int, max_positions: int, num_layers: int, fixed_init: bool = False,
                 layer_norm: bool = True, residual: bool = True):
        super().__init__()
        self.max_positions = max_positions
        self.num_layers = num_layers
        self.residual = residual
        # A_0, "randomly initialized and trained together with other model parameters"
        self.initial = nn.Parameter(torch.empty(heads, max_positions, max_positions),
                                    requires_grad=not fixed_init)
        nn.init.xavier_uniform_(self.initial)
        self.transition = nn.Linear(max_positions, max_positions)  # W, b of Eq. 3
        self.layer_norm = nn.LayerNorm(max_positions) if layer_norm else None

    def _apply(self, fn, recurse=True):
        """Every conversion of the model applies, except to a dtype below float32 (see the
        module docstring): ``.half()`` moves these tensors to the target's device and keeps
        them in float32 (from the original values, not a rounded copy)."""
        def at_least_float32(t: Tensor) -> Tensor:
            converted = fn(t)
            if converted.is_floating_point() and converted.dtype.itemsize < 4:
                return t.to(device=converted.device, dtype=torch.promote_types(t.dtype, torch.float32))
            return converted

        return super()._apply(at_least_float32, recurse)

    def provided_names(self) -> List[str]:
        """The names under which a pass of the stack hands each RAN layer its ``A_l``."""
        return [f"ran:{k}" for k in range(self.num_layers)]

    def pass_values(self, length: int, incremental_state=None):
        """``A_1 .. A_n`` of a pass over ``length`` positions, by name (:meth:`forward`)."""
        return dict(zip(self.provided_names(), self(length, incremental_state)))

    def step(self, previous: Tensor) -> Tensor:
        """One application of the Recurrent Transition Module, Eqs. 3-4."""
        update = torch.tanh(self.transition(previous))
        if self.layer_norm is not None:
            update = self.layer_norm(update)
        return update + previous if self.residual else update

    def compute(self, rows: Optional[int] = None, first: int = 0) -> Tuple[Tensor, ...]:
        """Rows ``first:rows`` (default: all) of every ``A_l``, in the parameters' dtype
        whatever autocast region encloses the call."""
        initial = self.initial if torch.is_grad_enabled() else self.initial.detach()
        with full_precision(initial.device):
            a = initial[:, first:rows]  # (without autograd: no view that claims to need a grad)
            out = []
            for _ in range(self.num_layers):
                a = self.step(a)
                out.append(a)
        return tuple(out)

    def forward(self, rows: int, incremental_state=None) -> Tuple[Tensor, ...]:
        """The matrices of every RAN layer, at least their first ``rows`` query rows.

        A full pass (no ``incremental_state``) computes exactly those rows. A decoding run
        keeps what it computed in its incremental state (not batch-first, so no beam
        reorder touches it) and computes further rows only when a step goes past them.
        """
        if rows > self.max_positions:
            raise ValueError(
                f"RAN attention got a sequence of {rows} positions but its attention matrices "
                f"cover {self.max_positions}; raise --ran-max-positions (the paper uses 256 "
                "with sentences of at most 256 tokens) or filter longer sentences with "
                "--max-source-positions / --max-target-positions."
            )
        if incremental_state is None:
            return self.compute(rows)
        kept = self.get_incremental_state(incremental_state, "matrices")
        have = 0 if kept is None else kept["0"].size(1)
        if have >= rows:
            return tuple(kept[str(i)] for i in range(self.num_layers))
        stop = min(self.max_positions, max(rows, 2 * have, self.first_decoding_rows))
        matrices = self.compute(stop, first=have)
        if kept is not None:
            matrices = tuple(torch.cat([kept[str(i)], m], dim=1) for i, m in enumerate(matrices))
        self.set_incremental_state(incremental_state, "matrices",
                                   {str(i): m for i, m in enumerate(matrices)})
        return matrices


def mixed_precision_caveats(args) -> List[str]:
    """Where fairseq's mixed-precision training assumes one dtype for all parameters, which
    a model with RAN's float32 matrices in an fp16/bf16 model breaks (for a warning)."""
    flags = ("fp16", "bf16", "memory_efficient_fp16", "memory_efficient_bf16")
    if not any(getattr(args, f, False) for f in flags):
        return []
    notes = []
    if getattr(args, "ddp_backend", None) == "legacy_ddp" and getattr(args, "distributed_world_size", 1) > 1:
        notes.append("--ddp-backend legacy_ddp all-reduces every gradient through one buffer of the "
                     "first parameter's dtype (fp16/bf16), where RAN's float32 gradients can overflow "
                     "again; use the default --ddp-backend pytorch_ddp.")
    if getattr(args, "memory_efficient_fp16", False) or getattr(args, "memory_efficient_bf16", False):
        from fairseq import utils

        if utils.multi_tensor_l2norm_available:
            notes.append("with apex installed, fairseq's gradient norm uses apex's multi_tensor_l2norm, "
                         "which reads every gradient in the first one's dtype and would misread RAN's "
                         "float32 gradients; use --fp16/--bf16 (float32 master copies) instead of "
                         "--memory-efficient-fp16/bf16.")
    return notes


class RecurrentAttention(PositionAttention):
    """Self-attention with input-independent weights ``softmax(A_l)`` (RAN Eqs. 2-4).

    The value and output projections, their initialisation and the attention dropout
    are those of fairseq's ``MultiheadAttention``, the softmax, dropout (or
    DropAttention) and value product the plugin's shared ones
    (:class:`~ea_fairseq.modules.position_attention.PositionAttention`); ``A_l`` is read
    from the stack's matrices.
    """

    map_name = "recurrent"

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 causal: bool = False, q_noise: float = 0.0, qn_block_size: int = 8,
                 ran_index: int = 0, **options):
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, causal=causal,
                         q_noise=q_noise, qn_block_size=qn_block_size, **options)
        self.ran_index = ran_index  # this layer attends with A_(ran_index + 1) of its stack
        self.share_matrices(None)  # the stack's, handed over when the stack is built

    def carried_names(self):
        return (f"ran:{self.ran_index}",), ()

    @classmethod
    def stack_shared(cls, modules, cfg, heads: int):
        """The stack's matrices (``A_0`` and the transition), one ``A_l`` per RAN layer, in
        the order the stack built them."""
        matrices = RecurrentAttentionMatrices(
            heads, cfg.ran_max_positions, len(modules), fixed_init=cfg.ran_fixed_init,
            layer_norm=not cfg.ran_no_layernorm, residual=not cfg.ran_no_residual)
        for module in modules:
            module.share_matrices(matrices)
        return "recurrent_matrices", matrices

    def share_matrices(self, matrices: Optional[RecurrentAttentionMatrices]) -> None:
        """The stack's matrices, whose ``A_(ran_index + 1)`` the stack hands this layer in every
        pass: a reference held outside this module's submodules, so the matrices are in the
        state dict (and converted by ``.to()``/``.half()``) once, under the stack."""
        object.__setattr__(self, "matrices", matrices)

    def causal_weights(self, matrix: Tensor, rows: int, incremental_state, dtype: torch.dtype) -> Tensor:
        """``softmax`` of rows of ``A_l`` over the keys up to their own position, at least
        the first ``rows`` (H, R, L), in ``dtype`` (the values').

        Decoding without autograd reads a step's attention weights from here: they depend
        on the position only, so a decoding run keeps them in its incremental state and
        computes them again only for rows the stack's matrices gained since.
        """
        memo = self.cache(incremental_state).memo
        weights = memo.get("causal_weights")
        have = 0 if weights is None else weights.size(1)
        if have < rows:
            positions = torch.arange(matrix.size(-1), device=matrix.device)
            future = positions[None, :] > positions[have : matrix.size(1), None]
            more = torch.softmax(matrix[:, have:].masked_fill(future, float("-inf")), dim=-1,
                                 dtype=torch.promote_types(matrix.dtype, torch.float32)).to(dtype)
            weights = more if weights is None else torch.cat([weights, more], dim=1)
            memo["causal_weights"] = weights
        return weights

    def matrix(self) -> Tensor:
        """``A_l`` of this layer, (H, rows, L) in float32 or wider: the stack computes the
        matrices of a pass when it opens it and hands each RAN layer its own."""
        matrix = self.previous_map(f"ran:{self.ran_index}")
        if matrix is None:
            raise RuntimeError(
                "RAN attention reads the matrix its stack computes in each forward pass and hands each "
                "RAN layer: build it in an encoder or decoder of this plugin and call the stack, not a "
                "layer or an attention alone.")
        return matrix

    def position_logits(self, query_positions, key_positions, padding_mask, start, dtype):
        """``A_l[pos_i, pos_j]`` of this layer's matrix (float32 or wider)."""
        matrix = self.matrix()
        one_hot = None if padding_mask is None else self.pass_one_hot(padding_mask, query_positions, matrix.dtype)
        return matrix_logits(matrix, query_positions.size(-1), key_positions.size(-1), padding_mask, start,
                             query_positions, one_hot)

    def decoding_step_weights(self, start: int, tgt_len: int, src_len: int, incremental_state,
                              dtype: torch.dtype) -> Tensor:
        """The weights of a decoding step: rows of the causal softmax of ``A_l``."""
        weights = self.causal_weights(self.matrix(), start + tgt_len,
                                      incremental_state, dtype)
        return weights[:, start : start + tgt_len, :src_len]
