"""DropAttention and one-sided positional embeddings on fairseq's own transformer, in one
flag: ``--arch transformer_lite --drop-attention element`` (or ``--arch transformer``,
...), ``--arch transformer --no-encoder-positional-embeddings``.

fairseq's ``transformer`` model has neither option, so its architectures (``transformer``,
``transformer_iwslt_de_en``, ..., and the plugin's ``transformer_lite``) are pointed at
:class:`BaselineTransformerModel` in fairseq's ``ARCH_MODEL_REGISTRY`` (a row of
:mod:`ea_fairseq.side_effects`, made when the plugin is loaded): fairseq's ``TransformerModel``
plus only these options.
Without them it builds fairseq's ``TransformerModel`` itself, the class untouched (every
vanilla run, and the benchmark's twins, are fairseq's model); with them, the plugin's
transformer with vanilla attention in every role, DropAttention where asked and the
positional embeddings of one side left out. With DropAttention only, the parameters are
the same either way, and DropAttention acts in training only, so such a checkpoint also
loads into fairseq's ``TransformerModel`` without the plugin.
"""
from fairseq.models.transformer import TransformerModel

from ..errors import OptionError
from . import attention_variants as variants
from .ea_transformer import EATransformerModel


class BaselineTransformerModel(EATransformerModel):
    """fairseq's transformer (its own class when these options are off) + DropAttention and
    one-sided positional embeddings."""

    @classmethod
    def add_args(cls, parser):
        TransformerModel.add_args(parser)
        variants.add_drop_attention_args(parser)
        variants.add_positional_embedding_args(parser)

    @classmethod
    def build_from_namespace(cls, args, task):
        one_sided = any(getattr(args, name, False) for name in variants.POSITIONAL_EMBEDDING_OPTIONS)
        if getattr(args, "drop_attention", None) in (None, "none"):
            stray = [f"--{name.replace('_', '-')}" for name in variants.DROP_ATTENTION_OPTIONS
                     if getattr(args, name, None) is not None]
            if stray:
                raise OptionError(f"{', '.join(stray)} given without --drop-attention: DropAttention "
                                 "is off unless --drop-attention is column or element")
            if not one_sided:
                return TransformerModel.build_model(args, task)
        return super().build_from_namespace(args, task)


def with_plugin_options(model_class):
    """What an architecture of fairseq's ``TransformerModel`` (``model_class``) is pointed at."""
    return BaselineTransformerModel
