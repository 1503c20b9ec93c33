"""Load fairseq checkpoints with torch's weights-only unpickler still on.

torch >= 2.6 loads checkpoints with ``weights_only=True``; fairseq checkpoints also hold
their configuration (an ``argparse.Namespace`` and omegaconf containers), which that
unpickler refuses unless allow-listed. Instead of switching the safety off, this module
allow-lists exactly those configuration classes (nothing that can execute code) when the
plugin is imported, so ``fairseq-train --restore-file``, ``fairseq-generate`` and
:func:`load_checkpoint` work while any other pickled object is still refused.
"""
import argparse
import collections
import typing
from typing import Any, Dict, List

import torch


def fairseq_checkpoint_globals() -> List[Any]:
    """The classes a fairseq checkpoint's configuration is made of.

    ``fairseq-train`` writes its options as an ``argparse.Namespace`` (the only class a
    checkpoint of the current fairseq needs); checkpoints written through hydra or by
    older fairseq keep omegaconf containers, whose node classes are listed too.
    """
    from omegaconf import DictConfig, ListConfig, nodes
    from omegaconf.base import ContainerMetadata, Metadata

    return [
        argparse.Namespace,
        DictConfig,
        ListConfig,
        ContainerMetadata,
        Metadata,
        nodes.AnyNode,
        typing.Any,
        collections.defaultdict,
    ]


def allow_fairseq_checkpoints() -> None:
    """Allow-list the configuration classes of fairseq checkpoints for weights-only loads."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:  # torch < 2.4 has no weights-only default to work around
        add(fairseq_checkpoint_globals())


def load_checkpoint(path: str) -> Dict[str, Any]:
    """``torch.load`` a fairseq checkpoint onto the CPU, weights-only."""
    allow_fairseq_checkpoints()
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # the unpickler names the refused global
        raise RuntimeError(
            f"could not load {path} with torch's weights-only loader: {err}\n"
            "If the file is a fairseq checkpoint that holds a class this list lacks, report "
            "it; ea_fairseq does not switch the weights-only safety off."
        ) from err
