"""Where torch.distributed's ranks meet: an address every rank can reach, chosen once over MPI.

Rank 0 listens on a free port of its host's address and broadcasts it. Its
hostname can resolve to a loopback address (Debian's installer writes
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

from dimd.host import free_port

#: The variable that overrides rank 0's address (torch's own convention).
ADDRESS_VARIABLE = "MASTER_ADDR"
#: How long ranks wait for each other in the rendezvous, instead of torch's 30 minutes.
RENDEZVOUS_TIMEOUT = timedelta(seconds=60)


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


def rendezvous_address(comm: Any) -> str:
    """Collective: ``tcp://HOST:PORT`` on rank 0's host, the same on every rank; a DimdError on all if none fits."""
    from dimd.mpi import agree_or_raise

    several = spans_nodes(comm)
    address, problem = host_address(several) if comm.Get_rank() == 0 else (None, None)
    agree_or_raise(comm, problem)   # MPI: every rank stops with rank 0's reason
    url = f"tcp://{address}:{free_port()}" if comm.Get_rank() == 0 else None
    return comm.bcast(url, root=0)
