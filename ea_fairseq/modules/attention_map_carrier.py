"""What the layers of one stack hand each other in one forward pass, as explicit values.

An encoder or a decoder of this plugin opens one :class:`StackPass` per forward pass (a
full pass, or one decoding step) and hands it to its layers. It holds

* ``values``: named tensors the layers read -- the previous layer's attention logits per
  attention kind (``"self"``, ``"cross"``), the first layer's values of value residual
  learning (``"self:values"``), RAN's matrix of each RAN layer (``"ran:<k>"``, computed by
  the stack when the pass opens);
* what every layer derives alike from the pass's masks (:meth:`StackPass.derive`: the
  boolean masks, the rows with every key masked, positions), computed by the first layer
  that asks and read by the others under the same name.

A layer takes the values it reads out of the pass, runs its body with them as explicit
inputs and returns what it hands on as explicit outputs (which the pass then holds for the
layers after it); only what a later layer reads is handed on. Inside the body the layer's
attention modules see one :class:`LayerMaps`: the layer's inputs, and where to put its
outputs. So a layer recomputed alone (activation checkpointing) gets the same inputs and
gives the same outputs, and gradients flow through both. Neither object is a module: they
never enter the state dict, and a pass's values die with it.
"""
from contextlib import contextmanager
from typing import Callable, Dict, FrozenSet, Iterable, Optional, TypeVar

from torch import Tensor

T = TypeVar("T")


class StackPass:
    """One forward pass of an encoder or a decoder (see the module docstring)."""

    __slots__ = ("values", "derived")

    def __init__(self, values: Optional[Dict[str, Tensor]] = None):
        self.values: Dict[str, Tensor] = dict(values or {})
        #: what every layer derives alike from the pass's masks (fairseq's loops hand every
        #: layer of a pass the same masks), by name: computed by the first layer that asks
        self.derived: Dict[str, object] = {}

    def derive(self, name: str, compute: Callable[[], T]) -> T:
        """``compute()``, once per pass (see :attr:`derived`)."""
        value = self.derived.get(name)
        if value is None:
            value = self.derived[name] = compute()
        return value


class LayerMaps:
    """What one layer's attention modules read from the layers before it (``inputs``) and
    hand to the layers after it (``outgoing``, only the names in ``wanted``)."""

    __slots__ = ("stack_pass", "inputs", "wanted", "outgoing")

    def __init__(self, stack_pass: Optional[StackPass], inputs: Dict[str, Optional[Tensor]],
                 wanted: FrozenSet[str] = frozenset()):
        self.stack_pass = stack_pass
        self.inputs = inputs
        self.wanted = wanted
        self.outgoing: Dict[str, Tensor] = {}

    def previous(self, name: str) -> Optional[Tensor]:
        return self.inputs.get(name)

    def hand_on(self, name: str, tensor: Tensor) -> None:
        if name in self.wanted:
            self.outgoing[name] = tensor


@contextmanager
def bound(modules: Iterable, maps: Optional[LayerMaps]):
    """``maps`` for ``modules`` (each reads it as ``module.layer_maps``) while the block runs."""
    modules = list(modules)
    for module in modules:
        module.layer_maps = maps
    try:
        yield maps
    finally:
        for module in modules:
            module.layer_maps = None


def layer_maps(*modules, previous: Optional[Dict[str, Tensor]] = None, wanted: Iterable[str] = ()):
    """Run attention modules outside a stack as one layer of it: ``with layer_maps(attn,
    previous={"self": logits}, wanted=("self",)) as maps: attn(...)``, then
    ``maps.outgoing["self"]`` is what it hands on."""
    return bound(modules, LayerMaps(None, dict(previous or {}), frozenset(wanted)))
