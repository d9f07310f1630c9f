"""``dimd export``: a checkpoint's model as plain files (state dict, TorchScript, ONNX) with its meta.json."""

from __future__ import annotations

from typing import Any

import click

from dimd.options import build_config, config_option
from dimd.train.export import ExportConfig


@click.command("export")
@click.argument("checkpoint", type=click.Path(dir_okay=False))
@click.option("-o", "--out", required=True, metavar="DIR", help="The folder to write (it must not exist).")
@config_option(ExportConfig, "torchvision",
               help="Refuse a model whose state dict is not torchvision's, key for key (resnet18, resnet50 are).")
@config_option(ExportConfig, "onnx", help="Also model.onnx (needs the onnx extra: pip install 'dimd[onnx]').")
@config_option(ExportConfig, "force", help="Replace DIR if it exists.")
def export_command(checkpoint: str, out: str, **fields: Any) -> None:
    """Write CHECKPOINT's model to DIR: model.pt, model.ts, meta.json.

    model.pt is a plain state dict; for resnet18 and resnet50 it has
    torchvision's keys, so torchvision.models.resnet50(num_classes=N) loads
    it with strict=True. model.ts is TorchScript. meta.json holds the class
    names in the model's order, the resize, crop and normalisation to apply,
    the epoch and the validation top-1 the run logged. `dimd predict DIR`
    classifies images with it. DIR is written under a temporary name and
    renamed.

    \b
    Example:
      dimd export demo/checkpoints/checkpoint-e0024-s00000600.pt -o demo/model
    """
    from dimd.train.export import export_model

    meta = export_model(build_config(ExportConfig, checkpoint=checkpoint, out=out, **fields))
    top1 = "" if meta["val_top1"] is None else f", val top1 {100 * meta['val_top1']:.2f}%"
    click.echo(f"exported {meta['model']} (epoch {meta['epoch']}{top1}, {len(meta['classes'])} classes) to "
               f"{out}: {', '.join(meta['files'])}"
               + (f"; torchvision.models.{meta['torchvision']} loads model.pt" if meta["torchvision"] else ""))
