"""``dimd predict``: an exported model's top-5 classes for image files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from dimd.options import OUTPUT_FILE
from dimd.train.config import TTA


@click.command("predict")
@click.argument("model_dir", metavar="DIR", type=click.Path(file_okay=False))
@click.argument("images", metavar="IMAGE...", nargs=-1, required=True)
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True, help="Classes shown per image.")
@click.option("--tta", type=click.Choice(TTA),
              help="Test-time augmentation: flip averages the logits of each image and of its mirror image.")
@click.option("--json", "json_path", type=OUTPUT_FILE, metavar="PATH", default=None,
              help="Write every image's classes and probabilities (or its error) to PATH as JSON.")
def predict_command(model_dir: str, images: tuple[str, ...], top: int, tta: str | None,
                    json_path: Path | None) -> None:
    """Classify each IMAGE (JPEG, PNG, WebP; any size) with the model `dimd export` wrote to DIR.

    Each image is resized and centre-cropped as meta.json says, as `dimd eval`
    does, and the model's --top classes are printed with their probabilities.
    An image that cannot be decoded is named on stderr, the others are
    classified, and the exit status is then 2.

    \b
    Example:
      dimd predict demo/model demo/images/val/0007.jpg demo/images/val/0101.jpg
    """
    from dimd.errors import BadInput
    from dimd.train.predict import ExportedModel

    model = ExportedModel(model_dir)
    predictions = model.predict(list(images), top=top, tta=tta)
    for prediction in predictions:
        if prediction.problem is not None:
            click.echo(f"dimd: error: {prediction.image}: {prediction.problem}", err=True)
            continue
        shown = "  ".join(f"{name} {100 * p:.1f}%" for name, p in prediction.top)
        click.echo(f"{prediction.image}: {shown}")
    if json_path is not None:
        document: dict[str, Any] = {"model": str(model_dir), "tta": tta,
                                    "predictions": [p.as_dict() for p in predictions]}
        json_path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    failed = sum(p.problem is not None for p in predictions)
    if failed:
        raise SystemExit(BadInput.exit_code)
