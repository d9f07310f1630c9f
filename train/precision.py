"""How a training step computes: 32-bit, or mixed precision under autocast (Lightning's names).

``32-true``: everything in float32. ``bf16-mixed``: the forward pass and the
loss run under ``torch.autocast`` in bfloat16 (float32's range, so no loss
scaling). ``16-mixed``: autocast in float16, with a dynamic loss scale: the
loss is multiplied by ``scale`` before backward, the gradients are divided by
it again before the allreduce, and a step whose gradients are not finite is
skipped and the scale halved (torch.amp.GradScaler's rule). In every mode the
parameters, the optimizer state and the gradients the allreduce sums stay
float32: autocast only changes the dtype of the operations it covers.

The scale is a 0-d tensor on the device that the step reads (:attr:`Precision.scale`), so a step
captured as a CUDA graph reads each new scale without a new capture; the host keeps the rule
(:class:`LossScale`) and writes the tensor after each step (:meth:`Precision.refresh`). Autocast runs
without its cast cache, as PyTorch asks of captured autocast regions, in both forms of the step.

Skipping must be agreed by every rank, or the replicas drift apart. Each rank
puts its own "my gradients overflowed" flag into the tail of the flat gradient
buffer, so the allreduce that sums the gradients also sums the flags, and
every rank reads the same sum (no extra collective): the step is skipped on
every rank if any rank overflowed.

Channels-last (NHWC) memory format makes cuDNN's convolutions faster on
tensor cores; it is the default for convolutional models on CUDA
(:func:`memory_format`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import nn

from dimd.private_apis import unscale_and_find_non_finite_
from dimd.train.config import PRECISIONS
from dimd.train.steps import ScalarWrites

_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}

#: A loss scale below this after repeated overflows means the loss itself is not finite: the run diverged.
MIN_LOSS_SCALE = 2.0 ** -24


@dataclass
class LossScale:
    """16-mixed's dynamic loss scale, with torch.amp.GradScaler's defaults and rule.

    Halve on a step with non-finite gradients (the step is skipped); double
    after ``growth_interval`` finite steps in a row.
    """

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0          # finite steps since the last change
    skipped: int = 0             # steps skipped so far in the run

    def update(self, overflowed: bool) -> None:
        if overflowed:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if key in self.__dict__:
                setattr(self, key, type(getattr(self, key))(value))


class Precision:
    """The step's numeric mode: autocast around forward and loss, and 16-mixed's loss scaling.

    A step uses it as::

        with precision.autocast():
            loss = F.cross_entropy(model(x), y)
        precision.backward(loss)
        precision.unscale(flat.grads, extras[OVERFLOW])    # this rank's flag, before the allreduce
        flat.allreduce(...)                                 # sums the flags too
        if not precision.skip(float(extras[OVERFLOW])):     # the same answer on every rank
            optimizer.step()                                # (skip also writes the next step's scale)
    """

    def __init__(self, name: str, device: torch.device) -> None:
        if name not in PRECISIONS:
            raise ValueError(f"unknown precision {name!r}; choose from {', '.join(PRECISIONS)}")
        self.name = name
        self.device_type = torch.device(device).type
        self.dtype = _AUTOCAST_DTYPES.get(name)
        self.loss_scale = LossScale() if name == "16-mixed" else None
        self.last_skipped = False
        #: The loss scale as the step reads it (16-mixed; 1 otherwise, and never read).
        self.scale = torch.ones((), device=device)
        self._writes = ScalarWrites()
        self.refresh()

    def autocast(self) -> ContextManager[Any]:
        """Autocast for the forward pass and the loss (nothing for 32-true), without the cast cache."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward from ``loss``, scaled first under 16-mixed (small float16 gradients stay non-zero)."""
        if self.loss_scale is None:
            loss.backward()
        else:
            (loss * self.scale).backward()

    def unscale(self, grads: torch.Tensor, flag: torch.Tensor) -> None:
        """Divide this rank's gradients by the loss scale in place; ``flag`` (a 0-d tensor) set to 1 if any
        is not finite, else 0.

        32-true and bf16-mixed: nothing to undo, and the flag is left as it is (the step zeroed it: no step
        is ever skipped for them; a non-finite loss is a divergence).
        """
        if self.loss_scale is None:
            return
        found = torch.zeros((), dtype=torch.float32, device=grads.device)
        # One fused pass: multiply by 1/scale and note any inf/nan (what GradScaler.unscale_ runs).
        unscale_and_find_non_finite_(grads, found, self.scale.reciprocal())
        flag.copy_(found)

    def skip(self, overflowed_ranks: float | torch.Tensor) -> bool:
        """After the allreduce: whether to skip this step (some rank's gradients overflowed).

        ``overflowed_ranks`` is the sum of the ranks' :meth:`unscale` flags,
        so every rank decides the same; the loss scale follows.
        """
        if self.loss_scale is None:
            self.last_skipped = False
            return False
        self.last_skipped = float(overflowed_ranks) > 0   # read only here: 32-true never waits for it
        self.loss_scale.update(self.last_skipped)
        self.refresh()
        return self.last_skipped

    def refresh(self) -> None:
        """Write the host's current loss scale into :attr:`scale`, if it changed."""
        if self.loss_scale is not None:
            self._writes.set(self.scale, self.loss_scale.scale)

    @property
    def diverged(self) -> bool:
        """Under 16-mixed: the scale fell so far that the loss itself must be non-finite."""
        return self.loss_scale is not None and self.loss_scale.scale < MIN_LOSS_SCALE

    def figures(self) -> dict[str, Any]:
        """For ``--json``: the mode, and under 16-mixed the loss scale and the skipped steps."""
        out: dict[str, Any] = {"precision": self.name}
        if self.loss_scale is not None:
            out.update(loss_scale=self.loss_scale.scale, skipped_steps=self.loss_scale.skipped)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.name,
                "loss_scale": self.loss_scale.state_dict() if self.loss_scale is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Continue a checkpoint's loss scale; returns what it had to change, as log lines."""
        if self.loss_scale is None:
            return []
        saved = state["loss_scale"]
        if saved is None:
            return [f"the checkpoint was written in {state['precision']}: the 16-mixed "
                    f"loss scale starts afresh at {self.loss_scale.scale:g}"]
        self.loss_scale.load_state_dict(saved)
        self.refresh()
        return []


def is_convolutional(model: nn.Module) -> bool:
    """Whether ``model`` has 2-d convolutions (channels-last pays off only for those)."""
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def memory_format(choice: bool | None, device: torch.device, model: nn.Module) -> torch.memory_format:
    """``choice`` None: channels-last for convolutional models on CUDA, where cuDNN's NHWC kernels
    run on tensor cores; contiguous (NCHW) elsewhere. True/False: as asked."""
    use = choice if choice is not None else (torch.device(device).type == "cuda" and is_convolutional(model))
    return torch.channels_last if use else torch.contiguous_format
