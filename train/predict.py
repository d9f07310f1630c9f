"""An exported model classifies image files (``dimd predict``), preprocessed as evaluation preprocesses them.

The export folder's ``meta.json`` names the model, its classes and the input size; each image is decoded,
resized and centre-cropped by :func:`dimd.shuffle.decode.decode_eval` (JPEG, PNG, and WebP where Pillow was
built with it; any size) and normalised by :class:`dimd.shuffle.normalize.Normalize`, as ``dimd eval`` feeds
its model, so an image scores the same in both. An image that does not decode is reported, and the others
are classified.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dimd.errors import BadInput, DimdError

#: Images per forward pass.
BATCH = 32


@dataclass(frozen=True)
class Prediction:
    """One image's ``top`` classes, best first, as (class name, probability); or why it was not classified."""

    image: str
    top: list[tuple[str, float]] = field(default_factory=list)
    problem: str | None = None

    def as_dict(self) -> dict[str, Any]:
        if self.problem is not None:
            return {"image": self.image, "error": self.problem}
        return {"image": self.image, "top": [{"class": name, "probability": p} for name, p in self.top]}


class ExportedModel:
    """An export folder's model, with the classes and the input size its meta.json gives."""

    def __init__(self, folder: str | Path) -> None:
        from dimd.train.models import build_model

        self.folder = Path(folder)
        meta_path = self.folder / "meta.json"
        try:
            self.meta = json.loads(meta_path.read_text(encoding="utf-8"))
            self.classes: list[str] = list(self.meta["classes"])
            self.image_size = int(self.meta["input_size"])
            self.crop_ratio = float(self.meta["crop_ratio"])
            model_name = str(self.meta["model"])
        except FileNotFoundError:
            raise BadInput(f"{meta_path}: not found (is {self.folder} a `dimd export` folder?)") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise BadInput(f"{meta_path}: not the meta.json dimd export writes ({exc!r})") from None
        try:
            state = torch.load(self.folder / "model.pt", map_location="cpu", weights_only=True)
            self.model = build_model(model_name, len(self.classes))
            self.model.load_state_dict(state)
        except DimdError as exc:
            raise BadInput(str(exc)) from None
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            raise BadInput(f"{self.folder / 'model.pt'}: not the weights of {model_name} with "
                           f"{len(self.classes)} classes ({str(exc).splitlines()[0]})") from None
        self.model.eval()

    def predict(self, images: list[str], *, top: int = 5, tta: str | None = None) -> list[Prediction]:
        """Each image's ``top`` classes (every image's own line if it does not decode), in the order given."""
        from dimd.shuffle.decode import decode_eval
        from dimd.shuffle.normalize import Normalize
        from dimd.train.evaluate import logits_of

        decoded: list[tuple[str, np.ndarray]] = []
        problems: dict[str, str] = {}
        for image in images:
            try:
                decoded.append((image, decode_eval(_read(image), self.image_size, self.crop_ratio)))
            except DimdError as exc:
                problems[image] = str(exc)
        normalize = Normalize(torch.device("cpu"))
        found: dict[str, Prediction] = {}
        k = min(top, len(self.classes))
        with torch.no_grad():
            for start in range(0, len(decoded), BATCH):
                chunk = decoded[start:start + BATCH]
                x = normalize(torch.from_numpy(np.stack([pixels for _, pixels in chunk])))
                probabilities = torch.softmax(logits_of(self.model, x, tta).float(), dim=1)
                values, indices = probabilities.topk(k, dim=1)
                for (image, _), p, i in zip(chunk, values.tolist(), indices.tolist()):
                    found[image] = Prediction(image, [(self.classes[c], q) for c, q in zip(i, p)])
        return [found.get(image) or Prediction(image, problem=problems[image]) for image in images]


def _read(image: str) -> bytes:
    """The file's bytes; one line for a missing one, or a WebP this Pillow cannot decode."""
    try:
        data = Path(image).read_bytes()
    except OSError as exc:
        raise DimdError(f"cannot read it ({exc.strerror or exc})") from None
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        from PIL import features

        if not features.check("webp"):
            raise DimdError("a WebP image, and this Pillow was built without WebP (libwebp-dev)")
    return data
