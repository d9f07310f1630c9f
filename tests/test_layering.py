"""The import layering stays as drawn: the core imports no stage, stages import only what sits below.

    dimd (core)  <-  dimd.pack, dimd.shuffle, dimd.allreduce  <-  dimd.train  <-  dimd.commands, dimd.cli

Every ``import`` counts, module-level or inside a function. The library (all
but the CLI layer) never imports click or rich: it never prints.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("pack", "shuffle", "allreduce", "train")
#: What each stage may import besides the core (itself always).
ALLOWED = {"pack": set(), "shuffle": set(), "allreduce": set(), "train": {"shuffle", "allreduce"}}
#: Core modules that make up the command-line layer: they may use click and rich.
CLI_LAYER = {"dimd.options", "dimd.console"}


def modules() -> dict[str, Path]:
    """Every module of the installed namespace, by import name, from pyproject's package-dir map."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = {}
    for package, folder in mapping.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            parts = [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def layer(module: str) -> str:
    """'commands', a stage name, or 'core'."""
    parts = module.split(".")
    if module in ("dimd.cli", "dimd.__main__") or (len(parts) > 1 and parts[1] == "commands"):
        return "commands"
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else "core"


def violations() -> list[str]:
    found = []
    for module, path in sorted(modules().items()):
        mine = layer(module)
        for name in sorted(imported(path)):
            theirs = layer(name) if name.split(".")[0] == "dimd" else None
            if mine == "commands" or theirs is None:
                continue
            if theirs == "commands":
                found.append(f"{module} imports the CLI layer ({name})")
            elif mine == "core" and theirs != "core":
                found.append(f"core module {module} imports stage {name}")
            elif mine in STAGES and theirs not in ("core", mine, *ALLOWED[mine]):
                found.append(f"{module} ({mine}) may not import {name} ({theirs})")
    return found


def test_imports_respect_the_layers():
    assert violations() == []


def test_the_library_never_imports_click_or_rich():
    found = [f"{module} imports {name}" for module, path in sorted(modules().items())
             if layer(module) != "commands" and module not in CLI_LAYER
             for name in sorted(imported(path)) if name.split(".")[0] in ("click", "rich")]
    assert found == [], "the library never prints; the CLI layer does"


def test_the_map_covers_every_stage():
    assert {layer(m) for m in modules()} >= {"core", "commands", *STAGES}
