"""SMA's learners replayed as CUDA graphs (:mod:`dimd.train.graphs`): Crossbow's many small learners per GPU.

The bodies are the eager strategy's (:class:`~dimd.train.learners.Learners`,
:class:`~dimd.train.sma.SMA`), which read the rate and alpha from 0-d device tensors: learner j's
gradient (zero its row of ``G``, forward, backward, its figures), the local update of all K
learners at once, and the synchronisation's ``share`` (the corrections and this rank's Delta) and
``apply`` (central momentum, ``z += Delta``), with Delta's allreduce between them (on one rank, one
``sync`` body). This module only captures and replays them. Two ways to run K learners' gradients
(``compute``):

* ``loop``: K graphs, learner j's on learner j's stream, each in a memory pool of its own (they run
  at the same time) and drawing random numbers from a generator state of its own, registered with
  its graph (:class:`~dimd.train.graphs.RandomStream`: concurrent replays would race on a shared
  one); K launches a step;
* ``branches``: one graph whose capture forks to the K learners' streams and joins them again: the
  GPU runs the same K branches concurrently, from one launch.

A new number of learners (the auto-tuner) or a loaded checkpoint reallocates the buffers the graphs
read: every graph is dropped and captured again after its warm-up, and the capture records say why.
The auto-tuner's measurement window starts only once every graph is captured, so eager warm-up steps
and captures never count as the throughput of K learners.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Hashable, Sequence

import torch
from torch import nn

from dimd.train.graphs import WARMUP_STEPS, Backend, StaticInputs, StepGraphs, backend_for, capture_problem
from dimd.train.learners import Learners
from dimd.train.sma import SMA
from dimd.train.steps import Batch, Batches, StepTimes

#: ``loop``: K graphs on K streams; ``branches``: one graph of K branches.
GRAPHED_COMPUTES = ("loop", "branches")


class GraphedLearners(Learners):
    """:class:`~dimd.train.learners.Learners` whose bodies replay as CUDA graphs.

    ``parts``: the strategy's :class:`~dimd.train.graphs.StepGraphs`, which records every capture (its
    synchronisation graphs read these buffers too); ``backend``: where to capture (None: CUDA on a GPU,
    the stand-in elsewhere).
    """

    computes = GRAPHED_COMPUTES

    def __init__(self, template: nn.Module, k: int, *, parts: StepGraphs, backend: Backend | None = None,
                 **options: Any) -> None:
        self._given_backend = backend
        self.inputs = StaticInputs(next(template.parameters()).device)
        super().__init__(template, k, parts=parts, **options)

    def _allocate(self, W: torch.Tensor, V: torch.Tensor, float_rows: torch.Tensor,
                  count_rows: torch.Tensor) -> None:
        super()._allocate(W, V, float_rows, count_rows)
        self.inputs.clear()
        if self._given_backend is not None:
            self.backends = [self._given_backend] * self.k
            self.branch_backend = self._given_backend
        else:   # loop: each learner captures on its own stream into its own pool (their replays overlap)
            streams = self.streams or [None] * self.k
            self.backends = [backend_for(self.device, stream, share_pool=False) for stream in streams]
            self.branch_backend = backend_for(self.device)

    def _inputs(self, batches: list[Batch]) -> tuple[Hashable, list[Batch]]:
        key, statics = self.inputs.load(batches)
        return key, [(static.images, static.labels) for static in statics]

    def _run_gradients(self, key: Hashable, bodies: Sequence[Callable[[], None]]) -> None:
        graphs = self.parts
        if self.compute == "branches":
            graphs.run("learners", key, partial(self._branches, bodies), self.branch_backend, self.randoms)
        else:
            self._on_streams([partial(graphs.run, f"learner {j}", key, body, self.backends[j], self.randoms[j:j + 1])
                              for j, body in enumerate(bodies)])


    def _branches(self, bodies: Sequence[Callable[[], None]]) -> None:
        """The K learners forked to their streams from the current one (the capturing one) and joined again."""
        self._on_streams(bodies)


class GraphedSMA(SMA):
    """:class:`~dimd.train.sma.SMA` with graphed learners and synchronisation; the same z as the eager strategy.

    ``backend``: where graphs are captured (None: CUDA on a GPU, the stand-in elsewhere); ``rule``:
    why graphs are on, for the JSON; ``compute``: ``loop`` (K graphs, the default) or ``branches`` (one
    graph); ``fallback``: a capture that fails runs eagerly from then on (graphs on by default).
    """

    def __init__(self, model: nn.Module, reduce: Any, world_size: int, *, backend: Backend | None = None,
                 rule: str = "on", warmup: int = WARMUP_STEPS, fallback: bool = False, **options: Any) -> None:
        problem = capture_problem(model)
        if problem:
            raise ValueError(problem)
        self.rule = rule
        self._backend = backend
        self.graphs = StepGraphs(backend or backend_for(next(model.parameters()).device), warmup=warmup,
                                 fallback=fallback)
        super().__init__(model, reduce, world_size, parts=self.graphs, **options)

    def _make_learners(self, model: nn.Module, k: int, **options: Any) -> Learners:
        options.pop("threads", None)
        return GraphedLearners(model, k, backend=self._backend, **options)

    def _measure(self, batches: Batches, times: StepTimes) -> None:
        """The auto-tuner's window opens only once every graph is captured (warm-up and capture do not count)."""
        if self.tuner is not None and self.graphs.warming_up():
            self._window_open = False
            return
        super()._measure(batches, times)

    def figures(self) -> dict[str, Any]:
        return {**super().figures(), "cuda_graphs": {"on": True, "rule": self.rule, **self.graphs.figures()}}
