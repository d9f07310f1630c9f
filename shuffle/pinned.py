"""Page-locking the loader's ring of batch slots, so that a GPU copies a decoded batch straight from its slot.

A copy to the GPU runs asynchronously only from page-locked (pinned) host
memory. Copying each slot into a fresh pinned tensor cost the training
process's thread 3.9-5.5 ms per batch of 128 at 224 px on an H100 machine
(``bench/probes/pinned_feed.py``, two runs); registering the ring once with
``cudaHostRegister`` costs nothing per batch. The ring is a shared memfd
mapping (:mod:`dimd.shuffle.shm`); the driver pins its pages for this
process only, the decoding workers write into them as before.
"""

from __future__ import annotations

from dimd.errors import DimdError
from dimd.shuffle.shm import Segment


def _cudart() -> object:
    import torch

    return torch.cuda.cudart()


def page_lock(segment: Segment) -> None:
    """Register ``segment``'s mapping with CUDA (until :func:`page_unlock`)."""
    code = _cudart().cudaHostRegister(segment.array.ctypes.data, segment.size, 0)  # type: ignore[attr-defined]
    if int(code) != 0:
        raise DimdError(f"cannot page-lock {segment.size} bytes of batch slots for the GPU (CUDA error "
                        f"{int(code)}); is the memlock limit (ulimit -l) too low?")


def page_unlock(segment: Segment) -> None:
    """Undo :func:`page_lock`; every copy from the segment must have finished."""
    _cudart().cudaHostUnregister(segment.array.ctypes.data)  # type: ignore[attr-defined]
