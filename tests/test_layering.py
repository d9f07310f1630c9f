"""The import layering stays as drawn: the core imports no stage, stages import only what sits below.

    dimd (core)  <-  dimd.pack, dimd.shuffle, dimd.allreduce  <-  dimd.train  <-  dimd.train.plan
                 <-  dimd.commands, dimd.cli

The planner (``dimd.train.plan``) sits above training: it may import
``dimd.train``, never the reverse, and it uses allreduce through the package's
public API (``dimd.allreduce``), not its modules. Every ``import`` counts,
module-level or inside a function. The library (all but the CLI layer) never
reaches click or rich, through any chain of imports: it never prints. The
planner's fitting code needs no torch.

No module imports itself back through others. Imports inside functions count
here too: they are for cost (torch loads when first needed), and one that
closes a circle only moves the failure from import time to the first call
that finds a module half-initialised, while the modules stay tangled.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from collections import deque
from pathlib import Path
from typing import Callable, Collection, Mapping

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


def imported(path: Path, known: Collection[str] = ()) -> set[str]:
    """The modules ``path`` imports, anywhere in it; ``from package import name`` is the submodule
    ``package.name`` where ``known`` has it, else the package."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                         for a in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Each module of the namespace -> the modules it imports (the namespace's and others, by name)."""
    found = modules()
    return {module: imported(path, found) for module, path in found.items()}


def with_packages(name: str) -> list[str]:
    """``a.b.c`` and the packages an import of it runs first: ``a``, ``a.b``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def import_chain(graph: Mapping[str, set[str]], start: str, wanted: Callable[[str], bool]) -> list[str] | None:
    """The shortest chain of imports from ``start`` to a module ``wanted`` accepts (packages run on the way
    included), or None."""
    came_from: dict[str, str | None] = {start: None}
    todo = deque([start])
    while todo:
        module = todo.popleft()
        for name in sorted(graph.get(module, ())):
            for step in with_packages(name):
                if step in came_from:
                    continue
                came_from[step] = module
                if wanted(step):
                    chain = [step]
                    while came_from[chain[-1]] is not None:
                        chain.append(came_from[chain[-1]])  # type: ignore[arg-type]
                    return chain[::-1]
                todo.append(step)
    return None


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The circles of imports among ``graph``'s modules (Tarjan's strongly connected components), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for name in graph[module] & graph.keys():
            if name not in index:
                visit(name)
                low[module] = min(low[module], low[name])
            elif name in stack:
                low[module] = min(low[module], index[name])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1 or module in graph[module]:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


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


def printing(name: str) -> bool:
    return name.split(".")[0] in ("click", "rich") or name in CLI_LAYER


def library_reaching_click_or_rich(graph: Mapping[str, set[str]]) -> list[str]:
    found = []
    for module in sorted(graph):
        if layer(module) != "commands" and module not in CLI_LAYER:
            chain = import_chain(graph, module, printing)
            if chain:
                found.append(" -> ".join(chain))
    return found


def test_the_library_never_reaches_click_or_rich():
    """Followed to their end: a library module that imports a CLI-layer module imports click through it."""
    assert library_reaching_click_or_rich(import_graph()) == [], "the library never prints; the CLI layer does"


def test_an_indirect_import_of_click_is_found():
    graph = {"dimd.stall": {"os", "dimd.mpi"}, "dimd.mpi": set(), "dimd.train.engine": {"dimd.stall"}}
    assert library_reaching_click_or_rich(graph) == []
    graph["dimd.mpi"] = {"dimd.options"}   # inside a function or not
    assert library_reaching_click_or_rich(graph) == [
        "dimd.mpi -> dimd.options", "dimd.stall -> dimd.mpi -> dimd.options",
        "dimd.train.engine -> dimd.stall -> dimd.mpi -> dimd.options"]


def test_no_module_imports_itself_back():
    """No circle of imports anywhere in the namespace (allreduce's registry and its algorithms among them)."""
    assert import_cycles(import_graph()) == []


def test_a_circle_closed_inside_a_function_is_found(tmp_path, monkeypatch):
    files = {"api": "from dimd.allreduce.group import TorchGroup\n",
             "group": "def device_group():\n    from dimd.allreduce.api import get_algorithm\n",
             "ring": "import numpy\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "modules",
                        lambda: {f"dimd.allreduce.{name}": tmp_path / f"{name}.py" for name in files})
    assert import_cycles(import_graph()) == [["dimd.allreduce.api", "dimd.allreduce.group"]]


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
