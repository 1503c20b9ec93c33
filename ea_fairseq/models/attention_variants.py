"""Which attention each role of the transformer uses, and its command-line options.

A model of this plugin has three attention *roles*: ``encoder`` (encoder
self-attention), ``decoder`` (decoder self-attention) and ``cross``
(encoder-decoder attention). Each role names a variant with
``--encoder-attention``, ``--decoder-attention`` and ``--cross-attention``; the
architectures only choose defaults, so variants compose freely (e.g. RAN-D with an EA
encoder). Each variant registers here (:func:`register_variant`) its builder, which makes
the role's attention module from the settings fairseq gives the role's attention
(:class:`RoleAttention`), and the roles it is defined for; the options' choices and the
model's checks are derived from that registry. What a module reads from the layers before
it and hands on to the layers after it, the module says itself (``carried_names``). Every
module a builder returns follows
:class:`~ea_fairseq.modules.attention_protocol.AttentionModule`.
"""
import argparse
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Tuple

import torch.nn as nn

from ..modules.attention_maps import LogitMapAttention
from ..modules.drop_attention import MODES as DROP_MODES, RESCALES as DROP_RESCALES, DropAttention
from ..modules import long_short_range_attention as lsra, value_residual
from ..modules.evolving_attention import EvolvingAttention
from ..modules.hard_coded_attention import HardCodedGaussianAttention
from ..modules.predictive_attention import PredictiveAttention
from ..modules.recurrent_attention import RecurrentAttention
from ..modules.residual_attention import ResidualAttention
from ..modules.synthesizer_attention import RandomSynthesizerAttention

ROLES: Tuple[str, ...] = ("encoder", "decoder", "cross")
SLOT = {"encoder": "self", "decoder": "self", "cross": "cross"}
CONV_LAYOUT = {"encoder": "full", "decoder": "causal", "cross": "rows"}


@dataclass(frozen=True)
class Variant:
    """One attention variant: what builds it, and where it applies."""

    name: str
    build: Callable  # build(attention: RoleAttention, cfg, role, layer_index) -> attention module
    roles: Tuple[str, ...]  # the roles it is defined for


#: every variant, in the order the options list them; the one source of the choices of
#: --encoder/decoder/cross-attention and of the roles a variant accepts
VARIANTS: Dict[str, Variant] = {}


@dataclass(frozen=True)
class RoleAttention:
    """What a layer hands a variant's builder: ``settings``, the keywords of fairseq's
    ``MultiheadAttention`` for this role and layer (``embed_dim``, ``num_heads``,
    ``dropout``, ``self_attention`` / ``encoder_decoder_attention``, ``kdim``/``vdim``,
    quantization noise, ...) plus ``value_projection`` where value residual learning
    applies; ``fairseq(width)``, fairseq's own module for the role (the vanilla variant)."""

    settings: Dict[str, Any]
    fairseq: Callable[[int], nn.Module] = field(repr=False)

    @property
    def width(self) -> int:
        return self.settings["embed_dim"]


def register_variant(name: str, roles: Tuple[str, ...]):
    """Register ``build`` for ``--<role>-attention name``."""
    def wrap(build):
        VARIANTS[name] = Variant(name, build, tuple(roles))
        return build

    return wrap


def choices_for(role: str) -> List[str]:
    return [name for name, variant in VARIANTS.items() if role in variant.roles]


def variant_of(cfg, role: str) -> str:
    return getattr(cfg, f"{role}_attention", None) or "vanilla"


def computed_attention(cfg, role: str) -> str:
    """The attention ``role`` computes: fairseq's module (vanilla) and the plugin's
    ``dot_product`` are one attention, with the same parameters under the same names."""
    variant = variant_of(cfg, role)
    return "vanilla" if variant == "dot_product" else variant


def uses(cfg, option: str, role: str) -> bool:
    """Does the per-role option ``option`` (a list of roles) name ``role``?"""
    return role in (getattr(cfg, option, None) or ())


def build_attention(role: str, attention: RoleAttention, cfg, layer_index: int = 0):
    """The attention module of ``role`` in layer ``layer_index``, built from ``attention``
    (fairseq's settings for the role, at the layer's width). With LSRA (``--lsra-on``) the
    variant is built at half the width, beside a convolution."""
    embed_dim = attention.settings["embed_dim"]
    width = embed_dim // 2 if uses(cfg, "lsra_on", role) else embed_dim
    if width != embed_dim and (embed_dim % 2 or width % cfg_heads(cfg, role)):
        raise ValueError(f"--lsra-on {role}: LSRA gives half of the width ({embed_dim}) to an attention "
                         f"of {cfg_heads(cfg, role)} heads; choose a width divisible by twice the heads")
    settings = dict(attention.settings, embed_dim=width)
    if uses(cfg, "value_residual_on", role):
        settings["value_projection"] = value_residual.value_projection(SLOT[role], cfg.value_residual_lambdas)
    variant = variant_of(cfg, role)
    if variant == "ran" and layer_index == 0 and cfg.ran_first_layer_standard:
        variant = "vanilla"  # the authors' code can keep standard attention in layer 1
    dropping = role in (getattr(cfg, "drop_attention_on", None) or ()) and cfg.drop_attention != "none"
    if variant == "vanilla" and (dropping or "value_projection" in settings):
        variant = "dot_product"  # DropAttention and value residual act in the plugin's own
    attn = _build_variant(variant, role, RoleAttention(settings, attention.fairseq), cfg, layer_index)
    if dropping:
        attn.set_weight_dropout(DropAttention(
            cfg.drop_attention, cfg.drop_attention_p, cfg.drop_attention_window,
            cfg.drop_attention_rescale,
        ))
    if width != embed_dim:
        if getattr(attn, "embed_dim", None) != width or variant in POSITION_ONLY:  # (LSRA's is dot-product)
            raise ValueError(f"--lsra-on {role}: the {variant} attention does not build at half the "
                             "width; LSRA cannot put it beside a convolution")
        sizes = list(cfg.lsra_kernel_sizes or ())
        if not sizes or min(sizes) < 1:  # argparse refuses both; this is a checkpoint's value
            raise ValueError(f"--lsra-kernel-sizes must list positive sizes, got {sizes}")
        attn = lsra.LongShortRangeAttention(attn, lsra.LightweightConvBranch(
            embed_dim - width, sizes[min(layer_index, len(sizes) - 1)], cfg_heads(cfg, role),
            causal=role == "decoder", weight_dropout=cfg.lsra_weight_dropout,
        ))
    return attn


def cfg_heads(cfg, role: str) -> int:
    return getattr(cfg, "decoder" if role == "cross" else role).attention_heads


def _build_variant(variant, role, attention: RoleAttention, cfg, layer_index):
    if variant not in VARIANTS:
        raise ValueError(
            f"--{role}-attention {variant}: unknown attention variant; "
            f"choose one of {list(VARIANTS)}"
        )
    roles = VARIANTS[variant].roles
    if role not in roles:
        raise ValueError(
            f"--{role}-attention {variant}: the {variant} variant is defined for "
            f"{', '.join(roles)} attention only"
        )
    return VARIANTS[variant].build(attention, cfg, role, layer_index)


def add_args(parser):
    # ``parser`` is fairseq's model-specific argument group (argument_default=SUPPRESS):
    # options not given on the command line stay unset; the --arch sets its own defaults
    # and the model's build_model fills the rest (fill_defaults).
    group = ea = parser
    for role, what in (
        ("encoder", "encoder self-attention"),
        ("decoder", "decoder self-attention"),
        ("cross", "encoder-decoder attention"),
    ):
        group.add_argument(
            f"--{role}-attention",
            choices=choices_for(role),
            help=f"attention variant of the {what} (default: set by --arch; vanilla: fairseq's "
                 "module, dot_product: the same attention and parameters on the plugin's path)",
        )
    ea.add_argument("--ea-alpha", type=float, metavar="A",
                    help="α: weight of the previous layer's attention logits in the encoder "
                         "(paper: 0.1 Lite, 0.5 Base)")
    ea.add_argument("--ea-decoder-alpha", type=float, metavar="A",
                    help="α for decoder self- and encoder-decoder attention (paper: 0, §4.3)")
    ea.add_argument("--ea-beta", type=float, metavar="B",
                    help="β: weight of ReLU(Conv(A_input)) in the new logits (paper: 0.1)")
    ea.add_argument("--ea-kernel-size", type=int, choices=[1, 3, 5],
                    help="size of the attention-map convolution kernel (paper: 3; Table 6)")
    ea.add_argument("--ea-no-encoder-conv", action="store_true",
                    help="no convolution on encoder self-attention maps (Table 6)")
    ea.add_argument("--ea-no-decoder-conv", action="store_true",
                    help="no convolution on decoder self-attention maps (Table 6)")
    ea.add_argument("--ea-no-cross-conv", action="store_true",
                    help="no convolution on encoder-decoder attention maps (Table 6)")
    group.add_argument("--pa-alpha", type=float, metavar="A",
                       help="PA: weight of the predicted attention logits, Eq. 4 (IWSLT'14: 0.1)")
    group.add_argument("--pa-conv-layers", type=int, metavar="M",
                       help="PA: 3x3 conv+ReLU layers of the prediction CNN; 0 = residual "
                            "connection only, the paper's 'Transformer with RC' (default 1)")
    add_drop_attention_args(group)
    group.add_argument("--lsra-on", nargs="+", choices=lsra.ROLES, metavar="ROLE",
                       help="LSRA (Lite Transformer; PA's Conv-Transformer): give half of the width of "
                            "these self-attentions (encoder, decoder) to a lightweight convolution")
    group.add_argument("--lsra-kernel-sizes", nargs="+", type=positive_int, metavar="K",
                       help="LSRA: convolution kernel size per layer, the last repeated for deeper "
                            "stacks (Lite Transformer: 3 7 15 31 31 31)")
    group.add_argument("--lsra-weight-dropout", type=float, metavar="P",
                       help="LSRA: dropout on the convolution's kernels (default: --attention-dropout)")
    group.add_argument("--value-residual-on", nargs="+", choices=value_residual.ROLES, metavar="ROLE",
                       help="value residual learning (ResFormer): these self-attentions (encoder, "
                            "decoder) mix the first layer's values into every later layer's")
    group.add_argument("--value-residual-lambdas", nargs=2, type=float, metavar=("L1", "L2"),
                       help="value residual: V'_n = L1 * V_1 + L2 * V_n (paper: 0.5 0.5)")
    group.add_argument("--ran-max-positions", type=positive_int, metavar="L",
                       help="RAN: size L of the L x L initial attention matrices; longer "
                            "sentences are refused (paper: 256)")
    group.add_argument("--ran-fixed-init", action="store_true",
                       help="RAN: do not train the initial attention matrices A0 (Table 3)")
    group.add_argument("--ran-no-layernorm", action="store_true",
                       help="RAN: no layer normalisation in the transition, Eq. 3 (Table 3)")
    group.add_argument("--ran-no-residual", action="store_true",
                       help="RAN: no residual connection in the transition, Eq. 4 (Table 3)")
    group.add_argument("--ran-first-layer-standard", action="store_true",
                       help="RAN: keep dot-product attention in the first layer of a RAN stack "
                            "(an option of the authors' code)")
    group.add_argument("--hcsa-std", type=float, metavar="S",
                       help="HC-SA: standard deviation of the hard-coded Gaussian weights "
                            "(You et al. 2020, and RAN's HC-SA baseline: 1.0)")
    group.add_argument("--hcsa-encoder-offsets", type=int, nargs="+", metavar="O",
                       help="HC-SA: centres i+O of the encoder heads' Gaussians, split evenly over "
                            "the heads (You et al. 2020: -1 1)")
    group.add_argument("--hcsa-decoder-offsets", type=int, nargs="+", metavar="O",
                       help="HC-SA: centres i+O of the decoder heads' Gaussians, at most 0 (the "
                            "decoder cannot see later tokens), split evenly over the heads "
                            "(You et al. 2020: -1 0)")
    group.add_argument("--hcsa-normalize", choices=HCSA_NORMALIZE,
                       help="HC-SA: 'none' attends with the Gaussian density itself, unnormalised, "
                            "and value/output projections without biases (You et al.'s code, which "
                            "RAN's HC-SA baseline follows; the default); 'visible' renormalises each "
                            "row over the keys the query sees (a softmax of the log-density) and keeps "
                            "fairseq's projection biases")
    group.add_argument("--synthesizer-max-positions", type=positive_int, metavar="L",
                       help="Random Synthesizer: size L of each head's L x L attention logits; "
                            "longer sentences are refused (default 256, RAN's longest sentence)")
    group.add_argument("--synthesizer-fixed", action="store_true",
                       help="Random Synthesizer: do not train the random attention logits "
                            "(Tay et al. 2020's Fixed Random Synthesizer)")
    add_positional_embedding_args(group)


def add_positional_embedding_args(group):
    """Options that remove one side's positional embeddings (also offered on fairseq's own
    transformer archs; fairseq's --no-token-positional-embeddings removes both)."""
    group.add_argument("--no-encoder-positional-embeddings", action="store_true",
                       help="no positional embeddings in the encoder (RAN Table 2)")
    group.add_argument("--no-decoder-positional-embeddings", action="store_true",
                       help="no positional embeddings in the decoder (RAN Table 2)")


POSITIONAL_EMBEDDING_OPTIONS = ("no_encoder_positional_embeddings", "no_decoder_positional_embeddings")


DROP_ATTENTION_OPTIONS = ("drop_attention_p", "drop_attention_window", "drop_attention_rescale",
                          "drop_attention_on")


def add_drop_attention_args(group):
    """The DropAttention options (also offered on fairseq's own transformer archs)."""
    group.add_argument("--drop-attention", choices=("none",) + DROP_MODES,
                       help="DropAttention: drop key columns (c) or elements (e) of the "
                            "attention weights in training, replacing --attention-dropout there")
    group.add_argument("--drop-attention-p", type=float, metavar="P",
                       help="DropAttention drop rate p (default 0.1; the paper's MT best: 0.2 with "
                            "window 2, element)")
    group.add_argument("--drop-attention-window", type=int, metavar="W",
                       help="DropAttention window w: each drop covers w consecutive keys (default 1)")
    group.add_argument("--drop-attention-rescale", choices=DROP_RESCALES,
                       help="DropAttention rescaling: re-normalise rows (the default, as the paper) or 1/(1-p)")
    group.add_argument("--drop-attention-on", nargs="+", choices=ROLES, metavar="ROLE",
                       help="attentions DropAttention applies to: encoder decoder cross (default: all)")


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def ea_alpha(cfg, role: str) -> float:
    return float(cfg.ea_alpha if role == "encoder" else cfg.ea_decoder_alpha)


@register_variant("vanilla", roles=ROLES)
def build_vanilla_attention(attention, cfg, role, layer_index):
    """fairseq's own attention (with its fused path)."""
    return attention.fairseq(attention.width)


@register_variant("ea", roles=ROLES)
def build_evolving_attention(attention, cfg, role, layer_index):
    conv_off = getattr(cfg, f"ea_no_{role}_conv", False)
    return EvolvingAttention(
        **attention.settings,
        slot=SLOT[role],
        alpha=ea_alpha(cfg, role),
        beta=float(cfg.ea_beta),
        kernel_size=int(cfg.ea_kernel_size),
        conv_layout=None if conv_off else CONV_LAYOUT[role],
        hand_on=ea_alpha(cfg, role) > 0.0,
    )


@register_variant("pa", roles=("encoder",))
def build_predictive_attention(attention, cfg, role, layer_index):
    return PredictiveAttention(
        **attention.settings, alpha=float(cfg.pa_alpha), conv_layers=int(cfg.pa_conv_layers), predict=layer_index > 0,
    )


def position_attention_options(attention: RoleAttention, role: str, name: str) -> dict:
    """The settings of fairseq's attention that a position-only attention
    (:class:`~ea_fairseq.modules.position_attention.PositionAttention`) takes."""
    settings = attention.settings
    if settings.get("xformers_att_config"):
        raise ValueError(f"{name} attends with weights of its own, not through xformers; drop "
                         f"--{role}-xformers-att-config.")
    options = {k: settings[k] for k in ("embed_dim", "num_heads", "dropout", "q_noise", "qn_block_size",
                                        "value_projection") if k in settings}  # (no keys: no kdim, bias_kv)
    return dict(options, causal=role == "decoder")


#: variants with no query/key projections (no extra key column, no cross-self-attention)
POSITION_ONLY = ("ran", "hcsa", "synthesizer")


@register_variant("ran", roles=("encoder", "decoder"))
def build_recurrent_attention(attention, cfg, role, layer_index):
    return RecurrentAttention(**position_attention_options(attention, role, "RAN"),
                              ran_index=layer_index - int(bool(cfg.ran_first_layer_standard)))


@register_variant("hcsa", roles=("encoder", "decoder"))
def build_hard_coded_attention(attention, cfg, role, layer_index):
    offsets = list(getattr(cfg, f"hcsa_{role}_offsets"))
    if role == "decoder" and max(offsets) > 0:
        raise ValueError(f"--hcsa-decoder-offsets {' '.join(map(str, offsets))}: a decoder head "
                         "cannot centre on a later token; use offsets of at most 0")
    return HardCodedGaussianAttention(**position_attention_options(attention, role, "HC-SA"),
                                      offsets=offsets, std=float(cfg.hcsa_std),
                                      normalize=cfg.hcsa_normalize)


@register_variant("synthesizer", roles=("encoder", "decoder"))
def build_synthesizer_attention(attention, cfg, role, layer_index):
    return RandomSynthesizerAttention(**position_attention_options(attention, role, "The Random Synthesizer"),
                                      max_positions=int(cfg.synthesizer_max_positions),
                                      fixed=bool(cfg.synthesizer_fixed))


@register_variant("realformer", roles=ROLES)
def build_residual_attention(attention, cfg, role, layer_index):
    return ResidualAttention(**attention.settings, slot=SLOT[role])


@register_variant("dot_product", roles=ROLES)
def build_dot_product_attention(attention, cfg, role, layer_index):
    """fairseq's dot-product attention (its math, its parameters under its names) on the
    plugin's attention path, with no mechanism: fewer kernels per decoding step than
    fairseq's unfused path (a RAN decoder's encoder-decoder attention: :func:`fill_defaults`)."""
    return LogitMapAttention(**attention.settings)


#: --hcsa-normalize: see the option's help and :mod:`~ea_fairseq.modules.hard_coded_attention`
HCSA_NORMALIZE = ("none", "visible")
#: options fill_defaults has set on every model since before --hcsa-normalize: all present
#: and hcsa_normalize absent means a configuration (checkpoint) written before it
FILLED_BEFORE_HCSA_NORMALIZE = ("hcsa_std", "hcsa_encoder_offsets", "hcsa_decoder_offsets",
                                "synthesizer_max_positions", "ran_max_positions", "drop_attention_p")


def set_default(args, name: str, value) -> None:
    """fairseq's ``getattr(args, name, default)`` idiom, also for options stored as None."""
    if getattr(args, name, None) is None:
        setattr(args, name, value)


def fill_defaults(args) -> None:
    """Defaults shared by every architecture of the plugin: everything off."""
    filled_before_hcsa_normalize = getattr(args, "hcsa_normalize", None) is None and all(
        getattr(args, name, None) is not None for name in FILLED_BEFORE_HCSA_NORMALIZE)
    # a RAN decoder's encoder-decoder attention, which RAN leaves dot-product, is the plugin's
    # (fairseq's attention and parameters, fewer kernels per decoding step), however the
    # decoder was chosen; a configuration that names fairseq's (a checkpoint) keeps it
    if variant_of(args, "decoder") == "ran":
        set_default(args, "cross_attention", "dot_product")
    for role in ROLES:
        set_default(args, f"{role}_attention", "vanilla")
        set_default(args, f"ea_no_{role}_conv", False)
    set_default(args, "ea_alpha", 0.0)
    set_default(args, "ea_decoder_alpha", 0.0)
    set_default(args, "ea_beta", 0.0)
    set_default(args, "ea_kernel_size", 3)
    set_default(args, "pa_alpha", 0.0)
    set_default(args, "pa_conv_layers", 1)
    set_default(args, "drop_attention", "none")
    set_default(args, "drop_attention_p", 0.1)
    set_default(args, "drop_attention_window", 1)
    set_default(args, "drop_attention_rescale", "normalized")
    set_default(args, "drop_attention_on", list(ROLES))
    set_default(args, "ran_max_positions", 256)
    set_default(args, "lsra_kernel_sizes", list(lsra.LITE_KERNEL_SIZES))
    set_default(args, "lsra_weight_dropout", args.attention_dropout)
    set_default(args, "value_residual_lambdas", [0.5, 0.5])
    for flag in ("ran_fixed_init", "ran_no_layernorm", "ran_no_residual", "ran_first_layer_standard"):
        set_default(args, flag, False)
    set_default(args, "hcsa_std", 1.0)
    set_default(args, "hcsa_encoder_offsets", [-1, 1])
    set_default(args, "hcsa_decoder_offsets", [-1, 0])
    # a configuration the plugin filled in before --hcsa-normalize existed (a checkpoint: it
    # holds the defaults set above, but not this one) was built with HC-SA normalised over
    # the visible keys, with projection biases: it loads as it was trained
    set_default(args, "hcsa_normalize", "visible" if filled_before_hcsa_normalize else "none")
    set_default(args, "synthesizer_max_positions", 256)
    set_default(args, "synthesizer_fixed", False)
    for flag in POSITIONAL_EMBEDDING_OPTIONS:
        set_default(args, flag, False)
