"""The carrier that hands a layer's attention maps to the next layer of its stack, and what
every layer of one forward pass derives alike from the pass's masks (computed once)."""
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

from torch import Tensor

T = TypeVar("T")


def shared_in_pass(carrier: Optional["AttentionMapCarrier"], name: str,
                   inputs: Tuple[Optional[Tensor], ...], compute: Callable[[], T]) -> T:
    """:meth:`AttentionMapCarrier.shared`, or ``compute()`` for a module without a stack."""
    return compute() if carrier is None else carrier.shared(name, inputs, compute)


class AttentionMapCarrier:
    """Hands each layer's attention logits to the next layer of the same stack.

    One carrier is owned by an encoder or a decoder and shared by its layers' attention
    modules (``slot`` names the attention kind: ``"self"`` or ``"cross"``). It is a plain
    object, not a module: it never enters the state dict, and :meth:`scope` empties it
    before and after every forward pass of its stack, so no tensor (or autograd graph)
    outlives the pass that made it.
    """

    def __init__(self):
        self._last: Dict[str, Tensor] = {}
        self._shared: List[Tuple[str, Tuple[Optional[Tensor], ...], object]] = []

    @contextmanager
    def scope(self):
        self._last.clear()
        self._shared.clear()
        try:
            yield self
        finally:
            self._last.clear()
            self._shared.clear()

    def shared(self, name: str, inputs: Tuple[Optional[Tensor], ...], compute: Callable[[], T]) -> T:
        """``compute()``, once per forward pass for the same ``inputs`` (the same tensor
        objects): what every layer of the stack derives alike from the pass's masks."""
        for entry_name, entry_inputs, value in self._shared:
            if entry_name == name and len(entry_inputs) == len(inputs) and all(
                    a is b for a, b in zip(entry_inputs, inputs)):
                return value
        value = compute()
        self._shared.append((name, inputs, value))
        return value

    def previous(self, slot: str) -> Optional[Tensor]:
        """The logits the previous layer handed on for ``slot`` (None in the first layer)."""
        return self._last.get(slot)

    def hand_on(self, slot: str, logits: Tensor) -> None:
        self._last[slot] = logits
