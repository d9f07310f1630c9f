"""Where torch.distributed's ranks meet: rank 0's TCPStore, its address and port broadcast over MPI.

Rank 0 opens torch's TCPStore on a port the kernel picks (so no other
process can take it between choosing and listening) and broadcasts
``tcp://ADDRESS:PORT``; every other rank connects to it, each within the
rendezvous timeout, and the ranks agree over MPI whether all of them got
there, so a rank that cannot reach it ends the job with one line on every
rank. No MASTER_ADDR or MASTER_PORT needs setting. Rank 0's host name
can resolve to a loopback address (Debian's installer writes
``127.0.1.1 HOST`` into /etc/hosts) or not at all: on one node that still
works, across nodes the other ranks would retry an address they cannot
reach for as long as the store's timeout, deaf to signals inside torch's C++.
So a job that spans several nodes refuses such an address with one line, and
``MASTER_ADDR`` (torch's own variable) names the address to use instead.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any, Mapping

#: The variable that overrides rank 0's address (torch's own convention).
ADDRESS_VARIABLE = "MASTER_ADDR"
#: How long ranks wait for each other in the rendezvous, instead of torch's 10 or 30 minutes.
RENDEZVOUS_TIMEOUT = timedelta(seconds=60)
#: What to set when the ranks cannot meet across nodes.
RENDEZVOUS_HINT = (f"rank 0's address or port may be blocked from the other nodes, or of another network: set "
                   f"{ADDRESS_VARIABLE} to an address of rank 0's host that every node reaches, and NCCL_SOCKET_IFNAME "
                   f"or GLOO_SOCKET_IFNAME to the interface between the nodes")


def spans_nodes(comm: Any) -> bool:
    """Collective: whether ``comm``'s ranks are on more than one node."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return local.Get_size() < comm.Get_size()   # MPI: one node holds them all, or not
    finally:
        local.Free()


def host_address(several_nodes: bool, environ: Mapping[str, str] = os.environ) -> tuple[str | None, str | None]:
    """(address, None), or (None, why not): rank 0's address for the others to connect to."""
    given = environ.get(ADDRESS_VARIABLE, "").strip()
    name = given or socket.gethostname()
    origin = f"{ADDRESS_VARIABLE}={given}" if given else f"this host's name {name!r}"
    try:
        address = socket.gethostbyname(name)
    except OSError as exc:
        if not several_nodes:
            return "127.0.0.1", None
        return None, (f"{origin} does not resolve ({exc.strerror or exc}); set {ADDRESS_VARIABLE} to an "
                      f"address of rank 0's host that the other nodes reach")
    if several_nodes and ipaddress.ip_address(address).is_loopback:
        return None, (f"{origin} resolves to the loopback address {address} (as /etc/hosts may say), "
                      f"which the ranks on other nodes cannot reach; set {ADDRESS_VARIABLE} to an "
                      f"address of rank 0's host on the network between the nodes")
    return address, None


def open_store(comm: Any, timeout: timedelta) -> tuple[Any, str]:
    """Collective: (this rank's handle on rank 0's TCPStore, its ``tcp://HOST:PORT``), the same store on every rank.

    ``timeout`` bounds each rank's connection and the store's later waits. A
    DimdError on every rank when rank 0 has no address the others can reach,
    cannot listen, or some rank cannot connect in time.
    """
    import torch.distributed as dist

    from dimd.mpi import agree_or_raise

    rank, size = comm.Get_rank(), comm.Get_size()
    several = spans_nodes(comm)   # MPI: on one node every address works
    address, problem = host_address(several) if rank == 0 else (None, None)
    agree_or_raise(comm, problem)   # MPI: every rank stops with rank 0's reason
    store, url = None, None
    if address is not None:   # rank 0
        try:
            store = dist.TCPStore(address, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
            url = f"tcp://{address}:{store.port}"
        except (RuntimeError, ValueError) as exc:   # torch's DistNetworkError is a RuntimeError
            problem = f"rank 0 cannot listen for the rendezvous on {address}: {first_line(exc)}"
    agree_or_raise(comm, problem)
    url = comm.bcast(url, root=0)   # MPI: rank 0's address and port
    if rank != 0:
        host, _, port = url.removeprefix("tcp://").rpartition(":")
        try:
            store = dist.TCPStore(host, int(port), size, is_master=False, timeout=timeout)
        except (RuntimeError, ValueError) as exc:   # a timeout, a refused or unreachable address
            problem = (f"rank {rank} on {socket.gethostname()} cannot reach the rendezvous at {url} "
                       f"({first_line(exc)}): {RENDEZVOUS_HINT}")
    agree_or_raise(comm, problem)   # MPI: every rank stops with the first unreachable rank's reason
    return store, url


def first_line(exc: BaseException) -> str:
    """An exception's first line (torch's C++ errors carry a stack trace after it)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
