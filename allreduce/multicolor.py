"""The DIMD paper's k-color allreduce (section 4.2, after Kumar & Faraj).

The buffer is split into k chunks; chunk c is summed up its own k-ary BFS
spanning tree to that tree's root and broadcast back down the same tree. The
trees are rotations of one rank order, shifted so that the non-leaf ranks of
different colours are disjoint whenever P allows it (k * internal <= P): a
rank does the additions for at most one colour and only forwards for the
others, so every rank's links and cores work at once. Each chunk moves in
pipelined segments, and every colour is in flight at the same time through
non-blocking sends and receives driven by one ``Waitsome`` loop.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from dimd.allreduce.buffers import auto_segment_bytes, block_bounds, scratch, segment_bounds

#: Segments a node has in flight per colour (and per child) at once.
WINDOW = 4
_TAG_BASE = 100


@dataclass(frozen=True)
class ColorTree:
    """One colour's spanning tree: parent of every rank (-1 at the root) and its children."""

    color: int
    root: int
    parent: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]

    @property
    def internal(self) -> frozenset[int]:
        """Ranks that add for this colour: the root and every rank with children."""
        return frozenset(r for r, kids in enumerate(self.children) if kids) | {self.root}


def internal_count(size: int, arity: int) -> int:
    """Non-leaf nodes of a complete ``arity``-ary BFS tree on ``size`` nodes."""
    return max(1, -(-(size - 1) // arity))


@functools.lru_cache(maxsize=64)
def color_trees(size: int, colors: int) -> tuple[ColorTree, ...]:
    """The k = ``colors`` k-ary BFS trees over ranks ``0..size-1``.

    Colour c lists the ranks starting at ``c * internal`` (mod P) and hangs
    node i of that list under node (i-1) // k, so its first ``internal``
    ranks are its non-leaves; consecutive colours use consecutive blocks of
    ranks as non-leaves (the paper's Figure 2: 8 nodes, 4 colours, colour 0
    rooted at 0 with 1 as its other non-leaf, colour 1 at 2 with 3, ...).
    """
    if size < 1 or colors < 1:
        raise ValueError(f"need at least one rank and one colour, got {size} and {colors}")
    shift = internal_count(size, colors)
    trees = []
    for c in range(colors):
        order = (np.arange(size) + c * shift) % size
        parent = np.full(size, -1, dtype=np.int64)
        parent[order[1:]] = order[(np.arange(1, size) - 1) // colors]
        children: list[list[int]] = [[] for _ in range(size)]
        for node in order[1:]:  # BFS order, so children stay sorted by tree position
            children[parent[node]].append(int(node))
        trees.append(ColorTree(c, int(order[0]), tuple(int(p) for p in parent),
                               tuple(tuple(kids) for kids in children)))
    return tuple(trees)


class _Color:
    """One colour's segments on this rank: receive from children, add, send up, pass the total down."""

    def __init__(self, tree: ColorTree, rank: int, chunk: np.ndarray, segment: int,
                 slots: np.ndarray | None, comm: Any, post: Callable[[Any, Callable[[], None]], None]):
        self.parent = tree.parent[rank] if tree.parent[rank] >= 0 else None
        self.children = tree.children[rank]
        self.up_tag, self.down_tag = _TAG_BASE + 2 * tree.color, _TAG_BASE + 2 * tree.color + 1
        self.chunk, self.comm, self.post = chunk, comm, post
        # A leaf receives nothing: an empty stand-in instead of None keeps the type plain.
        self.slots = slots if slots is not None else np.empty((WINDOW, 0, 0), chunk.dtype)
        self.bounds = segment_bounds(chunk.size, segment)
        self.count = len(self.bounds) - 1
        self.arrived = np.zeros(self.count, dtype=np.int64)
        self.up_done = np.zeros(self.count, dtype=bool)
        self.down_arrived = np.zeros(self.count, dtype=bool)
        self.next_reduce = self.next_recv = self.next_send = self.next_down = self.next_forward = 0

    def segment(self, s: int) -> np.ndarray:
        return self.chunk[self.bounds[s]:self.bounds[s + 1]]

    def start(self) -> None:
        if self.children:
            for _ in range(min(WINDOW, self.count)):
                self._post_child_receives()
        else:
            for _ in range(min(WINDOW, self.count)):
                self._send_up_next()

    # reduce phase -----------------------------------------------------------
    def _post_child_receives(self) -> None:
        s = self.next_recv
        self.next_recv += 1
        width = self.bounds[s + 1] - self.bounds[s]
        for j, child in enumerate(self.children):
            landing = self.slots[s % WINDOW, j, :width]
            self.post(self.comm.Irecv(landing, child, self.up_tag), functools.partial(self._arrived, s))

    def _arrived(self, s: int) -> None:
        self.arrived[s] += 1
        while self.next_reduce < self.count and self.arrived[self.next_reduce] == len(self.children):
            s = self.next_reduce
            self.next_reduce += 1
            part = self.segment(s)
            for j in range(len(self.children)):
                np.add(part, self.slots[s % WINDOW, j, :part.size], out=part)
            if self.next_recv < self.count:  # the slot of segment s is free again
                self._post_child_receives()
            if self.parent is None:
                self._send_down(s)
            else:
                self._send_up(s)

    def _send_up_next(self) -> None:  # leaves: segments go up in order, WINDOW at a time
        s = self.next_send
        self.next_send += 1
        self._send_up(s)

    def _send_up(self, s: int) -> None:
        self.post(self.comm.Isend(self.segment(s), self.parent, self.up_tag), functools.partial(self._sent_up, s))

    def _sent_up(self, s: int) -> None:
        self.up_done[s] = True
        if not self.children and self.next_send < self.count:
            self._send_up_next()
        # The total may land in segment s only once its partial sum has left;
        # receives are posted in segment order so messages match in order.
        while self.next_down < self.count and self.up_done[self.next_down]:
            d = self.next_down
            self.next_down += 1
            self.post(self.comm.Irecv(self.segment(d), self.parent, self.down_tag),
                      functools.partial(self._arrived_down, d))

    def _arrived_down(self, s: int) -> None:
        # Receives can complete out of order (large ones are copied in the
        # background); forward in order so the children's receives match.
        self.down_arrived[s] = True
        while self.next_forward < self.count and self.down_arrived[self.next_forward]:
            self.next_forward += 1
            self._send_down(self.next_forward - 1)

    # broadcast phase --------------------------------------------------------
    def _send_down(self, s: int) -> None:
        for child in self.children:
            self.post(self.comm.Isend(self.segment(s), child, self.down_tag), _nothing)


def _nothing() -> None:
    pass


def multicolor_split(count: int, size: int, colors: int, segment_bytes: int | None = None,
                     itemsize: int = 4) -> tuple[list[int], int]:
    """How ``multicolor`` cuts ``count`` elements on ``size`` ranks: the bounds of its k = min(colors,
    P) chunks (one per colour) and the elements per pipelined segment (by default up to 8 segments
    per chunk, of at least 512 KiB)."""
    chunks = block_bounds(count, min(colors, size))
    if segment_bytes is None:
        segment_bytes = auto_segment_bytes((chunks[1] - chunks[0]) * itemsize, 8, low=512 << 10)
    return chunks, max(1, min(segment_bytes // itemsize, chunks[1] - chunks[0]))


def multicolor(buf: np.ndarray, comm: Any, *, colors: int = 4, segment_bytes: int | None = None) -> None:
    """Sum ``buf`` over k = min(colors, P) colour trees, all colours pipelined at once."""
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or buf.size == 0:
        return
    chunks, segment = multicolor_split(buf.size, size, colors, segment_bytes, buf.itemsize)
    trees = color_trees(size, len(chunks) - 1)
    fan_in = [len(tree.children[rank]) for tree in trees]
    arena = scratch(sum(fan_in) * WINDOW * segment, buf.dtype)

    requests: list[Any] = []
    handlers: list[Callable[[], None]] = []

    def post(request: Any, handler: Callable[[], None]) -> None:
        requests.append(request)
        handlers.append(handler)

    states = []
    offset = 0
    for tree, kids in zip(trees, fan_in):
        chunk = buf[chunks[tree.color]:chunks[tree.color + 1]]
        if chunk.size == 0:
            continue
        slots = arena[offset:offset + kids * WINDOW * segment].reshape(WINDOW, kids, segment)
        offset += kids * WINDOW * segment
        states.append(_Color(tree, rank, chunk, segment, slots, comm, post))
    for state in states:
        state.start()
    while requests:
        finished = set(MPI.Request.Waitsome(requests) or ())
        ready = [handlers[i] for i in sorted(finished)]
        requests[:] = [r for i, r in enumerate(requests) if i not in finished]
        handlers[:] = [h for i, h in enumerate(handlers) if i not in finished]
        for handler in ready:
            handler()
