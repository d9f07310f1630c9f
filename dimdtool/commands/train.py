"""``mpirun dimd train``: synchronous data-parallel SGD on the in-memory data and dimd's allreduce.

Every option except the outputs (``--metrics``, ``--json``) is a field of
:class:`dimd.train.config.TrainConfig`, which holds its default and checks it;
S-SGD's and SMA's own are the fields of its nested
:class:`~dimd.train.config.SSGDConfig` and :class:`~dimd.train.config.SMAConfig`,
each a section of its own in ``--help``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

import click

from dimd.console import progress
from dimd.options import (ALLREDUCE_ALGORITHM, FLOAT_LIST, OUTPUT_DIR, OUTPUT_FILE, SIZE, RegistryChoice,
                          SectionedCommand, build_config, config_option, defer_output_checks, json_option,
                          option_group, quiet_option, shared_option, stall_timeout_option)
from dimd.train.config import (DECODES, DEVICES, LEARNER_COMPUTES, OPTIMIZERS, PRECISIONS, READ_FROM, SYNCS, TTA,
                               SMAConfig, SSGDConfig, TrainConfig)
from dimd.train.schedule import SCHEDULES


class ModelName(RegistryChoice):
    """A model of the zoo, or a user's ``package.module:callable`` / ``path/to/file.py:callable`` as given
    (loading it and every way that fails are dimd.train.model_source's)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value if isinstance(value, str) and ":" in value else super().convert(value, param, ctx)


class ShuffleEvery(click.ParamType):
    """``N`` steps, ``epoch`` (0 in the config) or ``never`` (None)."""

    name = "N|epoch|never"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value is None or isinstance(value, int):
            return value
        if value == "epoch":
            return 0
        if value == "never":
            return None
        if value.isdigit() and int(value) > 0:
            return int(value)
        self.fail(f"expected a number of steps, 'epoch' or 'never', got {value!r}", param, ctx)


class LearnersType(click.ParamType):
    """``K`` learners per rank or ``auto`` (Crossbow's auto-tuner)."""

    name = "K|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | str | None:
        if value is None or isinstance(value, int) or value == "auto":
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"expected a number of learners per rank or 'auto', got {value!r}", param, ctx)


def print_models() -> None:
    from dimd.train.models import MODELS, build_model, gradient_bytes, parameter_count
    from dimd.units import format_bytes

    click.echo(f"{'model':<14}{'parameters':>12}{'gradients':>12}{'size':>6}{'min':>5}  description")
    for name, spec in MODELS.items():
        model = build_model(name, 1000)
        click.echo(f"{name:<14}{parameter_count(model):>12,}{format_bytes(gradient_bytes(model)):>12}"
                   f"{spec.image_size:>6}{spec.smallest_image:>5}  {spec.description}")
    click.echo("(parameters for 1000 classes; `size` is the image size the model is designed for, "
               "`min` the smallest it takes)")


@click.command("train", cls=SectionedCommand)
@click.argument("train_set", metavar="TRAIN", required=False)
@click.option("--val", "val_set", metavar="VAL",
              help="Packed validation set (required); its classes are matched to TRAIN's by name.")
@config_option(TrainConfig, "model", type=ModelName("dimd.train.models:MODELS"),
               help="Model name (see --list-models), or your own: package.module:callable or "
                    "path/to/file.py:callable, called with num_classes, returning an nn.Module.")
@click.option("--list-models", is_flag=True,
              help="List the models with parameter counts and gradient bytes, then exit.")
@config_option(TrainConfig, "epochs")
@config_option(TrainConfig, "target_top1", metavar="P",
               help="Stop at the first evaluation whose top-1 (the model's, or the --ema average's) is at or "
                    "above P percent; the JSON's `target` and the epoch's --metrics line give the time, "
                    "epochs and updates it took, as MLPerf reports a time to train.")
@config_option(TrainConfig, "batch_size", help="Images per rank per step; under SMA, per learner per step.")
@config_option(TrainConfig, "lr",
               help="Learning rate for a batch of 256, scaled linearly: by the global batch / 256 under "
                    "S-SGD, by a learner's batch / 256 under SMA (each learner steps on its own batch).")
@config_option(TrainConfig, "lr_scaling", "--lr-scaling/--no-lr-scaling",
               help="Scale --lr by batch / 256 (the linear scaling rule); --no-lr-scaling uses it as "
                    "given (under SMA too: the rate of every learner's step).")
@config_option(TrainConfig, "momentum")
@config_option(TrainConfig, "optimizer", type=click.Choice(OPTIMIZERS),
               help="sgd: SGD with momentum (Goyal et al.); lars: each layer's rate scaled by its trust ratio "
                    "eta |w| / (|g| + wd |w|), for large global batches (You et al.; MLPerf's large-batch "
                    "ResNet-50). Under SMA each learner steps so.")
@config_option(TrainConfig, "lars_trust", metavar="ETA", help="LARS's trust coefficient eta.")
@config_option(TrainConfig, "label_smoothing", metavar="EPS",
               help="Label smoothing: the loss's target puts 1 - EPS on the label and spreads EPS over every "
                    "class (torch's cross_entropy; MLPerf and FFCV use 0.1).")
@config_option(TrainConfig, "weight_decay")
@config_option(TrainConfig, "decay_bn_and_bias", help="Also apply weight decay to batch-norm and bias parameters.")
@config_option(TrainConfig, "schedule", type=click.Choice(SCHEDULES),
               help="step: /10 at --milestones; poly: (1 - t)^0.5 as FireCaffe; cosine: half cosine to 0; "
                    "constant.")
@config_option(TrainConfig, "milestones", type=FLOAT_LIST,
               help="Epochs where step divides by 10 [default: 30,60,80 of 90, scaled to --epochs].")
@config_option(TrainConfig, "warmup_epochs",
               help="Linear warm-up from --lr to the scaled rate (Goyal et al.) [default: 5 if the "
                    "global batch exceeds 256, else 0].")
@config_option(TrainConfig, "image_size", help="Training crop and validation centre crop (px).")
@config_option(TrainConfig, "image_size_schedule", metavar="START:END[:FIRST:LAST]",
               help="Progressive resizing: the training crop grows from START to END px between epochs FIRST and "
                    "LAST (from 0; default: the whole run), in steps of 32 px for the ImageNet models and 8 px "
                    "for the others (FFCV: 160:192); the loader decodes each epoch at its size.")
@config_option(TrainConfig, "val_image_size", metavar="PX",
               help="The validation centre crop, e.g. larger than a progressive run's last size (the "
                    "train-test resolution effect) [default: --image-size].")
@config_option(TrainConfig, "tta", type=click.Choice(TTA),
               help="Test-time augmentation of every evaluation: flip averages the logits of each image and of "
                    "its mirror image.")
@config_option(TrainConfig, "val_crop_ratio", metavar="RATIO",
               help="The validation crop over the resized shorter side (torchvision's --val-crop-size / "
                    "--val-resize-size).")
@shared_option(TrainConfig, "crop_scale")
@config_option(TrainConfig, "zero_init_residual",
               help="Zero the last batch-norm scale of each residual block (every ResNet).")
@config_option(TrainConfig, "groups", help="Shuffle groups: each group of consecutive ranks holds the whole set.")
@config_option(TrainConfig, "shuffle_every", type=ShuffleEvery(), show_default="epoch",
               help="Reshuffle the store across each group every N steps, every 'epoch' or 'never' "
                    "(it is shuffled once before the first step in any case).")
@config_option(TrainConfig, "allreduce", type=ALLREDUCE_ALGORITHM,
               help="Allreduce algorithm (see `dimd bench-allreduce --help`); nccl (GPUs) and gloo (CPUs) reduce "
                    "the gradients in place through torch.distributed, started from the MPI job [default: nccl "
                    "where every rank has a GPU of its own and NCCL is there, else the fastest measured at "
                    "start-up for the model's gradient size].")
@config_option(TrainConfig, "bucket_mb",
               help="Allreduce the gradients in buckets of this size (0: one message) [default: 25 with "
                    "--overlap, else one message].")
@config_option(TrainConfig, "sync", type=click.Choice(SYNCS),
               help="ssgd: synchronous data-parallel SGD (one gradient allreduce per step); sma: "
                    "Crossbow's synchronous model averaging of independent learners (docs/sma.md; its "
                    "settings are listed apart, below).")
@option_group(
    "S-SGD (--sync ssgd, the default)",
    config_option(SSGDConfig, "overlap", "--overlap/--no-overlap",
                  help="Reduce each gradient bucket on a communication thread while backward goes on; the "
                       "weights are the same either way [default: on with a GPU whose step runs eagerly, or a "
                       "core free beyond the ranks' torch threads; docs/library.md]."),
    config_option(SSGDConfig, "noise_scale",
                  help="Log the gradient noise scale B_simple (McCandlish et al., appendix A) per epoch in "
                       "--metrics and --json: each rank's squared gradient norm rides the gradient allreduce, "
                       "compared with the averaged gradient's. On 2 ranks or more (docs/plan-batch.md)."),
    config_option(SSGDConfig, "nesterov", help="Nesterov momentum."),
    config_option(SSGDConfig, "ema", metavar="DECAY",
                  help="Keep an exponential moving average of the weights and batch-norm buffers (torch's "
                       "AveragedModel), evaluated and logged beside the model and kept in checkpoints; DECAY is "
                       "per step, in (0, 1), e.g. 0.9998 [default: off]."),
    config_option(SSGDConfig, "ema_every", help="Steps between two updates of the --ema average."),
    config_option(SSGDConfig, "compile",
                  help="Run the replica's forward and backward as torch.compile's code (compiled at the first "
                       "steps; the gradients reach dimd's buckets as before, with or without --overlap). Not with "
                       "--cuda-graphs. Measured on a 2-core CPU: 1.37x for resnet20 at 32 px, slower for lenet "
                       "and resnet18 (docs/train.md)."),
)
@option_group(
    "Model averaging (--sync sma; docs/sma.md)",
    config_option(SMAConfig, "learners", type=LearnersType(),
                  help="Learners per rank, each on its own batch of --batch-size images, or 'auto' "
                       "(Crossbow's auto-tuner: from 1, add one while the throughput rises by more than "
                       "--autotune-threshold) [default: 1]."),
    config_option(SMAConfig, "alpha",
                  help="Weight of each learner's correction towards the central model, in (0, 1] "
                       "[default: 1/L for L learners in all, the paper's choice; see docs/sma.md]."),
    config_option(SMAConfig, "sma_momentum",
                  help="Momentum of the central model's updates [default: 0; Crossbow's code hard-codes "
                       "0.9, unstable on top of the learners' momentum at --alpha 1/L, see docs/sma.md]."),
    config_option(SMAConfig, "sync_every",
                  help="Learner steps between synchronisations (an epoch's last step synchronises too)."),
    config_option(SMAConfig, "autotune_threshold",
                  help="With --learners auto: the relative rise in throughput that adds a learner."),
    config_option(SMAConfig, "learner_compute", type=click.Choice(LEARNER_COMPUTES),
                  help="How a rank computes its learners' gradients: loop (one after another; on CUDA "
                       "one stream each, under CUDA graphs one graph each), threads (one each, sharing the "
                       "rank's torch threads) or branches (one CUDA graph with a branch per learner); see "
                       "docs/sma.md."),
)
@shared_option(TrainConfig, "device", type=click.Choice(DEVICES))
@config_option(TrainConfig, "decode", type=click.Choice(DECODES),
               help="Where images are decoded: cpu (the loader's decoders) or gpu (one nvJPEG call per batch, "
                    "then crop, resize and flip on the GPU; needs CUDA and torchvision, `pip install dimd[gpu]`).")
@config_option(TrainConfig, "precision", type=click.Choice(PRECISIONS),
               help="32-true; bf16-mixed or 16-mixed: autocast over the forward pass and the loss, the "
                    "weights, optimizer state and allreduced gradients in float32; 16-mixed adds a dynamic "
                    "loss scale (steps with overflowing gradients are skipped on every rank and counted).")
@config_option(TrainConfig, "cuda_graphs", "--cuda-graphs/--no-cuda-graphs", default=None,
               help="Replay the training step as CUDA graphs (captured once after a few eager steps; S-SGD's "
                    "step, SMA's learners); evaluation stays eager [default: on with CUDA where a learner's "
                    "batch is small, at most 32 images of 224 px or the same pixels, off elsewhere; the JSON says "
                    "why, and lists every capture; docs/gpu.md].")
@config_option(TrainConfig, "channels_last", "--channels-last/--no-channels-last", default=None,
               help="Channels-last (NHWC) activations and weights [default: on for convolutional models "
                    "on CUDA, off elsewhere].")
@shared_option(TrainConfig, "decode_workers")
@shared_option(TrainConfig, "threads")
@config_option(TrainConfig, "seed")
@config_option(TrainConfig, "eval_batch_size", help="Validation batch per rank [default: --batch-size].")
@config_option(TrainConfig, "checkpoint_dir", type=click.Path(file_okay=False),
               help="Write a checkpoint here after every epoch (rank 0, atomically).")
@config_option(TrainConfig, "checkpoint_every", help="Also checkpoint every N steps (0: per epoch only).")
@config_option(TrainConfig, "keep_checkpoints", help="Keep the newest N checkpoints (0: all).")
@config_option(TrainConfig, "resume", help="Continue from the newest checkpoint in --checkpoint-dir, if there is one.")
@config_option(TrainConfig, "resume_from", type=click.Path(dir_okay=False), help="Continue from this checkpoint.")
@config_option(TrainConfig, "force",
               help="A fresh run (no --resume) into a --checkpoint-dir that holds an earlier run's "
                    "checkpoints deletes them first (without it such a start is refused).")
@stall_timeout_option(TrainConfig, "a step's allreduce, the shuffle, an evaluation or a checkpoint")
@config_option(TrainConfig, "memory_limit", type=SIZE, metavar="SIZE",
               help="Refuse to load more than this per rank (e.g. 8G).")
@config_option(TrainConfig, "read_from", type=click.Choice(READ_FROM),
               help="files: read every training image from its original file on each access (the "
                    "baseline the in-memory store is measured against); files-cold: the same, each "
                    "file's cached pages dropped just before it is read (every read goes to the disk or "
                    "the file server).")
@config_option(TrainConfig, "files_root", type=click.Path(file_okay=False),
               help="With --read-from files(-cold): the folder TRAIN was packed from [default: as recorded by "
                    "dimd pack].")
@click.option("--metrics", "metrics_path", type=OUTPUT_FILE, default=None,
              help="Append one JSON line per epoch here.")
@click.option("--tensorboard", "tensorboard_dir", type=OUTPUT_DIR, default=None, metavar="DIR",
              help="Write TensorBoard scalars here (rank 0): the loss, top-1, rate, lr and step split every "
                   "--tensorboard-every steps, the validation figures every epoch (the tensorboard extra).")
@click.option("--tensorboard-every", type=click.IntRange(min=1), default=10, show_default=True, metavar="N",
              help="Steps between --tensorboard's training scalars.")
@json_option("the run's summary")
@quiet_option()
@defer_output_checks  # --metrics and --json: checked on rank 0 once MPI is up (mpi_command)
def train(train_set: str | None, val_set: str | None, list_models: bool, metrics_path: Path | None,
          tensorboard_dir: Path | None, tensorboard_every: int, json_path: Path | None, quiet: bool,
          **fields: Any) -> None:
    """Synchronous data-parallel SGD or model averaging on packed data held in memory (run under mpirun).

    Every rank holds its share of TRAIN (a `dimd pack` output) in memory,
    reshuffled across ranks every epoch. S-SGD (the default): gradients live
    in one flat buffer and are summed with one allreduce per step. SMA
    (--sync sma, Crossbow): K learners per rank step independently on their
    own small batches and are pulled towards a central model, updated with one
    allreduce per synchronisation; the central model is evaluated and
    checkpointed. Rank 0 prints one line per epoch
    and writes checkpoints; SIGTERM, SIGUSR2 or SIGUSR1 (a batch scheduler's
    time-limit warning) finishes the step, writes a checkpoint and exits
    cleanly, so a requeued job continues with --resume. Under Open MPI's
    mpirun send SIGUSR2 (or SIGUSR1), not SIGTERM: mpirun kills the ranks
    250 ms after a SIGTERM (docs/batch-jobs.md).

    \b
    Example:
      mpirun -n 2 dimd train demo/train --val demo/val --model resnet20 --image-size 32 \\
          --epochs 16 --batch-size 16 --lr 0.8 --schedule cosine --warmup-epochs 2 \\
          --checkpoint-dir demo/checkpoints --json demo/train.json
      mpirun -n 2 dimd train mnist/train --val mnist/val --model lenet --image-size 28 \\
          --epochs 10 --batch-size 8 --lr 0.05 --no-lr-scaling --sync sma --learners auto
      mpirun -n 64 dimd train /scratch/in1k/train --val /scratch/in1k/val --model resnet50 \\
          --device cuda --decode-workers 8 --checkpoint-dir ckpt --resume
    """
    if list_models:
        return print_models()
    if not train_set:
        raise click.UsageError("missing argument TRAIN (a packed data set, e.g. demo/train)")
    if not val_set:
        raise click.UsageError("missing option --val (the packed validation set)")
    from dimd.commands.mpi_job import mpi_command
    from dimd.train.signals import install_stop_handlers

    # serialized: one thread calls MPI at a time (the main one; with --overlap the communication thread,
    # while the main thread runs backward and makes no MPI call); the loader decodes in worker processes.
    # The stop signals (a scheduler's warning, scancel) are caught from MPI's start-up on.
    mpi_command("serialized", install_handlers=install_stop_handlers)(_run)(
        train_set=train_set, val_set=val_set, metrics_path=metrics_path, json_path=json_path, quiet=quiet,
        fields=fields, board=(tensorboard_dir, tensorboard_every))


def _epoch_line(m, epochs: int) -> str:
    split = m.time_split
    return (f"epoch {m.epoch}/{epochs}  lr {m.lr:.4g}  train loss {m.train_loss:.3f} top1 {100 * m.train_top1:.1f}%"
            f"  val loss {m.val_loss:.3f} top1 {100 * m.val_top1:.1f}% top5 {100 * m.val_top5:.1f}%"
            + (f" (ema top1 {100 * m.ema_val_top1:.1f}%)" if m.ema_val_top1 is not None else "")
            + f"  {m.images_per_s:,.0f} img/s  {m.seconds:.1f}s (data {split['data']:.1f}"
            f" compute {split['compute']:.1f} allreduce {split['allreduce']:.1f}"
            f" optimizer {split['optimizer']:.1f}" + (f" sync {split['sync']:.1f}" if m.sync == "sma" else "")
            + f" eval {m.eval_seconds:.1f} shuffle {m.shuffle_seconds:.1f})"
            + (f"  {m.learners_per_rank} learners/rank alpha {m.alpha:.3g}" if m.sync == "sma" else "")
            + (f"  B_simple {_noise(m.noise_scale)}" if m.noise_steps is not None else ""))


def _noise(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _layout_line(trainer) -> str:
    config, ranks = trainer.config, trainer.world
    if config.sync == "sma":
        k = "auto-tuned" if config.sma.autotune else trainer.strategy.learners
        return (f"SMA: {ranks} ranks x {k} learner(s) x batch {config.batch_size}, alpha "
                f"{'1/L' if config.sma.alpha is None else config.sma.alpha}, {trainer.batches_per_epoch} batches/epoch "
                f"per rank")
    return (f"{ranks} ranks x batch {config.batch_size} = {trainer.global_batch}, "
            f"{trainer.batches_per_epoch} steps/epoch")


def _graphs_note(plan) -> str:
    """`` (CUDA graphs on)`` or off, on a GPU; the reason is in the JSON."""
    return f" (CUDA graphs {'on' if plan.graphs.on else 'off'})" if plan.device.type == "cuda" else ""


class RunProgress:
    """What rank 0 shows and writes of a run as it goes, through the trainer's hooks: the run's line at its
    start, a progress bar over its steps, a line and a ``--metrics`` record per epoch. The other ranks stay
    silent. A context: the bar ends with it."""

    def __init__(self, config: TrainConfig, *, leader: bool, quiet: bool, metrics_path: Path | None) -> None:
        self.config, self.leader, self.quiet, self.metrics_path = config, leader, quiet, metrics_path
        self.run_id = ""                      # the run's, once it started (a resume carries it over)
        self.advance: Callable[[int], None] = lambda steps: None
        self._bar = contextlib.ExitStack()

    def __enter__(self) -> "RunProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()

    def hooks(self) -> Any:
        from dimd.train.engine import Hooks

        return Hooks(on_start=self.on_start, on_step=self.on_step, on_epoch=self.on_epoch, on_event=self.say)

    def say(self, line: str) -> None:
        if self.leader:
            click.echo(line)

    def on_start(self, trainer: Any) -> None:
        from dimd.train.results import drop_superseded_metrics

        config, plan = self.config, trainer.plan
        self.run_id = trainer.state.run_id
        if self.leader and self.metrics_path and plan.resume_path:   # a resume may run some epochs again
            drop_superseded_metrics(self.metrics_path, self.run_id, trainer.state.epoch)
        info = plan.model_info
        self.say(f"{config.model}: {info['parameters']:,} parameters, {info['gradient_bytes'] / 2**20:.1f} MiB of "
                 f"gradients; {_layout_line(trainer)}; lr {trainer.schedule.peak_lr:.4g} ({config.schedule}, "
                 f"warm-up {trainer.schedule.warmup_steps} steps); allreduce {plan.algorithm}; "
                 f"device {plan.device}{_graphs_note(plan)}, {plan.threads} thread(s) per rank")
        remaining = trainer.steps_per_epoch * config.epochs - trainer.state.step
        self.advance = self._bar.enter_context(progress(remaining, "train", unit="step",
                                                        enabled=self.leader and not self.quiet))

    def on_step(self, steps: int) -> None:
        self.advance(steps)

    def on_epoch(self, metrics: Any) -> None:
        from dimd.train.results import metrics_line

        self.say(_epoch_line(metrics, self.config.epochs))
        if self.leader and self.metrics_path:
            with open(self.metrics_path, "a") as f:
                f.write(metrics_line(metrics, self.run_id))


def open_board(comm, folder: Path | None, every: int):
    """Collective: rank 0's TensorBoard writer for ``folder`` (a silent one elsewhere, or without a folder);
    one line on every rank where the tensorboard extra is missing."""
    from dimd.mpi import agree_or_raise
    from dimd.train.board import TrainingBoard, tensorboard_problem

    if folder is not None:
        agree_or_raise(comm, tensorboard_problem())   # MPI: every rank has the same flag
    return TrainingBoard(folder if comm.Get_rank() == 0 else None, every)


def _run(train_set: str, val_set: str, comm, mpi_setup, metrics_path: Path | None,
         json_path: Path | None, quiet: bool, fields: dict[str, Any],
         board: tuple[Path | None, int] = (None, 1)) -> None:
    from dimd.commands.mpi_job import check_outputs
    from dimd.report import result_document, write_json
    from dimd.train.engine import Trainer
    from dimd.train.folderlock import claim_checkpoint_folder
    from dimd.train.signals import stop_request

    config = build_config(TrainConfig, train=train_set, val=val_set, **fields)
    tensorboard = open_board(comm, *board)   # MPI: the extra's absence stops every rank, before the data loads
    check_outputs(comm, ("--checkpoint-dir", config.checkpoint_dir, "folder"))  # before the data loads
    # One run per checkpoint folder, and a fresh one never over an earlier run's checkpoints.
    lock = claim_checkpoint_folder(comm, config.checkpoint_dir, resume=bool(config.resume or config.resume_from),
                                   force=config.force)
    leader = comm.Get_rank() == 0
    run_progress = RunProgress(config, leader=leader, quiet=quiet, metrics_path=metrics_path)
    # The flag mpi_command's handlers set since MPI started: a signal while loading is not lost.
    try:
        with stop_request() as stop:
            trainer = Trainer(config, comm, stop=stop, hooks=tensorboard.hooks(run_progress.hooks()))
            with run_progress:
                result = trainer.run()
    finally:
        tensorboard.close()
        if lock is not None:
            lock.release()
    say = run_progress.say
    if result.stopped_by == "target" and result.target is not None:
        target = result.target
        say(f"target reached: top-1 {target['reached_top1']:.2f}% (the {target['by']}'s) at or above "
            f"{target['top1']:g}% after {target['epochs']:g} epochs, {target['updates']} updates, "
            f"{target['images']} training images, {target['seconds']:.1f}s")
    elif result.stopped_by:
        after = f"stopped by {result.stopped_by} after step {trainer.state.step}"
        say(f"{after}; checkpoint {result.checkpoint}; run again with --resume to continue"
            if result.checkpoint else f"{after}; no checkpoint written (no --checkpoint-dir): a new run starts over")
    elif result.final is not None:
        final = result.final
        say(f"done: val top1 {100 * final.val_top1:.1f}% top5 {100 * final.val_top5:.1f}% after "
            f"{final.epoch} epochs in {result.seconds:.1f}s; {result.figures()['images_per_s']:,.0f} img/s")
    if leader and json_path:
        write_json(json_path, result_document("train", config, result.figures(), mpi=mpi_setup.as_dict()))
