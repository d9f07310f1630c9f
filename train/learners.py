"""K learners on one rank: K replicas of one model whose state lives in a few flat buffers.

Crossbow (section 3.3) trains several small-batch learners per GPU so that
small batches still use the hardware. Here every learner's weights are one
row of ``W`` (K x N), its gradient one row of ``G`` and its momentum one row of
``V``, so the learner step and SMA's corrections are a handful of vectorised
operations over all K learners at once, whatever computes the gradients.
Batch-norm running statistics live in ``B`` (floating point) and ``C``
(counts), one row per learner too.

Two ways to compute the K gradients (``compute``), each learner with
:func:`dimd.train.steps.forward_backward`, the step every strategy shares:

* ``loop``: one ordinary module per learner (parameters are views into ``W``,
  gradients into ``G``), run one after the other; on CUDA each learner issues
  its work on its own stream, so the GPU overlaps them (Crossbow's way).
* ``threads``: the ``loop`` replicas run in K threads at once, each with an
  equal share of torch's threads.

``bench/probes/sma_learners.py`` measures them; see docs/sma.md for the choice (a
third, one ``vmap`` pass over the stacked replicas, was the slowest at every
point measured and is gone).

A step is two kinds of body, written once and run through ``parts``
(:mod:`dimd.train.steps`: as called, or replayed as CUDA graphs by
:class:`~dimd.train.graphed_sma.GraphedLearners`): learner j's gradient, and
the local update of all K learners at once, which reads the rate from a 0-d
tensor. Each learner draws its random numbers (dropout) from a stream of its
own (:class:`~dimd.train.graphs.RandomStream`; under ``threads`` the learners
share the default generator, which no thread can swap for itself).
"""

from __future__ import annotations

import contextlib
import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable, ContextManager, Hashable, Sequence, TypeVar

import torch
from torch import nn

from dimd.train.config import LEARNER_COMPUTES
from dimd.train.graphs import RandomStream
from dimd.train.steps import Batch, EagerParts, ScalarWrites, StepParts, forward_backward

T = TypeVar("T")


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


def slots(named: Sequence[tuple[str, torch.Tensor]]) -> list[Slot]:
    out, offset = [], 0
    for name, tensor in named:
        out.append(Slot(name, tuple(tensor.shape), offset, tensor.numel()))
        offset += tensor.numel()
    return out


class Layout:
    """Where each parameter and buffer of the model lives in the flat buffers."""

    def __init__(self, model: nn.Module) -> None:
        self.params = slots([(n, p) for n, p in model.named_parameters()])
        buffers = list(model.named_buffers())
        self.floats = slots([(n, t) for n, t in buffers if t.is_floating_point()])
        self.counts = slots([(n, t) for n, t in buffers if not t.is_floating_point()])
        self.numel = sum(s.numel for s in self.params)

    # -- one model <-> flat vectors ---------------------------------------------------------

    def flat_params(self, model: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def flat_floats(self, model: nn.Module) -> torch.Tensor:
        ref = next(model.parameters())
        found = [t.detach().reshape(-1) for t in model.buffers() if t.is_floating_point()]
        return torch.cat(found) if found else ref.new_zeros(0)

    def flat_counts(self, model: nn.Module) -> torch.Tensor:
        found = [t.detach().reshape(-1) for t in model.buffers() if not t.is_floating_point()]
        return torch.cat(found) if found else torch.zeros(0, dtype=torch.int64)

    def bind(self, model: nn.Module, params: torch.Tensor, floats: torch.Tensor,
             counts: torch.Tensor) -> None:
        """Make ``model``'s parameters views of ``params`` (N) and its buffers views of the others."""
        for slot, p in zip(self.params, model.parameters()):
            p.data = params[slot.offset: slot.offset + slot.numel].view(slot.shape)
        set_buffers(model, {s.name: floats[s.offset: s.offset + s.numel].view(s.shape) for s in self.floats})
        set_buffers(model, {s.name: counts[s.offset: s.offset + s.numel].view(s.shape) for s in self.counts})


def set_buffers(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        setattr(owner, leaf, tensor)   # an existing buffer's name: the tensor replaces it as that buffer


class LayerTrust:
    """LARS's trust ratios for K learners at once: ``eta |w| / (|g| + lambda |w|)`` per learner and layer,
    on their rows of the flat buffers (You, Gitman and Ginsburg, 2017; :class:`dimd.train.lars.LARS` is the
    same rule for one model). Batch-norm scales and shifts and biases take no ratio (:func:`decays`).
    The norms are one ``index_add_`` over all rows per step, no loop over layers."""

    def __init__(self, template: nn.Module, trust: float, weight_decay: float, *,
                 decay_bn_and_bias: bool = False) -> None:
        from dimd.train.sgd import decays

        if not trust > 0:
            raise ValueError(f"the trust coefficient must be positive (got {trust})")
        params = list(template.parameters())
        device = params[0].device
        sizes = torch.tensor([p.numel() for p in params], device=device)
        self.trust = trust
        self.layer_of = torch.repeat_interleave(torch.arange(len(params), device=device), sizes)
        self.adapts = torch.tensor([decays(p, decay_bn_and_bias) for p in params], device=device)
        self.decay = self.adapts.float() * weight_decay   # lambda per layer (weight decay only where it adapts)

    def ratios(self, W: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
        """K x N: each element's learner's and layer's ratio (1 where the layer takes none, or a norm is 0),
        from the weights ``W`` and the gradients ``G`` before weight decay."""
        k, layers = W.shape[0], self.adapts.numel()
        w = W.new_zeros(k, layers).index_add_(1, self.layer_of, W * W).sqrt_()
        g = G.new_zeros(k, layers).index_add_(1, self.layer_of, G * G).sqrt_()
        ratio = self.trust * w / (g + self.decay * w)
        ratio = torch.where(self.adapts & (w > 0) & (g > 0), ratio, torch.ones_like(ratio))
        return ratio[:, self.layer_of]


class Learners:
    """K learners' state (flat buffers) and the gradient computation chosen by ``compute``."""

    #: The ``compute`` choices of these eager learners (branches exist only as a CUDA graph: GraphedLearners).
    computes: tuple[str, ...] = tuple(c for c in LEARNER_COMPUTES if c != "branches")

    def __init__(self, template: nn.Module, k: int, *, compute: str = "loop",
                 normalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 threads: int = 1, parts: StepParts | None = None, seed: int | None = None,
                 label_smoothing: float = 0.0, trust: LayerTrust | None = None) -> None:
        """``parts``: how the bodies run (default: as called); ``seed``: learner j's random numbers start
        from ``seed + j`` (default: the default generator's initial seed); ``label_smoothing``: the loss's
        (:func:`~dimd.train.steps.forward_backward`); ``trust``: each learner steps as LARS does."""
        if compute not in self.computes:
            raise ValueError(f"unknown learner compute {compute!r}; choose from {', '.join(self.computes)}")
        if k < 1:
            raise ValueError(f"need at least one learner (got {k})")
        self.template = template
        self.layout = Layout(template)
        self.compute = compute
        self.normalize = normalize or (lambda x: x.float())
        self.threads = threads
        self.device = next(template.parameters()).device
        self.parts: StepParts = parts or EagerParts()
        self.label_smoothing = label_smoothing
        self.trust = trust
        self.seed = torch.initial_seed() if seed is None else seed
        self.randoms: list[RandomStream] = []
        self.neg_lr = torch.zeros((), device=self.device)   # minus the rate, as the update reads it
        self._writes = ScalarWrites()
        params = self.layout.flat_params(template)
        floats = self.layout.flat_floats(template)
        counts = self.layout.flat_counts(template)
        self._allocate(params.repeat(k, 1), torch.zeros(k, params.numel(), device=self.device),
                       floats.repeat(k, 1), counts.repeat(k, 1))

    # -- state ------------------------------------------------------------------------------

    @property
    def k(self) -> int:
        return self.W.shape[0]

    def _allocate(self, W: torch.Tensor, V: torch.Tensor, float_rows: torch.Tensor,
                  count_rows: torch.Tensor) -> None:
        """(Re)build the flat buffers from K rows of each, and the replicas that view them."""
        k = W.shape[0]
        self.W = W.detach().clone().contiguous()
        self.V = V.detach().clone().contiguous()
        self.G = torch.zeros_like(self.W)
        self.W_pre = torch.zeros_like(self.W)          # w~: the weights before the last learner step
        self.B = float_rows.detach().clone().contiguous()
        self.C = count_rows.detach().clone().contiguous()
        self.stats = torch.zeros(k, 2, device=self.device)   # each learner's (loss sum, hits), per step
        if self.compute != "threads":   # a learner keeps its stream when others are added or dropped
            self.randoms = self.randoms[:k] + [RandomStream(self.device, self.seed + j)
                                               for j in range(len(self.randoms), k)]
        self.replicas: list[nn.Module] = []
        self.streams: list | None = None
        self._pool: ThreadPoolExecutor | None = None
        for j in range(k):
            replica = copy.deepcopy(self.template)
            self.layout.bind(replica, self.W[j], self.B[j], self.C[j])
            for slot, p in zip(self.layout.params, replica.parameters()):
                p.grad = self.G[j, slot.offset: slot.offset + slot.numel].view(slot.shape)
            self.replicas.append(replica)
        if self.device.type == "cuda":
            self.streams = [torch.cuda.Stream(device=self.device) for _ in range(k)]
        if self.compute == "threads" and k > 1:
            self._pool = ThreadPoolExecutor(k, thread_name_prefix="dimd-learner")

    def float_rows(self) -> torch.Tensor:
        """K x M: each learner's floating-point buffers (batch-norm running statistics)."""
        return self.B

    def count_rows(self) -> torch.Tensor:
        return self.C

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"weights": self.W.detach().cpu().clone(), "momentum": self.V.cpu().clone(),
                "buffers": self.B.cpu().clone(), "counts": self.C.cpu().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        device = self.device
        self.close()
        self._allocate(state["weights"].to(device), state["momentum"].to(device),
                       state["buffers"].to(device), state["counts"].to(device))
        self.parts.reset("a checkpoint was loaded")   # graphs read the old buffers

    def resize(self, k: int) -> None:
        """Add learners (copies of learner 0: weights, momentum, buffers) or drop the last ones."""
        if k < 1:
            raise ValueError(f"need at least one learner (got {k})")
        before = self.k
        index = torch.tensor([j if j < before else 0 for j in range(k)], device=self.device)
        with torch.no_grad():
            state = (self.W.detach()[index], self.V[index], self.float_rows()[index], self.count_rows()[index])
        self.close()
        self._allocate(*state)
        self.parts.reset(f"learners per rank {before} -> {k}")   # graphs read the old buffers

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- the step: each learner's gradient, then the local update of all -------------------------

    def gradients(self, images: Sequence[torch.Tensor],
                  labels: Sequence[torch.Tensor]) -> tuple[Hashable, torch.Tensor]:
        """Each learner's gradient on its own batch into ``G``; returns the inputs' key (the update's
        graphs are kept by it) and K x 2 (loss sum, correct) on the device."""
        if len(images) != self.k:
            raise ValueError(f"{self.k} learners need {self.k} batches, got {len(images)}")
        key, batches = self._inputs(list(zip(images, labels)))
        self._run_gradients(key, [partial(self._gradient, j, batch) for j, batch in enumerate(batches)])
        return key, self.stats

    def _inputs(self, batches: list[Batch]) -> tuple[Hashable, list[Batch]]:
        """The batches the bodies read, and the key of their shapes (graphed: copies in static inputs)."""
        return None, batches

    def _run_gradients(self, key: Hashable, bodies: Sequence[Callable[[], None]]) -> None:
        """Learner j's body on stream j (CUDA), on a thread each (``threads``), or in turn."""
        if self._pool is None:
            self._on_streams(bodies)
            return
        per_learner = max(1, self.threads // self.k)
        before = torch.get_num_threads()
        torch.set_num_threads(per_learner)
        try:
            for future in [self._pool.submit(body) for body in bodies]:
                future.result()
        finally:
            torch.set_num_threads(before)

    def _gradient(self, j: int, batch: Batch) -> None:
        """Learner j's body: its gradient row zeroed, forward, backward, its figures."""
        images, labels = batch
        self.G[j].zero_()
        with self._random(j):
            self.stats[j].copy_(forward_backward(self.replicas[j], images, labels, self.normalize,
                                                 label_smoothing=self.label_smoothing))

    def _random(self, j: int) -> ContextManager[None]:
        return self.randoms[j].active() if self.randoms else contextlib.nullcontext()

    def _on_streams(self, works: Sequence[Callable[[], T]]) -> list[T]:
        """Learner j's work on stream j, all at once (in turn where there are no streams), and what each returned.

        Each stream first waits for the current stream (the previous step's
        update and synchronisation wrote W); the current stream then waits for
        every learner stream before the vectorised update reads G.
        """
        if self.streams is None:
            return [work() for work in works]
        current = torch.cuda.current_stream(self.device)
        out = []
        for stream, work in zip(self.streams, works):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                out.append(work())
        for stream in self.streams:
            current.wait_stream(stream)
        return out

    def update(self, key: Hashable, lr: float, momentum: float, decay: torch.Tensor | None) -> None:
        """Crossbow's learner step for all K learners at once, after :meth:`gradients` (``key``: its inputs').

        ``decay`` is a length-N vector of weight-decay factors (0 where a parameter is exempt) or None;
        ``momentum`` and ``decay`` are the run's constants (a graph captures them), the rate is written
        into a tensor the body reads.
        """
        self._writes.set(self.neg_lr, -lr)
        self.parts.run("update", key, partial(self._update, momentum, decay))

    @torch.no_grad()
    def _update(self, momentum: float, decay: torch.Tensor | None) -> None:
        """``g += wd*w``; ``v = mu*v - lr*g``; ``w~ = w`` (the next synchronisation reads it); ``w += v``.
        With ``trust`` (LARS): ``g`` after weight decay is scaled by its layer's trust ratio first."""
        W = self.W.detach()
        ratios = self.trust.ratios(W, self.G) if self.trust is not None else None
        if decay is not None:
            self.G.addcmul_(W, decay)
        if ratios is not None:
            self.G.mul_(ratios)
        if momentum > 0:
            self.V.mul_(momentum).addcmul_(self.G, self.neg_lr)
        else:
            torch.mul(self.G, self.neg_lr, out=self.V)
        self.W_pre.copy_(W)   # every step, as a graph cannot choose: a pass over W (4 bytes per weight)
        W.add_(self.V)
