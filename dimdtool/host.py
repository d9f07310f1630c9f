"""Facts about this machine and process: cores we may use, memory available, memory held.

Plain ``os``, ``socket`` and ``/proc`` reads; importing this module starts
nothing (no MPI, no torch), so ``dimd pack`` and the MPI start-up can both use it.
"""

from __future__ import annotations

import os
import socket


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), not all the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def affinity(pid: int = 0) -> frozenset[int]:
    """The CPUs process ``pid`` (0: this one) may run on; empty where unknown (not Linux, gone)."""
    try:
        return frozenset(os.sched_getaffinity(pid))
    except (AttributeError, OSError):
        return frozenset()


def launcher_cores() -> int:
    """Cores this node gives the job, as far as one process can tell before MPI starts.

    A launcher that binds ranks (Open MPI does by default, ``mpiexec -bind-to core``)
    leaves each rank one core, but its own process on the node (Hydra's proxy,
    Open MPI's prted, SLURM's step daemon) keeps what the job was given: the
    parent's affinity joined with ours. A wrapper between them that inherited the
    binding makes this the rank's own cores, as before.
    """
    cores = affinity() | affinity(os.getppid())
    return len(cores) or available_cores()


def available_memory() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
    value = _proc_field("/proc/meminfo", "MemAvailable:")
    if value is not None:
        return value
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages) * int(os.sysconf("SC_PAGE_SIZE")) if pages else 1 << 62


def resident_memory(pid: int | str = "self") -> int:
    """Process ``pid``'s resident set size in bytes (VmRSS), 0 where unknown or gone."""
    return _proc_field(f"/proc/{pid}/status", "VmRSS:") or 0


def _proc_field(path: str, key: str) -> int | None:
    """A ``key: N kB`` line of a /proc file, in bytes."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` now ("" = every interface), for a rendezvous such as gloo's.

    The port is released before it is used, so another process could take it
    in between; rendezvous that fail on a taken port say so clearly.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
