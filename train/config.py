"""The training run's configuration: the only defaults, checked once, frozen.

``dimd train``'s options are generated from these fields
(:func:`dimd.options.config_option`), so a default lives here and nowhere
else; ``__post_init__`` rejects nonsense whether the config came from the
command line or from Python. Each synchronisation's own settings are a config
of their own, nested in :class:`TrainConfig` (and a group of their own in
``dimd train --help``): S-SGD's :class:`SSGDConfig` as ``ssgd``, SMA's
:class:`SMAConfig` as ``sma``; the other ``sync`` refuses any of them set. The
rules between settings are :mod:`dimd.train.rules`'s: the config refuses
what was asked for explicitly, the run plan applies them to the defaults. The
resolved config goes into every checkpoint and JSON result.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from dimd.checks import at_least, finite, in_range, one_of, positive, require
from dimd.errors import ConfigError
from dimd.shuffle.crop import EVAL_CROP_RATIO
from dimd.stall import STALL_TIMEOUT_S
from dimd.train.rules import (branches_need_graphs, compile_is_not_captured, graphs_asked, graphs_need_a_gpu,
                              overlap_cannot_be_captured, threads_cannot_be_captured)
from dimd.train.schedule import SCHEDULES

DEVICES = ("auto", "cpu", "cuda")
#: Where training images come from: the in-memory store, or each image's original file on every
#: access (page cache allowed), or that file read cold (its cached pages dropped before each read).
READ_FROM = ("memory", "files", "files-cold")
SYNCS = ("ssgd", "sma")
#: How a rank computes its SMA learners' gradients (dimd.train.learners): one replica after another (on
#: CUDA each on its own stream, Crossbow's way; under CUDA graphs one graph each), or one thread each;
#: branches: one CUDA graph with a branch per learner (dimd.train.graphed_sma). docs/sma.md says why loop is
#: the default.
LEARNER_COMPUTES = ("loop", "threads", "branches")
#: Where images are decoded: the loader's CPU decoders, or nvJPEG on the rank's GPU (dimd.shuffle.gpu_decode).
DECODES = ("cpu", "gpu")
#: How the step computes, in Lightning's names (dimd.train.precision).
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
#: Test-time augmentations of the evaluation: ``flip`` averages the logits of each image and of its mirror image.
TTA = ("flip",)
#: Steps between two updates of the weights' moving average (``ema_every``; torchvision's reference: 32).
EMA_EVERY = 32
#: The optimizers a run may use (dimd.train.optimizers builds them).
OPTIMIZERS = ("sgd", "lars")
#: LARS's trust coefficient eta unless ``lars_trust`` says otherwise (You, Gitman and Ginsburg; MLPerf's reference).
LARS_TRUST = 0.001


class Section:
    """A synchronisation's own settings, nested in :class:`TrainConfig`: the other ``sync`` refuses any set."""

    def changed(self) -> list[str]:
        """The fields set to other than their defaults."""
        return [f.name for f in fields(self)  # type: ignore[arg-type]  # the sections are dataclasses
                if getattr(self, f.name) != f.default]


@dataclass(frozen=True)
class SSGDConfig(Section):
    """Synchronous data-parallel SGD's own settings (the gradient allreduce and its optimizer): ``sync`` ssgd
    reads them, and nothing else does."""

    overlap: bool | None = None           # reduce buckets during backward; None: where a core or GPU is free
    noise_scale: bool = False             # McCandlish et al.'s gradient noise scale B_simple, per epoch (2+ ranks)
    nesterov: bool = False                # Nesterov momentum in the replica's optimizer
    ema: float | None = None              # decay per step of the weights' moving average (dimd.train.ema); None: off
    ema_every: int = EMA_EVERY            # steps between two updates of that average
    compile: bool = False                 # run the replica's forward and backward as torch.compile's code

    #: Why each field is S-SGD's: the end of SMA's refusal.
    WHY: ClassVar[dict[str, str]] = {
        "overlap": "SMA averages models, not gradients, so it has no gradient buckets to reduce during backward",
        "noise_scale": "it compares each rank's gradient with their average, and SMA averages models, not "
                       "gradients",
        "nesterov": "SMA's learners use Polyak momentum, as Crossbow's do",
        "ema": "SMA's central model z is itself an average of the learners' weights",
        "ema_every": "SMA's central model z is itself an average of the learners' weights",
        "compile": "SMA's learners are K replicas over rows of flat buffers, which dimd does not compile",
    }

    def __post_init__(self) -> None:
        require(not (self.overlap and self.noise_scale), "overlap", "cannot go with `noise_scale`: the "
                "noise scale needs each rank's whole gradient before any bucket is reduced")
        in_range(self, "ema", 0.0, 1.0, low_open=True, high_open=True, optional=True)
        at_least(self, "ema_every", 1)
        if self.compile:
            import torch

            require(hasattr(torch, "compile") and hasattr(torch.nn.Module, "compile"), "compile",
                    f"needs torch.compile, which this torch ({torch.__version__}) lacks: leave it out")


@dataclass(frozen=True)
class SMAConfig(Section):
    """Crossbow's synchronous model averaging (docs/sma.md): what ``sync`` sma reads, and nothing else does."""

    learners: int | str | None = None     # learners per rank: a number or "auto"; None: 1
    alpha: float | None = None            # correction weight; None: 1/L for L learners in all
    sma_momentum: float | None = None     # the central model's momentum; None: sma.CENTRAL_MOMENTUM (0)
    sync_every: int = 1                   # learner steps per synchronisation (an epoch's last step synchronises too)
    autotune_threshold: float = 0.1       # learners auto: the relative throughput rise that adds a learner
    learner_compute: str = "loop"         # how a rank computes its learners' gradients

    def __post_init__(self) -> None:
        one_of(self, "learner_compute", LEARNER_COMPUTES)
        in_range(self, "alpha", 0.0, 1.0, low_open=True, optional=True)
        in_range(self, "sma_momentum", 0.0, 1.0, high_open=True, optional=True)
        at_least(self, "sync_every", 1)
        at_least(self, "autotune_threshold", 0.0)
        if self.learners is not None and self.learners != "auto":
            require(isinstance(self.learners, int) and not isinstance(self.learners, bool), "learners",
                    f"must be a number of learners per rank or auto (got {self.learners!r})")
            at_least(self, "learners", 1)

    @property
    def autotune(self) -> bool:
        """``learners="auto"``: the auto-tuner chooses the learners per rank."""
        return self.learners == "auto"

    @property
    def fixed_learners(self) -> int:
        """Learners per rank when their number is fixed, else 1 (the auto-tuner's start)."""
        return self.learners if isinstance(self.learners, int) else 1


@dataclass(frozen=True)
class TrainConfig:
    """Everything that shapes a run; it goes into every checkpoint and JSON result."""

    train: str
    val: str
    model: str = "resnet50"
    image_size: int = 224
    image_size_schedule: str | None = None   # START:END[:FIRST:LAST]: the training crop grows (progressive resizing)
    val_image_size: int | None = None     # the validation centre crop; None: image_size (the schedule's end)
    val_crop_ratio: float = EVAL_CROP_RATIO   # the validation crop over the resized shorter side (224/256)
    tta: str | None = None                # the validation's test-time augmentation ("flip"); None: none
    crop_scale: float = 0.08              # smallest area share of a random-resized training crop
    epochs: int = 90
    target_top1: float | None = None      # percent: stop at the first evaluation at or above it
    batch_size: int = 64                  # per rank
    lr: float = 0.1                       # for a global batch of 256
    lr_scaling: bool = True
    momentum: float = 0.9
    optimizer: str = "sgd"                # "sgd", or "lars": each layer's rate scaled by its trust ratio
    lars_trust: float = LARS_TRUST        # LARS's trust coefficient eta
    label_smoothing: float = 0.0          # the loss's target: 1 - eps on the label, eps spread over every class
    weight_decay: float = 1e-4
    decay_bn_and_bias: bool = False
    schedule: str = "step"
    milestones: tuple[float, ...] | None = None   # epochs; None: 30/60/80 of 90, scaled
    warmup_epochs: float | None = None            # None: 5 when the global batch exceeds 256
    power: float = 0.5
    zero_init_residual: bool = False
    groups: int = 1
    shuffle_every: int | None = 0         # steps; 0: at every epoch start; None: never
    allreduce: str | None = None          # None: nccl on GPUs where it can run, else the fastest measured at start-up
    bucket_mb: float | None = None        # None: DEFAULT_BUCKET_MB with overlap, else one message; 0: one message
    device: str = "auto"
    decode_workers: int | None = None     # the loader's decoding processes per rank; None: cores per rank - 1
    threads: int | None = None            # torch threads per rank; None: cores / ranks on the node
    seed: int = 0
    eval_batch_size: int | None = None    # None: batch_size
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0             # steps; 0: at the end of every epoch only
    keep_checkpoints: int = 3             # 0: keep all
    resume: bool = False                  # continue from the newest checkpoint in checkpoint_dir, if any
    resume_from: str | None = None        # continue from this checkpoint file
    force: bool = False                   # a fresh run deletes an earlier run's checkpoints in checkpoint_dir
    memory_limit: int | None = None       # bytes per rank
    stall_timeout: float = STALL_TIMEOUT_S  # seconds a rank waits in a collective before it ends the job; 0: forever
    read_from: str = "memory"             # "files"/"files-cold": read each image from its original file
    files_root: str | None = None         # the folder the set was packed from (default: the index's source)
    # Synchronisation: S-SGD, or Crossbow's synchronous model averaging (docs/sma.md).
    sync: str = "ssgd"                    # "ssgd" or "sma"
    ssgd: SSGDConfig = SSGDConfig()       # read with `sync` ssgd only; left at its defaults for SMA
    sma: SMAConfig = SMAConfig()          # read with `sync` sma only; left at its defaults for S-SGD
    # How the step computes (dimd.train.precision) and where images are decoded.
    precision: str = "32-true"            # "32-true", "bf16-mixed" (autocast) or "16-mixed" (autocast + loss scale)
    channels_last: bool | None = None     # None: channels-last for convolutional models on CUDA
    decode: str = "cpu"                   # "gpu": nvJPEG on the rank's GPU, then crop and resize there
    cuda_graphs: bool | None = None       # replay the step as CUDA graphs; None: where launches bound it (graphs.py)

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "groups"):
            at_least(self, name, 1)
        for name in ("threads", "eval_batch_size", "decode_workers"):
            at_least(self, name, 1, optional=True)
        at_least(self, "image_size", 8)
        self._check_model_size()
        in_range(self, "crop_scale", 0.0, 1.0, low_open=True)
        positive(self, "lr")
        in_range(self, "momentum", 0.0, 1.0, high_open=True)
        in_range(self, "label_smoothing", 0.0, 1.0, high_open=True)
        one_of(self, "optimizer", OPTIMIZERS)
        positive(self, "lars_trust")
        require(self.optimizer != "lars" or self.precision != "16-mixed", "optimizer",
                "lars cannot skip an overflowed 16-mixed step on the device yet; use bf16-mixed or 32-true")
        at_least(self, "val_image_size", 8, optional=True)
        in_range(self, "val_crop_ratio", 0.0, 1.0, low_open=True)
        one_of(self, "tta", TTA, optional=True)
        if self.image_size_schedule is not None:
            self.size_schedule   # noqa: B018  (parsed and checked once: a ConfigError names the field)
        in_range(self, "target_top1", 0.0, 100.0, low_open=True, optional=True)
        for name in ("weight_decay", "seed", "checkpoint_every", "keep_checkpoints"):
            at_least(self, name, 0)
        at_least(self, "bucket_mb", 0, optional=True)
        at_least(self, "warmup_epochs", 0, optional=True)
        at_least(self, "shuffle_every", 0, optional=True)
        positive(self, "power")
        positive(self, "memory_limit", optional=True)
        at_least(self, "stall_timeout", 0)
        finite(self, "stall_timeout")
        one_of(self, "schedule", SCHEDULES)
        one_of(self, "device", DEVICES)
        one_of(self, "read_from", READ_FROM)
        self._check_device_work()
        if self.allreduce is not None:
            from dimd.allreduce import ALGORITHMS

            one_of(self, "allreduce", ALGORITHMS)
        if self.milestones is not None:
            require(all(m > 0 and math.isfinite(m) for m in self.milestones), "milestones",
                    f"must be positive, finite epochs (got {self.milestones})")
        finite(self, "lr")
        require(not (self.resume or self.checkpoint_every) or self.checkpoint_dir is not None,
                "checkpoint_dir", "is needed to resume or to checkpoint every N steps")
        self._check_sync()
        self._check_graphs()

    def _check_model_size(self) -> None:
        from dimd.train.models import image_size_problem

        problem = image_size_problem(self.model, self.image_size)
        require(problem is None, "image_size", problem or "")

    def _check_device_work(self) -> None:
        one_of(self, "precision", PRECISIONS)
        one_of(self, "decode", DECODES)
        require(self.decode == "cpu" or self.device != "cpu", "decode",
                "gpu needs a GPU: leave out `device` cpu (or decode on the cpu)")
        require(self.decode == "cpu" or self.read_from == "memory", "decode",
                "gpu decodes the records held in memory: leave out `read_from`")
        if self.allreduce == "nccl":
            from dimd.allreduce.group import nccl_needs_a_gpu

            nccl_needs_a_gpu(self.device).check()
        require(self.files_root is None or self.read_from != "memory", "files_root",
                "is where `read_from` files or files-cold finds the original images; give one of those too")

    def _check_graphs(self) -> None:
        """The rules of :mod:`dimd.train.rules` on what was asked for; the run plan applies them to the defaults."""
        if self.cuda_graphs:
            graphs_need_a_gpu(self.device).check()
            overlap_cannot_be_captured(self.ssgd.overlap).check()
            compile_is_not_captured(self.ssgd.compile).check()
            threads_cannot_be_captured(self.sma.learner_compute).check()
        asked = graphs_asked(self.cuda_graphs, self.device)
        if asked is not None:
            branches_need_graphs(self.sma.learner_compute, asked).check()

    def _check_sync(self) -> None:
        one_of(self, "sync", SYNCS)
        require(isinstance(self.ssgd, SSGDConfig), "ssgd", f"must be an SSGDConfig (got {self.ssgd!r})")
        require(isinstance(self.sma, SMAConfig), "sma", f"must be an SMAConfig (got {self.sma!r})")
        if self.sync == "ssgd":
            changed = self.sma.changed()
            if changed:
                raise ConfigError(changed[0], "is a setting of model averaging: add `sync` sma, or leave it out for "
                                  "S-SGD")
            return
        changed = self.ssgd.changed()
        if changed:
            raise ConfigError(changed[0], f"is a setting of S-SGD: {SSGDConfig.WHY[changed[0]]}; leave it out with "
                              "`sync` sma")
        require(self.channels_last is not True, "channels_last", "is implemented for S-SGD's replica; leave "
                "it out with `sync` sma")
        require(self.precision == "32-true", "precision", "is implemented for S-SGD's step (its loss scale "
                "is agreed through the gradient allreduce); leave it out with `sync` sma")

    @property
    def size_schedule(self) -> Any:
        """The training crop of each epoch (:class:`dimd.train.image_sizes.SizeSchedule`), or None: ``image_size``."""
        if self.image_size_schedule is None:
            return None
        from dimd.train.image_sizes import parse_size_schedule

        return parse_size_schedule(self.image_size_schedule, model=self.model, epochs=self.epochs)

    @property
    def largest_image_size(self) -> int:
        """The training crop the loader's slots hold: the schedule's end, else ``image_size``."""
        schedule = self.size_schedule
        return schedule.largest if schedule is not None else self.image_size

    def bucket_bytes(self, overlap: bool) -> int:
        """The S-SGD bucket in bytes (0: one message), given whether the buckets overlap backward."""
        from dimd.train.buckets import DEFAULT_BUCKET_MB

        mb = self.bucket_mb if self.bucket_mb is not None else DEFAULT_BUCKET_MB if overlap else 0.0
        return int(mb * 2**20)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
