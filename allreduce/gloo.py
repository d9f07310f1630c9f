"""torch.distributed's gloo all_reduce in the same MPI job: what a PyTorch user gets instead."""

from __future__ import annotations

import socket
from typing import Any, Callable

import numpy as np

from dimd.host import free_port


def gloo_reducer(comm: Any) -> tuple[Callable[[np.ndarray], None], Callable[[], None]]:
    """Start a gloo process group over ``comm``'s ranks; return (sum in place, shut down).

    Rank 0 picks a free TCP port and broadcasts its address over MPI, so no
    MASTER_ADDR/MASTER_PORT needs setting.
    """
    import torch
    import torch.distributed as dist

    address = None
    if comm.Get_rank() == 0:
        host = socket.gethostname()
        try:
            host = socket.gethostbyname(host)
        except OSError:
            host = "127.0.0.1"
        address = f"tcp://{host}:{free_port()}"
    address = comm.bcast(address, root=0)
    dist.init_process_group("gloo", init_method=address, rank=comm.Get_rank(), world_size=comm.Get_size())

    def run(buf: np.ndarray) -> None:
        if buf.size:
            dist.all_reduce(torch.from_numpy(buf))

    def close() -> None:
        dist.destroy_process_group()

    return run, close
