"""Checkpoints: written by rank 0 to a temporary name and renamed, the last N kept, loaded safely.

A checkpoint holds what an exact resume needs: the model that is evaluated
(S-SGD's replica, SMA's central model z), the synchronisation strategy's
shared state (S-SGD: optimizer momentum; SMA: Delta_prev, alpha, the learner
count and the auto-tuner), every rank's own state (batch-norm statistics;
SMA: every learner's weights, momentum and buffers), the sampler positions and
torch RNGs, the schedule position (epoch and batch of the loader, so it does
not depend on the rank count), the store's last shuffle round and the metrics
so far. It is read with ``torch.load(weights_only=True)``, so every value is a
tensor or a plain container of plain values; numpy arrays and tuples are
encoded as tensors and tagged lists on the way in.

A checkpoint that cannot be written (a full disk) raises a one-line error and
leaves the older checkpoints alone: they are rotated out only after the new
one is complete.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dimd.errors import DimdError
from dimd.fsutil import atomic_path

FORMAT = "dimd-checkpoint"
VERSION = 2
_NAME = re.compile(r"^checkpoint-e(\d+)-s(\d+)\.pt$")


def checkpoint_name(epoch: int, step: int) -> str:
    """``epoch`` is the number of finished epochs, ``step`` the number of optimizer steps taken."""
    return f"checkpoint-e{epoch:04d}-s{step:08d}.pt"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step a checkpoint file's name records (-1 for another name)."""
    m = _NAME.match(Path(path).name)
    return int(m.group(2)) if m else -1


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in ``directory``, oldest first (by step)."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if _NAME.match(p.name)), key=lambda p: (checkpoint_step(p), p))


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
    if version != VERSION:
        raise DimdError(f"{path}: checkpoint version {version}; this dimd reads version {VERSION} only "
                        f"(start the run afresh without `resume`)")
    return decode(document)


def _reason(exc: Exception) -> str:
    """The first line of a load error, without torch's advice to unpickle the file."""
    text = str(exc)
    if "weights_only" in text or "Unsupported global" in text or "WeightsUnpickler" in text:
        return "it holds Python objects other than tensors and plain values"
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
