"""How the layers of the plugin's stacks hand each other values: explicitly, one forward pass
at a time, checkpointed with what they read and hand on.

The encoder and the decoder (:class:`AttentionMapsMixin`) open one
:class:`~ea_fairseq.modules.attention_map_carrier.StackPass` per forward pass and hand it to
their layers; each layer (:class:`StackLayer`) runs fairseq's layer as its body with what it
reads from earlier layers (the previous layer's attention logits, value residual's first
values, RAN's matrices, the target padding) as explicit inputs and what it hands on as
explicit outputs, which is also what it hands fairseq's activation checkpointing
(``--checkpoint-activations``, ``--offload-activations``: :func:`checkpointed`), so a
recomputed layer gets the same inputs, under the forward's autocast, and gradients reach
them.
"""
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import FrozenSet, Optional, Tuple

import torch
from fairseq.distributed import fsdp_wrap
from fairseq.modules.checkpoint_activations import CheckpointFunction, pack_kwargs, unpack_non_tensors
from torch import Tensor

from ..modules.attention_map_carrier import LayerMaps, StackPass, bound
from ..modules.attention_mechanism import AttentionMechanism

def checkpointed(function, offload: bool, *args, **kwargs):
    """``function(*args, **kwargs)`` under fairseq's activation checkpointing (its
    ``CheckpointFunction``, as its ``checkpoint_wrapper`` calls it): run without storing
    activations, run again in the backward pass with the same tensor arguments, random
    state and autocast settings (fairseq's backward runs outside the forward's autocast,
    e.g. ``--amp``: recomputed in another precision, a layer would compute other values
    than its forward did, and mix dtypes with what it saved), gradients to every tensor
    argument; ``offload`` keeps those arguments on the CPU in between."""
    keys, flat = pack_kwargs(*args, **kwargs)
    context = {"offload": offload}
    outputs = CheckpointFunction.apply(partial(under_autocast, autocast_settings(), function), context, keys, *flat)
    return unpack_non_tensors(outputs, context.get("packed_non_tensor_outputs"))


def autocast_settings():
    """Autocast's settings here and now, per device type (the CPU's, and CUDA's where there
    is one): ``(device_type, enabled, dtype)`` each, and whether its cache is on."""
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    return (tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices),
            torch.is_autocast_cache_enabled())


def under_autocast(settings, function, *args, **kwargs):
    """``function(*args, **kwargs)`` with autocast as :func:`autocast_settings` found it."""
    devices, cache = settings
    with ExitStack() as stack:
        for device_type, enabled, dtype in devices:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
        return function(*args, **kwargs)


class StackLayer:
    """What a layer of this plugin's stacks adds to fairseq's (a mixin before fairseq's layer
    class): the values it reads from the layers before it go in, and the values it hands on
    come out, as explicit tensors of one call of its body (:meth:`body`, fairseq's layer),
    under activation checkpointing where the model asks for it.

    Its stack sets :attr:`stack_pass` for the duration of a forward pass and, once built,
    which values the layer reads and hands on (:meth:`setup_stack_layer`); :func:`wrap_layer`
    sets ``checkpoint`` and ``offload``."""

    def init_stack_layer(self) -> None:
        self.stack_pass: Optional[StackPass] = None
        self.reads: Tuple[str, ...] = ()
        self.hands: Tuple[str, ...] = ()
        self.wanted: FrozenSet[str] = frozenset()
        self.checkpoint, self.offload = False, False
        self._mechanisms = ()
        self.hands_target_padding = False

    def mechanisms(self):
        """The modules of this layer that read or hand on values of the pass."""
        return [m for m in self.modules() if m is not self and hasattr(m, "carried_names")]

    def carried_names(self):
        """``(reads, writes)`` of the layer's modules, each a set of names."""
        reads, writes = set(), set()
        for module in self.mechanisms():
            r, w = module.carried_names()
            reads.update(r)
            writes.update(w)
        return reads, writes

    def setup_stack_layer(self, reads: Tuple[str, ...], hands: Tuple[str, ...]) -> None:
        self.reads, self.hands, self.wanted = tuple(reads), tuple(hands), frozenset(hands)
        self._mechanisms = self.mechanisms()
        # the encoder-decoder attention of a mechanism is handed the target padding (fairseq
        # gives it only the source's), whose rows a map transform treats as neutral:
        # left-padded targets' padded rows then do not reach real rows
        self.hands_target_padding = isinstance(getattr(self, "encoder_attn", None), AttentionMechanism)

    def forward(self, x, *args, **kwargs):
        stack_pass = self.stack_pass
        inputs = {}
        if stack_pass is not None:
            for name in self.reads:
                inputs[name] = stack_pass.values.get(name)
        if self.hands_target_padding:
            inputs["target_padding"] = kwargs.get("self_attn_padding_mask")
        names = tuple(inputs)
        if self.checkpoint and torch.is_grad_enabled():
            out = checkpointed(self.body, self.offload, stack_pass, names, x, *args, *inputs.values(), **kwargs)
        else:
            out = self.body(stack_pass, names, x, *args, *inputs.values(), **kwargs)
        result, handed = out[:len(out) - len(self.hands)], out[len(out) - len(self.hands):]
        if stack_pass is not None:
            for name, value in zip(self.hands, handed):
                if value is not None:
                    stack_pass.values[name] = value
        return result[0] if len(result) == 1 else result

    def body(self, stack_pass: Optional[StackPass], names: Tuple[str, ...], x, *rest, **kwargs):
        """fairseq's layer on ``x``, its arguments and ``rest``'s last ``len(names)`` values
        (what the layer reads, by name); returns its result's items, then one value (or
        None) per name the layer hands on."""
        args, values = rest[:len(rest) - len(names)], rest[len(rest) - len(names):]
        # what this call's attentions read and hand on
        with bound(self._mechanisms, LayerMaps(stack_pass, dict(zip(names, values)), self.wanted)) as maps:
            result = super().forward(x, *args, **kwargs)
        result = (result,) if isinstance(result, Tensor) else tuple(result)  # (an encoder layer's x alone)
        return result + tuple(map(maps.outgoing.get, self.hands))


def wrap_layer(layer, cfg):
    """fairseq's wrapping policy for a layer this plugin builds itself (see its
    ``build_encoder_layer``): activation checkpointing -- the layer's own, whose inputs and
    outputs include what it reads from and hands to the other layers (:class:`StackLayer`)
    -- then FSDP."""
    checkpoint = cfg.checkpoint_activations
    layer.checkpoint, layer.offload = bool(checkpoint), bool(checkpoint and cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


class AttentionMapsMixin:
    """What an encoder or decoder of this plugin adds to fairseq's: one
    :class:`~ea_fairseq.modules.attention_map_carrier.StackPass` per forward pass handed to
    its layers, and what its attentions share across layers (RAN's matrices), built by their
    class (:meth:`~ea_fairseq.modules.attention_mechanism.AttentionMechanism.stack_shared`),
    owned here and asked for the values of every pass."""

    def setup_attention_maps(self, cfg, heads: int) -> None:
        self.stack_pass: Optional[StackPass] = None
        self.stack_layers = [m for m in self.modules() if isinstance(m, StackLayer)]
        by_class = {}
        for module in self.modules():
            if isinstance(module, AttentionMechanism):
                by_class.setdefault(type(module), []).append(module)
        self.shared_names, provided = [], set()
        for kind, modules in by_class.items():
            shared = kind.stack_shared(modules, cfg, heads)
            if shared is not None:
                name, module = shared
                setattr(self, name, module)
                self.shared_names.append(name)
                provided.update(module.provided_names())
        # each layer reads what an earlier layer hands on or the pass provides (RAN's
        # matrices), and hands on only what a later layer reads (the last one: nothing)
        names = [layer.carried_names() for layer in self.stack_layers]
        for i, layer in enumerate(self.stack_layers):
            earlier = provided.union(*(writes for _, writes in names[:i]))
            later = set().union(*(reads for reads, _ in names[i + 1:]))
            layer.setup_stack_layer(tuple(sorted(names[i][0] & earlier)), tuple(sorted(names[i][1] & later)))

    def next_layer_index(self) -> int:
        """Index of the layer being built, the one source of layer indices: fairseq builds
        a stack's layers in order, so it is the layer's position in ``self.layers``."""
        self._layers_built = getattr(self, "_layers_built", 0) + 1
        return self._layers_built - 1

    @contextmanager
    def attention_scope(self, length: int, incremental_state=None):
        """One forward pass of the stack: a fresh :class:`StackPass` handed to its layers,
        with what its shared modules provide (RAN's matrices) computed once (a decoding run
        keeps them in its incremental state)."""
        values = {}
        for name in self.shared_names:
            values.update(getattr(self, name).pass_values(length, incremental_state))
        stack_pass = StackPass(values)
        self.stack_pass = stack_pass
        for layer in self.stack_layers:
            layer.stack_pass = stack_pass
        try:
            yield stack_pass
        finally:
            self.stack_pass = None
            for layer in self.stack_layers:
                layer.stack_pass = None
