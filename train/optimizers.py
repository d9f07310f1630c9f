"""The optimizers a run may use, by name: the one registry ``--optimizer`` and the planner read.

``sgd``: torch's SGD with momentum (Goyal et al.'s recipe, the default).
``lars``: :class:`dimd.train.lars.LARS`, each layer's rate scaled by its trust
ratio, for the large global batches where SGD stops converging in as few
updates (MLPerf's large-batch ResNet-50 runs use it). Both get the same
parameter groups (weight decay on weights only, :func:`dimd.train.sgd.parameter_groups`),
so a checkpoint's optimizer state has the same layout either way.
"""

from __future__ import annotations

import torch
from torch import nn

from dimd.errors import ConfigError
from dimd.train.config import LARS_TRUST, OPTIMIZERS
from dimd.train.lars import LARS



def build_optimizer(name: str, model: nn.Module, *, lr: float, momentum: float, weight_decay: float,
                    nesterov: bool = False, decay_bn_and_bias: bool = False,
                    trust: float = LARS_TRUST) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``model``'s trainable parameters; ``trust`` is LARS's eta (``sgd`` has none)."""
    from dimd.train.sgd import make_optimizer, parameter_groups

    if name == "sgd":
        return make_optimizer(model, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                              decay_bn_and_bias=decay_bn_and_bias)
    if name == "lars":
        return LARS(parameter_groups(model, weight_decay, decay_bn_and_bias=decay_bn_and_bias), lr=lr,
                    momentum=momentum, weight_decay=weight_decay, trust=trust, nesterov=nesterov and momentum > 0,
                    decay_bn_and_bias=decay_bn_and_bias)
    raise ConfigError("optimizer", f"must be one of {', '.join(OPTIMIZERS)} (got {name!r})")


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """The registry's name of a built optimizer (what a run used, for its records); a class's own name
    for one from elsewhere."""
    if isinstance(optimizer, LARS):
        return "lars"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    return type(optimizer).__name__
