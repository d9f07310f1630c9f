"""The private APIs dimd relies on (dimd.private_apis) behave as its code expects, on the versions installed.

Run this file first on a new torch, mpi4py or Python: when it passes, the
version can join ``WRITTEN_FOR``. It also checks that the rest of dimd reaches
no private API of another package but through that module.
"""

import ast
import multiprocessing
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from dimd import private_apis

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("dimdtool", "pack", "shuffle", "allreduce", "train")


def test_a_backward_pass_has_one_id_newer_than_the_last_and_none_outside():
    x = torch.ones(3, requires_grad=True)
    seen = []
    x.register_hook(lambda grad: seen.append(private_apis.graph_task_id()))
    y = x * 2
    y.register_hook(lambda grad: seen.append(private_apis.graph_task_id()))
    y.sum().backward()
    (x * 3).sum().backward()
    assert private_apis.graph_task_id() == -1
    assert seen[0] == seen[1] >= 0 and seen[2] > seen[1]


def test_a_callback_queued_in_a_pass_runs_after_its_last_hook_before_backward_returns():
    x = torch.ones(3, requires_grad=True)
    events = []

    def hook(grad):
        if not events:
            private_apis.at_backward_end(lambda: events.append("end"))
        events.append("hook")

    y = x * 2
    y.register_hook(hook)
    x.register_hook(hook)
    y.sum().backward()
    assert events == ["hook", "hook", "end"]


def test_unscaling_divides_in_place_and_flags_a_non_finite_gradient():
    grads = torch.tensor([2.0, 4.0])
    found = torch.zeros(())
    private_apis.unscale_and_find_non_finite_(grads, found, torch.tensor(0.5))
    assert grads.tolist() == [1.0, 2.0] and found.item() == 0
    grads[0] = float("inf")
    private_apis.unscale_and_find_non_finite_(grads, found, torch.tensor(0.5))
    assert found.item() == 1


def test_the_multi_tensor_ops_act_on_every_tensor_of_a_list():
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 0.0], [0.0, 0.0]])]
    assert [float(n) for n in private_apis.foreach("norm")(tensors)] == [5.0, 1.0]
    scaled = private_apis.foreach("mul")(tensors, [torch.tensor(2.0), torch.tensor(3.0)])
    assert torch.equal(scaled[0], torch.tensor([6.0, 8.0])) and torch.equal(scaled[1], 3 * tensors[1])
    private_apis.foreach("add_")(tensors, scaled, alpha=-0.5)
    assert torch.equal(tensors[0], torch.tensor([0.0, 0.0]))
    assert torch.equal(tensors[1], torch.tensor([[-0.5, 0.0], [0.0, 0.0]]))


def test_a_dataloaders_worker_pids_are_its_running_workers():
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True)
    assert private_apis.dataloader_worker_pids(loader) == []
    next(iter(loader))
    pids = private_apis.dataloader_worker_pids(loader)
    assert len(pids) == 2 and all(os.path.exists(f"/proc/{pid}") for pid in pids)
    del loader


def test_a_pools_workers_are_its_processes_only():
    other = multiprocessing.get_context("fork").Process(target=lambda: None)
    other.start()
    with multiprocessing.get_context("fork").Pool(2) as pool:
        workers = private_apis.pool_workers(pool)
        assert len(workers) == 2 and all(isinstance(w, multiprocessing.process.BaseProcess) for w in workers)
        assert other.pid not in [w.pid for w in workers]
        assert set(pool.map(_pid, range(8), chunksize=1)) <= {w.pid for w in workers}
    other.join()


def _pid(_: int) -> int:
    return os.getpid()


ABORT_REQUESTS = """
import sys
from dimd.mpi import init_mpi
from dimd import private_apis
init_mpi()
import mpi4py.run
assert private_apis.watching_abort_requests() and private_apis.abort_requested_at_exit() == 0
mpi4py.run.set_abort_status(SystemExit(3))      # what python -m mpi4py does after a failing sys.exit(3)
assert private_apis.abort_requested_at_exit() == 3
private_apis.take_back_abort_at_exit()
assert private_apis.abort_requested_at_exit() == 0
mpi4py.run.set_abort_status(KeyboardInterrupt())
print(private_apis.abort_requested_at_exit())
private_apis.take_back_abort_at_exit()           # or mpi4py would abort this process at exit
"""


def test_mpi4pys_requests_to_abort_at_exit_are_noted_and_can_be_taken_back(tmp_path):
    """In a process of its own: it starts MPI, and mpi4py would act on a request left standing."""
    script = tmp_path / "abort_requests.py"
    script.write_text(ABORT_REQUESTS)
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "130\n", "")


def test_another_version_is_named_once_in_one_line_with_what_to_do(monkeypatch):
    monkeypatch.setitem(private_apis.WRITTEN_FOR, "torch", ("1.0",))
    private_apis._written_for.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            private_apis.graph_task_id()
            private_apis.graph_task_id()
    finally:
        private_apis._written_for.cache_clear()
    series = ".".join(torch.__version__.split(".")[:2])
    assert [str(w.message) for w in caught] == [
        f"dimd's private torch hooks (dimd.private_apis) were written for torch 1.0, not {torch.__version__}: "
        f"run `pytest tests/test_private_apis.py`, and when it passes add \"{series}\" to WRITTEN_FOR there"]
    assert caught[0].category is private_apis.UntestedVersionWarning


def test_the_versions_installed_here_are_the_ones_written_for():
    """This suite runs on the versions it declares: a new one is added here only once this file passes on it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", private_apis.UntestedVersionWarning)
        private_apis._written_for.cache_clear()
        import mpi4py  # noqa: F401  # the hooks' callers have it imported

        for package in ("torch", "mpi4py", "python"):
            private_apis._written_for(package)


def foreign_private_uses(path: Path) -> list[str]:
    """``module._name`` where ``module`` is imported from another package, and ``getattr(x, "_name")``."""
    tree = ast.parse(path.read_text(), str(path))
    foreign = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            foreign.update((a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("dimd"))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("dimd") and not node.level:
            foreign.update(a.asname or a.name for a in node.names)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in foreign - {"os"}:   # os._exit is public
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value).startswith("_") and not str(node.args[1].value).startswith("__")
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_private_apis_module_reaches_into_other_packages_private_names():
    found = [use for folder in LIBRARY for path in sorted((ROOT / folder).rglob("*.py"))
             if path.name != "private_apis.py" for use in foreign_private_uses(path)]
    assert found == []


UNTESTED_PYTHON = """
import sys

from dimd import private_apis

private_apis.WRITTEN_FOR["python"] = ("2.7",)
from dimd.cli import main

main(sys.argv[1:], prog_name="dimd")
"""


def test_dimd_says_an_untested_version_once_in_one_line_and_goes_on(sample_tree, tmp_path):
    from conftest import run_python

    script = tmp_path / "untested_python.py"
    script.write_text(UNTESTED_PYTHON)
    proc = run_python(script, "pack", sample_tree, "-o", tmp_path / "set", "--workers", "2", "--quiet", check=True)
    version = ".".join(map(str, sys.version_info[:3]))
    assert proc.stderr == (f"dimd: warning: dimd's private python hooks (dimd.private_apis) were written for python "
                           f"2.7, not {version}: run `pytest tests/test_private_apis.py`, and when it passes add "
                           f"\"{version.rsplit('.', 1)[0]}\" to WRITTEN_FOR there\n")
    assert (tmp_path / "set.dimd").exists()
