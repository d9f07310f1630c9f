"""Crossbow's synchronous model averaging (SMA) over MPI, as its authors coded it.

K learners per rank (:class:`~dimd.train.learners.Learners`), L = P x K in all.
Each learner steps on its own batch with weight decay and local Polyak
momentum, keeping its pre-step weights w~::

    g = grad + wd * w;   v = mu_l * v - lr * g;   w~ = w;   w = w + v

Every ``sync_every`` steps, and at every epoch's last step, all learners
synchronise with the central model z, which every rank holds (there is no
parameter server)::

    d_j = w~_j - z;   w_j = w_j - alpha * d_j;   Delta = sum over all L learners of alpha * d_j
    Delta = Delta + mu_c * Delta_prev;   Delta_prev = Delta;   z = z + Delta

``Delta`` is summed over the ranks by ONE allreduce of a flat vector (with a
few scalars in its tail: loss, hits, samples, the stop flag and the
auto-tuner's window figures), and every rank applies the same arithmetic to
the same bits, so z stays bit-identical on every rank. z is the model that is
evaluated and checkpointed; its batch-norm statistics are its own, recomputed
on a few training batches before it is evaluated or saved
(:mod:`dimd.train.batchnorm`; without a source of batches, the learners'
statistics averaged over all L learners).

When the learning-rate schedule passes a milestone, every learner restarts
from z (Crossbow's restart). The cadence (steps since the last
synchronisation) and the milestones passed are SMA's own state, saved with it.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Hashable, Iterator

import numpy as np
import torch
from torch import nn

from dimd.train.autotune import AutoTuner
from dimd.train.batchnorm import recompute_batch_norm
from dimd.train.buckets import DeviceReduce, GradientBuckets
from dimd.train.flatgrad import Reduce
from dimd.train.learners import LayerTrust, Learners
from dimd.train.sgd import decays, identical_across_ranks
from dimd.train.steps import Batches, EagerParts, ScalarWrites, StepParts, StepPlace, StepResult, StepTimes

#: The message's tail after Delta: summed over ranks in the same allreduce.
LOSS, CORRECT, SAMPLES, STOP, NOT_FINITE, WINDOW_DONE, WINDOW_IMAGES, WINDOW_SECONDS = range(8)
EXTRAS = 8

#: What the synchronisation's bodies leave for the host: the learners' weights' sum (after the corrections:
#: finite or not), Delta's sum.
W_SUM, DELTA_SUM = 0, 1

#: The central momentum unless ``--sma-momentum`` is given (docs/sma.md, "Why no central momentum by default").
CENTRAL_MOMENTUM = 0.0

#: Training images (all ranks together) z's batch-norm statistics are recomputed on before it is
#: evaluated or saved: enough for stable estimates, a fraction of an epoch's forward passes.
CALIBRATION_IMAGES = 256

#: ``(round, images)`` -> this rank's training batches for the recompute, at least ``images`` images
#: (a fresh draw per round; :class:`~dimd.train.batchnorm.CalibrationBatches`).
Calibration = Callable[[int, int], Iterator[tuple[torch.Tensor, torch.Tensor]]]


def decay_vector(model: nn.Module, weight_decay: float, *, decay_bn_and_bias: bool = False) -> torch.Tensor | None:
    """Per-element weight decay: ``weight_decay`` on weights, 0 on batch-norm and bias (as S-SGD's groups)."""
    if weight_decay <= 0:
        return None
    parts = [torch.full((p.numel(),), weight_decay if decays(p, decay_bn_and_bias) else 0.0,
                        device=p.device) for p in model.parameters()]
    return torch.cat(parts)


class SMA:
    """SMA as a :class:`~dimd.train.steps.Strategy`; ``model`` becomes the central model z."""

    name = "sma"
    average = None   # z is itself an average of the learners: no moving average of it (``ema``)

    def __init__(self, model: nn.Module, reduce: Reduce, world_size: int, *, learners: int | None,
                 alpha: float | None, momentum: float, central_momentum: float | None,
                 weight_decay: float, decay_bn_and_bias: bool = False, sync_every: int = 1, compute: str = "loop",
                 normalize: Callable[[torch.Tensor], torch.Tensor] | None = None, threads: int = 1,
                 autotune_threshold: float = 0.1, autotune_window: float = 2.0, max_learners: int = 64,
                 synchronize: Callable[[], None] | None = None, calibration: Calibration | None = None,
                 calibration_images: int = CALIBRATION_IMAGES, device_reduce: DeviceReduce | None = None,
                 parts: StepParts | None = None, label_smoothing: float = 0.0,
                 lars_trust: float | None = None) -> None:
        """``learners`` None: the auto-tuner chooses; ``alpha`` None: 1/L (L = all learners, the
        paper's suggestion); ``central_momentum`` None: 0 (the authors hard-coded 0.9, which on top of
        the learners' momentum at alpha 1/L is unstable at rates one sixth of the usual, docs/sma.md);
        ``sync_every``: learner steps per synchronisation (the epoch's last step synchronises
        too); ``calibration``: training batches that z's batch-norm statistics are
        recomputed on (None: the learners' statistics averaged); ``device_reduce``: sum Delta in place on
        the learners' device (NCCL on GPUs, gloo on CPUs) instead of with ``reduce``; ``parts``: how the
        step's bodies run (:mod:`dimd.train.steps`; default: as called; graphed: captured and replayed);
        ``lars_trust``: each learner steps as LARS (its trust coefficient eta): each learner owns its
        optimizer, and z's update is unchanged."""
        self.model = model
        self.reduce = reduce
        self.world_size = world_size
        self.parts: StepParts = parts or EagerParts()
        self.alpha_given = alpha
        self.momentum = momentum
        self.central_momentum = CENTRAL_MOMENTUM if central_momentum is None else central_momentum
        self.sync_every = sync_every
        self.decay = decay_vector(model, weight_decay, decay_bn_and_bias=decay_bn_and_bias)
        self.tuner = AutoTuner(threshold=autotune_threshold, max_learners=max_learners) if learners is None else None
        self.autotune_window = autotune_window
        self._sync = synchronize or (lambda: None)
        self.calibration = calibration
        self.calibration_images = calibration_images
        self._calibrated_at: int | None = None   # the synchronisation z's statistics were measured after
        self.learner_group = self._make_learners(model, 1 if learners is None else learners, compute=compute,
                                                 normalize=normalize, threads=threads, parts=self.parts,
                                                 label_smoothing=label_smoothing,
                                                 trust=None if lars_trust is None else LayerTrust(
                                                     model, lars_trust, weight_decay,
                                                     decay_bn_and_bias=decay_bn_and_bias))
        layout = self.learner_group.layout
        device = next(model.parameters()).device
        # z: the model's own parameters become views of one flat vector.
        self.z = layout.flat_params(model).clone()
        self.z_floats = layout.flat_floats(model).clone()
        self.z_counts = layout.flat_counts(model).clone()
        layout.bind(model, self.z, self.z_floats, self.z_counts)
        n = layout.numel
        # The message, Delta and the extras, summed over the ranks by S-SGD's transport (in place on the device
        # with a device_reduce, else through a host copy on a GPU): Delta is the gradient slot of a parameter
        # that is never trained.
        self.transport = GradientBuckets([nn.Parameter(torch.zeros(n, device=device))], reduce, world_size,
                                         extras=EXTRAS, overlap=False, average=False, device_reduce=device_reduce)
        self.message = self.transport.flat.buffer
        self.delta = self.transport.flat.grads
        self.extras = self.transport.flat.extras
        self.delta_prev = torch.zeros(n, device=device)
        # What the host writes before a synchronisation, and what it reads after: whether W is finite (after
        # the corrections), Delta's sum.
        self.alpha_t = torch.zeros((), device=device)
        self.neg_alpha_t = torch.zeros((), device=device)
        self.sync_readout = torch.zeros(2, device=device)
        self._writes = ScalarWrites()
        self._key: Hashable = None            # the last step's inputs (the synchronisation's graphs are kept by it)
        self.pending = np.zeros(3)            # this rank's loss sum, hits, samples since the last sync
        self.syncs = 0
        self.since_sync = 0                   # learner steps since the last synchronisation (every rank alike)
        self.lr_phase = 0                     # the schedule's milestones passed at the last step
        self.restarts = 0
        self._window_open = False             # the auto-tuner's measurement window
        self._window_images = 0
        self._window_seconds = 0.0

    def _make_learners(self, model: nn.Module, k: int, **options: Any) -> Learners:
        """The K learners (the graphed strategy makes graphed ones)."""
        return Learners(model, k, **options)

    # -- the strategy interface ----------------------------------------------------------------

    @property
    def learners(self) -> int:
        return self.learner_group.k

    @property
    def total_learners(self) -> int:
        return self.learners * self.world_size

    @property
    def alpha(self) -> float:
        return self.alpha_given if self.alpha_given is not None else 1.0 / self.total_learners

    def step(self, batches: Batches, place: StepPlace, *, stop: bool = False,
             times: StepTimes | None = None) -> StepResult:
        """Every learner steps on its batch at ``place.lr``; every ``sync_every`` steps and at the
        epoch's last, all learners synchronise with z (collective: every rank decides alike).

        A step past a milestone of the schedule first restarts the learners from z.
        ``times`` holds what the step cost before this call (the wait for data).
        """
        times = times or StepTimes()
        events = self._restart_past_a_milestone(place, times)
        sync = place.last or self.since_sync + 1 >= self.sync_every
        t0 = time.perf_counter()
        stats, t1 = self._learn(batches, place.lr)
        figures = stats.sum(dim=0).tolist()   # on a GPU a sync point: waits for the update (as the _sync below)
        self.pending += (figures[0], figures[1], sum(int(b[1].numel()) for b in batches))
        self._sync()
        t2 = time.perf_counter()
        times.compute, times.optimizer = t1 - t0, t2 - t1
        if not sync:
            self.since_sync += 1
            self._measure(batches, times)
            return StepResult(0.0, 0.0, 0.0, False, times, synced=False, events=events)
        result = self.synchronize(stop, times, batches)
        result.events[:0] = events
        return result

    def _restart_past_a_milestone(self, place: StepPlace, times: StepTimes) -> list[str]:
        """Crossbow's restart, when the schedule has passed a milestone since the last step; its log line."""
        due = place.phase > self.lr_phase
        self.lr_phase = place.phase
        if not due:
            return []
        t0 = time.perf_counter()
        self.restart()
        self._sync()
        times.sync += time.perf_counter() - t0
        return [f"restart at step {place.step} (epoch {place.epoch:g}): the learning rate drops to "
                f"{place.lr:.4g}, every learner starts again from the central model"]

    def _learn(self, batches: Batches, lr: float) -> tuple[torch.Tensor, float]:
        """Every learner's forward, backward and local step: K x (loss sum, hits), and when the gradients were done."""
        self.parts.begin_step()
        group = self.learner_group
        self._key, stats = group.gradients([b[0] for b in batches], [b[1] for b in batches])
        self._sync()
        computed = time.perf_counter()
        group.update(self._key, lr, self.momentum, self.decay)
        return stats, computed

    def _measure(self, batches: Batches, times: StepTimes) -> None:
        """The auto-tuner's window: images and seconds of whole steps (data wait included), skipping the
        first step after a change (a warm-up); evaluation and checkpoints between steps do not count."""
        if self.tuner is None or self.tuner.frozen:
            return
        if not self._window_open:
            self._window_open = True
            return
        self._window_images += sum(int(b[1].numel()) for b in batches)
        self._window_seconds += sum(times.as_dict().values())

    @torch.no_grad()
    def synchronize(self, stop: bool, times: StepTimes | None = None, batches: Batches = ()) -> StepResult:
        """Corrections, one allreduce of Delta (and the extras), central momentum, z += Delta: two bodies
        (``share`` and ``apply``) with the allreduce between them; on one rank, nothing to sum, one body."""
        times = times or StepTimes()
        t0 = time.perf_counter()
        self._writes.set(self.alpha_t, self.alpha)        # 1/L changes with the learners
        self._writes.set(self.neg_alpha_t, -self.alpha)
        key = self._key if self._key is not None else "no step yet"
        if self.world_size == 1:                # nothing to sum: the extras stay on the host
            self.parts.run("sync", key, self._share_and_apply)
            # On a GPU a device-to-host sync point: the one read of a synchronisation.
            w_sum, delta_sum = self.sync_readout.tolist()
            extras = self._extras(stop, not math.isfinite(w_sum), batches, times, t0)
            summed = extras.astype(np.float32).tolist()   # the message's float32, as a reduced message reads
            t1 = t2 = time.perf_counter()
        else:
            self.parts.run("share", key, self._share)
            # On a GPU a device-to-host sync point: whether some learner diverged, before the allreduce.
            diverged = not math.isfinite(float(self.sync_readout[W_SUM]))
            self.extras.copy_(torch.from_numpy(self._extras(stop, diverged, batches, times, t0)))
            self._sync()
            t1 = time.perf_counter()
            self.transport.synchronize()        # MPI: Delta summed over every learner of every rank
            t2 = time.perf_counter()
            self.parts.run("apply", key, self._apply)
            summed = self.extras.tolist()       # the same answer on every rank (Delta and the extras are summed)
            delta_sum = float(self.sync_readout[DELTA_SUM])
        return self._finish(summed, math.isfinite(delta_sum), times, t0, t1, t2)

    # -- the synchronisation's bodies (run as called, or captured and replayed) -------------------

    def _share(self) -> None:
        """The corrections and this rank's share of Delta; a full pass over every learner's weights
        (K x 4 bytes per parameter) for the divergence check."""
        group = self.learner_group
        W, D = group.W.detach(), group.W_pre
        D.sub_(self.z)                                   # d_j = w~_j - z (pre-step weights)
        W.addcmul_(D, self.neg_alpha_t)                  # w_j = w_j - alpha d_j
        torch.sum(D, dim=0, out=self.delta)
        self.delta.mul_(self.alpha_t)                    # this rank's share of Delta
        self.sync_readout[W_SUM].copy_(W.sum())

    def _apply(self) -> None:
        """Central momentum and z += Delta; a full pass over Delta (4 bytes per parameter) for the divergence check."""
        if self.central_momentum > 0:
            self.delta.add_(self.delta_prev, alpha=self.central_momentum)
        self.delta_prev.copy_(self.delta)
        self.z.add_(self.delta)                          # the same bits on every rank
        self.sync_readout[DELTA_SUM].copy_(self.delta.sum())

    def _share_and_apply(self) -> None:
        self._share()
        self._apply()

    def _extras(self, stop: bool, diverged: bool, batches: Batches, times: StepTimes, t0: float) -> np.ndarray:
        """The message's tail from this rank: its figures since the last synchronisation, the stop and divergence
        flags, the auto-tuner's window (summed over ranks by the allreduce)."""
        extras = np.zeros(EXTRAS)
        extras[[LOSS, CORRECT, SAMPLES]] = self.pending
        extras[STOP] = 1.0 if stop else 0.0
        extras[NOT_FINITE] = 1.0 if diverged else 0.0
        self._measure(batches, times)
        if self._window_images:
            seconds = self._window_seconds + (time.perf_counter() - t0)
            extras[WINDOW_DONE] = 1.0 if seconds >= self.autotune_window else 0.0
            extras[[WINDOW_IMAGES, WINDOW_SECONDS]] = self._window_images, seconds
        return extras

    def _finish(self, summed: list[float], delta_finite: bool, times: StepTimes, t0: float, t1: float,
                t2: float) -> StepResult:
        """The synchronisation's result from the summed extras; the auto-tuner's decision; its times."""
        finite = math.isfinite(summed[LOSS]) and summed[NOT_FINITE] == 0 and delta_finite
        self.pending[:] = 0
        self.syncs += 1
        self.since_sync = 0
        events = []
        if summed[WINDOW_DONE] > 0:
            events += self._tune(summed[WINDOW_IMAGES] / (summed[WINDOW_SECONDS] / self.world_size))
        self._sync()
        t3 = time.perf_counter()
        if self._window_images:
            self._window_seconds += t3 - t0              # the synchronisation belongs to the window too
        times.sync += (t1 - t0) + (t3 - t2)
        times.allreduce += t2 - t1
        return StepResult(summed[LOSS], summed[CORRECT], summed[SAMPLES], summed[STOP] > 0, times,
                          synced=True, finite=finite, events=events)

    def _tune(self, throughput: float) -> list[str]:
        assert self.tuner is not None
        decision = self.tuner.observe(throughput)
        self._window_open, self._window_images, self._window_seconds = False, 0, 0.0
        if decision is None:
            return []
        if decision.change:
            self.learner_group.resize(self.tuner.learners)
        return [decision.describe()]

    @torch.no_grad()
    def restart(self) -> None:
        """Every learner's weights <- z (momentum and batch-norm statistics are kept, as Crossbow does)."""
        self.learner_group.W.detach().copy_(self.z.expand_as(self.learner_group.W))
        self.restarts += 1

    @torch.no_grad()
    def eval_model(self) -> nn.Module:
        """Collective: z, with batch-norm statistics of its own (recomputed on training batches), or
        without a source of batches the learners' statistics averaged over all learners of all ranks."""
        group = self.learner_group
        if self.z_counts.numel():
            self.z_counts.copy_(group.count_rows()[0])
        if not self.z_floats.numel() or self._calibrated_at == self.syncs:
            return self.model
        if self.calibration is not None:
            recompute_batch_norm(self.model, self._calibration_batches(), group.normalize, self.reduce,
                                 self.world_size)
        else:
            total = group.float_rows().sum(dim=0).cpu().contiguous()
            self.reduce(total.numpy())                       # MPI: sum over the ranks' learners
            self.z_floats.copy_(total.div_(self.total_learners))
        self._calibrated_at = self.syncs
        return self.model

    def _calibration_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of :data:`CALIBRATION_IMAGES`, a fresh draw after every synchronisation."""
        assert self.calibration is not None
        return self.calibration(self.syncs, -(-self.calibration_images // self.world_size))

    def global_state(self) -> dict[str, Any]:
        return {"delta_prev": self.delta_prev.cpu().clone(), "alpha": self.alpha,
                "alpha_given": self.alpha_given, "central_momentum": self.central_momentum,
                "learners": self.learners, "syncs": self.syncs, "restarts": self.restarts,
                "since_sync": self.since_sync, "lr_phase": self.lr_phase,
                "tuner": self.tuner.state_dict() if self.tuner is not None else None}

    def local_state(self) -> dict[str, Any]:
        return {"learners": self.learner_group.state_dict(), "pending": self.pending.copy()}

    @torch.no_grad()
    def load_state(self, shared: dict[str, Any], local: dict[str, Any] | None) -> list[str]:
        """z comes with the model's weights; here Delta_prev, the cadence, the learners and the tuner.

        On another layout the checkpoint is an epoch boundary, whose last step synchronised: the
        cadence starts afresh there either way, and the milestones passed are the schedule's, in epochs.
        """
        notes: list[str] = []
        self.delta_prev.copy_(shared["delta_prev"])
        self.syncs, self.restarts = int(shared["syncs"]), int(shared["restarts"])
        self.since_sync, self.lr_phase = int(shared["since_sync"]), int(shared["lr_phase"])
        if local is not None:
            self.learner_group.load_state_dict(local["learners"])
            self.pending[:] = local["pending"]
            if self.tuner is not None and shared["tuner"] is not None:
                self.tuner = AutoTuner.from_state(shared["tuner"])
            return notes
        # Another layout: every learner starts from z (and z's averaged batch-norm statistics).
        k = self.tuner.learners if self.tuner is not None else self.learners
        group = self.learner_group
        group.load_state_dict({"weights": self.z.expand(k, -1).cpu(),
                               "momentum": torch.zeros(k, self.z.numel()),
                               "buffers": self.z_floats.expand(k, -1).cpu(),
                               "counts": self.z_counts.expand(k, -1).cpu()})
        notes.append(f"the {shared['learners']} learner(s) per rank of the checkpoint are re-created as "
                     f"{k} per rank from the central model z (momentum zero)")
        return notes

    def figures(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "central_momentum": self.central_momentum,
                "learner_momentum": self.momentum, "synchronisations": self.syncs,
                "restarts": self.restarts, "learners_per_rank": self.learners,
                "learners_total": self.total_learners, "compute": self.learner_group.compute,
                "autotune": None if self.tuner is None else self.tuner.state_dict()}

    def identical(self, comm) -> bool:
        """Whether z is bit-identical on every rank (a crc32 of its bytes, compared)."""
        return identical_across_ranks([self.z], comm)   # MPI: compare the ranks' checksums

    def close(self) -> None:
        self.learner_group.close()
        self.transport.close()
        self.parts.reset("closed")
