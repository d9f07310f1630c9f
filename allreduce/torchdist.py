"""``torch``: torch.distributed's all_reduce on the process group the caller initialised.

A GPU user keeps the device's own collective (NCCL on CUDA tensors) while
using dimd's data path; on CPU it is gloo's. dimd does not start the group:
``torch.distributed.init_process_group`` is the caller's, with the backend
and rendezvous their site wants (:func:`dimd.allreduce.start_group` starts
one from MPI instead). The communicator argument is unused: the group
defines the ranks, and they must be the communicator's, in the same order.
The sum is :meth:`TorchGroup.reduce_array`'s, as on the groups dimd starts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dimd.allreduce.base import AllreduceError
from dimd.allreduce.group import TorchGroup


def process_group_ready() -> None:
    """Raise the one-line error when no default process group is initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise AllreduceError("allreduce algorithm 'torch' needs torch.distributed.init_process_group(...) "
                             "first (gloo for CPU tensors, nccl for CUDA ones)")


def caller_group() -> TorchGroup:
    """The default group the caller initialised (``algorithm="torch"``), as a :class:`TorchGroup`."""
    import torch
    import torch.distributed as dist

    process_group_ready()
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return TorchGroup(backend, dist.get_world_size(), device)


def torch_allreduce(buf: np.ndarray, comm: Any) -> None:
    """The registry's form: a 1-D numpy view summed in place on the caller's group (through the GPU for NCCL)."""
    caller_group().reduce_array(buf)
