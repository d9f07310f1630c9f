"""The import layering stays as drawn: the core imports no stage, stages import only what sits below.

    dimd (core)  <-  dimd.pack, dimd.shuffle, dimd.allreduce  <-  dimd.train  <-  dimd.train.plan
                 <-  dimd.commands, dimd.cli

The planner (``dimd.train.plan``) sits above training: it may import
``dimd.train``, never the reverse, and it uses allreduce through the package's
public API (``dimd.allreduce``), not its modules. Every ``import`` counts,
module-level or inside a function. The library (all but the CLI layer) never
imports click or rich: it never prints. The planner's fitting code needs no
torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("pack", "shuffle", "allreduce", "train", "plan")
#: What each stage may import besides the core (itself always).
ALLOWED = {"pack": set(), "shuffle": set(), "allreduce": set(), "train": {"shuffle", "allreduce"},
           "plan": {"train", "shuffle", "allreduce"}}
#: Stages that reach another only through its package's public API (its ``__init__``).
PUBLIC_API_ONLY = {"plan": {"allreduce"}}
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
    """'commands', a stage name ('plan' for the planner under dimd.train), or 'core'."""
    parts = module.split(".")
    if module in ("dimd.cli", "dimd.__main__") or (len(parts) > 1 and parts[1] == "commands"):
        return "commands"
    if parts[1:3] == ["train", "plan"]:
        return "plan"
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
            elif theirs in PUBLIC_API_ONLY.get(mine, ()) and name != f"dimd.{theirs}":
                found.append(f"{module} ({mine}) reaches into {name}: use dimd.{theirs}'s public API")
    return found


def test_imports_respect_the_layers():
    assert violations() == []


def test_the_library_never_imports_click_or_rich():
    found = [f"{module} imports {name}" for module, path in sorted(modules().items())
             if layer(module) != "commands" and module not in CLI_LAYER
             for name in sorted(imported(path)) if name.split(".")[0] in ("click", "rich")]
    assert found == [], "the library never prints; the CLI layer does"


def test_training_never_imports_the_planner(tmp_path, monkeypatch):
    """The rule the planner's layer adds, seen catching an import of it from training."""
    engine = tmp_path / "engine.py"
    engine.write_text("def f():\n    from dimd.train.plan.noise import NoiseScale\n")
    monkeypatch.setattr(sys.modules[__name__], "modules", lambda: {"dimd.train.engine": engine})
    assert violations() == ["dimd.train.engine (train) may not import dimd.train.plan.noise (plan)"]


#: The planner's fitting code: least squares, step time, comm fit, convergence fit, the solver.
FITTING = ("lsq", "steptime", "commmodel", "commfit", "convergence", "solver")


def test_the_planners_fitting_code_needs_no_torch():
    """Imported and run with torch made unimportable: fits and solves on a laptop without torch."""
    code = "\n".join([
        "import sys",
        "sys.modules['torch'] = None   # any import of torch now raises ImportError",
        f"from dimd.train.plan import {', '.join(FITTING)}",
        "fit = steptime.fit_step_time([1, 2, 4, 8], [1e-3, 2e-3, 4e-3, 8e-3])",
        "spans = [commmodel.features(name, 1 << 20, 4) for name in commmodel.COST_MODELS]",
        "print(round(fit.gamma, 6), len(spans))",
    ])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "0.001"


def test_the_map_covers_every_stage():
    assert {layer(m) for m in modules()} >= {"core", "commands", *STAGES}
