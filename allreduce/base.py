"""What every allreduce module may import: the error they raise and the registry's name for the caller's group.

It imports nothing of ``dimd.allreduce``, so the registry (:mod:`dimd.allreduce.api`) can import the modules
that implement its algorithms, and they can raise its error, without a circle between them.
"""

from __future__ import annotations

from dimd.errors import DimdError

#: ``Algorithm.torch_group`` of ``torch``: the torch.distributed group the caller initialised.
CALLER = "caller"


class AllreduceError(DimdError, ValueError):
    """A bad buffer, algorithm name or option (the same on every rank, so every rank raises)."""
