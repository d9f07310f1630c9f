"""What ``dimd eval`` evaluates and how: the only defaults, checked once (as :mod:`dimd.train.config` for training).

Light to import (no torch), so that ``dimd --help`` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass

from dimd.checks import at_least, in_range, one_of
from dimd.train.config import DEVICES, PRECISIONS, TTA



@dataclass(frozen=True)
class EvalConfig:
    """What ``dimd eval`` evaluates, and how; None: as the checkpoint's run evaluated."""

    checkpoint: str
    val: str
    image_size: int | None = None         # None: the run's
    val_crop_ratio: float | None = None   # the crop over the resized shorter side; None: the run's
    batch_size: int | None = None         # images per rank per batch; None: the run's validation batch
    tta: str | None = None                # test-time augmentation (TTA)
    device: str = "auto"
    precision: str | None = None          # None: the run's
    decode_workers: int | None = None     # None: the rank's cores but one
    threads: int | None = None            # None: cores / ranks on the node
    per_class: bool = False               # each class's top-1 too
    ema: bool = False                     # the run's weight average (``ema``) instead of its model

    def __post_init__(self) -> None:
        one_of(self, "tta", TTA, optional=True)
        one_of(self, "device", DEVICES)
        one_of(self, "precision", PRECISIONS, optional=True)
        at_least(self, "image_size", 8, optional=True)
        in_range(self, "val_crop_ratio", 0.0, 1.0, low_open=True, optional=True)
        for name in ("batch_size", "decode_workers", "threads"):
            at_least(self, name, 1, optional=True)
