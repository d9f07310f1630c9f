"""torchvision's own ResNet definition beside the CPU build of torch, for the export's test.

The torchvision wheels on PyPI are built for CUDA: beside the CPU torch, ``import torchvision`` fails
(``operator torchvision::nms does not exist``, from its compiled operators' registrations, which its
``__init__`` runs). ``make setup`` installs the wheel without its dependencies into a folder of its own,
``.venv/torchvision-reference`` (not on the path: ``import torchvision`` still finds nothing, as dimd's
``decode gpu`` check expects); here ``torchvision`` and ``torchvision.models`` are empty packages over that
folder, so that ``torchvision.models.resnet`` is imported, with the pure-Python modules it needs (transforms,
the weights' metadata), and neither package's ``__init__`` nor any compiled operator is.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import types
from pathlib import Path
from typing import Any, Callable

FOLDER = Path(sys.prefix) / "torchvision-reference"


def torchvision_resnet(name: str) -> Callable[..., Any]:
    """``torchvision.models.resnet.<name>`` (``resnet18``, ``resnet50``), from torchvision's own source."""
    if not (FOLDER / "torchvision" / "models" / "resnet.py").is_file():
        raise AssertionError(f"{FOLDER}: no torchvision here; `make setup` installs it")
    for package in ("torchvision", "torchvision.models"):
        if package not in sys.modules:
            module = types.ModuleType(package)
            module.__path__ = [str(FOLDER.joinpath(*package.split(".")))]
            sys.modules[package] = module
    return getattr(importlib.import_module("torchvision.models.resnet"), name)


def pil_is_pillow_simd() -> bool:
    """Whether the ``PIL`` imported is pillow-simd's, and plain Pillow is not installed."""
    import PIL

    try:
        importlib.metadata.version("pillow")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    files = importlib.metadata.files("pillow-simd") or []
    return any(Path(str(f)).as_posix() == "PIL/__init__.py" for f in files) and FOLDER not in Path(PIL.__file__).parents
