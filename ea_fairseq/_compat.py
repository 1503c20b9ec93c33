"""Checks that the installed fairseq is one this plugin is built against."""


def check_fairseq() -> None:
    try:
        import fairseq  # noqa: F401
        from fairseq.models.transformer import TransformerEncoderBase  # noqa: F401
        from fairseq.modules import MultiheadAttention
    except ImportError as err:
        raise ImportError(
            "ea_fairseq needs fairseq newer than 0.12.2 (upstream main; 0.12.2 from PyPI does "
            "not import on Python 3.11). Run `bash scripts/setup_env.sh` for the tested "
            "environment, or `pip install ve-fairseq==0.12.3` (or fairseq-fixed) next to a "
            f"pinned torch. Import failed with: {err}"
        ) from err
    if not hasattr(MultiheadAttention, "_set_skip_embed_dim_check"):
        raise ImportError(
            f"fairseq {getattr(fairseq, '__version__', '?')} is too old for ea_fairseq: its "
            "MultiheadAttention lacks skip_embed_dim_check (upstream main since 2022). "
            "Install ve-fairseq==0.12.3 or a recent fairseq checkout."
        )
