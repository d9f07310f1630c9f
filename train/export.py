"""A checkpoint's model taken to where it is used (``dimd export``): a folder of plain files.

- ``model.pt``: the state dict, plain tensors (``torch.load(weights_only=True)``); for ``resnet18`` and
  ``resnet50`` its keys and shapes are torchvision's (:mod:`dimd.train.models`), so
  ``torchvision.models.resnet50(num_classes=N).load_state_dict(...)`` takes it with ``strict=True``;
- ``model.ts``: TorchScript, traced at the input size (``torch.jit.load`` runs it without dimd);
- ``model.onnx`` on request, where the ``onnx`` extra is installed;
- ``meta.json``: the class names in the model's order, the preprocessing a caller must apply (resize,
  centre crop, normalisation: evaluation's, :mod:`dimd.shuffle.decode`), the model, the epoch, the validation
  top-1 the run logged for it, dimd's version.

The folder is written under a temporary name beside ``out`` and renamed: a failed export leaves nothing.
The weights are the run's model (S-SGD's replica, rank 0's batch-norm statistics; SMA's central model), or its
weight average (``--ema``) where that evaluated better at the checkpoint's epoch; ``meta.json`` says which.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dimd.errors import BadInput, bad_input

if TYPE_CHECKING:   # torch loads when an export is written, not for `dimd --help`
    from dimd.train.checkpoint_eval import TrainedModel

META = "meta.json"


@dataclass(frozen=True)
class ExportConfig:
    """What ``dimd export`` writes."""

    checkpoint: str
    out: str
    torchvision: bool = False     # refuse a model whose state dict is not torchvision's, key for key
    onnx: bool = False            # model.onnx too (the onnx extra)
    force: bool = False           # replace an existing ``out``


def preprocessing(image_size: int, crop_ratio: float) -> dict[str, Any]:
    """What evaluation does to an image before the model, in words a caller can follow (and dimd predict does)."""
    from dimd.shuffle.decode import resize_side
    from dimd.shuffle.normalize import MEAN, STD

    return {"input_size": image_size, "channels": "RGB", "crop_ratio": crop_ratio,
            "resize_shorter_side": resize_side(image_size, crop_ratio), "centre_crop": image_size,
            "interpolation": "bilinear",
            "normalize": {"mean": [m / 255 for m in MEAN], "std": [s / 255 for s in STD],
                          "of": "pixels / 255, channel first (N x 3 x H x W)"}}


def torchvision_name(model_name: str) -> str | None:
    """torchvision's builder for the zoo's ``model_name`` whose state dict has the same keys, or None."""
    from dimd.train.models import MODELS

    spec = MODELS.get(model_name)
    return spec.torchvision if spec is not None else None


def export_problem(config: ExportConfig, trained: TrainedModel) -> str | None:
    """Why ``config`` cannot be written for ``trained`` (one line), or None; checked before anything is."""
    out = Path(config.out)
    if out.exists() and not config.force:
        return f"{out}: exists (set `force` to replace it)"
    if config.torchvision and torchvision_name(trained.model_name) is None:
        from dimd.train.models import MODELS

        have = ", ".join(name for name, spec in MODELS.items() if spec.torchvision)
        return (f"{trained.path}: model {trained.model_name!r} has no torchvision counterpart whose names its "
                f"state dict could take; `torchvision` names are for {have}")
    if config.onnx and importlib.util.find_spec("onnx") is None:
        return "`onnx` needs the onnx package: pip install 'dimd[onnx]'"
    return None


def export_model(config: ExportConfig) -> dict[str, Any]:
    """Write the export folder ``config.out`` (see the module's docstring); returns its meta.json."""
    import torch

    from dimd import __version__
    from dimd.train.checkpoint_eval import read_trained_model

    with bad_input():
        trained = read_trained_model(config.checkpoint)
        problem = export_problem(config, trained)
        if problem:
            raise BadInput(problem)
        average = trained.ema_better   # the weight average evaluated better: it is what goes out
        if average:
            trained = trained.average()
        model = trained.build()
    out = Path(config.out)
    logged = trained.logged
    meta = {"model": trained.model_name, "torchvision": torchvision_name(trained.model_name),
            "classes": trained.classes, **preprocessing(trained.image_size, trained.crop_ratio),
            "epoch": trained.epoch, "step": trained.step,
            "val_top1": logged["val_top1"] if logged else None, "val_top5": logged["val_top5"] if logged else None,
            "weights": ("the run's weight average (--ema), which evaluated better than its model" if average else
                        "the run's model: S-SGD's replica (rank 0's batch-norm statistics), SMA's central model"),
            "checkpoint": str(Path(trained.path).resolve()), "dimd_version": __version__,
            "files": ["model.pt", "model.ts", *(["model.onnx"] if config.onnx else []), META]}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        torch.save({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, tmp / "model.pt")
        example = torch.zeros(1, 3, trained.image_size, trained.image_size)
        # torch deprecates TorchScript, and its ONNX exporter, for torch.export: still the formats C++ and
        # ONNX runtimes load. The ONNX exporter of torch.export needs onnxscript besides onnx.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.save(torch.jit.trace(model, example), str(tmp / "model.ts"))
            if config.onnx:
                torch.onnx.export(model, (example,), str(tmp / "model.onnx"), input_names=["image"],
                                  output_names=["logits"], dynamic_axes={"image": {0: "batch"}}, dynamo=False)
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _replace(tmp: Path, out: Path) -> None:
    """Rename the finished folder ``tmp`` onto ``out``; an old ``out`` (``force``) goes only once it is there."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if old.exists():
            os.replace(old, out)
        raise
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
