"""``--ema DECAY``: an exponential moving average of the weights and batch-norm buffers, evaluated beside the model.

Late in training the weights wander around a minimum at the scale of the learning rate; their running
average sits nearer its centre and often evaluates better, for the price of one more pass over the
weights now and then (torchvision's reference script: ``--model-ema``). The average is torch's own,
:class:`torch.optim.swa_utils.AveragedModel` with :func:`~torch.optim.swa_utils.get_ema_multi_avg_fn`
(``use_buffers``: batch-norm statistics are averaged too), updated where the model lives, with one
multi-tensor pass per update, every ``every`` steps.

``decay`` is per step: updating every ``every`` steps applies ``decay ** every``, so the average
spans about ``1 / (1 - decay)`` steps whatever the stride. Every rank holds the same replica under
S-SGD, so every rank's average is the same too (batch-norm statistics aside, which are per rank, as
the replica's are).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from dimd.train.config import EMA_EVERY



class WeightAverage:
    """The moving average of ``model``'s weights and buffers, updated by :meth:`after_step`."""

    def __init__(self, model: nn.Module, decay: float, every: int = EMA_EVERY) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the EMA decay must lie in (0, 1) (got {decay})")
        if every < 1:
            raise ValueError(f"the EMA must be updated every 1 step or more (got {every})")
        self.model = model
        self.decay = decay
        self.every = every
        # AveragedModel deep-copies the model; its first update copies the weights, the later ones average.
        self.averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay ** every), use_buffers=True)
        self.averaged.update_parameters(model)

    @property
    def module(self) -> nn.Module:
        """The averaged model, to evaluate, checkpoint and export."""
        return self.averaged.module

    def after_step(self, step: int) -> None:
        """After the optimizer's step number ``step`` (1-based): fold the weights in, every ``every`` steps."""
        if step % self.every == 0:
            self.averaged.update_parameters(self.model)

    def restart(self) -> None:
        """Start afresh from the model's weights as they are now (a checkpoint without an average)."""
        self.averaged.n_averaged.zero_()
        self.averaged.update_parameters(self.model)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "every": self.every,
                "averaged": {k: v.detach().cpu().clone() for k, v in self.averaged.state_dict().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.averaged.load_state_dict(state["averaged"])
