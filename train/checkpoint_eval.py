"""A checkpoint evaluated again (``dimd eval``), with ``dimd train``'s own evaluation.

The model is the one the checkpoint holds (S-SGD's replica, SMA's central model),
built from the model name and classes it records; the validation set is loaded
into the ranks' memory and scored by :func:`dimd.train.evaluate.local_counts`
with the loader, normalisation, precision and memory format the run evaluated
with, and the counts are summed over the ranks, as :meth:`Trainer.evaluate
<dimd.train.engine.Trainer.evaluate>` does. Unless the size, batch or precision
is changed, the checkpoint of an epoch's end gives the figures the run logged
for that epoch. S-SGD's ranks keep batch-norm statistics of their own (each
normalises its own batches): on the run's rank count each rank scores with its
own, as the run did; on another, every rank takes rank 0's, those of the model
``dimd export`` writes. The EMA weights are not read (checkpoints do not hold them yet).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dimd.errors import DimdError
from dimd.train.eval_config import EvalConfig
from dimd.train.evaluate import EvalResult, local_counts, summarize


@dataclass(frozen=True)
class TrainedModel:
    """What a checkpoint says of its model: enough to rebuild, evaluate and export it."""

    path: str
    model_name: str
    classes: list[str]
    weights: dict[str, torch.Tensor]
    config: dict[str, Any]                # the run's TrainConfig, as a dict
    epoch: int                            # epochs finished
    step: int
    at_epoch_end: bool
    history: list[dict[str, Any]] = field(default_factory=list)
    #: S-SGD: each rank's batch-norm statistics (the weights are the same on every rank); else empty.
    rank_buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    #: ``ema``: the weights' moving average (weights and batch-norm buffers, rank 0's), or None.
    ema_weights: dict[str, torch.Tensor] | None = None

    @property
    def ema_better(self) -> bool:
        """Whether the run's last evaluation scored the moving average above the model (export takes it then)."""
        logged = self.logged
        return (self.ema_weights is not None and logged is not None and logged.get("ema_val_top1") is not None
                and logged["ema_val_top1"] > logged["val_top1"])

    def average(self) -> "TrainedModel":
        """This checkpoint with the moving average's weights in place of the model's; one line if it has none."""
        if self.ema_weights is None:
            raise DimdError(f"{self.path}: has no weight average (the run had no `ema`)")
        logged = self.logged
        history = [*self.history[:-1], {**logged, "val_top1": logged.get("ema_val_top1"),
                                        "val_top5": logged.get("ema_val_top5"),
                                        "val_loss": logged.get("ema_val_loss")}] if logged else self.history
        return replace(self, weights=self.ema_weights, rank_buffers=[], ema_weights=None, history=history)

    @property
    def logged(self) -> dict[str, Any] | None:
        """The run's record of the epoch this checkpoint ends (None mid-epoch, or before the first)."""
        if not self.at_epoch_end or not self.history or self.history[-1]["epoch"] != self.epoch:
            return None
        return self.history[-1]

    @property
    def image_size(self) -> int:
        """The validation crop the run evaluated at (``val_image_size``, else ``image_size``)."""
        return int(self.config.get("val_image_size") or self.config["image_size"])

    @property
    def crop_ratio(self) -> float:
        """The run's validation crop over the resized shorter side (``val_crop_ratio``)."""
        from dimd.train.config import EVAL_CROP_RATIO

        return float(self.config.get("val_crop_ratio", EVAL_CROP_RATIO))

    def build(self, rank: int | None = None) -> nn.Module:
        """The model with the checkpoint's weights, in eval mode (with ``rank``: that rank's batch-norm
        statistics, where the run kept them per rank); one line if they do not fit it."""
        from dimd.train.models import build_model

        model = build_model(self.model_name, len(self.classes))
        weights = self.weights
        if rank is not None and rank < len(self.rank_buffers):
            weights = {**weights, **self.rank_buffers[rank]}
        try:
            model.load_state_dict(weights)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise DimdError(f"{self.path}: does not fit model {self.model_name!r} with {len(self.classes)} "
                            f"classes ({str(exc).splitlines()[0]})") from None
        return model.eval()


def read_trained_model(path: str | Path) -> TrainedModel:
    """The model a dimd checkpoint holds; one line for a file that is not one (:func:`load_checkpoint`)."""
    from dimd.train.checkpoint import load_checkpoint

    document = load_checkpoint(path)
    return TrainedModel(path=str(path), model_name=str(document["model_name"]), classes=list(document["classes"]),
                        weights=document["model"], config=dict(document["config"]), epoch=int(document["epoch"]),
                        step=int(document["step"]), at_epoch_end=document["position"]["batch"] == 0,
                        history=list(document["history"]),
                        rank_buffers=[r["strategy"]["buffers"] for r in document["ranks"]
                                      if "buffers" in r.get("strategy", {})],
                        ema_weights=_averaged_weights(document["strategy"].get("ema")))


def _averaged_weights(ema: dict[str, Any] | None) -> dict[str, torch.Tensor] | None:
    """The model's state dict inside an EMA state (torch's AveragedModel keeps it under ``module.``)."""
    if ema is None:
        return None
    prefix = "module."
    return {k[len(prefix):]: v for k, v in ema["averaged"].items() if k.startswith(prefix)}


def class_problem(trained: TrainedModel, val: str, val_classes: list[str]) -> str | None:
    """Why the packed set ``val`` cannot be scored by ``trained`` (classes it does not know), or None."""
    from dimd.train.run_plan import val_label_map

    try:
        val_label_map(trained.classes, val_classes, val, trained.path)
    except DimdError as exc:
        return str(exc)
    return None


def input_problem(config: EvalConfig, comm: Any) -> tuple[TrainedModel | None, str | None]:
    """Collective, before any data loads: the checkpoint (read by every rank) and the validation set's classes
    (its index, read by rank 0). The model, or the first problem any rank met (the same on every rank)."""
    from dimd.format import PackedDataset
    from dimd.mpi import agree_or_raise

    trained, problem = None, None
    try:
        trained = read_trained_model(config.checkpoint)
        if config.ema:
            trained = trained.average()
        trained.build()
        if comm.Get_rank() == 0:
            problem = class_problem(trained, config.val, PackedDataset(config.val, check_size=False).classes)
    except DimdError as exc:
        problem = str(exc)
    try:
        agree_or_raise(comm, problem)   # MPI: a file one rank cannot read stops every rank
    except DimdError as exc:
        return None, str(exc)
    return trained, None


@dataclass
class CheckpointEvaluation:
    """``dimd eval``'s result: the figures, what was evaluated, and what the run had logged for it."""

    result: EvalResult
    trained: TrainedModel
    config: EvalConfig
    image_size: int
    precision: str
    device: str
    world_size: int

    def figures(self) -> dict[str, Any]:
        logged = self.trained.logged
        figures: dict[str, Any] = {
            **self.result.as_dict(), "checkpoint": self.trained.path, "model": self.trained.model_name,
            "epoch": self.trained.epoch, "step": self.trained.step, "image_size": self.image_size,
            "tta": self.config.tta, "precision": self.precision, "device": self.device,
            "world_size": self.world_size,
            "logged": None if logged is None else {k: logged[k] for k in ("val_loss", "val_top1", "val_top5")}}
        if self.result.per_class:
            figures["per_class"] = [{"class": name, "top1": hits / samples if samples else None, "samples": samples}
                                    for name, (hits, samples) in zip(self.trained.classes, self.result.per_class)]
        return figures


def evaluate_checkpoint(config: EvalConfig, trained: TrainedModel, comm: Any) -> CheckpointEvaluation:
    """Collective: ``trained`` (from :func:`input_problem`) scored on ``config.val``, sharded over ``comm``'s ranks."""
    from mpi4py import MPI

    from dimd.shuffle import BatchLoader, DistributedStore
    from dimd.shuffle.device_feed import device_feed
    from dimd.shuffle.normalize import Normalize
    from dimd.train.run_plan import val_label_map
    from dimd.train.hardware import default_decode_workers, pick_device, set_threads
    from dimd.train.precision import Precision, memory_format

    run = trained.config
    set_threads(config.threads, comm)   # MPI: the node's cores are shared by its ranks
    device = pick_device(config.device, comm)
    workers = config.decode_workers or default_decode_workers(comm)
    image_size = config.image_size or trained.image_size
    crop_ratio = config.val_crop_ratio or trained.crop_ratio
    batch = config.batch_size or run.get("eval_batch_size") or int(run["batch_size"])
    same_ranks = len(trained.rank_buffers) == comm.Get_size()
    model = trained.build(comm.Get_rank() if same_ranks else None)
    # The memory format and precision the run evaluated with (channels-last: S-SGD's replica only).
    layout = memory_format(run.get("channels_last") if run.get("sync") == "ssgd" else False, device, model)
    model.to(device, memory_format=layout)  # type: ignore[call-overload]  # torch's stub lacks it
    precision = Precision(config.precision or run.get("precision", "32-true"), device)
    store = DistributedStore.load(config.val, comm, groups=1, decode_workers=workers)
    label_map = val_label_map(trained.classes, store.classes, config.val, trained.path)
    loader = BatchLoader(store, batch, image_size, train=False, decode_workers=workers, seed=int(run.get("seed", 0)),
                         pin_memory=device.type == "cuda", crop_ratio=crop_ratio)
    feed = device_feed(loader, device)
    try:
        t0 = time.perf_counter()
        with precision.autocast():
            counts = local_counts(model, feed.epoch(0), Normalize(device, layout), label_map=label_map,
                                  tta=config.tta, classes=len(trained.classes) if config.per_class else 0)
        comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)   # MPI: every rank scored its share
        result = summarize(counts, time.perf_counter() - t0)
    finally:
        feed.close()   # and its loader
    return CheckpointEvaluation(result=result, trained=trained, config=config, image_size=image_size,
                                precision=precision.name, device=str(device), world_size=comm.Get_size())
