"""A warm interpreter for the tests' ``dimd`` runs: it imports torch and dimd once, then forks a child per run.

Starting Python and importing torch costs about 3 CPU-seconds per process,
most of the suite's time. :func:`conftest.run_dimd` sends each run here as
one JSON line (argv, environment, folder, output files); the server forks,
the child runs ``dimd ARGS`` as ``python -m dimd`` would (its own process,
MPI world, signal handlers, stdin at /dev/null, standard output and error to
the files, ``atexit`` handlers run at the end), and the server answers with
the child's exit status. Nothing here starts MPI or a thread before the fork.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import traceback

import dimd.cli
# the commands' heavy imports (torch above all), paid once here
import dimd.commands.pack
import dimd.commands.plan_batch
import dimd.commands.train
import dimd.train.engine


def run_child(request: dict) -> None:
    """In the forked child: ``dimd ARGS`` with the request's folder, environment and output files."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["dimd", *request["args"]]
    code: object = 0
    try:
        dimd.cli.main(request["args"], prog_name="dimd")
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()   # as the interpreter ends: wait for non-daemon threads, then run atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def serve() -> None:
    """One run at a time: a request line in, ``{"pid": ...}`` when started, ``{"returncode": ...}`` when done."""
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
