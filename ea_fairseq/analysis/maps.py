"""Attention maps of a trained model: capture them in a forward pass and dump them.

:class:`AttentionCapture` collects, for one teacher-forced forward pass,

* the attention *weights* of every fairseq ``MultiheadAttention`` (the plugin's
  mechanisms are subclasses): each call is made with ``need_weights=True,
  need_head_weights=True`` (and through fairseq's own attention path rather than the
  fused PyTorch one, which only returns head averages), giving
  ``heads x batch x tgt x src`` per layer;
* the intermediate maps each mechanism reports to a map hook
  (:meth:`~ea_fairseq.modules.attention_maps.AttentionMechanism.register_map_hook`),
  which :meth:`AttentionCapture.record` receives with the layer and slot it watches: EA its ``dot_product``, ``convolution`` and ``logits`` per layer
  (EA Fig. 11), PA its ``prediction``, RAN its input-independent ``recurrent`` logits (HC-SA
  ``gaussian``, Syn-R ``synthesized``). The
  capture is generic over these keys. The maps are the same whichever backend computes a
  mechanism (a mechanism asks its operation for them while a hook listens).

Names: an *attention* is ``encoder.self``, ``decoder.self`` or ``decoder.cross``; a
*kind* is ``weights`` or a reported map's key. Arrays are ``(layers, heads, queries, keys)``;
a layer where the mechanism does not apply is NaN in its kinds (RAN with a standard
first layer), and entries the attention masks (zero weight) are zero in every kind.
Decoder rows are the positions that predict ``target[t]``; their input token is
``decoder_input[t]`` (``</s>`` first, fairseq's BOS), which also labels decoder
self-attention keys.
"""
import json
import logging
import os
from functools import partial
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from fairseq.modules import MultiheadAttention
from torch import Tensor

from . import ATTENTIONS
from .dumps import META_KEY
from ..modules.attention_mechanism import AttentionMechanism
from ..errors import OptionError
from ..safety.writers import replaced, write_text

logger = logging.getLogger(__name__)



# -- loading --------------------------------------------------------------------------------
def load_model(path: str, data: Optional[str] = None, overrides: Optional[dict] = None):
    """``(model, task, cfg)`` of a fairseq checkpoint, on the CPU, in eval mode.

    Uses ``checkpoint_utils.load_model_ensemble_and_task`` after ``import ea_fairseq``,
    whose loader reads it weights-only and refuses a configuration fairseq would evaluate
    unless it is literal (``ea_fairseq.safety.no_code``). ``data``: the directory holding
    the dictionaries (and splits); by default the checkpoint's own directory, as fairseq's hub
    does. The data directory a checkpoint records is a path from the file: never opened.
    """
    import ea_fairseq  # noqa: F401  (registers the plugin, validates checkpoints)
    from fairseq import checkpoint_utils

    arg_overrides = dict(overrides or {})
    arg_overrides["data"] = data if data is not None else os.path.dirname(os.path.abspath(path))
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=arg_overrides)
    model = models[0]
    model.eval()
    return model, task, cfg


def split_dataset(task, split: str):
    """The binarized ``split`` (test, valid, ...) of the task's data directory."""
    task.load_dataset(split, combine=False, epoch=1)
    return task.dataset(split)


def text_dataset(task, source_lines: Sequence[str], reference_lines: Optional[Sequence[str]] = None):
    """A dataset of already tokenized and BPE'd lines, mapped through the model's dictionaries."""
    from fairseq.data import LanguagePairDataset

    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary

    def encode(d, lines):
        return [d.encode_line(line.strip(), add_if_not_exist=False, append_eos=True).long()
                for line in lines]

    src = encode(src_dict, source_lines)
    tgt = encode(tgt_dict, reference_lines) if reference_lines is not None else None
    for side, d, encoded in (("source", src_dict, src), ("reference", tgt_dict, tgt or [])):
        unknown = sum(int(t.eq(d.unk()).sum()) for t in encoded)
        if unknown:
            logger.warning("%d %s tokens are not in the model's dictionary (<unk>); is the text "
                           "tokenized and BPE'd like the training data?", unknown, side)
    if tgt is not None and len(tgt) != len(src):
        raise ValueError(f"{len(src)} source lines but {len(tgt)} reference lines")
    cfg = getattr(task, "cfg", None)
    return LanguagePairDataset(
        src, np.array([len(s) for s in src]), src_dict,
        tgt, np.array([len(t) for t in tgt]) if tgt is not None else None, tgt_dict,
        left_pad_source=getattr(cfg, "left_pad_source", True),
        left_pad_target=getattr(cfg, "left_pad_target", False),
        shuffle=False,
    )


def read_lines(path: str) -> List[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


# -- capture --------------------------------------------------------------------------------
class AttentionCapture:
    """Context manager collecting the attention maps of the forward passes run inside it.

    ``result()`` gives ``{attention: {kind: [per-layer tensor (batch, heads, tgt, src)]}}``;
    a reported kind has ``None`` for layers that did not report it. Use one capture per
    forward pass.
    """

    def __init__(self, model, mechanism_maps: bool = True):
        self.model = model
        self.mechanism_maps = mechanism_maps  # also collect the mechanisms' intermediate maps
        self._handles = []
        self._maps: Dict[str, Dict[str, Dict[int, Tensor]]] = {}  # attention -> kind -> layer
        self._weights: Dict[str, Dict[int, Tensor]] = {}
        self._skip_flags = []

    def __enter__(self):
        for stack_name in ("encoder", "decoder"):
            stack = getattr(self.model, stack_name, None)
            for layer_index, layer in enumerate(getattr(stack, "layers", ())):
                for module in layer.modules():
                    if isinstance(module, (MultiheadAttention, AttentionMechanism)):
                        self._watch(module, stack_name, layer_index)
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        for module, flag in self._skip_flags:
            module.skip_embed_dim_check = flag
        return False

    def _watch(self, module, stack_name: str, layer_index: int) -> None:
        slot = "cross" if module.encoder_decoder_attention else "self"
        name = f"{stack_name}.{slot}"
        # fairseq's fused path (F.multi_head_attention_forward) returns head averages only;
        # skipping the embed-dim check routes the call through fairseq's own path
        if isinstance(module, MultiheadAttention):
            self._skip_flags.append((module, module.skip_embed_dim_check))
            module.skip_embed_dim_check = True

        def pre(mod, args, kwargs):
            args = list(args)
            if len(args) > 5:
                args[5] = True
            else:
                kwargs["need_weights"] = True
            kwargs["need_head_weights"] = True
            return tuple(args), kwargs

        def post(mod, args, kwargs, output):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is not None and weights.dim() == 4:
                self._weights.setdefault(name, {})[layer_index] = weights.detach().transpose(0, 1).float()

        self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(module.register_forward_hook(post, with_kwargs=True))
        if self.mechanism_maps and isinstance(module, AttentionMechanism):
            self._handles.append(module.register_map_hook(partial(self.record, stack_name, layer_index, slot)))

    def record(self, stack_name: str, layer_index: int, slot: str, maps: Dict[str, Tensor]) -> None:
        """Keep the intermediate maps a mechanism reported (its map hook)."""
        kinds = self._maps.setdefault(f"{stack_name}.{slot}", {})
        for kind, tensor in maps.items():
            kinds.setdefault(kind, {})[layer_index] = tensor.float()

    def result(self) -> Dict[str, Dict[str, List[Tensor]]]:
        out: Dict[str, Dict[str, List[Tensor]]] = {}
        for name, layers in self._weights.items():
            out.setdefault(name, {})["weights"] = [layers[i] for i in sorted(layers)]
        for name, kinds in self._maps.items():
            n = len(out.get(name, {}).get("weights", ()))
            for kind, layers in kinds.items():
                # None where the mechanism did not report (e.g. a standard first RAN layer)
                out.setdefault(name, {})[kind] = [layers.get(i) for i in range(max(n, max(layers) + 1))]
        return {k: out[k] for k in sorted(out, key=_order)}


def _order(name: str):
    return (ATTENTIONS.index(name) if name in ATTENTIONS else len(ATTENTIONS), name)


# -- forward passes ---------------------------------------------------------------------------
def build_generator(task, model, beam: int = 5, max_len_a: float = 0.0, max_len_b: int = 200):
    """fairseq's beam search with fairseq-generate's defaults (max length 0 * src + 200)."""
    from fairseq.sequence_generator import SequenceGenerator

    return SequenceGenerator([model], task.target_dictionary, beam_size=beam,
                             max_len_a=max_len_a, max_len_b=max_len_b)


def with_hypotheses(sample, generator, task) -> dict:
    """``sample`` with its target replaced by the best beam hypothesis of each sentence."""
    from fairseq.data import data_utils

    d = task.target_dictionary
    with torch.no_grad():
        hypos = generator.forward(sample)
    best = [h[0]["tokens"].cpu() for h in hypos]
    target = data_utils.collate_tokens(best, d.pad(), d.eos(), left_pad=False)
    prev = data_utils.collate_tokens(best, d.pad(), d.eos(), left_pad=False, move_eos_to_beginning=True)
    sample = dict(sample)
    sample["target"] = target
    sample["net_input"] = dict(sample["net_input"], prev_output_tokens=prev)
    return sample


def capture(model, sample, mechanism_maps: bool = True) -> Dict[str, Dict[str, List[Tensor]]]:
    """Teacher-forced forward pass of ``sample`` (its ``prev_output_tokens``), captured."""
    net = sample["net_input"]
    with torch.no_grad(), AttentionCapture(model, mechanism_maps) as cap:
        model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"])
    return cap.result()


def query_masks(sample, pad: int) -> Dict[str, Tensor]:
    """(batch, queries) masks of real tokens for each attention."""
    src = sample["net_input"]["src_tokens"].ne(pad)
    tgt = sample["target"].ne(pad)
    return {"encoder.self": src, "decoder.self": tgt, "decoder.cross": tgt}


def batch_indices(dataset, ids: Optional[Iterable[int]] = None, max_tokens: Optional[int] = 4000,
                  max_sentences: Optional[int] = None) -> List[np.ndarray]:
    """Index groups of ``dataset`` (all of it, or ``ids``), grouped by length."""
    from fairseq.data import data_utils

    indices = np.arange(len(dataset)) if ids is None else np.asarray(list(ids), dtype=np.int64)
    if len(indices) == 0:
        return []
    sizes = np.array([dataset.num_tokens(int(i)) for i in indices])
    indices = indices[np.argsort(sizes, kind="stable")]
    return list(data_utils.batch_by_size(indices, dataset.num_tokens, max_tokens=max_tokens,
                                         max_sentences=max_sentences))


def within_positions(model, task, dataset, ids: Sequence[int]) -> Tuple[List[int], List[int]]:
    """``(kept, skipped)``: the sentences ``ids`` of ``dataset`` within the model's
    ``max_positions`` (``utils.resolve_max_positions`` of the task's and the model's, as
    fairseq-generate), and those longer, which fairseq-generate skips with
    ``--skip-invalid-size-inputs-valid-test``: a map is quadratic in a sentence's length."""
    from fairseq import utils

    limit = utils.resolve_max_positions(task.max_positions(), model.max_positions())
    kept, skipped = dataset.filter_indices_by_size(np.asarray(list(ids), dtype=np.int64), limit)
    return [int(i) for i in kept], [int(i) for i in skipped]


def collate(dataset, indices) -> dict:
    return dataset.collater([dataset[int(i)] for i in indices])


# -- dumps ------------------------------------------------------------------------------------
def _per_sentence(layers: List[Optional[Tensor]]) -> Dict[str, np.ndarray]:
    """Per-layer tensors of a batch of one -> ``{"": (layers, ...)}`` (or one per layer).

    A layer that did not log the kind (None) becomes NaN; a scalar placeholder (PA's
    "no prediction" in its first layer) becomes a zero map.
    """
    arrays = []
    for t in layers:
        if t is not None and t.dim() == 4 and t.size(0) == 1:
            t = t[0]
        arrays.append(None if t is None else t.cpu().numpy().astype(np.float32))
    shapes = {a.shape for a in arrays if a is not None and a.size > 1}
    if len(shapes) == 1:
        (shape,) = shapes
        arrays = [np.full(shape, np.nan, np.float32) if a is None
                  else np.broadcast_to(a.reshape(()) if a.size == 1 else a, shape) for a in arrays]
        return {"": np.stack(arrays)}
    return {f".layer{i + 1}": a for i, a in enumerate(arrays) if a is not None}


def _zero_masked(kinds: Dict[str, List[Tensor]]) -> None:
    """Zero the mechanisms' maps where the attention is masked (zero weight: future
    positions, padding), as EA's and PA's logged logits already are."""
    weights = kinds.get("weights")
    if not weights:
        return
    for kind, layers in kinds.items():
        if kind == "weights" or len(layers) != len(weights):
            continue
        kinds[kind] = [t.masked_fill(w == 0, 0.0) if t is not None and t.shape == w.shape else t
                       for t, w in zip(layers, weights)]


def _strings(d, tokens: Tensor) -> List[str]:
    return [d[int(t)] for t in tokens]


def dump(model, task, dataset, ids: Sequence[int], out: str, hypothesis: bool = False,
         beam: int = 5, extra_meta: Optional[dict] = None, max_len: Tuple[float, int] = (0.0, 200)) -> dict:
    """Write the maps of sentences ``ids`` to ``out`` (.npz) and ``out`` .json; returns the meta.
    Sentences longer than the model's max_positions are skipped (:func:`within_positions`; the
    meta lists them), and :class:`OptionError` when every one is.

    With ``hypothesis`` the decoder is teacher-forced on the best beam-``beam``
    hypothesis (max length ``max_len[0] * src_len + max_len[1]``), else on the reference.
    """
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    generator = build_generator(task, model, beam, *max_len) if hypothesis else None
    arrays: Dict[str, np.ndarray] = {}
    sentences = []
    for sid in ids:
        if not 0 <= sid < len(dataset):
            raise IndexError(f"sentence id {sid} outside 0..{len(dataset) - 1}")
    ids, skipped = within_positions(model, task, dataset, ids)
    if not ids:
        from fairseq import utils

        raise OptionError(f"sentences {skipped} are longer than the model's max_positions "
                          f"{utils.resolve_max_positions(task.max_positions(), model.max_positions())}; "
                          "pick shorter ones (--ids)")
    for sid in ids:
        sample = dataset.collater([dataset[sid]])
        if generator is not None:
            sample = with_hypotheses(sample, generator, task)
        elif sample.get("target") is None:
            raise ValueError("no reference target: give references or use the beam hypothesis")
        maps = capture(model, sample)
        src = sample["net_input"]["src_tokens"][0]
        src = src[src.ne(src_dict.pad())]
        tgt = sample["target"][0]
        keep = tgt.ne(tgt_dict.pad())
        prev = sample["net_input"]["prev_output_tokens"][0][keep]
        entry = {
            "id": int(sid),
            "source": _strings(src_dict, src),
            "decoder_input": _strings(tgt_dict, prev),
            "target": _strings(tgt_dict, tgt[keep]),
            "maps": {},
        }
        for attention, kinds in maps.items():
            entry["maps"][attention] = []
            _zero_masked(kinds)
            for kind, layers in kinds.items():
                for suffix, arr in _per_sentence(layers).items():
                    key = f"{sid}/{attention}/{kind}{suffix}"
                    arrays[key] = arr
                    entry["maps"][attention].append(kind + suffix)
        sentences.append(entry)
    meta = {
        "format": "ea_fairseq.analysis dump v1",
        "layout": "key '<id>/<attention>/<kind>' -> float32 (layers, heads, queries, keys)",
        "decoder_targets": "beam hypothesis" if hypothesis else "reference",
        "beam": beam if hypothesis else None,
        "sentences": sentences,
        "skipped_longer_than_max_positions": skipped,
        **(extra_meta or {}),
    }
    text = json.dumps(meta, ensure_ascii=False, indent=1)
    arrays[META_KEY] = np.array(text)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with replaced(out if out.endswith(".npz") else out + ".npz") as f:  # (np.savez's name)
        np.savez_compressed(f, **arrays)
    write_text(os.path.splitext(out)[0] + ".json", text)
    return meta
