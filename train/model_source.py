"""A user's own network for ``dimd train --model``: ``package.module:callable`` or ``path/to/file.py:callable``.

The callable gets ``num_classes`` and returns an ``nn.Module``. Whatever goes
wrong on the way (no such file or module, the file raises or exits while it
loads, no such callable, the callable raises, exits or returns something
else) is one line naming the spec and the problem, the same on every rank.
Even ``sys.exit(0)`` there is an error: a run that ended while it imported
or built its model must not exit as one that trained.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from torch import nn

from dimd.errors import DimdError


def is_model_spec(name: str) -> bool:
    """Whether ``name`` names a user's callable (``where:callable``) rather than a model of the zoo."""
    return ":" in name


def _split(spec: str) -> tuple[str, str]:
    where, _, attribute = spec.rpartition(":")
    if not where or not attribute.isidentifier():
        raise DimdError(f"--model {spec}: expected package.module:callable or path/to/file.py:callable")
    return where, attribute


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def _load_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise DimdError(f"--model {spec}: {path}: no such file")
    name = "dimd_user_model_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise DimdError(f"--model {spec}: {path}: not a Python file that can be imported")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module   # dataclasses and pickling look the module up while it runs
    try:
        loader_spec.loader.exec_module(module)
    except SystemExit as exc:
        del sys.modules[name]
        raise DimdError(f"--model {spec}: {path} called {_exit_call(exc)} while loading") from None
    except Exception as exc:
        del sys.modules[name]
        raise DimdError(f"--model {spec}: {path} raised {type(exc).__name__} while loading: {exc}") from None
    return module


def _exit_call(exc: SystemExit) -> str:
    return "sys.exit()" if exc.code is None else f"sys.exit({exc.code!r})"


def _load_module(where: str, spec: str) -> Any:
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        raise DimdError(f"--model {spec}: no module named {exc.name!r} (is it on PYTHONPATH?)") from None
    except SystemExit as exc:
        raise DimdError(f"--model {spec}: importing {where} called {_exit_call(exc)}") from None
    except Exception as exc:
        raise DimdError(f"--model {spec}: importing {where} raised {type(exc).__name__}: {exc}") from None


def model_callable(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` names, imported (a file is run once per process)."""
    where, attribute = _split(spec)
    module = _load_file(Path(where), spec) if _is_file(where) else _load_module(where, spec)
    found = getattr(module, attribute, None)
    if not callable(found):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        what = "no callable" if found is None else f"{type(found).__name__} (not callable)"
        raise DimdError(f"--model {spec}: {where} has {what} {attribute!r}"
                        + (f"; it defines {', '.join(defined[:8])}" if defined else ""))
    return found


def build_user_model(spec: str, num_classes: int) -> nn.Module:
    """Call the user's callable with ``num_classes``; the module it returns, or one line why not."""
    function = model_callable(spec)
    try:
        model = function(num_classes=num_classes)
    except SystemExit as exc:
        raise DimdError(f"--model {spec}: calling it with num_classes={num_classes} called {_exit_call(exc)}") from None
    except Exception as exc:
        raise DimdError(f"--model {spec}: calling it with num_classes={num_classes} raised "
                        f"{type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise DimdError(f"--model {spec}: returned {type(model).__name__}, not a torch.nn.Module")
    return model


def model_source(spec: str) -> dict[str, Any]:
    """Where a user's model came from, for the checkpoint: the spec, and a file's path and sha256."""
    where, _ = _split(spec)
    source: dict[str, Any] = {"spec": spec}
    if _is_file(where):
        path = Path(where).resolve()
        source.update(path=str(path), sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    else:
        module = sys.modules.get(where)
        source["path"] = getattr(module, "__file__", None)
    return source


def recorded_source(name: str) -> dict[str, Any]:
    """``{"source": ...}`` for a user's model (what results and checkpoints record), ``{}`` for the zoo's."""
    return {"source": model_source(name)} if is_model_spec(name) else {}
