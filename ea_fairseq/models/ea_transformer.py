"""The plugin's transformer: fairseq's ``TransformerModel`` with a pluggable attention per role.

Only the attention builders of fairseq's layers are overridden (``build_self_attention``,
``build_encoder_attention``): they hand the settings fairseq gives each role's attention to
the variant registry (:class:`~ea_fairseq.models.attention_variants.RoleAttention`), which
builds the role's module; the encoder and decoder loops are fairseq's. What the layers of a
stack hand each other travels as explicit values (:mod:`~ea_fairseq.models.stack`: one
pass per forward, each layer's inputs and outputs, activation checkpointing). The decoder's beam reorder is the faster one of
:mod:`~ea_fairseq.models.fairseq_speedups`.
"""
import copy
import logging
from functools import partial

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
)
from fairseq.models.transformer.transformer_legacy import base_architecture
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from omegaconf import OmegaConf

from ..modules.recurrent_attention import mixed_precision_caveats
from ..errors import OptionError, note_position_limit
from . import attention_variants as variants
from . import hydra_config
from .fairseq_speedups import ListedStateHolders
from .stack import AttentionMapsMixin, StackLayer, wrap_layer
from .transformer_lite import transformer_lite

logger = logging.getLogger(__name__)


class EATransformerEncoderLayer(StackLayer, TransformerEncoderLayerBase):
    def __init__(self, cfg, return_fc=False, layer_index=0):
        self.layer_index = layer_index  # read by the attention builders below
        super().__init__(cfg, return_fc=return_fc)
        self.init_stack_layer()

    def build_self_attention(self, embed_dim, cfg):
        settings = dict(embed_dim=embed_dim, num_heads=cfg.encoder.attention_heads, dropout=cfg.attention_dropout,
                        self_attention=True, q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size,
                        xformers_att_config=cfg.encoder.xformers_att_config)
        fairseq = partial(super().build_self_attention, cfg=cfg)
        return variants.build_attention("encoder", variants.RoleAttention(settings, fairseq), cfg, self.layer_index)


class EATransformerDecoderLayer(StackLayer, TransformerDecoderLayerBase):
    def __init__(self, cfg, no_encoder_attn=False, layer_index=0):
        self.layer_index = layer_index
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)
        self.init_stack_layer()

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        variant = variants.variant_of(cfg, "decoder")
        if (add_bias_kv or add_zero_attn) and variant in variants.POSITION_ONLY:
            raise ValueError(f"The {variant} attention has no keys, so no extra key column of "
                             "--add-bias-kv / --add-zero-attn; drop those options.")
        settings = dict(embed_dim=embed_dim, num_heads=cfg.decoder.attention_heads, dropout=cfg.attention_dropout,
                        add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
                        self_attention=not cfg.cross_self_attention, q_noise=self.quant_noise,
                        qn_block_size=self.quant_noise_block_size, xformers_att_config=cfg.decoder.xformers_att_config)
        fairseq = partial(super().build_self_attention, cfg=cfg, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
        return variants.build_attention("decoder", variants.RoleAttention(settings, fairseq), cfg, self.layer_index)

    def build_encoder_attention(self, embed_dim, cfg):
        settings = dict(embed_dim=embed_dim, num_heads=cfg.decoder.attention_heads, kdim=cfg.encoder.embed_dim,
                        vdim=cfg.encoder.embed_dim, dropout=cfg.attention_dropout, encoder_decoder_attention=True,
                        q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size,
                        xformers_att_config=cfg.encoder.xformers_att_config)
        fairseq = partial(super().build_encoder_attention, cfg=cfg)
        return variants.build_attention("cross", variants.RoleAttention(settings, fairseq), cfg, self.layer_index)


def side_config(cfg, role: str):
    """``cfg`` for the ``role`` stack: without positional embeddings where
    ``--no-<role>-positional-embeddings`` asks (fairseq's own option removes both sides')."""
    if not getattr(cfg, f"no_{role}_positional_embeddings", False):
        return cfg
    cfg = copy.copy(cfg)
    cfg.no_token_positional_embeddings = True
    return cfg


class EATransformerEncoder(AttentionMapsMixin, TransformerEncoderBase):
    def __init__(self, cfg, dictionary, embed_tokens, return_fc=False):
        super().__init__(side_config(cfg, "encoder"), dictionary, embed_tokens, return_fc=return_fc)
        self.setup_attention_maps(cfg, cfg.encoder.attention_heads)

    def build_encoder_layer(self, cfg):
        layer = EATransformerEncoderLayer(cfg, self.return_fc, self.next_layer_index())
        return wrap_layer(layer, cfg)

    def forward(self, src_tokens, src_lengths=None, return_all_hiddens: bool = False,
                token_embeddings=None):
        with self.attention_scope(src_tokens.size(1)):
            return super().forward(src_tokens, src_lengths, return_all_hiddens, token_embeddings)


class EATransformerDecoder(AttentionMapsMixin, ListedStateHolders, TransformerDecoderBase):
    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False,
                 output_projection=None):
        super().__init__(side_config(cfg, "decoder"), dictionary, embed_tokens,
                         no_encoder_attn=no_encoder_attn, output_projection=output_projection)
        self.setup_attention_maps(cfg, cfg.decoder.attention_heads)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        layer = EATransformerDecoderLayer(cfg, no_encoder_attn, self.next_layer_index())
        return wrap_layer(layer, cfg)

    def buffered_future_mask(self, tensor):
        """fairseq's future mask, the same tensor for every layer of a pass (fairseq slices
        its buffer anew per layer), so the mechanisms derive their masks from it once."""
        compute = partial(super().buffered_future_mask, tensor)
        return compute() if self.stack_pass is None else self.stack_pass.derive(f"future_mask_{tensor.size(0)}", compute)

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None,
                         full_context_alignment: bool = False, alignment_layer=None,
                         alignment_heads=None):
        with self.attention_scope(prev_output_tokens.size(1), incremental_state):
            return super().extract_features(
                prev_output_tokens, encoder_out, incremental_state,
                full_context_alignment, alignment_layer, alignment_heads,
            )


@register_model(hydra_config.PLUGIN_MODEL)
class EATransformerModel(TransformerModel):
    """fairseq's transformer with evolving-attention variants (see ``--*-attention``)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        variants.add_args(parser)

    @classmethod
    def build_model(cls, args, task):
        if OmegaConf.is_config(args):  # fairseq-hydra-train, or a checkpoint it wrote
            cfg, args = args, hydra_config.namespace_from_config(args, cls)
            model = cls.build_model(args, task)
            hydra_config.record_options(cfg, args, hydra_config.plugin_option_names(cls))
            return model
        return cls.build_from_namespace(args, task)

    @classmethod
    def build_from_namespace(cls, args, task):
        """``build_model`` for fairseq-train's namespace (a hydra config arrives here as one)."""
        variants.fill_defaults(args)
        check_options(args)
        lower_max_positions(args)
        warn_about_ran_mixed_precision(args)
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
    """Refuse values and combinations the mechanisms cannot honour, before anything is built
    (one-line errors on the command line: :mod:`ea_fairseq.errors`): the one place the weights
    of EA's and PA's Eq. 4 are held to [0, 1], whether they come from the command line, hydra
    or a checkpoint (the modules take them as given)."""
    for name, low, high, closed in (("ea_alpha", 0, 1, True), ("ea_decoder_alpha", 0, 1, True),
                                    ("ea_beta", 0, 1, True), ("pa_alpha", 0, 1, True),
                                    ("drop_attention_p", 0, 1, False)):
        value = getattr(args, name, None)
        if value is not None and not (low <= value <= high if closed else low <= value < high):
            raise OptionError(f"--{name.replace('_', '-')} must lie in [{low}, {high}{']' if closed else ')'}, "
                              f"got {value}")
    if (getattr(args, "pa_conv_layers", None) or 0) < 0:
        raise OptionError(f"--pa-conv-layers must be at least 0, got {args.pa_conv_layers}")
    for role in variants.ROLES:  # argparse refuses them; these are a checkpoint's values
        option = POSITION_LIMITS.get(variants.variant_of(args, role))
        if option is not None and getattr(args, option) < 1:
            raise OptionError(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    if getattr(args, "cross_self_attention", False) and variants.uses(args, "lsra_on", "decoder"):
        raise OptionError("--cross-self-attention mixes source and target keys in one map, which the "
                          "convolution of LSRA (--lsra-on decoder) does not define; drop one of them.")
    if getattr(args, "cross_self_attention", False) and variants.variant_of(args, "decoder") != "vanilla":
        raise OptionError(
            "--cross-self-attention mixes source and target keys in one map, which the "
            f"{variants.variant_of(args, 'decoder')} decoder attention does not define; drop it."
        )


def ran_roles(args):
    return [r for r in ("encoder", "decoder") if variants.variant_of(args, r) == "ran"]


#: variants that attend over at most N positions, and the option that sets N
POSITION_LIMITS = {"ran": "ran_max_positions", "synthesizer": "synthesizer_max_positions"}


def lower_max_positions(args) -> None:
    """Adjust ``--max-source/target-positions`` down to the positions the attention of that
    side covers (``--ran-max-positions``, ``--synthesizer-max-positions``), so that fairseq
    itself filters (training) or refuses (generation) longer sentences."""
    for role, side in (("encoder", "source"), ("decoder", "target")):
        variant = variants.variant_of(args, role)
        option = POSITION_LIMITS.get(variant)
        if option is not None:
            name, limit = f"max_{side}_positions", getattr(args, option)
            given = getattr(args, name, None)
            if given is not None and given > limit:
                logger.info(f"--max-{side}-positions {given} lowered to {limit}: the {variant} {role} "
                            f"attends over at most --{option.replace('_', '-')} {limit} tokens; longer "
                            f"{side} sentences are filtered in training and refused in generation")
            setattr(args, name, min(given or limit, limit))
            note_position_limit(
                f"the {variant} {role} of this model takes at most --{option.replace('_', '-')} {limit} tokens "
                f"(a model trained with a larger --{option.replace('_', '-')} takes more)")


def warn_about_ran_mixed_precision(args) -> None:
    if ran_roles(args):
        for note in mixed_precision_caveats(args):
            logger.warning("RAN keeps its attention matrices' parameters in float32: %s", note)


def _ea_defaults(args, alpha: float, dims) -> None:
    """EA in every attention (§4.3): encoder α as given, no decoder skip, β=0.1."""
    for role in variants.ROLES:
        variants.set_default(args, f"{role}_attention", "ea")
    variants.set_default(args, "ea_alpha", alpha)
    variants.set_default(args, "ea_beta", 0.1)
    variants.set_default(args, "ea_decoder_alpha", 0.0)
    dims(args)


@register_model_architecture("ea_transformer", "ea_transformer_lite")
def ea_transformer_lite(args):
    """EA-Transformer-Lite (EA paper §4.3, Table 5): transformer_lite dims, α=0.1, β=0.1."""
    _ea_defaults(args, 0.1, transformer_lite)


@register_model_architecture("ea_transformer", "ea_transformer_base")
def ea_transformer_base(args):
    """EA-Transformer-Base (EA paper §4.3, Table 5): transformer-base dims, α=0.5, β=0.1."""
    _ea_defaults(args, 0.5, base_architecture)


@register_model_architecture("ea_transformer", "pa_transformer_lite")
def pa_transformer_lite(args):
    """PA-Transformer on transformer_lite dims (PA paper §4, IWSLT'14 setting: α=0.1,
    one conv layer, encoder only)."""
    variants.set_default(args, "encoder_attention", "pa")
    variants.set_default(args, "pa_alpha", 0.1)
    variants.set_default(args, "pa_conv_layers", 1)
    transformer_lite(args)


#: archs whose self-attentions are a position-only variant, on Transformer-base dims and, with
#: ``_lite``, on transformer_lite's: name -> (encoder, decoder) self-attention. RAN-E, -D, -ALL
#: (RAN §3; attention dropout 0.2, §Settings); RAN Table 1's baselines HC-SA (You et al. 2020:
#: Gaussians on i-1 / i+1 in the encoder, i-1 / i in the decoder, σ = 1) and Syn-R (Tay et al.
#: 2020: Random Synthesizer) replace both self-attentions; encoder-decoder attention stays
#: dot-product.
POSITION_ARCHS = {
    "ran_e": ("ran", "vanilla"), "ran_d": ("vanilla", "ran"), "ran_all": ("ran", "ran"),
    "hcsa": ("hcsa", "hcsa"), "syn_r": ("synthesizer", "synthesizer"),
}


def _position_arch(name: str, encoder: str, decoder: str, dims) -> None:
    def arch(args):
        variants.set_default(args, "encoder_attention", encoder)
        variants.set_default(args, "decoder_attention", decoder)
        if "ran" in (encoder, decoder):
            variants.set_default(args, "attention_dropout", 0.2)
        dims(args)

    arch.__name__ = arch.__qualname__ = name
    arch.__doc__ = f"{encoder} encoder / {decoder} decoder self-attention on {dims.__name__} dims."
    register_model_architecture("ea_transformer", name)(arch)


for _name, (_encoder, _decoder) in POSITION_ARCHS.items():
    _position_arch(_name, _encoder, _decoder, base_architecture)
    _position_arch(f"{_name}_lite", _encoder, _decoder, transformer_lite)
