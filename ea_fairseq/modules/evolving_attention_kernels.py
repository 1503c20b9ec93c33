"""Fused CPU kernels for Evolving Attention, EA paper Eq. (4).

* :func:`evolving_attention_input` and :func:`convolution_residual` (training and full
  passes): Eq. (4) before and after the convolution, one pass forward and one backward
  each (autograd functions). The first writes ``A_input`` channels-last, the layout the
  convolution reads; the second reads the convolution's uncropped output and writes
  its gradient, border zeros included, in that layout. In PyTorch ops that is lerp,
  neutral fill and a layout copy before the convolution, ReLU, lerp and masking after
  it, their backward passes, the crop's zero fill and copy, and layout conversions.
* :func:`evolving_attention_step` (incremental decoding): the whole of Eq. (4) for one
  new query row per hypothesis -- and, where no later layer reads the map, the softmax and
  the value product too.

A decoding step hands each attention one new query row per hypothesis. For that row,
Eq. (4) -- the α skip connection, the neutral zeros of masked entries, the convolution
over the cached ``k - 1`` earlier rows of ``A_input`` and the new one, ReLU, the β
interpolation and the ``-inf`` masking -- is a handful of tensor operations on a few
hundred numbers, and on CPU each one's fixed cost is larger than its work: measured
here, they made EA-Lite's beam search 30% slower than the vanilla transformer's.
``csrc/evolving_attention.cpp`` does the same arithmetic in one pass.

The kernels are a PyTorch C++ extension built on first use (about 40 s, once per machine:
``torch.utils.cpp_extension`` keeps it in ``TORCH_EXTENSIONS_DIR``). It needs a C++
compiler and ``ninja``; without them, or with ``EA_FAIRSEQ_FUSED_KERNELS=0``, training and
decoding use the PyTorch path of :class:`~ea_fairseq.modules.evolving_attention.EvolvingAttention`,
which computes the same values and gradients (tests check both).
"""
import logging
import os
import threading
from typing import Optional

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc",
                      "evolving_attention.cpp")
ENV_SWITCH = "EA_FAIRSEQ_FUSED_KERNELS"
DTYPES = (torch.float32, torch.float64)

# A decoding step's softmax and value product run inside the step kernel (one call instead
# of half a dozen small tensor operations, whose fixed costs dominate small steps: 11 vs 32
# us per attention call at 5 hypotheses), except where torch's softmax and batched matmul
# were measured faster: encoder-decoder attention whose values are not shared by beams
# (beam 1), above this many hypotheses. One EA-Lite attention call, kernel vs torch, 25
# encoder keys: 834 vs 724 us at 128 hypotheses, 1512 vs 1148 at 320, against 436 vs 455 at
# 64; beam-shared encoder values 741 vs 764 at 160; decoder self-attention 877 vs 1059 at
# 128 and 1278 vs 1732 at 320 (6 keys), 2024 vs 2043 at 320 (20 keys).
STEP_VALUES_MAX_BATCH = 64

_lock = threading.Lock()
_state = {"module": None, "tried": False}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def extension():
    """The compiled extension, or None (switched off, or it could not be built: warned once).

    Decided once per process: the switch is read and the build tried on the first call.
    """
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if not _state["tried"]:
            _state["module"] = _build() if enabled() else None
            _state["tried"] = True
    return _state["module"]


def _build():
    path = os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load

        try:  # pip's ninja, also when its venv is not activated (e.g. .venv/bin/fairseq-generate)
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])
        except ImportError:
            pass
        logger.info("loading EA's fused CPU kernels (compiled on first use, then cached)")
        return load(name="ea_fairseq_evolving_attention", sources=[SOURCE],
                    extra_cflags=["-O3", "-fno-trapping-math", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # no compiler, no ninja, read-only cache, ...
        logger.warning(
            "EA's fused CPU kernels could not be built (%s: %s); training and decoding use "
            "the PyTorch path: same results, slower on CPU. To build it, install a C++ compiler "
            "and `pip install ninja`; set %s=0 to silence this.",
            type(err).__name__, (str(err).strip().splitlines() or [""])[-1], ENV_SWITCH)
        return None
    finally:
        os.environ["PATH"] = path


def applies(logits: Tensor) -> bool:
    """Whether the fused step can compute this step's map (else: the PyTorch path)."""
    return (
        not torch.is_grad_enabled()
        and logits.size(2) == 1
        and logits.dtype in DTYPES
        and logits.device.type == "cpu"
        and extension() is not None
    )


def key_mask(masked: Optional[Tensor], bsz: int, src_len: int) -> Optional[Tensor]:
    """``masked`` as the kernel's (B, S) mask; False if it differs across heads."""
    if masked is None:
        return None
    if masked.size(1) != 1:
        return False
    if masked.size(0) != bsz:
        masked = masked.expand(bsz, 1, 1, src_len)
    return masked.reshape(bsz, src_len)  # (the kernel makes it contiguous where it is not)


def evolving_attention_step(logits: Tensor, previous: Optional[Tensor], earlier: Optional[Tensor],
                            masked: Optional[Tensor], weight: Tensor, bias: Optional[Tensor],
                            alpha: float, beta: float, left: int, values: Optional[Tensor] = None,
                            order: Optional[Tensor] = None):
    """EA Eq. (4) for one query row per hypothesis, written into ``logits`` (B, H, 1, S).

    ``previous`` is the previous layer's ``A_logit`` row (or None), ``earlier`` the cached
    ``k - 1`` rows of ``A_input`` (B, H, k-1, S' <= S; None before the first step),
    ``masked`` a (B, S) bool mask, ``weight`` the (masked) kernel, ``left`` the zero
    columns left of the map (``k - 1`` causal, ``k // 2`` centred). Returns
    ``(A_logit, rows to cache, None)``. With ``values`` (B_kv * H, S, head_dim; beam search
    shares a sentence's values across its hypotheses) it returns ``(weights, rows to cache,
    context)``: the softmax of ``A_logit`` over the keys in its place, and the value
    product as (1, B, H * head_dim). ``order`` (B, int64), when given, is beam search's
    reorder since the rows were cached: hypothesis n reads ``earlier[order[n]]``.
    """
    return extension().evolving_attention_step(logits, previous, earlier, masked, weight, bias,
                                               alpha, beta, left, values, order)


class EvolvingAttentionInput(torch.autograd.Function):
    """EA Eq. (4), line 1, before the convolution (see :func:`evolving_attention_input`)."""

    @staticmethod
    def forward(ctx, logits: Tensor, previous: Optional[Tensor], neutral: Optional[Tensor], alpha: float):
        ctx.alpha, ctx.has_previous = alpha, previous is not None
        ctx.save_for_backward(neutral)
        return extension().evolving_attention_input_forward(logits, previous, neutral, alpha)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (neutral,) = ctx.saved_tensors
        grad_logits, grad_previous = extension().evolving_attention_input_backward(
            grad, neutral, ctx.alpha, ctx.has_previous)
        return grad_logits, grad_previous if ctx.has_previous else None, None, None


class ConvolutionResidual(torch.autograd.Function):
    """EA Eq. (4), line 2, after the convolution (see :func:`convolution_residual`)."""

    @staticmethod
    def forward(ctx, a_input: Tensor, conv: Tensor, masked: Optional[Tensor], beta: float):
        ctx.beta = beta
        ctx.channels_last = not a_input.is_contiguous()
        ctx.save_for_backward(conv, masked)
        return extension().convolution_residual_forward(a_input, conv, masked, beta)

    @staticmethod
    def backward(ctx, grad: Tensor):
        conv, masked = ctx.saved_tensors
        grad_a, grad_conv = extension().convolution_residual_backward(
            grad, conv, masked, ctx.beta, ctx.channels_last)
        return grad_a, grad_conv, None, None


def full_map_applies(logits: Tensor) -> bool:
    """Whether the fused full-pass functions can take this map (else: the PyTorch path)."""
    return logits.dtype in DTYPES and logits.device.type == "cpu" and extension() is not None


def evolving_attention_input(logits: Tensor, previous: Optional[Tensor], neutral: Optional[Tensor],
                             alpha: float) -> Tensor:
    """``A_input = α·A_logit(i-1) + (1-α)·logits`` (just ``logits`` without ``previous``),
    zero where ``neutral`` (Eq. 4, line 1), in the channels-last layout the convolution
    reads. ``previous`` may hold ``-inf`` where ``neutral`` is set."""
    if neutral is not None:
        neutral = neutral.expand(logits.shape)
    return EvolvingAttentionInput.apply(logits, previous, neutral, float(alpha))


def convolution_residual(a_input: Tensor, conv: Tensor, masked: Optional[Tensor], beta: float) -> Tensor:
    """``A_logit = β·ReLU(C) + (1-β)·A_input``, ``-inf`` where ``masked`` (Eq. 4, line 2).

    ``a_input`` is (B, H, T, S), in any layout; ``conv`` the convolution's uncropped output,
    at least T x S, of which ``[:, :, :T, :S]`` is C; ``masked`` broadcastable to the map,
    or None. The result is contiguous.
    """
    if masked is not None:
        masked = masked.expand(a_input.shape)
    return ConvolutionResidual.apply(a_input, conv, masked, float(beta))
