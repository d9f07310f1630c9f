"""The memory layout of the model and its inputs: channels-last (NHWC) or contiguous (NCHW).

On CUDA, convolutional models take channels-last: cuDNN's NHWC kernels run
on tensor cores. On a CPU neither layout wins everywhere: one torch thread,
forward + backward + SGD step, oneDNN's channels-last was 1.21x faster for
resnet20 at 32 px, 1.13x for resnet50 and 1.48x for googlenet-bn, but 0.93x
for resnet18 at 64 px and even for vgg16 (docs/train.md). So on a CPU the
layout is measured at start-up, on a throwaway copy of the model, and every
rank takes the one that is faster on its slowest rank.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn

#: Images per rank the start-up trial steps on (at most the training batch), and its timed steps per layout.
TRIAL_BATCH = 8
TRIAL_STEPS = 2


def is_convolutional(model: nn.Module) -> bool:
    """Whether ``model`` has 2-d convolutions (channels-last pays off only for those)."""
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def memory_format(choice: bool | None, device: torch.device, model: nn.Module) -> torch.memory_format:
    """``choice`` None: channels-last for convolutional models on CUDA, where cuDNN's NHWC kernels
    run on tensor cores; contiguous (NCHW) elsewhere. True/False: as asked."""
    use = choice if choice is not None else (torch.device(device).type == "cuda" and is_convolutional(model))
    return torch.channels_last if use else torch.contiguous_format


def _step_seconds(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """The best of TRIAL_STEPS timed forward + backward passes, after one untimed."""
    best = float("inf")
    for step in range(TRIAL_STEPS + 1):
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(images), labels).backward()
        if step:
            best = min(best, time.perf_counter() - start)
    return best


def measured_memory_format(model: nn.Module, classes: int, image_size: int, batch: int,
                           comm: Any) -> tuple[torch.memory_format, dict[str, Any]]:
    """Collective: the layout whose forward + backward is faster on the slowest rank, on a CPU.

    Times a deep copy of ``model`` (the model itself, its statistics and its
    random state are left as they were) on random inputs of
    ``min(batch, TRIAL_BATCH)`` images, each layout in turn; returns the
    layout and what was measured.
    """
    import numpy as np
    from mpi4py import MPI

    rng_state = torch.get_rng_state()
    trial = copy.deepcopy(model).train()
    n = max(1, min(batch, TRIAL_BATCH))
    images = torch.randn(n, 3, image_size, image_size)
    labels = torch.randint(0, classes, (n,))
    seconds = {}
    for layout in (torch.contiguous_format, torch.channels_last):
        trial.to(memory_format=layout)  # type: ignore[call-overload]  # torch's stub lacks it
        seconds[layout] = _step_seconds(trial, images.contiguous(memory_format=layout), labels)
    torch.set_rng_state(rng_state)
    slowest = np.array([seconds[torch.contiguous_format], seconds[torch.channels_last]])
    comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)   # MPI: every rank decides on the same figures
    contiguous, channels_last = (float(s) for s in slowest)
    chosen = torch.channels_last if channels_last < contiguous else torch.contiguous_format
    return chosen, {"how": "faster forward + backward measured at start-up", "images": n,
                    "contiguous_s": contiguous, "channels_last_s": channels_last}


def choose_memory_format(choice: bool | None, sync: str, model: nn.Module, device: torch.device, classes: int,
                         image_size: int, batch: int, comm: Any) -> tuple[torch.memory_format, dict[str, Any]]:
    """Collective: ``choice`` (``--channels-last``/``--no-channels-last``) when given; SMA's learners
    contiguous; on CUDA channels-last for convolutional models; on a CPU the faster, measured."""
    if sync != "ssgd":
        return torch.contiguous_format, {"how": "contiguous: channels-last is implemented for S-SGD's replica"}
    if choice is not None or torch.device(device).type == "cuda" or not is_convolutional(model):
        how = "requested" if choice is not None else ("CUDA: convolutional models" if is_convolutional(model)
                                                      else "no convolutions")
        return memory_format(choice, device, model), {"how": how}
    return measured_memory_format(model, classes, image_size, batch, comm)


def layout_name(layout: torch.memory_format) -> str:
    return "channels_last" if layout == torch.channels_last else "contiguous"
