"""torch.distributed's gloo all_reduce in the same MPI job: what a PyTorch user gets instead."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from dimd.allreduce.rendezvous import RENDEZVOUS_TIMEOUT, rendezvous_address
from dimd.errors import DimdError


def gloo_reducer(comm: Any) -> tuple[Callable[[np.ndarray], None], Callable[[], None]]:
    """Start a gloo process group over ``comm``'s ranks; return (sum in place, shut down).

    Rank 0 picks a free TCP port and broadcasts its address over MPI, so no
    MASTER_PORT needs setting (MASTER_ADDR chooses the address where the
    host's name does not serve: :mod:`dimd.allreduce.rendezvous`).
    """
    import torch
    import torch.distributed as dist

    address = rendezvous_address(comm)
    try:
        dist.init_process_group("gloo", init_method=address, rank=comm.Get_rank(), world_size=comm.Get_size(),
                                timeout=RENDEZVOUS_TIMEOUT)
    except (RuntimeError, ValueError) as exc:   # torch's DistStoreError and timeouts are RuntimeErrors
        raise DimdError(f"gloo's rendezvous at {address} failed: {str(exc).splitlines()[0]}") from None

    def run(buf: np.ndarray) -> None:
        if buf.size:
            dist.all_reduce(torch.from_numpy(buf))

    def close() -> None:
        dist.destroy_process_group()

    return run, close
