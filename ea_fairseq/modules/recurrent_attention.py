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
import contextlib
import math
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.modules.fairseq_dropout import FairseqDropout
from fairseq.modules.quant_noise import quant_noise
from torch import Tensor

from .attention_maps import AttentionMechanism


def full_precision(device: torch.device):
    """A region where autocast is off: the ops inside compute in their inputs' dtype."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


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
        self._this_pass: Optional[Tuple[Tensor, ...]] = None  # A_1 .. A_n during a pass

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

    @contextlib.contextmanager
    def shared_for_pass(self, rows: int, incremental_state=None):
        """Compute ``A_1 .. A_n`` once for one forward pass of the stack (:meth:`forward`)
        and let its RAN layers read theirs (:meth:`layer`) until the pass ends; nothing
        (no autograd graph) outlives it."""
        self._this_pass = self(rows, incremental_state)
        try:
            yield
        finally:
            self._this_pass = None

    def layer(self, index: int) -> Tensor:
        """``A_(index + 1)``, (H, rows, L) in float32 or wider, of the pass under way."""
        if self._this_pass is None:
            raise RuntimeError(
                "RAN attention runs inside its encoder's or decoder's forward pass, which "
                "computes the stack's attention matrices; call the stack, not a layer alone "
                "(or wrap the call in the stack's attention_scope())."
            )
        return self._this_pass[index]

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


def sentence_positions(padding_mask: Optional[Tensor], length: int, device) -> Tensor:
    """0-based position of each token within its own sentence, (batch or 1, length).

    Padding is skipped as in fairseq's ``make_positions``; padded slots get position 0
    (they are masked as keys, and their query rows are never used).
    """
    if padding_mask is None:
        return torch.arange(length, device=device).unsqueeze(0)
    real = (~padding_mask.to(torch.bool)).long()
    return (real.cumsum(dim=1) - 1).clamp(min=0)


def sentence_logits(square: Tensor, padding_mask: Tensor) -> Tensor:
    """``A[pos_i, pos_j]`` at ``(i, j)`` of each sentence (B, H, T, T) from ``square`` = the
    first T rows and columns of ``A`` (H, T, T), with positions counted per sentence
    (:func:`sentence_positions`); zero at padded slots' rows and columns.

    With ``P`` (B, T, T) mapping each real slot to its position (one-hot rows, zero rows
    for padding) this is ``P A P^T``: exact (``P`` is 0/1, ``A`` finite, float32 matmuls
    without TF32, PyTorch's default), computed without autocast, and its backward is two
    matrix products per sentence -- the sum over the batch in ``A``'s dtype, no scatter.
    """
    length = square.size(-1)
    slots_to_positions = (
        sentence_positions(padding_mask, length, square.device)[:, :, None]
        == torch.arange(length, device=square.device)
    ) & ~padding_mask.to(torch.bool)[:, :, None]
    p = slots_to_positions.to(square.dtype).unsqueeze(1)  # (B, 1, T, T)
    with full_precision(square.device):
        return torch.matmul(torch.matmul(p, square), p.transpose(-1, -2))


@with_incremental_state
class RecurrentAttention(AttentionMechanism, nn.Module):
    """Self-attention with input-independent weights ``softmax(A_l)`` (RAN Eqs. 2-4).

    Only the value and output projections: no query or key projection. Their names in the
    state dict, their initialisation and the attention dropout are those of fairseq's
    ``MultiheadAttention``; the softmax, dropout (or DropAttention) and value product are
    the plugin's shared ones (:class:`~ea_fairseq.modules.attention_maps.AttentionMechanism`).
    """

    self_attention = True
    encoder_decoder_attention = False

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 causal: bool = False, q_noise: float = 0.0, qn_block_size: int = 8,
                 ran_index: int = 0):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != embed_dim:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        # fairseq's module name, so that --retain-dropout-modules MultiheadAttention covers it
        self.dropout_module = FairseqDropout(dropout, module_name="MultiheadAttention")
        self.v_proj = quant_noise(nn.Linear(embed_dim, embed_dim, bias=bias), q_noise, qn_block_size)
        self.out_proj = quant_noise(nn.Linear(embed_dim, embed_dim, bias=bias), q_noise, qn_block_size)
        self.causal = causal
        self.ran_index = ran_index  # this layer attends with A_(ran_index + 1) of its stack
        self.share_matrices(None)  # the stack's, handed over when the stack is built
        self.init_mechanism()
        self.reset_parameters()

    def share_matrices(self, matrices: Optional[RecurrentAttentionMatrices]) -> None:
        """Read ``A_l`` from the stack's matrices, which the stack owns: a reference held
        outside this module's submodules, so the matrices are in the state dict (and
        converted by ``.to()``/``.half()``) once, under the stack, not once per layer."""
        object.__setattr__(self, "matrices", matrices)

    def reset_parameters(self) -> None:
        """fairseq's ``MultiheadAttention.reset_parameters`` for these two projections."""
        nn.init.xavier_uniform_(self.v_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        if self.out_proj.bias is not None:
            nn.init.constant_(self.out_proj.bias, 0.0)

    def _get_input_buffer(self, incremental_state):
        """The cache, under the name fairseq's decoder layer asks every self-attention for."""
        return self.get_mechanism_state(incremental_state)

    def causal_weights(self, matrix: Tensor, rows: int, incremental_state, dtype: torch.dtype) -> Tensor:
        """``softmax`` of rows of ``A_l`` over the keys up to their own position, at least
        the first ``rows`` (H, R, L), in ``dtype`` (the values').

        Decoding without autograd reads a step's attention weights from here: they depend
        on the position only, so a decoding run keeps them in its incremental state and
        computes them again only for rows the stack's matrices gained since.
        """
        kept = self.get_incremental_state(incremental_state, "causal_weights")
        weights = None if kept is None else kept["weights"]
        have = 0 if weights is None else weights.size(1)
        if have < rows:
            positions = torch.arange(matrix.size(-1), device=matrix.device)
            future = positions[None, :] > positions[have : matrix.size(1), None]
            more = torch.softmax(matrix[:, have:].masked_fill(future, float("-inf")), dim=-1,
                                 dtype=torch.promote_types(matrix.dtype, torch.float32)).to(dtype)
            weights = more if weights is None else torch.cat([weights, more], dim=1)
            self.set_incremental_state(incremental_state, "causal_weights", {"weights": weights})
        return weights

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None,
                need_weights: bool = True, static_kv: bool = False, attn_mask=None,
                before_softmax: bool = False, need_head_weights: bool = False):
        tgt_len, bsz, _ = query.size()
        heads, head_dim = self.num_heads, self.head_dim
        v = self.v_proj(query).view(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)
        if self.matrices is None:
            raise RuntimeError("RAN attention reads its stack's matrices: build it in an encoder or "
                               "decoder of this plugin (which calls share_matrices()), not alone.")
        matrix = self.matrices.layer(self.ran_index)  # (H, rows, L), >= fp32

        if incremental_state is not None:
            state = self.get_mechanism_state(incremental_state)
            earlier = state.get("prev_value")
            start = 0 if earlier is None else earlier.size(2)
            if earlier is not None:
                v = torch.cat([earlier, v], dim=2)
            state["prev_value"] = v
            self.set_mechanism_state(incremental_state, state)
            src_len = v.size(2)
            if (self.causal and key_padding_mask is None and not torch.is_grad_enabled()
                    and not self.training and not (need_weights or need_head_weights or before_softmax)):
                # a decoding step: the weights of these positions are fixed rows of the
                # stack's matrices; no logits, masks or softmax per step and sentence
                weights = self.causal_weights(matrix, start + tgt_len, incremental_state, v.dtype)
                out = torch.matmul(weights[:, start : start + tgt_len, :src_len], v)  # shared by the batch
                return self.out_proj(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, self.embed_dim)), None
            logits = matrix[:, start : start + tgt_len, :src_len].unsqueeze(0).expand(bsz, -1, -1, -1)
            if self.causal and tgt_len > 1:
                q_pos = torch.arange(start, start + tgt_len, device=query.device)
                future = torch.arange(src_len, device=query.device)[None, :] > q_pos[:, None]
                logits = logits.masked_fill(future, float("-inf"))
        else:
            src_len = tgt_len
            square = matrix[:, :tgt_len, :tgt_len]
            if key_padding_mask is None:
                # nothing padded: every token's position is its index, a plain slice (whose
                # backward is a sum over the batch)
                logits = square.unsqueeze(0).expand(bsz, -1, -1, -1)
            else:
                logits = sentence_logits(square, key_padding_mask)  # (B, H, T, S)
            if attn_mask is not None:  # fairseq's future mask for the decoder (-inf above)
                logits = logits + attn_mask.to(logits.dtype)
        if key_padding_mask is not None:
            logits = logits.masked_fill(key_padding_mask.to(torch.bool)[:, None, None, :], float("-inf"))
        self.report_maps(lambda: {"recurrent": logits.masked_fill(torch.isneginf(logits), 0.0)}, None)
        if before_softmax:
            return logits.reshape(bsz * heads, tgt_len, src_len), v.reshape(bsz * heads, src_len, head_dim)

        # float32 logits and softmax; the weights meet the values in the values' dtype
        return self.attend_with(logits, v.reshape(bsz * heads, src_len, head_dim), bsz, tgt_len,
                                need_weights, need_head_weights)
