"""Conservation check: a group still holds every record exactly once, with its original bytes.

The multiset of (name, crc32) of a group is unchanged exactly when every
global record index appears once in the group and the bytes each rank holds
hash to the crc32 the packed index gives for that record (names are a
function of the index). Every rank hashes its own bytes; the group's rank 0
gathers (index, crc32) pairs and compares them with the packed index.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dimd.format import PackedDataset
from dimd.shuffle.exchange import displacements
from dimd.mpi import agree_or_raise

#: At most this many offending records are named in an error.
_SHOW = 5


def check_group(store: Any, when: str) -> int:
    """Collective over the world: raise on every rank if any group lost, duplicated or changed a record.

    Returns the number of records checked in this rank's group.
    """
    from mpi4py import MPI

    comm = store.group_comm
    indices = np.ascontiguousarray(store.global_index, np.int64)
    actual = store.actual_crc32()
    counts = np.array(comm.allgather(len(indices)), np.int64)
    root = comm.Get_rank() == 0
    all_indices = np.empty(int(counts.sum()) if root else 0, np.int64)
    all_crc = np.empty(int(counts.sum()) if root else 0, np.uint32)
    comm.Gatherv(indices, [all_indices, (counts, displacements(counts)), MPI.INT64_T], root=0)
    comm.Gatherv(actual, [all_crc, (counts, displacements(counts)), MPI.UINT32_T], root=0)
    problem = _compare(store, all_indices, all_crc, when) if root else None
    agree_or_raise(store.comm, problem)
    return int(counts.sum())


def _compare(store: Any, indices: np.ndarray, actual: np.ndarray, when: str) -> str | None:
    packed = PackedDataset(store.path)
    total = len(packed)
    where = f"verify after {when}: group {store.group}"
    if len(indices) and (indices.min() < 0 or indices.max() >= total):
        return f"{where} holds record indices outside 0..{total - 1}"
    seen = np.bincount(indices, minlength=total)
    missing, doubled = np.flatnonzero(seen == 0), np.flatnonzero(seen > 1)
    changed = indices[actual != packed.records["crc32"][indices]]
    if not (len(missing) or len(doubled) or len(changed)):
        return None
    names = packed.names
    parts = []
    for label, found in (("missing", missing), ("held more than once", doubled),
                         ("with changed bytes (crc32)", changed)):
        if len(found):
            shown = ", ".join(f"{i} ({names[i]})" for i in found[:_SHOW].tolist())
            more = f" and {len(found) - _SHOW} more" if len(found) > _SHOW else ""
            parts.append(f"{len(found)} records {label}: {shown}{more}")
    return f"{where}: " + "; ".join(parts)
