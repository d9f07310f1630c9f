"""The frozen configurations of the plan-batch steps: the only defaults, each validating itself.

Plain dataclasses with nothing heavy imported at module level, so the CLI can
build its options from them without loading numpy or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from dimd.checks import at_least, one_of, positive, require

DEVICES = ("auto", "cpu", "cuda")
#: Delta(P) is predicted for P = 1, 2, 4, ... up to this by default.
DEFAULT_MAX_RANKS = 1024
POWERS_OF_TWO_TO_1024 = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: median: the usual summary of repeats; min: the least disturbed run, for a busy machine.
REPEAT_STATISTICS = ("median", "min")


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

    def __post_init__(self) -> None:
        from dimd.train.models import MODELS

        require(self.model in MODELS, "model", f"{self.model!r} is unknown; choose from {', '.join(MODELS)}")
        require(len(set(self.batch_sizes)) >= 2, "batch_sizes", "needs at least 2 distinct batch sizes to fit "
                f"the knee, got {','.join(map(str, self.batch_sizes)) or 'none'}")
        require(min(self.batch_sizes) >= 1, "batch_sizes", f"must be positive, got {min(self.batch_sizes)}")
        at_least(self, "image_size", 8)
        at_least(self, "steps", 1)
        at_least(self, "warmup", 0)
        at_least(self, "classes", 2, optional=True)
        one_of(self, "device", DEVICES)
        at_least(self, "threads", 1, optional=True)

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
        for name in ("strong_batch", "weak_per_rank", "max_batch"):
            at_least(self, name, 1, optional=True)
        positive(self, "max_holdout_error", optional=True)
        require(self.allowed_per_rank is None or (bool(self.allowed_per_rank) and min(self.allowed_per_rank) >= 1),
                "allowed_per_rank", "must be positive whole batch sizes")
