"""Checkpoints: written by rank 0 to a temporary name and renamed, the last N kept, loaded safely.

A checkpoint holds what an exact resume needs: the model that is evaluated
(S-SGD's replica, SMA's central model z), the synchronisation strategy's
shared state (S-SGD: optimizer momentum; SMA: Delta_prev, alpha, the learner
count, its cadence and the auto-tuner), every rank's own state (batch-norm statistics;
SMA: every learner's weights, momentum and buffers), the sampler positions and
torch RNGs, the schedule position (epoch and batch of the loader, so it does
not depend on the rank count), the store's last shuffle round and the metrics
so far. It is read with ``torch.load(weights_only=True)``, so every value is a
tensor or a plain container of plain values; numpy arrays and tuples are
encoded as tensors and tagged lists on the way in.

A checkpoint that cannot be written (a full disk) raises a one-line error and
leaves the older checkpoints alone: they are rotated out only after the new
one is complete.

A run saves and resumes through one pair, :func:`save_run` and
:func:`restore_run`, over :class:`RunState` (the run's counters and records)
and the run's pieces, :class:`RunParts` (model, strategy, loader, store).
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from dimd.errors import DimdError
from dimd.fsutil import atomic_path
from dimd.mpi import agree_or_raise, agreed, require_on_every_rank
from dimd.train.config import TrainConfig
from dimd.train.model_source import recorded_source
from dimd.train.results import EpochMetrics, EpochTally, Evaluation
from dimd.train.steps import Strategy

FORMAT = "dimd-checkpoint"
#: 3: a run id in every checkpoint (rotation and resume go by the order checkpoints were written).
#: 4: one random stream per purpose (dimd.shuffle.streams): the same position holds other records and crops.
#: 5: SMA's cadence (steps since its last synchronisation, milestones passed) is in its strategy state;
#:    the world size is the layout's alone, and no learning rate is written (the schedule gives it).
#: 6: the config's S-SGD settings (overlap, noise_scale, nesterov) are a section of their own, ``ssgd``; the
#:    ImageNet ResNets' modules have torchvision's names (the stem's convolution and batch norm were
#:    ``stem.0`` and ``stem.1``).
VERSION = 6
#: Older versions still read: each model's parameter names then, as prefixes, and now. A key of any
#: state dict in the checkpoint (the model, a rank's buffers, a learner's) is renamed.
RENAMED: dict[int, dict[str, tuple[tuple[str, str], ...]]] = {
    5: {name: (("stem.0.", "conv1."), ("stem.1.", "bn1.")) for name in ("resnet18", "resnet50")},
}
#: Older versions still read: the config fields that moved into a section, by version.
MOVED_FIELDS: dict[int, dict[str, tuple[str, ...]]] = {5: {"ssgd": ("overlap", "noise_scale", "nesterov")}}
#: What a resume reads from every checkpoint: a file without one of them is refused in one line.
REQUIRED = ("run_id", "sync", "model_name", "classes", "config", "layout", "epoch", "step", "position",
            "images", "train_seconds", "next_eval_images", "model", "strategy", "ranks", "store_round", "tally",
            "history", "evaluations")
_NAME = re.compile(r"^checkpoint-e(\d+)-s(\d+)\.pt$")


def checkpoint_name(epoch: int, step: int) -> str:
    """``epoch`` is the number of finished epochs, ``step`` the number of optimizer steps taken."""
    return f"checkpoint-e{epoch:04d}-s{step:08d}.pt"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step a checkpoint file's name records (-1 for another name)."""
    m = _NAME.match(Path(path).name)
    return int(m.group(2)) if m else -1


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in ``directory``, oldest first: in the order they were written, then by step.

    Not by step alone: a run resumed from an earlier checkpoint on another
    layout counts its steps from there, so its new checkpoints can have lower
    step numbers than the abandoned ones it leaves behind; by step, the
    rotation would delete the new ones and ``resume`` would pick the stale one
    again, for ever.
    """
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        if _NAME.match(path.name):
            with contextlib.suppress(FileNotFoundError):   # rotated out by another process meanwhile
                found.append((path.stat().st_mtime_ns, checkpoint_step(path), path))
    return [path for *_, path in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def save_checkpoint(directory: str | os.PathLike, state: dict[str, Any], *, keep: int = 3) -> Path:
    """Write ``state`` atomically as the next checkpoint; delete all but the newest ``keep``."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / checkpoint_name(int(state["epoch"]), int(state["step"]))
    document = {"format": FORMAT, "version": VERSION, **encode(state)}
    try:
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                torch.save(document, f)
                f.flush()
                os.fsync(f.fileno())
    except (DimdError, OSError, RuntimeError) as exc:   # torch.save wraps a failed write in a RuntimeError
        if isinstance(exc, DimdError):   # a full disk, said the way every full disk is (dimd.fsutil)
            problem = str(exc)
        else:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
            problem = f"{path}: cannot write the checkpoint ({reason})"
        raise DimdError(f"{problem}; the {len(list_checkpoints(folder))} older checkpoint(s) in {folder} "
                        f"are kept") from None
    if keep > 0:
        for old in list_checkpoints(folder)[:-keep]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
    return path


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`; a clear error for anything else."""
    path = Path(path)
    if not path.exists():
        raise DimdError(f"{path}: checkpoint not found")
    if not zipfile.is_zipfile(path):   # what torch.save writes; anything else is damaged or foreign
        raise DimdError(f"{path}: not a readable dimd checkpoint (not the zip archive torch.save writes: "
                        f"truncated, overwritten or another kind of file)")
    try:
        document = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DimdError(f"{path}: checkpoint not found") from None
    except Exception as exc:  # a truncated or foreign file: pickle/zip errors of many kinds
        # torch's own message suggests weights_only=False, i.e. running the file's code: never that.
        raise DimdError(f"{path}: not a readable dimd checkpoint ({_reason(exc)}); dimd reads "
                        f"checkpoints as plain tensors and lists only and will not load this file") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise DimdError(f"{path}: not a dimd checkpoint")
    version = int(document.get("version", 1))   # version 1 wrote no number
    if version != VERSION and version not in RENAMED:
        older = " and ".join(str(v) for v in sorted(RENAMED))
        raise DimdError(f"{path}: checkpoint version {version}; this dimd reads version {VERSION} (and {older}) "
                        f"only (start the run afresh without `resume`)")
    if version in RENAMED:
        document = _renamed(document, RENAMED[version].get(str(document.get("model_name")), ()))
        config = document.get("config")
        if isinstance(config, dict):   # the fields a section took over move into it
            for section, names in MOVED_FIELDS.get(version, {}).items():
                config[section] = {**{name: config.pop(name) for name in names if name in config},
                                   **config.get(section, {})}
    missing = [key for key in REQUIRED if key not in document]
    if missing:
        raise DimdError(f"{path}: a damaged checkpoint: it has no {', '.join(repr(k) for k in missing[:3])}"
                        f"{' ...' if len(missing) > 3 else ''} (start the run afresh without `resume`)")
    return decode(document)


def _renamed(value: Any, prefixes: tuple[tuple[str, str], ...]) -> Any:
    """``value`` with every dict key that starts with an old prefix renamed to the new one, at any depth."""
    if not prefixes:
        return value
    if isinstance(value, dict):
        return {_new_name(k, prefixes): _renamed(v, prefixes) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed(v, prefixes) for v in value]
    return value


def _new_name(key: Any, prefixes: tuple[tuple[str, str], ...]) -> Any:
    for old, new in prefixes:
        if isinstance(key, str) and key.startswith(old):
            return new + key[len(old):]
    return key


def _reason(exc: Exception) -> str:
    """The first line of a load error, without torch's advice to unpickle the file."""
    text = str(exc)
    if "Unsupported global" in text:
        return "it holds Python objects other than tensors and plain values"
    for line in text.splitlines():   # torch's weights-only errors: the line after its advice says what
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip()[:200]
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:200]


# weights_only=True loads tensors and plain containers only: encode the rest reversibly.
_TUPLE, _NDARRAY, _NDARRAY_DTYPE = "__tuple__", "__ndarray__", "__ndarray_dtype__"


def encode(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {_NDARRAY: torch.from_numpy(np.ascontiguousarray(value).copy()),
                _NDARRAY_DTYPE: value.dtype.str}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return {_TUPLE: [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    return value


def decode(value: Any) -> Any:
    if isinstance(value, dict):
        if _NDARRAY in value and len(value) == 2:
            return value[_NDARRAY].numpy().astype(np.dtype(value[_NDARRAY_DTYPE]), copy=False)
        if _TUPLE in value and len(value) == 1:
            return tuple(decode(v) for v in value[_TUPLE])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


# -- a run's checkpoint: what it saves, how it resumes -------------------------------------------


@dataclass
class RunState:
    """Where a run stands: what a checkpoint restores besides the model, the strategy, the loader and the store."""

    epoch: int = 0                 # epochs finished
    step: int = 0                  # steps taken (each consumes one batch per learner)
    images: int = 0                # training images processed, all ranks
    train_seconds: float = 0.0     # in training steps so far (this rank's clock)
    next_eval_images: int = 0      # the periodic evaluation is due once ``images`` reaches this
    tally: EpochTally = field(default_factory=EpochTally)
    history: list[EpochMetrics] = field(default_factory=list)
    evaluations: list[Evaluation] = field(default_factory=list)
    #: Which run this is: new for a fresh start, carried over by every resume (rank 0's is written).
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


class RunParts(Protocol):
    """The pieces of a run that a checkpoint covers (:class:`dimd.train.engine.Trainer` has them)."""

    config: TrainConfig
    comm: Any
    model: nn.Module
    strategy: Strategy
    store: Any      # dimd.shuffle.DistributedStore: its classes and last shuffle round
    loader: Any     # the training loader: its position and sampler state


def run_layout(config: TrainConfig, world_size: int) -> dict[str, Any]:
    """What a mid-epoch resume needs unchanged: the data's split over ranks and learners."""
    return {"world_size": world_size, "groups": config.groups, "batch_size": config.batch_size,
            "learners": config.sma.learners, "sync_every": config.sma.sync_every,
            "shuffle_every": config.shuffle_every}


def resume_point(config: TrainConfig, comm: Any) -> str | None:
    """The checkpoint to continue from (``resume_from``, or the newest in the folder with ``resume``), if any."""
    path = None
    if comm.Get_rank() == 0:
        if config.resume_from:
            path = config.resume_from
        elif config.resume:
            found = latest_checkpoint(config.checkpoint_dir)  # type: ignore[arg-type]
            path = str(found) if found else None
    path = comm.bcast(path, root=0)   # MPI: rank 0 chooses for everyone
    if path is not None:
        require_on_every_rank(comm, path, "checkpoint")   # MPI: a folder one node alone sees
    return path


def save_run(run: RunParts, state: RunState, *, last_good: str | None = None) -> str | None:
    """Collective: rank 0 writes a checkpoint of ``run`` at ``state``; every rank learns its path (or the error).

    A model that is not finite is never saved (it would rotate a good checkpoint out).
    """
    config, comm = run.config, run.comm
    if config.checkpoint_dir is None:
        return None
    document = run_document(run, state)
    outcome: tuple[str | None, str | None] = (None, None)
    if document is not None:
        bad = [k for k, v in document["model"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            outcome = (None, f"the model is not finite ({bad[0]}); not saved, the last good checkpoint "
                             f"is {last_good or 'none'}")
        else:
            try:
                outcome = (str(save_checkpoint(config.checkpoint_dir, document, keep=config.keep_checkpoints)), None)
            except DimdError as exc:
                outcome = (None, str(exc))
    path, problem = comm.bcast(outcome, root=0)   # MPI: every rank learns the outcome
    if problem is not None:
        raise agreed(comm, problem)
    return path


def run_document(run: RunParts, state: RunState) -> dict[str, Any] | None:
    """Collective: gather every rank's local state; the whole checkpoint on rank 0, else None."""
    comm = run.comm
    model = run.strategy.eval_model()   # collective for SMA (averaged batch-norm statistics)
    local = {"strategy": run.strategy.local_state(), "loader": run.loader.state_dict(),
             "torch_rng": torch.get_rng_state()}
    everyone = comm.gather(local, root=0)   # MPI: rank 0 writes every rank's state
    if comm.Get_rank() != 0:
        return None
    epoch, done = run.loader.position
    return {
        "run_id": state.run_id, "sync": run.strategy.name, "model_name": run.config.model,
        "model_source": recorded_source(run.config.model).get("source"),   # a user's: spec, path, sha256
        "classes": list(run.store.classes),
        "config": run.config.as_dict(), "layout": run_layout(run.config, comm.Get_size()),
        "epoch": state.epoch, "step": state.step,
        # The schedule's position, in epochs and batches of the loader: it does not depend on P.
        "position": {"epoch": state.epoch, "batch": done if epoch == state.epoch else 0,
                     "batches_per_epoch": run.loader.steps_per_epoch},
        "images": state.images, "train_seconds": state.train_seconds, "next_eval_images": state.next_eval_images,
        "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "strategy": run.strategy.global_state(),
        "ranks": everyone, "store_round": run.store.round,
        "tally": state.tally.as_dict(),
        "history": [m.as_dict() for m in state.history],
        "evaluations": [e.__dict__ for e in state.evaluations],
    }


def _restore_model_and_strategy(run: RunParts, path: str, layout: dict[str, Any]
                                ) -> tuple[dict[str, Any], bool, dict[str, Any], list[str]]:
    """This rank's part of :func:`restore_run` before anything collective: (the checkpoint, whether it
    has this run's layout, this rank's saved state, notes)."""
    document = load_checkpoint(path)
    check_fits(path, document, run.config, list(run.store.classes))
    same_layout = document["layout"] == layout
    if not same_layout and document["position"]["batch"]:
        raise DimdError(mid_epoch_problem(path, document, layout))
    try:
        run.model.load_state_dict(document["model"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise DimdError(f"{path}: does not fit this model ({str(exc).splitlines()[0]})") from None
    mine: dict[str, Any] = document["ranks"][run.comm.Get_rank()] if same_layout else {}
    try:
        notes = run.strategy.load_state(document["strategy"], mine["strategy"] if same_layout else None)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise DimdError(f"{path}: does not fit this run ({str(exc).splitlines()[0]})") from None
    return document, same_layout, mine, notes


def restore_run(run: RunParts, path: str) -> tuple[RunState, list[str]]:
    """Continue ``run`` from the checkpoint at ``path``: exactly on the same layout, from an epoch
    boundary otherwise. Collective (the store's shuffle is replayed); returns the state to go on
    from and what had to change, as log lines."""
    config, comm = run.config, run.comm
    layout = run_layout(config, comm.Get_size())
    restored, problem = None, None
    try:
        restored = _restore_model_and_strategy(run, path, layout)
    except DimdError as exc:
        problem = str(exc)
    agree_or_raise(comm, problem)   # MPI: a checkpoint one rank cannot take stops every rank, in order
    assert restored is not None
    document, same_layout, mine, notes = restored
    state = RunState(epoch=int(document["epoch"]), step=int(document["step"]), images=int(document["images"]),
                     next_eval_images=int(document["next_eval_images"]),
                     train_seconds=float(document["train_seconds"]),
                     history=[EpochMetrics.from_dict(m) for m in document["history"]],
                     evaluations=[Evaluation(**e) for e in document["evaluations"]],
                     run_id=str(document["run_id"]))
    if document["store_round"] is not None:
        run.store.shuffle(config.seed, int(document["store_round"]))   # MPI: the records' placement, replayed
    if same_layout:
        run.loader.load_state_dict(mine["loader"])
        torch.set_rng_state(mine["torch_rng"])
        state.tally = EpochTally.from_dict(document["tally"])
    else:
        run.loader.seek(state.epoch)
        notes.insert(0, f"the checkpoint's layout ({describe_layout(document['layout'])}) differs from this run's "
                        f"({describe_layout(layout)}); continuing from the end of epoch {state.epoch}")
    return state, notes


def check_fits(path: str, document: dict[str, Any], config: TrainConfig, classes: list[str]) -> None:
    """The checkpoint is of this run's synchronisation, model and classes (one line naming what differs)."""
    saved_sync = document["sync"]
    if saved_sync != config.sync:
        raise DimdError(f"{path}: a checkpoint of a `sync` {saved_sync} run, this run is `sync` "
                        f"{config.sync}; resume it with `sync` {saved_sync} (or start afresh without `resume`)")
    if document["model_name"] != config.model:
        raise DimdError(f"{path}: checkpoint of model {document['model_name']!r}, not {config.model!r}")
    if list(document["classes"]) != classes:
        raise DimdError(f"{path}: checkpoint has {len(document['classes'])} classes, {config.train} has "
                        f"{len(classes)}")


def mid_epoch_problem(path: str, document: dict[str, Any], layout: dict[str, Any]) -> str:
    """What to do with a mid-epoch checkpoint on another layout: the exact alternatives."""
    folder = os.path.dirname(os.path.abspath(path))
    earlier = [p for p in list_checkpoints(folder) if checkpoint_step(p) <= int(document["step"])]
    boundary = [p for p in earlier if at_epoch_boundary(p)]
    alternative = (f", or resume from {boundary[-1]} (an epoch boundary) on any layout" if boundary
                   else "; no epoch-boundary checkpoint is beside it")
    return (f"{path}: written mid-epoch (epoch {document['epoch'] + 1}, step {document['step']}) with "
            f"{describe_layout(document['layout'])}; this run has {describe_layout(layout)}: resume it with "
            f"that layout{alternative}")


def describe_layout(layout: dict[str, Any]) -> str:
    """A :func:`run_layout` in words."""
    parts = [f"{layout['world_size']} ranks"]
    if layout["learners"] is not None:
        parts.append(f"{layout['learners']} learners per rank")
    parts += [f"groups {layout['groups']}", f"batch {layout['batch_size']}"]
    if layout["sync_every"] != 1:
        parts.append(f"sync every {layout['sync_every']}")
    every = layout["shuffle_every"]
    parts.append("shuffle " + ("never" if every is None else "every epoch" if every == 0 else f"every {every}"))
    return ", ".join(parts)


def at_epoch_boundary(path: str | os.PathLike) -> bool:
    """Whether a checkpoint file was written at an epoch's end (reads only its position)."""
    try:
        document = load_checkpoint(path)
    except DimdError:
        return False
    return document["position"]["batch"] == 0
