"""Transformer-Lite, the baseline of EA Table 5 (Wu et al., 2020): 6+6 layers, every
dimension 160 (embeddings, FFN, attention), 4 heads. Registered on fairseq's own
``transformer`` model, so the baseline is fairseq's code untouched."""
from fairseq.models import register_model_architecture
from fairseq.models.transformer.transformer_legacy import base_architecture

LITE_DIM = 160


@register_model_architecture("transformer", "transformer_lite")
def transformer_lite(args):
    for side in ("encoder", "decoder"):
        setattr(args, f"{side}_embed_dim", getattr(args, f"{side}_embed_dim", LITE_DIM))
        setattr(args, f"{side}_ffn_embed_dim", getattr(args, f"{side}_ffn_embed_dim", LITE_DIM))
        setattr(args, f"{side}_attention_heads", getattr(args, f"{side}_attention_heads", 4))
        setattr(args, f"{side}_layers", getattr(args, f"{side}_layers", 6))
    base_architecture(args)
