"""SMA's learners replayed as CUDA graphs (:mod:`dimd.train.graphs`): Crossbow's many small learners per GPU.

Each learner's step (zero its gradient row, forward, backward, its figures, and its local update
``g += wd*w; v = mu*v - lr*g; w~ = w; w += v`` on its rows of the flat ``W``/``G``/``V`` buffers)
is captured once, over static inputs of its own. Two ways to run K of them (``compute``):

* ``loop``: K graphs, learner j's on learner j's stream, each in a memory pool of its own (they run
  at the same time); K launches a step;
* ``branches``: one graph whose capture forks to the K learners' streams and joins them again: the
  GPU runs the same K branches concurrently, from one launch.

The synchronisation with z is captured too, once for all learners (a handful of kernels over the
K x N buffers, not one graph per learner): ``share`` (the corrections ``d_j = w~_j - z``,
``w_j -= alpha d_j``, this rank's ``Delta = alpha sum d_j``, and whether some learner diverged) and
``apply`` (central momentum, ``z += Delta``, whether Delta is finite), with Delta's allreduce between them
as in the eager strategy (on the device through a ``device_reduce``, NCCL's group; else through a host
copy); on one rank there is nothing to sum, and both are one graph.
The rate, alpha and its negation are device tensors written before a replay; learner momentum,
weight decay and central momentum are the run's constants.

A new number of learners (the auto-tuner) or a loaded checkpoint reallocates the buffers the graphs
read: every graph is dropped and captured again after its warm-up, and the capture records say why.
The auto-tuner's measurement window starts only once every graph is captured, so eager warm-up steps
and captures never count as the throughput of K learners.

The learner step is the eager one's arithmetic with the rate read from a tensor (``addcmul`` with a
0-d tensor where the eager step adds with ``alpha=-lr``); on the CPU the two are bit for bit the same.
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import torch
from torch import nn

from dimd.train.graphs import (WARMUP_STEPS, Backend, ScalarWrites, StaticBatch, StaticInputs, StepGraphs, backend_for,
                               capture_problem)
from dimd.train.learners import Learners
from dimd.train.sma import SMA
from dimd.train.steps import Batches, StepResult, StepTimes, forward_backward

#: ``loop``: K graphs on K streams; ``branches``: one graph of K branches.
GRAPHED_COMPUTES = ("loop", "branches")

#: What the synchronisation graphs leave for the host: whether W is finite (after the corrections), Delta's sum.
W_SUM, DELTA_SUM = 0, 1


class GraphedLearners(Learners):
    """:class:`~dimd.train.learners.Learners` whose step (gradients and local update) replays as CUDA graphs.

    ``graphs`` records every capture (shared with the strategy, whose synchronisation graphs read these
    buffers too); ``backend``: where to capture (None: CUDA on a GPU, the stand-in elsewhere).
    """

    computes = GRAPHED_COMPUTES

    def __init__(self, template: nn.Module, k: int, *, graphs: StepGraphs, backend: Backend | None = None,
                 compute: str = "loop", normalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 threads: int = 1) -> None:
        self.graphs = graphs
        self._given_backend = backend
        device = next(template.parameters()).device
        self.inputs = StaticInputs(device)
        self.neg_lr = torch.zeros((), device=device)
        self._writes = ScalarWrites()
        super().__init__(template, k, compute=compute, normalize=normalize, threads=threads)

    def _allocate(self, W: torch.Tensor, V: torch.Tensor, float_rows: torch.Tensor,
                  count_rows: torch.Tensor) -> None:
        super()._allocate(W, V, float_rows, count_rows)
        self.stats = torch.zeros(self.k, 2, device=self.device)   # each learner's (loss sum, hits), per step
        self.inputs.clear()
        if self._given_backend is not None:
            self.backends = [self._given_backend] * self.k
            self.branch_backend = self._given_backend
        else:   # loop: each learner captures on its own stream into its own pool (their replays overlap)
            streams = self.streams or [None] * self.k
            self.backends = [backend_for(self.device, stream, share_pool=False) for stream in streams]
            self.branch_backend = backend_for(self.device)

    def resize(self, k: int) -> None:
        before = self.k
        super().resize(k)
        self.graphs.reset(f"learners per rank {before} -> {k}")

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        self.graphs.reset("a checkpoint was loaded")

    # -- the step -------------------------------------------------------------------------------

    def learn(self, images: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], lr: float, momentum: float,
              decay: torch.Tensor | None) -> tuple[Hashable, torch.Tensor]:
        """Every learner's gradient on its batch and its local step (``w~ = w`` kept for the synchronisation);
        returns the inputs' key and K x (loss sum, hits), on the device. ``momentum`` and ``decay`` are
        captured: the run's constants."""
        if len(images) != self.k:
            raise ValueError(f"{self.k} learners need {self.k} batches, got {len(images)}")
        key, statics = self.inputs.load(list(zip(images, labels)))
        self._writes.set(self.neg_lr, -lr)
        bodies = [partial(self._learner_step, j, static, momentum, decay) for j, static in enumerate(statics)]
        if self.compute == "branches":
            self.graphs.run("learners", key, partial(self._branches, bodies), self.branch_backend)
        else:
            self._on_streams([partial(self.graphs.run, f"learner {j}", key, body, self.backends[j])
                              for j, body in enumerate(bodies)])
        return key, self.stats

    def _branches(self, bodies: Sequence[Callable[[], None]]) -> None:
        """The K learners forked to their streams from the current one (the capturing one) and joined again."""
        self._on_streams(bodies)

    def _learner_step(self, j: int, static: StaticBatch, momentum: float, decay: torch.Tensor | None) -> None:
        """Learner j's step, as :meth:`Learners.forward_backward` and :meth:`Learners.sgd_step` compute it."""
        G, V = self.G[j], self.V[j]
        W = self.W.detach()[j]
        G.zero_()
        self.stats[j].copy_(forward_backward(self.replicas[j], static.images, static.labels, self.normalize))
        with torch.no_grad():
            if decay is not None:
                G.addcmul_(W, decay)
            if momentum > 0:
                V.mul_(momentum).addcmul_(G, self.neg_lr)
            else:
                torch.mul(G, self.neg_lr, out=V)
            self.W_pre[j].copy_(W)                  # always: the synchronisation after this step reads it
            W.add_(V)


class GraphedSMA(SMA):
    """:class:`~dimd.train.sma.SMA` with graphed learners and synchronisation; the same z as the eager strategy.

    ``backend``: where graphs are captured (None: CUDA on a GPU, the stand-in elsewhere); ``rule``:
    why graphs are on, for the JSON; ``compute``: ``loop`` (K graphs, the default) or ``branches`` (one graph).
    """

    def __init__(self, model: nn.Module, reduce: Any, world_size: int, *, backend: Backend | None = None,
                 rule: str = "on", warmup: int = WARMUP_STEPS, **options: Any) -> None:
        problem = capture_problem(model)
        if problem:
            raise ValueError(problem)
        device = next(model.parameters()).device
        self.rule = rule
        self._backend = backend
        self.graphs = StepGraphs(backend or backend_for(device), warmup=warmup)
        self.alpha_t = torch.zeros((), device=device)
        self.neg_alpha_t = torch.zeros((), device=device)
        self.sync_readout = torch.zeros(2, device=device)
        self._writes = ScalarWrites()
        self._key: Hashable = None
        super().__init__(model, reduce, world_size, **options)

    def _make_learners(self, model: nn.Module, k: int, **options: Any) -> Learners:
        options.pop("threads", None)
        return GraphedLearners(model, k, graphs=self.graphs, backend=self._backend, **options)

    def _learn(self, batches: Batches, lr: float, *, keep_pre: bool) -> tuple[torch.Tensor, float]:
        self.graphs.begin_step()
        group = self.learner_group
        assert isinstance(group, GraphedLearners)
        self._key, stats = group.learn([b[0] for b in batches], [b[1] for b in batches], lr, self.momentum,
                                       self.decay)
        self._sync()
        return stats, time.perf_counter()

    def _measure(self, batches: Batches, times: StepTimes) -> None:
        """The auto-tuner's window opens only once every graph is captured (warm-up and capture do not count)."""
        if self.tuner is not None and self.graphs.warming_up():
            self._window_open = False
            return
        super()._measure(batches, times)

    @torch.no_grad()
    def synchronize(self, stop: bool, times: StepTimes | None = None, batches: Batches = ()) -> StepResult:
        times = times or StepTimes()
        t0 = time.perf_counter()
        self._writes.set(self.alpha_t, self.alpha)        # 1/L changes with the learners
        self._writes.set(self.neg_alpha_t, -self.alpha)
        key = self._key if self._key is not None else "no step yet"
        if self.world_size == 1:                # nothing to sum: the extras stay on the host
            self.graphs.run("sync", key, self._share_and_apply)
            w_sum, delta_sum = self.sync_readout.tolist()
            extras = self._extras(stop, not math.isfinite(w_sum), batches, times, t0)
            summed = extras.astype(np.float32).tolist()   # the message's float32, as the eager strategy reads it
            t1 = t2 = time.perf_counter()
        else:
            self.graphs.run("share", key, self._share)
            diverged = not math.isfinite(float(self.sync_readout[W_SUM]))
            self.extras.copy_(torch.from_numpy(self._extras(stop, diverged, batches, times, t0)))
            self._sync()
            t1 = time.perf_counter()
            self._reduce_message()               # MPI: Delta summed over every learner of every rank
            t2 = time.perf_counter()
            self.graphs.run("apply", key, self._apply)
            summed = self.extras.tolist()
            delta_sum = float(self.sync_readout[DELTA_SUM])
        result = self._finish(summed, math.isfinite(delta_sum), times, t0, t1, t2)
        result.events[:0] = self.graphs.events()
        return result

    # -- what the synchronisation graphs hold -------------------------------------------------------

    def _share(self) -> None:
        group = self.learner_group
        W, D = group.W.detach(), group.W_pre
        D.sub_(self.z)                                   # d_j = w~_j - z (pre-step weights)
        W.addcmul_(D, self.neg_alpha_t)                  # w_j = w_j - alpha d_j
        torch.sum(D, dim=0, out=self.delta)
        self.delta.mul_(self.alpha_t)                    # this rank's share of Delta
        self.sync_readout[W_SUM].copy_(W.sum())

    def _apply(self) -> None:
        if self.central_momentum > 0:
            self.delta.add_(self.delta_prev, alpha=self.central_momentum)
        self.delta_prev.copy_(self.delta)
        self.z.add_(self.delta)                          # the same bits on every rank
        self.sync_readout[DELTA_SUM].copy_(self.delta.sum())

    def _share_and_apply(self) -> None:
        self._share()
        self._apply()

    def figures(self) -> dict[str, Any]:
        return {**super().figures(), "cuda_graphs": {"on": True, "rule": self.rule, **self.graphs.figures()}}

    def close(self) -> None:
        super().close()
        self.graphs.reset("closed")
