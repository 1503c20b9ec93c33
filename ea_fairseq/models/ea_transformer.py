"""The plugin's transformer: fairseq's ``TransformerModel`` with a pluggable attention per role.

Only the attention builders of fairseq's layers are overridden (``build_self_attention``,
``build_encoder_attention``); the encoder and decoder loops are fairseq's. The encoder
and the decoder each own one :class:`~ea_fairseq.modules.attention_maps.AttentionMapCarrier`
that hands a layer's attention logits to the next layer; their ``forward`` only opens a
fresh scope on it and returns ``super()``'s result.
"""
import logging

from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
)
from fairseq.models.transformer.transformer_legacy import base_architecture
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper

from ..modules.attention_maps import AttentionMapCarrier, LogitMapAttention
from . import attention_variants as variants
from .transformer_lite import transformer_lite

logger = logging.getLogger(__name__)


class EATransformerEncoderLayer(TransformerEncoderLayerBase):
    def build_self_attention(self, embed_dim, cfg):
        return variants.build_attention("encoder", super().build_self_attention(embed_dim, cfg), cfg)


class EATransformerDecoderLayer(TransformerDecoderLayerBase):
    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        attn = super().build_self_attention(embed_dim, cfg, add_bias_kv, add_zero_attn)
        return variants.build_attention("decoder", attn, cfg)

    def build_encoder_attention(self, embed_dim, cfg):
        return variants.build_attention("cross", super().build_encoder_attention(embed_dim, cfg), cfg)


def wrap_layer(layer, cfg):
    """fairseq's wrapping policy for a layer this plugin builds itself (see its
    ``build_encoder_layer``): activation checkpointing, then FSDP."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


def attach_carrier(stack, carrier: AttentionMapCarrier) -> None:
    for module in stack.modules():
        if isinstance(module, LogitMapAttention):
            module.attach(carrier)


class EATransformerEncoder(TransformerEncoderBase):
    def __init__(self, cfg, dictionary, embed_tokens, return_fc=False):
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)
        self.attention_maps = AttentionMapCarrier()
        attach_carrier(self, self.attention_maps)

    def build_encoder_layer(self, cfg):
        return wrap_layer(EATransformerEncoderLayer(cfg, return_fc=self.return_fc), cfg)

    def forward(self, src_tokens, src_lengths=None, return_all_hiddens: bool = False,
                token_embeddings=None):
        with self.attention_maps.scope():
            return super().forward(src_tokens, src_lengths, return_all_hiddens, token_embeddings)


class EATransformerDecoder(TransformerDecoderBase):
    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False,
                 output_projection=None):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)
        self.attention_maps = AttentionMapCarrier()
        attach_carrier(self, self.attention_maps)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return wrap_layer(EATransformerDecoderLayer(cfg, no_encoder_attn), cfg)

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None,
                         full_context_alignment: bool = False, alignment_layer=None,
                         alignment_heads=None):
        with self.attention_maps.scope():
            return super().extract_features(
                prev_output_tokens, encoder_out, incremental_state,
                full_context_alignment, alignment_layer, alignment_heads,
            )


@register_model("ea_transformer")
class EATransformerModel(TransformerModel):
    """fairseq's transformer with evolving-attention variants (see ``--*-attention``)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        variants.add_args(parser)

    @classmethod
    def build_model(cls, args, task):
        variants.fill_defaults(args)
        check_options(args)
        return super().build_model(args, task)

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return EATransformerEncoder(args, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return EATransformerDecoder(
            args, tgt_dict, embed_tokens, no_encoder_attn=args.no_cross_attention
        )


def check_options(args) -> None:
    """Refuse combinations the mechanisms cannot honour, before anything is built."""
    carrying = [r for r in variants.ROLES if variants.reads_previous_maps(args, r)]
    if carrying and (getattr(args, "checkpoint_activations", False)
                     or getattr(args, "offload_activations", False)):
        raise ValueError(
            "--checkpoint-activations recomputes each layer on its own, without the previous "
            f"layer's attention logits that the {', '.join(carrying)} attention reads "
            "(α > 0). Drop --checkpoint-activations/--offload-activations, or set "
            "--ea-alpha 0 / --ea-decoder-alpha 0."
        )
    if getattr(args, "cross_self_attention", False) and variants.variant_of(args, "decoder") != "vanilla":
        raise ValueError(
            "--cross-self-attention mixes source and target keys in one map, which the "
            f"{variants.variant_of(args, 'decoder')} decoder attention does not define; drop it."
        )


@register_model_architecture("ea_transformer", "ea_transformer_lite")
def ea_transformer_lite(args):
    """EA-Transformer-Lite (EA paper §4.3, Table 5): transformer_lite dims, α=0.1, β=0.1."""
    for role in variants.ROLES:
        variants.set_default(args, f"{role}_attention", "ea")
    variants.set_default(args, "ea_alpha", 0.1)
    variants.set_default(args, "ea_beta", 0.1)
    variants.set_default(args, "ea_decoder_alpha", 0.0)
    transformer_lite(args)
    variants.fill_defaults(args)


@register_model_architecture("ea_transformer", "ea_transformer_base")
def ea_transformer_base(args):
    """EA-Transformer-Base (EA paper §4.3, Table 5): transformer-base dims, α=0.5, β=0.1."""
    for role in variants.ROLES:
        variants.set_default(args, f"{role}_attention", "ea")
    variants.set_default(args, "ea_alpha", 0.5)
    variants.set_default(args, "ea_beta", 0.1)
    variants.set_default(args, "ea_decoder_alpha", 0.0)
    base_architecture(args)
    variants.fill_defaults(args)
