"""``mpirun dimd train``: synchronous data-parallel SGD on the in-memory data and dimd's allreduce."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import click

from dimd.console import progress


def _shuffle_every(value: str) -> int | None:
    if value == "epoch":
        return 0
    if value == "never":
        return None
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise click.BadParameter(f"expected a number of steps, 'epoch' or 'never', got {value!r}")


def _milestones(value: str | None) -> tuple[float, ...] | None:
    if not value:
        return None
    try:
        return tuple(float(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated epochs like 30,60,80, got {value!r}") from None


def list_models() -> None:
    from dimd.train.models import MODELS, build_model, gradient_bytes, parameter_count
    from dimd.units import format_bytes

    click.echo(f"{'model':<14}{'parameters':>12}{'gradients':>12}{'size':>6}  description")
    for name, spec in MODELS.items():
        model = build_model(name, 1000)
        click.echo(f"{name:<14}{parameter_count(model):>12,}{format_bytes(gradient_bytes(model)):>12}"
                   f"{spec.image_size:>6}  {spec.description}")
    click.echo("(parameters for 1000 classes; `size` is the image size the model is designed for)")


@click.command("train", context_settings={"show_default": True})
@click.argument("train_set", metavar="TRAIN", required=False)
@click.option("--val", "val_set", metavar="VAL", help="Packed validation set (required); its classes are matched to TRAIN's by name.")
@click.option("--model", default="resnet50", help="Model name (see --list-models).")
@click.option("--list-models", is_flag=True, help="List the models with parameter counts and gradient bytes, then exit.")
@click.option("--epochs", default=90, type=int)
@click.option("--batch-size", default=64, type=int, help="Images per rank per step.")
@click.option("--lr", default=0.1, type=float, help="Learning rate for a global batch of 256.")
@click.option("--no-lr-scaling", is_flag=True, help="Use --lr as is instead of scaling it by global batch / 256.")
@click.option("--momentum", default=0.9, type=float)
@click.option("--weight-decay", default=1e-4, type=float)
@click.option("--decay-bn-and-bias", is_flag=True, help="Also apply weight decay to batch-norm and bias parameters.")
@click.option("--nesterov", is_flag=True, help="Nesterov momentum.")
@click.option("--schedule", type=click.Choice(["step", "poly", "cosine", "constant"]), default="step",
              help="step: /10 at --milestones; poly: (1 - t)^0.5 as FireCaffe; cosine: half cosine to 0.")
@click.option("--milestones", default=None, help="Epochs where step divides by 10 [default: 30/60/80 of 90, scaled].")
@click.option("--warmup-epochs", type=float, default=None,
              help="Linear warm-up from --lr to the scaled rate (Goyal et al.) [default: 5 if global batch > 256, else 0].")
@click.option("--image-size", default=224, type=int, help="Training crop and validation centre crop (px).")
@click.option("--crop-scale", default=0.08, type=float, show_default=True,
              help="Smallest share of the image area a random-resized training crop keeps "
                   "(0.08 as for ImageNet; 0.35 or more suits small images).")
@click.option("--zero-init-residual", is_flag=True, help="Zero each residual block's last batch-norm scale (ResNets).")
@click.option("--groups", default=1, type=int, help="Shuffle groups: each group of consecutive ranks holds the whole set.")
@click.option("--shuffle-every", default="epoch", help="Reshuffle the store across each group every N steps, 'epoch' or 'never'.")
@click.option("--allreduce", "allreduce_algorithm", default=None,
              help="Allreduce algorithm (see `dimd bench-allreduce`) [default: fastest measured at start-up].")
@click.option("--bucket-mb", default=0.0, type=float, help="Allreduce the gradients in buckets of this size (0: one message).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto")
@click.option("--workers", default=2, type=int, help="Decoding threads per rank.")
@click.option("--threads", default=None, type=int, help="Torch compute threads per rank [default: cores / ranks on the node].")
@click.option("--seed", default=0, type=int)
@click.option("--eval-batch-size", default=None, type=int, help="Validation batch per rank [default: --batch-size].")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), default=None,
              help="Write a checkpoint here after every epoch (rank 0, atomically).")
@click.option("--checkpoint-every", default=0, type=int, help="Also checkpoint every N steps (0: per epoch only).")
@click.option("--keep-checkpoints", default=3, type=int, help="Keep the newest N checkpoints (0: all).")
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in --checkpoint-dir, if there is one.")
@click.option("--resume-from", type=click.Path(dir_okay=False), default=None, help="Continue from this checkpoint.")
@click.option("--memory-limit", default=None, help="Refuse to load more than this per rank (e.g. 8G).")
@click.option("--read-from", type=click.Choice(["memory", "files"]), default="memory",
              help="files: read every training image from its original file on each access (the baseline "
                   "the in-memory store is measured against).")
@click.option("--files-root", type=click.Path(file_okay=False), default=None,
              help="With --read-from files: the folder TRAIN was packed from [default: as recorded by dimd pack].")
@click.option("--metrics", "metrics_path", type=click.Path(dir_okay=False), default=None,
              help="Append one JSON line per epoch here.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the run's summary here.")
def train(train_set, val_set, list_models: bool, **options) -> None:
    """Synchronous data-parallel SGD on packed data held in memory (run under mpirun).

    Every rank holds its share of TRAIN (a `dimd pack` output) in memory,
    reshuffled across ranks every epoch; gradients live in one flat buffer and
    are summed with one allreduce per step. Rank 0 prints one line per epoch
    and writes checkpoints; SIGTERM or SIGUSR1 (a batch scheduler's time-limit
    warning) finishes the step, writes a checkpoint and exits cleanly, so a
    requeued job continues with --resume.

    \b
    Example:
      mpirun -n 2 dimd train demo/train --val demo/val --model resnet20 --image-size 32 \\
          --epochs 16 --batch-size 16 --lr 0.8 --schedule cosine --warmup-epochs 2 \\
          --checkpoint-dir demo/checkpoints --json demo/train.json
      mpirun -n 64 dimd train /scratch/in1k/train --val /scratch/in1k/val --model resnet50 \\
          --device cuda --workers 8 --checkpoint-dir ckpt --resume
    """
    if list_models:
        return globals()["list_models"]()
    if not train_set:
        raise click.UsageError("missing argument TRAIN (a packed data set, e.g. demo/train)")
    if not val_set:
        raise click.UsageError("missing option --val (the packed validation set)")
    _train_job(train_set=train_set, val_set=val_set, **options)


def _config(train_set: str, val_set: str, options: dict):
    from dimd.train.config import TrainConfig
    from dimd.units import parse_size

    memory = options["memory_limit"]
    return TrainConfig(
        train=train_set, val=val_set, model=options["model"], image_size=options["image_size"],
        crop_scale=options["crop_scale"],
        epochs=options["epochs"], batch_size=options["batch_size"], lr=options["lr"],
        lr_scaling=not options["no_lr_scaling"], momentum=options["momentum"],
        weight_decay=options["weight_decay"], decay_bn_and_bias=options["decay_bn_and_bias"],
        nesterov=options["nesterov"], schedule=options["schedule"],
        milestones=_milestones(options["milestones"]), warmup_epochs=options["warmup_epochs"],
        zero_init_residual=options["zero_init_residual"], groups=options["groups"],
        shuffle_every=_shuffle_every(options["shuffle_every"]), allreduce=options["allreduce_algorithm"],
        bucket_mb=options["bucket_mb"], device=options["device"], workers=options["workers"],
        threads=options["threads"], seed=options["seed"], eval_batch_size=options["eval_batch_size"],
        checkpoint_dir=options["checkpoint_dir"], checkpoint_every=options["checkpoint_every"],
        keep_checkpoints=options["keep_checkpoints"], resume=options["resume"],
        resume_from=options["resume_from"], memory_limit=parse_size(memory) if memory else None,
        read_from=options["read_from"], files_root=options["files_root"])


def _train_job(**kwargs) -> None:
    from dimd.commands.mpi_job import mpi_command
    from dimd.train.signals import install_stop_handlers

    # funneled: the loader's decoding threads never call MPI, only the main thread does.
    # The stop signals (a scheduler's warning, scancel) are caught from MPI's start-up on.
    mpi_command("funneled", install_handlers=install_stop_handlers)(_run)(**kwargs)


def _epoch_line(m, epochs: int) -> str:
    split = m.time_split
    return (f"epoch {m.epoch}/{epochs}  lr {m.lr:.4g}  train loss {m.train_loss:.3f} top1 {100 * m.train_top1:.1f}%"
            f"  val loss {m.val_loss:.3f} top1 {100 * m.val_top1:.1f}% top5 {100 * m.val_top5:.1f}%"
            f"  {m.images_per_s:,.0f} img/s  {m.seconds:.1f}s (data {split['data']:.1f}"
            f" compute {split['compute']:.1f} allreduce {split['allreduce']:.1f}"
            f" optimizer {split['optimizer']:.1f} eval {m.eval_seconds:.1f} shuffle {m.shuffle_seconds:.1f})")


def _run(train_set: str, val_set: str, comm, mpi_setup, metrics_path: str | None,
         json_path: str | None, **options) -> None:
    from dimd.report import result_document, write_json
    from dimd.train.engine import Trainer

    config = _config(train_set, val_set, options)
    leader = comm.Get_rank() == 0
    say = (lambda line: click.echo(line)) if leader else (lambda line: None)
    stack = contextlib.ExitStack()
    advance = [lambda n: None]

    def on_event(message: str) -> None:
        say(message)

    def on_epoch(metrics) -> None:
        say(_epoch_line(metrics, config.epochs))
        if leader and metrics_path:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(metrics.as_dict()) + "\n")

    def on_start(trainer) -> None:
        info = trainer.model_info
        say(f"{config.model}: {info['parameters']:,} parameters, {info['gradient_bytes'] / 2**20:.1f} MiB of "
            f"gradients; {comm.Get_size()} ranks x batch {config.batch_size} = {trainer.global_batch}, "
            f"{trainer.steps_per_epoch} steps/epoch; lr {trainer.schedule.peak_lr:.4g} ({config.schedule}, "
            f"warm-up {trainer.schedule.warmup_steps} steps); allreduce {trainer.algorithm}; "
            f"device {trainer.device}")
        remaining = trainer.steps_per_epoch * config.epochs - trainer.step
        advance[0] = stack.enter_context(progress(remaining, "train", unit="step", enabled=leader))

    trainer = Trainer(config, comm, on_epoch=on_epoch, on_step=lambda n: advance[0](n),
                      on_event=on_event, on_start=on_start)
    with stack:
        result = trainer.run()
    if result.stopped_by:
        say(f"stopped by {result.stopped_by} after step {trainer.step}; checkpoint {result.checkpoint}; "
            f"run again with --resume to continue")
    elif result.final is not None:
        final = result.final
        say(f"done: val top1 {100 * final.val_top1:.1f}% top5 {100 * final.val_top5:.1f}% after "
            f"{final.epoch} epochs in {result.seconds:.1f}s; {result.figures()['images_per_s']:,.0f} img/s")
    if leader and json_path:
        write_json(Path(json_path), result_document("train", config, result.figures(),
                                                    mpi=mpi_setup.as_dict()))
