"""``mpirun dimd eval``: a checkpoint scored again on a packed validation set, as ``dimd train`` scores it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from dimd.commands.mpi_job import mpi_command
from dimd.options import build_config, config_option, json_option, shared_option
from dimd.train.config import DEVICES, PRECISIONS
from dimd.train.config import TTA
from dimd.train.eval_config import EvalConfig


@click.command("eval")
@click.argument("checkpoint", type=click.Path(dir_okay=False))
@click.argument("val", metavar="VAL")
@config_option(EvalConfig, "image_size",
               help="Centre crop (px) [default: the run's --val-image-size, else its --image-size].")
@config_option(EvalConfig, "ema", help="Score the run's weight average (dimd train --ema) instead of its model.")
@config_option(EvalConfig, "val_crop_ratio", metavar="RATIO",
               help="The crop over the resized shorter side (torchvision's --val-crop-size / --val-resize-size) "
                    "[default: the run's --val-crop-ratio].")
@config_option(EvalConfig, "batch_size", help="Images per rank per batch [default: the run's validation batch].")
@config_option(EvalConfig, "tta", type=click.Choice(TTA),
               help="Test-time augmentation: flip averages the logits of each image and of its mirror image.")
@shared_option(EvalConfig, "device", type=click.Choice(DEVICES))
@config_option(EvalConfig, "precision", type=click.Choice(PRECISIONS), help="[default: the run's --precision].")
@shared_option(EvalConfig, "decode_workers")
@shared_option(EvalConfig, "threads")
@config_option(EvalConfig, "per_class", help="Also each class's top-1 (printed, and in --json).")
@json_option("the figures (rank 0)")
@mpi_command("single")
def eval_command(checkpoint: str, val: str, json_path: Path | None, comm, mpi_setup, **fields: Any) -> None:
    """Score CHECKPOINT (a `dimd train` checkpoint) on VAL (a packed validation set): top-1, top-5, loss.

    Every rank loads its share of VAL into memory and scores it, and the
    counts are summed, as `dimd train` evaluates after each epoch: on the
    checkpoint of an epoch's end and the run's validation set, the figures
    are those the run logged for that epoch (printed beside them). VAL's
    classes are matched to the checkpoint's by name.

    \b
    Examples:
      dimd eval demo/checkpoints/checkpoint-e0024-s00000600.pt demo/val
      mpirun -n 8 dimd eval ckpt/checkpoint-e0090-s00450360.pt /scratch/in1k/val --tta flip --json eval.json
    """
    from dimd.report import result_document, write_json
    from dimd.train.checkpoint_eval import evaluate_checkpoint, input_problem

    config = build_config(EvalConfig, checkpoint=checkpoint, val=val, **fields)
    trained, problem = input_problem(config, comm)   # MPI: agreed, before the data loads
    if problem is not None:
        raise click.UsageError(problem)   # every rank: one line, exit status 2
    assert trained is not None
    evaluation = evaluate_checkpoint(config, trained, comm)
    if comm.Get_rank() != 0:
        return
    figures = evaluation.figures()
    click.echo(f"{checkpoint} (epoch {trained.epoch}, step {trained.step}) on {val}: top1 "
               f"{100 * figures['top1']:.2f}%  top5 {100 * figures['top5']:.2f}%  loss {figures['loss']:.4f}  "
               f"({figures['samples']} images at {figures['image_size']} px"
               + (f", tta {config.tta}" if config.tta else "") + f", {figures['seconds']:.1f}s)")
    if figures["logged"] is not None:
        logged = figures["logged"]
        click.echo(f"the run logged for epoch {trained.epoch}: top1 {100 * logged['val_top1']:.2f}%  "
                   f"top5 {100 * logged['val_top5']:.2f}%  loss {logged['val_loss']:.4f}")
    for row in figures.get("per_class", []):
        top1 = "-" if row["top1"] is None else f"{100 * row['top1']:.1f}%"
        click.echo(f"  {row['class']:<24} top1 {top1:>6}  ({row['samples']} images)")
    if json_path is not None:
        write_json(json_path, result_document("eval", config, figures, mpi=mpi_setup.as_dict()))
