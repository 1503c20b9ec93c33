"""Architectures of the systems the papers compare against, on the plugin's transformer.

* ``conv_transformer_lite`` / ``pa_conv_transformer_lite``: PA paper Table 1's
  Conv-Transformer and PA-Conv-Transformer for IWSLT'14 De-En (§4.1, appendix B.1, Fig. 4):
  every encoder and decoder block's self-attention is Lite Transformer's LSRA (half of the
  width to a 4-head attention, half to a lightweight convolution; Wu et al. 2020's IWSLT
  setting: kernels 3 7 15 31 31 31, kernel dropout 0.1) on ``transformer_lite`` dims; the PA
  one adds PA's predictor (α=0.1, one conv layer) to the encoder's attention half.
* ``realformer_lite`` / ``realformer_base``: RealFormer (He et al. 2021) -- residual
  attention in every attention of the model (encoder self, decoder self, encoder-decoder),
  the cross-layer baseline of EA Table 3.
* ``resformer_lite`` / ``resformer_base``: value residual learning (Zhou et al. 2024) in the
  encoder's and the decoder's self-attention, λ1 = λ2 = 0.5.
"""
from fairseq.models import register_model_architecture
from fairseq.models.transformer.transformer_legacy import base_architecture

from . import attention_variants as variants
from .transformer_lite import transformer_lite


def _conv_transformer(args) -> None:
    variants.set_default(args, "lsra_on", ["encoder", "decoder"])
    variants.set_default(args, "lsra_weight_dropout", 0.1)
    transformer_lite(args)


@register_model_architecture("ea_transformer", "conv_transformer_lite")
def conv_transformer_lite(args):
    """PA Table 1's Conv-Transformer (LSRA blocks) on transformer_lite dims."""
    _conv_transformer(args)


@register_model_architecture("ea_transformer", "pa_conv_transformer_lite")
def pa_conv_transformer_lite(args):
    """PA Table 1's PA-Conv-Transformer: Conv-Transformer with PA (α=0.1, one conv layer)
    on the encoder's attention half."""
    variants.set_default(args, "encoder_attention", "pa")
    variants.set_default(args, "pa_alpha", 0.1)
    variants.set_default(args, "pa_conv_layers", 1)
    _conv_transformer(args)


def _realformer(args, dims) -> None:
    for role in variants.ROLES:
        variants.set_default(args, f"{role}_attention", "realformer")
    dims(args)


@register_model_architecture("ea_transformer", "realformer_lite")
def realformer_lite(args):
    """RealFormer (residual attention in every attention) on transformer_lite dims."""
    _realformer(args, transformer_lite)


@register_model_architecture("ea_transformer", "realformer_base")
def realformer_base(args):
    """RealFormer on transformer-base dims."""
    _realformer(args, base_architecture)


def _resformer(args, dims) -> None:
    variants.set_default(args, "value_residual_on", ["encoder", "decoder"])
    variants.set_default(args, "value_residual_lambdas", [0.5, 0.5])
    dims(args)


@register_model_architecture("ea_transformer", "resformer_lite")
def resformer_lite(args):
    """ResFormer (value residual learning in encoder and decoder self-attention) on
    transformer_lite dims."""
    _resformer(args, transformer_lite)


@register_model_architecture("ea_transformer", "resformer_base")
def resformer_base(args):
    """ResFormer on transformer-base dims."""
    _resformer(args, base_architecture)
