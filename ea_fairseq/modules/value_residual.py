"""Value residual learning (ResFormer), Zhou et al. 2024, *Value Residual Learning for
Alleviating Attention Concentration in Transformers*, Eq. (5)::

    V'_n = λ1 · V_1 + λ2 · V_n          (n ≥ 2; the first layer attends over V_1 itself)
    U_n  = A_n V'_n

``V_1`` is the first layer's value projection of its input, ``V_n`` layer n's; the paper's
default is λ1 = λ2 = 0.5. :class:`ValueResidualProjection` is the attention's own value
projection (an ``nn.Linear``, made by the attention in place of its plain one: same
parameters, same names in the state dict, same initialisation) that, in the first layer of
its stack, hands its output on to the later layers
(:mod:`~ea_fairseq.modules.attention_map_carrier`) and, in the later ones, mixes it with
that output. The mix is per position, so the values an attention caches for
incremental decoding are the mixed ones, exactly those a full pass computes; a decoding step
hands on the first layer's values of the step's own positions. The attention around it is
whichever variant the role uses, made with this value projection (``value_projection=``
:func:`value_projection`); plain dot-product attention is the plugin's
:class:`~ea_fairseq.modules.attention_maps.LogitMapAttention` then.
"""
from functools import partial

import torch.nn as nn
from torch import Tensor

#: the roles value residual learning is defined for (self-attention, as in the paper)
ROLES = ("encoder", "decoder")


class ValueResidualProjection(nn.Linear):
    """A value projection that mixes in the first layer's values (Eq. 5)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, slot: str, lambdas):
        super().__init__(in_features, out_features, bias=bias)
        self.slot = f"{slot}:values"
        self.lambdas = (float(lambdas[0]), float(lambdas[1]))
        self.layer_maps = None  # set by its layer while the layer runs

    def carried_names(self):
        return (self.slot,), (self.slot,)

    def forward(self, x: Tensor) -> Tensor:
        values = super().forward(x)
        maps = self.layer_maps
        first = None if maps is None else maps.previous(self.slot)
        if first is None:  # the first layer of the stack: V_1
            if maps is not None:
                maps.hand_on(self.slot, values)
            return values
        first_weight, own_weight = self.lambdas
        return first_weight * first + own_weight * values

    def extra_repr(self) -> str:
        return super().extra_repr() + f", value_residual_lambdas={self.lambdas}"


def value_projection(slot: str, lambdas):
    """The ``value_projection`` factory an attention takes: ``(in, out, bias=) -> projection``."""
    return partial(ValueResidualProjection, slot=slot, lambdas=lambdas)
