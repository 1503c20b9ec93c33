"""Build an architecture without data, the way ``fairseq-train`` builds it: fairseq's
training option parser, the architecture's defaults, and a placeholder dictionary standing
in for the task's. The tests, the FLOPs counter and the benchmark all build through here.
"""
from types import SimpleNamespace
from typing import Optional, Tuple

import torch
from fairseq import options
from fairseq.data import Dictionary
from fairseq.models import ARCH_MODEL_REGISTRY


def placeholder_dictionary(size: int) -> Dictionary:
    """A dictionary of ``size`` symbols in all: fairseq's four special symbols, then
    made-up words ``w0, w1, ...``."""
    d = Dictionary()
    if size < len(d):
        raise ValueError(f"a fairseq dictionary has at least {len(d)} symbols (its specials), got {size}")
    for i in range(size - len(d)):
        d.add_symbol(f"w{i}")
    return d


class SizedDictionary(Dictionary):
    """fairseq's dictionary with its four special symbols and a length of ``size``: what a
    model reads when it is built (``len``, ``pad()``, ``eos()``, ...), without a stored
    symbol for every entry."""

    def __init__(self, size: int):
        super().__init__()
        if size < len(self.symbols):
            raise ValueError(f"a fairseq dictionary has at least {len(self.symbols)} symbols (its specials), got {size}")
        self.size = size

    def __len__(self):
        return self.size

    def __eq__(self, other):
        return isinstance(other, SizedDictionary) and other.size == self.size and other.indices == self.indices


def parse_options(arch: str, *model_options: str):
    """fairseq-train's arguments for ``--arch arch`` and ``model_options`` (no data needed)."""
    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, ["/nonexistent-data", "--arch", arch, *model_options])


def build_model(arch: str, *model_options: str, vocab: int = 1000,
                dictionary: Optional[Dictionary] = None, seed: int = 1,
                meta: bool = False) -> Tuple[torch.nn.Module, object]:
    """``(model, args)``: ``arch`` built with ``model_options`` after ``torch.manual_seed(seed)``,
    source and target sharing ``dictionary`` (default: :func:`placeholder_dictionary` of
    ``vocab`` symbols). ``meta=True`` builds on PyTorch's meta device: shapes without
    storage, all that counting parameters and FLOPs needs."""
    args = parse_options(arch, *model_options)
    d = dictionary if dictionary is not None else placeholder_dictionary(vocab)
    task = SimpleNamespace(source_dictionary=d, target_dictionary=d)
    torch.manual_seed(seed)
    model_class = ARCH_MODEL_REGISTRY[args.arch]
    if meta:
        with torch.device("meta"):
            return model_class.build_model(args, task), args
    return model_class.build_model(args, task), args


def build_on_meta(model_cfg, source_size: int, target_size: int, task_class=None, task_cfg=None):
    """The model fairseq builds from ``model_cfg`` (a copy), on torch's ``meta`` device: no
    memory, no data. The task's dictionaries are placeholders of ``source_size`` and
    ``target_size`` symbols (one dictionary when they are equal, as a joined dictionary is);
    with ``task_class`` the task's own ``build_model`` runs (``task_class(task_cfg, src, tgt)``),
    else fairseq's ``models.build_model`` with a stand-in task."""
    import copy

    from fairseq import models

    source = SizedDictionary(source_size)
    target = source if target_size == source_size else SizedDictionary(target_size)
    with torch.device("meta"):
        if task_class is None:
            task = SimpleNamespace(source_dictionary=source, target_dictionary=target)
            model = models.build_model(copy.deepcopy(model_cfg), task)
        else:
            model = task_class(task_cfg, source, target).build_model(copy.deepcopy(model_cfg), from_checkpoint=True)
    # a module that makes its parameters with ``torch.Tensor(...)`` (fairseq's
    # LightweightConv1dTBC, LSRA's convolution) ignores the default device: on meta too
    return model.to("meta")
