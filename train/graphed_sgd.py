"""S-SGD's step replayed as CUDA graphs: :class:`~dimd.train.sgd.SSGD`'s own bodies, captured (dimd.train.graphs).

On one rank (nothing to reduce) the step is one graph. On several it is two graphs, ``forward`` and
``update``, with the gradients' reduction between them, as in the eager step: on the device where
the strategy has a ``device_reduce`` (NCCL's group, :mod:`dimd.allreduce.group`: the buckets'
collectives are queued on NCCL's stream after the first graph's work and the second graph's replay
waits for them, with no copy to the host and no wait on the host), else on the host (dimd's allreduce
sums host buffers).

The bodies are the eager step's (:class:`~dimd.train.sgd.SSGD`): they read the rate, the stop flag
and 16-mixed's loss scale from 0-d device tensors and leave their figures in one small tensor the
host reads after the step, so every CPU test of S-SGD tests the arithmetic the graphs replay. What
this class adds is only the capture and replay: the batch copied into the graph's static inputs
first, and the graphs' records in the JSON. No overlap: a graph cannot capture the communication
thread, nor a bucket's collective started from a hook.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
from torch import nn

from dimd.shuffle.normalize import Normalize
from dimd.train.buckets import DeviceReduce
from dimd.train.flatgrad import Reduce
from dimd.train.graphs import WARMUP_STEPS, Backend, StaticInputs, StepGraphs, backend_for, capture_problem
from dimd.train.noise import NoiseScale
from dimd.train.precision import Precision
from dimd.train.sgd import SSGD
from dimd.train.steps import Batch, Batches


class GraphedSSGD(SSGD):
    """:class:`~dimd.train.sgd.SSGD` whose step replays as CUDA graphs; the same weights as the eager step.

    ``backend``: where graphs are captured (default: CUDA on a GPU, :class:`~dimd.train.graphs.StandIn`
    elsewhere); ``rule``: why graphs are on, for the JSON; ``fallback``: a capture that fails runs the
    step and the rest of the run eagerly (graphs on by default) instead of ending the run (asked for).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, reduce: Reduce, world_size: int, *,
                 backend: Backend | None = None, device_reduce: DeviceReduce | None = None, bucket_bytes: int = 0,
                 normalize: Normalize | None = None, noise: NoiseScale | None = None,
                 precision: Precision | None = None, warmup: int = WARMUP_STEPS, rule: str = "on",
                 fallback: bool = False, **options: Any) -> None:
        """``options``: the eager step's (:class:`~dimd.train.sgd.SSGD`): ``label_smoothing``, ``average``."""
        problem = capture_problem(model)
        if problem:
            raise ValueError(problem)
        device = next(model.parameters()).device
        self.rule = rule
        self.graphs = StepGraphs(backend or backend_for(device), warmup=warmup, fallback=fallback)
        self.inputs = StaticInputs(device)
        super().__init__(model, optimizer, reduce, world_size, bucket_bytes=bucket_bytes, normalize=normalize,
                         noise=noise, overlap=False, precision=precision, device_reduce=device_reduce,
                         parts=self.graphs, **options)

    def _inputs(self, batches: Batches) -> tuple[Hashable, Batch]:
        key, (static,) = self.inputs.load(batches)
        return key, (static.images, static.labels)

    def figures(self) -> dict[str, Any]:
        return {**super().figures(), "cuda_graphs": {"on": True, "rule": self.rule, **self.graphs.figures()}}

    def close(self) -> None:
        super().close()
        self.inputs.clear()
