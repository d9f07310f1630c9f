"""``torch``: torch.distributed's all_reduce on the process group the caller initialised.

A GPU user keeps the device's own collective (NCCL on CUDA tensors) while
using dimd's data path; on CPU it is gloo's. dimd does not start the group:
``torch.distributed.init_process_group`` is the caller's, with the backend
and rendezvous their site wants (``dimd.allreduce.gloo`` starts one over MPI).
The communicator argument is unused: the group defines the ranks, and they
must be the communicator's, in the same order.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def process_group_ready() -> None:
    """Raise the one-line error when no default process group is initialised."""
    import torch.distributed as dist

    from dimd.allreduce.api import AllreduceError

    if not (dist.is_available() and dist.is_initialized()):
        raise AllreduceError("allreduce algorithm 'torch' needs torch.distributed.init_process_group(...) "
                             "first (gloo for CPU tensors, nccl for CUDA ones)")


def all_reduce_tensor(tensor: Any) -> None:
    """Sum a contiguous tensor in place over the default process group (on its own device)."""
    import torch.distributed as dist

    process_group_ready()
    if tensor.numel():
        dist.all_reduce(tensor)   # MPI: (the process group's ranks) the sum over every rank


def torch_allreduce(buf: np.ndarray, comm: Any) -> None:
    """The registry's form: a 1-D numpy view, summed in place through a zero-copy CPU tensor."""
    import torch

    all_reduce_tensor(torch.from_numpy(buf))
