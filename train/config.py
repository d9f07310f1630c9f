"""The training run's configuration: click options -> this frozen dataclass -> the engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dimd.errors import DimdError
from dimd.train.schedule import SCHEDULES

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class TrainConfig:
    """Everything that shapes a run; it goes into every checkpoint and JSON result."""

    train: str
    val: str
    model: str
    image_size: int = 224
    crop_scale: float = 0.08              # smallest area share of a random-resized training crop
    epochs: int = 90
    batch_size: int = 64                  # per rank
    lr: float = 0.1                       # for a global batch of 256
    lr_scaling: bool = True
    momentum: float = 0.9
    weight_decay: float = 1e-4
    decay_bn_and_bias: bool = False
    nesterov: bool = False
    schedule: str = "step"
    milestones: tuple[float, ...] | None = None   # epochs; None: 30/60/80 of 90, scaled
    warmup_epochs: float | None = None            # None: 5 when the global batch exceeds 256
    power: float = 0.5
    zero_init_residual: bool = False
    groups: int = 1
    shuffle_every: int | None = 0         # steps; 0: at every epoch start; None: never
    allreduce: str | None = None          # None: the fastest measured at start-up
    bucket_mb: float = 0.0                # 0: one allreduce for all gradients
    device: str = "auto"
    workers: int = 2
    threads: int | None = None            # torch threads per rank; None: cores / ranks on the node
    seed: int = 0
    eval_batch_size: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0             # steps; 0: at the end of every epoch only
    keep_checkpoints: int = 3
    resume: bool = False                  # continue from the newest checkpoint in checkpoint_dir, if any
    resume_from: str | None = None        # continue from this checkpoint file
    memory_limit: int | None = None
    read_from: str = "memory"             # "files": read each image from its original file (baseline)
    files_root: str | None = None         # the folder the set was packed from (default: the index's source)
    # Synchronisation: S-SGD, or Crossbow's synchronous model averaging (docs/sma.md).
    sync: str = "ssgd"                    # "ssgd" or "sma"
    learners: int | str | None = None     # SMA learners per rank: a number or "auto"; None: 1
    alpha: float | None = None            # SMA correction weight; None: 1/L for L learners in all
    sma_momentum: float | None = None     # SMA's central momentum; None: 0.9 with --momentum > 0, else 0
    sync_every: int = 1                   # SMA: learner steps per synchronisation
    autotune_threshold: float = 0.1       # SMA auto: the throughput rise that adds a learner

    def __post_init__(self) -> None:
        checks = [
            (self.epochs >= 1, f"--epochs must be at least 1 (got {self.epochs})"),
            (self.batch_size >= 1, f"--batch-size must be at least 1 (got {self.batch_size})"),
            (self.image_size >= 8, f"--image-size must be at least 8 (got {self.image_size})"),
            (0 < self.crop_scale <= 1, f"--crop-scale must be in (0, 1] (got {self.crop_scale})"),
            (self.lr > 0, f"--lr must be positive (got {self.lr})"),
            (0 <= self.momentum < 1, f"--momentum must be in [0, 1) (got {self.momentum})"),
            (self.weight_decay >= 0, f"--weight-decay must be non-negative (got {self.weight_decay})"),
            (self.schedule in SCHEDULES, f"--schedule must be one of {', '.join(SCHEDULES)}"),
            (self.groups >= 1, f"--groups must be at least 1 (got {self.groups})"),
            (self.shuffle_every is None or self.shuffle_every >= 0, "--shuffle-every must be >= 0"),
            (self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}"),
            (self.workers >= 1, f"--workers must be at least 1 (got {self.workers})"),
            (self.checkpoint_every >= 0, "--checkpoint-every must be >= 0"),
            (self.bucket_mb >= 0, "--bucket-mb must be >= 0"),
            (self.read_from in ("memory", "files"), "--read-from must be memory or files"),
            (self.warmup_epochs is None or self.warmup_epochs >= 0, "--warmup-epochs must be >= 0"),
            (not (self.resume or self.checkpoint_every) or self.checkpoint_dir is not None,
             "--resume and --checkpoint-every need --checkpoint-dir"),
        ]
        for ok, message in checks:
            if not ok:
                raise DimdError(message)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
