"""Allreduce algorithms, their registry and the microbenchmark.

    from dimd.allreduce import allreduce, ALGORITHMS, choose_fastest

    allreduce(grads, comm, "ring")                    # sum in place on every rank
    allreduce(grads, comm, "multicolor", colors=4, average=True)
    best = choose_fastest(grads.nbytes, comm, grads.dtype, ["mpi", "ring", "multicolor"])

``ALGORITHMS`` maps each name to an :class:`Algorithm` (function, one-line
description, options with their defaults); ``STANDALONE`` names those that
need nothing but the communicator (all but ``torch``, which runs on the
``torch.distributed`` process group the caller set up, and ``nccl`` and
``gloo``, which run on the one :func:`start_group` starts from MPI)::

    with start_group(comm, "gloo") as group:      # collective; NCCL: start_group(comm, "nccl", device)
        allreduce(grads, comm, "gloo")            # or group.start(tensor, average=True).wait()
"""

from dimd.allreduce.api import (ALGORITHMS, DEFAULT_COLORS, STANDALONE, SUPPORTED_DTYPES, Algorithm, allreduce,
                                device_group, get_algorithm)
from dimd.allreduce.base import AllreduceError
from dimd.allreduce.bench import choose_fastest
from dimd.allreduce.group import BACKENDS, TorchGroup, backend_problem, group_problem, start_group, started_group
from dimd.allreduce.buffers import release_scratch
from dimd.allreduce.multicolor import ColorTree, color_trees, multicolor_split
from dimd.allreduce.ring import ring_root_segment_bytes
from dimd.allreduce.torchdist import caller_group

__all__ = ["ALGORITHMS", "BACKENDS", "DEFAULT_COLORS", "STANDALONE", "SUPPORTED_DTYPES", "Algorithm",
           "AllreduceError", "ColorTree", "TorchGroup", "allreduce", "backend_problem", "caller_group",
           "choose_fastest", "color_trees", "device_group", "get_algorithm", "group_problem", "multicolor_split",
           "release_scratch", "ring_root_segment_bytes", "start_group", "started_group"]
