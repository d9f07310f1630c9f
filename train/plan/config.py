"""The frozen configurations of the plan-batch steps: the only defaults, each validating itself.

Plain dataclasses with nothing heavy imported at module level, so the CLI can
build its options from them without loading numpy or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dimd.checks import at_least, finite, in_range, one_of, positive, require
from dimd.stall import STALL_TIMEOUT_S
from dimd.train.config import DEVICES
#: Delta(P) is predicted for P = 1, 2, 4, ... up to this by default.
DEFAULT_MAX_RANKS = 1024
POWERS_OF_TWO_TO_1024 = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: The most ranks the planner predicts for (2^20, more than any machine runs): the cost models build
#: arrays of P entries (multicolor's trees), so a larger P would allocate gigabytes or run for hours.
MAX_RANKS = 1 << 20
#: median: the usual summary of repeats; min: the least disturbed run, for a busy machine.
REPEAT_STATISTICS = ("median", "min")


def bounded_ranks(name: str, ranks: tuple[int, ...]) -> None:
    """The one size check on rank counts the planner predicts for: at most :data:`MAX_RANKS`."""
    largest = max(ranks, default=0)
    require(largest <= MAX_RANKS, name, f"goes up to {largest:,} ranks; the planner predicts for at most "
            f"{MAX_RANKS:,} (2^20)")


def default_classes(model: str) -> int:
    """1000 for the ImageNet-style models (designed for 224 px), 10 for the CIFAR-style ones."""
    from dimd.train.models import MODELS

    return 1000 if MODELS[model].image_size >= 224 else 10


@dataclass(frozen=True)
class StepTimeConfig:
    """What ``plan-batch step-time`` measures."""

    model: str
    image_size: int = 32
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    steps: int = 10                # timed steps per batch size
    warmup: int = 3                # untimed steps before them
    classes: int | None = None     # None: 1000 for ImageNet-style models, 10 for the others
    device: str = "auto"
    threads: int | None = None     # torch threads per rank; None: cores / ranks on the node
    seed: int = 0
    #: A packed training set: time steps on its batches from ``dimd train``'s loader, its decoding workers
    #: running alongside (they compete with the step for the cores); None: synthetic inputs.
    data: str | None = None
    decode_workers: int | None = None   # with ``data``: the loader's processes per rank; None: dimd train's
    crop_scale: float | None = None     # with ``data``: the training crop's smallest area share; None: dimd train's
    stall_timeout: float = STALL_TIMEOUT_S   # seconds a rank waits for the others in a step; 0: forever

    def __post_init__(self) -> None:
        from dimd.train.models import MODELS, image_size_problem

        require(self.model in MODELS, "model", f"{self.model!r} is unknown; choose from {', '.join(MODELS)}")
        require(len(set(self.batch_sizes)) >= 2, "batch_sizes", "needs at least 2 distinct batch sizes to fit "
                f"the knee, got {','.join(map(str, self.batch_sizes)) or 'none'}")
        require(min(self.batch_sizes) >= 1, "batch_sizes", f"must be positive, got {min(self.batch_sizes)}")
        at_least(self, "image_size", 8)
        problem = image_size_problem(self.model, self.image_size)
        require(problem is None, "image_size", problem or "")
        at_least(self, "steps", 1)
        at_least(self, "warmup", 0)
        at_least(self, "classes", 2, optional=True)
        one_of(self, "device", DEVICES)
        at_least(self, "threads", 1, optional=True)
        at_least(self, "decode_workers", 1, optional=True)
        in_range(self, "crop_scale", 0.0, 1.0, low_open=True, optional=True)
        for name in ("decode_workers", "crop_scale"):
            require(self.data is not None or getattr(self, name) is None, name,
                    "goes with `data` (real batches from the loader)")
        at_least(self, "stall_timeout", 0)
        finite(self, "stall_timeout")

    @property
    def num_classes(self) -> int:
        return self.classes if self.classes is not None else default_classes(self.model)


@dataclass(frozen=True)
class CommFitConfig:
    """What ``plan-batch comm`` fits and predicts."""

    files: tuple[str, ...]
    gradient_bytes: int | None = None          # None: the size the bench results recorded (--model)
    holdout: tuple[int, ...] | None = None     # None: the larger half of the measured rank counts
    max_ranks: int = DEFAULT_MAX_RANKS
    algorithms: tuple[str, ...] | None = None  # None: every modelled algorithm in the files
    statistic: str = "median"                  # how repeated rows (several files at one P) combine

    def __post_init__(self) -> None:
        from dimd.train.plan.commmodel import COST_MODELS

        one_of(self, "statistic", REPEAT_STATISTICS)
        require(bool(self.files), "files", "needs at least one bench-allreduce result")
        positive(self, "gradient_bytes", optional=True)
        require(self.holdout is None or min(self.holdout, default=2) >= 2, "holdout",
                f"must be rank counts of at least 2, got {list(self.holdout or ())}")
        at_least(self, "max_ranks", 2)
        bounded_ranks("max_ranks", (self.max_ranks,))
        for name in self.algorithms or ():
            require(name in COST_MODELS, "algorithms",
                    f"has {name!r}, which has no cost model (modelled: {', '.join(COST_MODELS)})")


@dataclass(frozen=True)
class SolveConfig:
    """What ``plan-batch solve`` tabulates."""

    ranks: tuple[int, ...] = POWERS_OF_TWO_TO_1024
    strong_batch: int | None = None       # None: the optimal global batch at the largest P
    weak_per_rank: int | None = None      # None: the optimal per-rank batch at the smallest P
    max_batch: int | None = None          # a cap on the global batch (e.g. the training set's size)
    allowed_per_rank: tuple[int, ...] | None = None   # None: any whole number of images per rank
    algorithms: tuple[str, ...] | None = None         # None: every algorithm comm fitted and trusts
    max_holdout_error: float | None = 0.5             # leave out fits whose held-out median error is larger

    def __post_init__(self) -> None:
        require(bool(self.ranks), "ranks", "needs at least one rank count")
        bad = [p for p in self.ranks if isinstance(p, bool) or not isinstance(p, int) or p < 1]
        require(not bad, "ranks", f"must be positive integers, got {bad[0]!r}" if bad else "")
        bounded_ranks("ranks", self.ranks)
        for name in ("strong_batch", "weak_per_rank", "max_batch"):
            at_least(self, name, 1, optional=True)
        positive(self, "max_holdout_error", optional=True)
        require(self.allowed_per_rank is None or (bool(self.allowed_per_rank) and min(self.allowed_per_rank) >= 1),
                "allowed_per_rank", "must be positive whole batch sizes")
        if self.max_batch is not None:   # the cap holds for every batch the plan takes
            require(self.max_batch >= max(self.ranks), "max_batch",
                    f"must give each rank an image: {self.max_batch} is smaller than P = {max(self.ranks)}")
            require(self.strong_batch is None or self.strong_batch <= self.max_batch, "strong_batch",
                    f"must not exceed `max_batch` (got {self.strong_batch} > {self.max_batch})")


#: The TrainConfig fields ``plan-batch convergence`` passes through when given (None: `dimd train`'s default).
CONVERGENCE_TRAIN_FIELDS = ("lr", "warmup_epochs", "momentum", "weight_decay", "crop_scale", "allreduce",
                            "device", "decode_workers", "optimizer", "lars_trust")


@dataclass(frozen=True)
class ConvergenceConfig:
    """What ``plan-batch convergence`` trains: every (global batch, seed) once, to a validation top-1.

    The runs use ``dimd train``'s engine and its defaults for every setting
    left as None here (rate, warm-up, momentum, ...); the rate is the base
    ``lr`` (for 256 images) scaled linearly to each global batch, and stays
    at its peak after the warm-up (``constant``), so a run's updates to the
    target do not depend on its budget.
    """

    train: str
    val: str
    model: str
    target_top1: float
    batch_sizes: tuple[int, ...]              # global batches M
    seeds: int = 3                            # runs per batch, seeds first_seed, first_seed + 1, ...
    first_seed: int = 0
    max_epochs: int = 20                      # each run's budget
    eval_every_images: int | None = None      # None: a tenth of the training set
    ranks_per_run: int = 1                    # G: each run on G ranks (M/G images each); P/G runs at once
    image_size: int | None = None             # None: the size the model is designed for
    eval_batch_size: int | None = None        # None: the per-rank batch, at least 128
    threads: int | None = None                # torch threads per rank; None: cores / ranks on the node
    lr: float | None = None                   # base rate for 256 images; None: dimd train's
    warmup_epochs: float | None = None        # None: dimd train's rule (5 when M > 256, else 0)
    momentum: float | None = None
    weight_decay: float | None = None
    crop_scale: float | None = None
    allreduce: str | None = None              # with G >= 2; None: the fastest measured at start-up
    device: str | None = None
    decode_workers: int | None = None
    optimizer: str | None = None              # None: dimd train's (sgd); the fit is per optimizer
    lars_trust: float | None = None           # with optimizer lars; None: dimd train's

    def __post_init__(self) -> None:
        from dimd.train.models import MODELS

        require(self.model in MODELS, "model", f"{self.model!r} is unknown; choose from {', '.join(MODELS)}")
        require(len(set(self.batch_sizes)) >= 2, "batch_sizes", "needs at least 2 distinct global batch sizes "
                f"to fit N_inf and alpha, got {','.join(map(str, self.batch_sizes)) or 'none'}")
        require(min(self.batch_sizes) >= 1, "batch_sizes", f"must be positive, got {min(self.batch_sizes)}")
        in_range(self, "target_top1", 0.0, 1.0, low_open=True)
        at_least(self, "seeds", 1)
        at_least(self, "first_seed", 0)
        at_least(self, "max_epochs", 1)
        at_least(self, "eval_every_images", 1, optional=True)
        at_least(self, "ranks_per_run", 1)
        at_least(self, "eval_batch_size", 1, optional=True)
        at_least(self, "threads", 1, optional=True)
        uneven = [m for m in self.batch_sizes if m % self.ranks_per_run]
        require(not uneven, "batch_sizes", f"must be multiples of `ranks_per_run` ({self.ranks_per_run}): "
                f"{uneven[0] if uneven else ''} images cannot be split evenly over its ranks")
        self.train_config(min(self.batch_sizes), self.first_seed)   # the engine's own checks, at once

    @property
    def model_image_size(self) -> int:
        from dimd.train.models import MODELS

        return self.image_size if self.image_size is not None else MODELS[self.model].image_size

    @property
    def run_seeds(self) -> tuple[int, ...]:
        return tuple(range(self.first_seed, self.first_seed + self.seeds))

    def train_config(self, batch: int, seed: int, threads: int | None = None) -> Any:
        """The :class:`dimd.train.config.TrainConfig` of the run at global batch ``batch``."""
        from dimd.train.config import TrainConfig

        given = {name: getattr(self, name) for name in CONVERGENCE_TRAIN_FIELDS if getattr(self, name) is not None}
        per_rank = batch // self.ranks_per_run
        return TrainConfig(train=self.train, val=self.val, model=self.model, image_size=self.model_image_size,
                           epochs=self.max_epochs, batch_size=per_rank, lr_scaling=True, schedule="constant",
                           eval_batch_size=self.eval_batch_size or max(per_rank, 128), seed=seed,
                           threads=threads if threads is not None else self.threads, **given)
