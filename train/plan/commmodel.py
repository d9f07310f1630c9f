"""What each of dimd's allreduce algorithms costs, as a latency-bandwidth-reduction model.

After Hockney's alpha-beta model and Thakur, Rabenseifner & Gropp (2005),
one allreduce of n bytes on P ranks takes

    T(n, P) = a * L(n, P) + b * X(n, P) + c * R(n, P)   [ + s * W(n, P) on shared cores ]

with L the messages, X the bytes moved and R the bytes added along the
critical path, and three fitted constants: a seconds per message, b per byte
moved, c per byte added. The counts are those of dimd's implementations
(``dimd/allreduce/*.py``), not textbook ones: the extra ranks folded into
the butterflies, the binomial tree's ceil(log2 P) rounds, the pipelines'
segment counts as their modules size them.

Counting convention: every message counts once for its sender and once for
its receiver, in L (a message's software overhead) and in X (one memory copy
on a shared-memory node). So where Thakur writes 2(P-1)/P * n * b for the
ring, :func:`costs` has 4(P-1)/P * n for X: the same law, b halved.

Two views of the same counts (:class:`Costs`): ``span``, what the busiest
rank does plus the pipeline fill, is the time when every rank has a core of
its own; ``work`` is the sum over all ranks. When the ranks on a node
outnumber its cores, they share them: the time approaches work / cores
(:func:`features` takes the larger of the two, term by term: Brent's bound),
and every message may wait for its partner's time slice, a cost per message
of another order (milliseconds, not microseconds), so a fourth constant s
multiplies the messages per core, W = work.messages / cores. Predictions
for a cluster use the span and no s: a core per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from dimd.errors import DimdError

#: The allreduce's element size: gradients are float32.
ITEMSIZE = 4


@dataclass(frozen=True)
class Counts:
    """Messages, bytes moved and bytes added."""

    messages: float
    moved: float
    added: float

    def as_array(self) -> np.ndarray:
        return np.array([self.messages, self.moved, self.added], dtype=np.float64)


@dataclass(frozen=True)
class Costs:
    span: Counts    # the busiest rank, plus the pipeline's fill and drain
    work: Counts    # summed over every rank


def _same(span: Counts, ranks: int) -> Costs:
    """An algorithm where every rank does the same."""
    return Costs(span, Counts(span.messages * ranks, span.moved * ranks, span.added * ranks))


def _fold(ranks: int) -> tuple[int, int, int]:
    """(P', log2 P', extra ranks): the butterflies run on the largest power of two P' <= P."""
    pof2 = 1 << (ranks.bit_length() - 1)
    return pof2, pof2.bit_length() - 1, ranks - pof2


def ring_costs(n: float, ranks: int, **_: object) -> Costs:
    """P-1 reduce-scatter and P-1 allgather Sendrecvs of n/P bytes; adds in the first half."""
    p = ranks
    return _same(Counts(4 * (p - 1), 4 * (p - 1) / p * n, (p - 1) / p * n), p)


def recursive_doubling_costs(n: float, ranks: int, **_: object) -> Costs:
    """log2 P' whole-buffer exchanges; with extra ranks, one more receive-and-add before and a send after."""
    pof2, rounds, extra = _fold(ranks)
    fold = 1 if extra else 0
    span = Counts(2 * rounds + 2 * fold, 2 * n * (rounds + fold), n * (rounds + fold))
    work = Counts(2 * pof2 * rounds + 4 * extra, 2 * n * pof2 * rounds + 4 * n * extra,
                  n * pof2 * rounds + n * extra)
    return Costs(span, work)


def rabenseifner_costs(n: float, ranks: int, **_: object) -> Costs:
    """Recursive halving then doubling on P' ranks: 2 log2 P' exchanges moving (P'-1)/P' n each way."""
    pof2, rounds, extra = _fold(ranks)
    fold = 1 if extra else 0
    share = (pof2 - 1) / pof2 * n
    span = Counts(4 * rounds + 2 * fold, 4 * share + 2 * n * fold, share + n * fold)
    work = Counts(4 * pof2 * rounds + 4 * extra, 4 * pof2 * share + 4 * n * extra,
                  pof2 * share + n * extra)
    return Costs(span, work)


def tree_costs(n: float, ranks: int, **_: object) -> Costs:
    """Binomial reduce then broadcast: the root receives, adds and sends the whole buffer ceil(log2 P) times.

    FireCaffe's eq. 4: |grad W| * 2 log2(p) / BW.
    """
    p = ranks
    rounds = math.ceil(math.log2(p)) if p > 1 else 0
    span = Counts(2 * rounds, 2 * rounds * n, rounds * n)
    work = Counts(4 * (p - 1), 4 * (p - 1) * n, (p - 1) * n)
    return Costs(span, work)


def parameter_server_costs(n: float, ranks: int, **_: object) -> Costs:
    """Rank 0 receives and adds P-1 buffers, then sends P-1 back: FireCaffe's eq. 3, |grad W| * p / BW."""
    p = ranks
    span = Counts(2 * (p - 1), 2 * (p - 1) * n, (p - 1) * n)
    work = Counts(4 * (p - 1), 4 * (p - 1) * n, (p - 1) * n)
    return Costs(span, work)


def ring_root_segments(n: float, segment_bytes: int | None = None) -> tuple[int, float]:
    """(segments, bytes per segment) as ``ring_root`` cuts an n-byte float32 buffer."""
    from dimd.allreduce import ring_root_segment_bytes

    count = int(n) // ITEMSIZE
    if segment_bytes is None:
        segment_bytes = ring_root_segment_bytes(count * ITEMSIZE)
    segment = max(1, segment_bytes // ITEMSIZE)
    segments = max(1, -(-count // segment))
    return segments, min(segment, max(count, 1)) * ITEMSIZE


def ring_root_costs(n: float, ranks: int, *, segment_bytes: int | None = None, **_: object) -> Costs:
    """Chain reduce to the root and broadcast back, in s pipelined segments of g bytes.

    A rank in the middle of the chain receives, adds and passes on every
    segment up, and receives and passes on every segment down: 4 messages,
    4g bytes moved and g added per segment. The pipeline holds P-2 more
    segment stages while it fills and drains: (s + P - 2) stages in all.
    """
    p = ranks
    s, g = ring_root_segments(n, segment_bytes)
    if p == 2:  # no middle rank: the root receives, adds and sends each segment
        span = Counts(2 * s, 2 * n, n)
    else:
        span = Counts(4 * (s + p - 2), 4 * g * (s + p - 2), g * (s + p - 2))
    return Costs(span, Counts(4 * s * (p - 1), 4 * n * (p - 1), n * (p - 1)))


@dataclass(frozen=True)
class MulticolorPlan:
    """How ``multicolor`` splits a buffer: k colours, each chunk's element count and segment count."""

    colors: int
    chunks: np.ndarray
    segment_elements: int
    segments: np.ndarray


def multicolor_plan(n: float, ranks: int, colors: int | None = None,
                    segment_bytes: int | None = None) -> MulticolorPlan:
    """How ``multicolor`` splits an n-byte float32 buffer (its own sizing rules)."""
    from dimd.allreduce import DEFAULT_COLORS, multicolor_split

    bounds, segment = multicolor_split(int(n) // ITEMSIZE, ranks, colors or DEFAULT_COLORS, segment_bytes, ITEMSIZE)
    chunks = np.diff(bounds)
    return MulticolorPlan(len(chunks), chunks, segment, np.maximum(1, -(-chunks // segment)))


def multicolor_costs(n: float, ranks: int, *, colors: int | None = None,
                     segment_bytes: int | None = None, **_: object) -> Costs:
    """k = min(colors, P) chunks, each summed up its own k-ary tree and broadcast back, pipelined.

    Per colour, a rank with c children receives c chunks, adds them, sends
    one up, receives the total and sends it to its c children; a leaf sends
    and receives its chunk once. Every rank works for every colour at once,
    so the busiest rank's sum over colours sets the pace; the pipeline adds
    h-1 stages of one segment per tree level below the top (h: tree height).
    """
    from dimd.allreduce import color_trees

    p = ranks
    plan = multicolor_plan(n, p, colors, segment_bytes)
    k, chunks, segments = plan.colors, plan.chunks, plan.segments
    messages = np.zeros(p)
    moved = np.zeros(p)
    added = np.zeros(p)
    height = 0
    for tree in color_trees(p, k):
        parent = np.asarray(tree.parent)
        kids = np.bincount(parent[parent >= 0], minlength=p).astype(np.float64)
        up = (parent >= 0).astype(np.float64)      # every rank but the root sends up and receives down
        chunk_bytes = float(chunks[tree.color]) * ITEMSIZE
        if chunk_bytes == 0:
            continue
        messages += float(segments[tree.color]) * (2 * kids + 2 * up)
        moved += chunk_bytes * (2 * kids + 2 * up)
        added += chunk_bytes * kids
        height = max(height, _tree_height(parent, tree.root))
    busiest = int(np.lexsort((messages, moved))[-1])
    g = float(plan.segment_elements) * ITEMSIZE
    stages = max(0, height - 1)
    span = Counts(messages[busiest] + stages * (2 * k + 2), moved[busiest] + stages * (2 * k + 2) * g,
                  added[busiest] + stages * k * g)
    return Costs(span, Counts(float(messages.sum()), float(moved.sum()), float(added.sum())))


def _tree_height(parent: np.ndarray, root: int) -> int:
    depth = np.full(parent.size, -1)
    depth[root] = 0
    pending = [i for i in range(parent.size) if i != root]
    while pending:  # parents come first in BFS order, so this settles in one or two sweeps
        left = []
        for i in pending:
            if depth[parent[i]] >= 0:
                depth[i] = depth[parent[i]] + 1
            else:
                left.append(i)
        pending = left
    return int(depth.max())


def nccl_costs(n: float, ranks: int, **_: object) -> Costs:
    """NCCL from device memory, modelled as its large-message ring: P-1 reduce-scatter and P-1 allgather steps of
    n/P bytes each, the sums on the GPU (what nccl-tests' bus bandwidth, algbw x 2(P-1)/P, assumes). a, b and c
    are the GPUs' links' (NVLink within a node, the network across nodes), not the CPUs'."""
    return ring_costs(n, ranks)


def mpi_costs(n: float, ranks: int, **_: object) -> Costs:
    """The MPI library chooses its own algorithm; modelled as the usual large-message one
    (ceil(log2 P) latency terms, ring-like bandwidth: Rabenseifner's or the ring's)."""
    p = ranks
    rounds = math.ceil(math.log2(p)) if p > 1 else 0
    return _same(Counts(2 * rounds, 4 * (p - 1) / p * n, (p - 1) / p * n), p)


@dataclass(frozen=True)
class CostModel:
    name: str
    costs: Callable[..., Costs]
    formula: str        # the span, in the module's counting convention


#: One per algorithm of ``dimd.allreduce.STANDALONE`` and for ``nccl`` (the registry's names; a test holds them so).
COST_MODELS: dict[str, CostModel] = {m.name: m for m in (
    CostModel("ring", ring_costs, "4(P-1) a + 4(P-1)/P n b + (P-1)/P n c"),
    CostModel("recursive-doubling", recursive_doubling_costs,
              "(2 log2 P' + 2f) a + 2 (log2 P' + f) n b + (log2 P' + f) n c; P' = 2^floor(log2 P), f = [P > P']"),
    CostModel("rabenseifner", rabenseifner_costs,
              "(4 log2 P' + 2f) a + (4 (P'-1)/P' + 2f) n b + ((P'-1)/P' + f) n c"),
    CostModel("tree", tree_costs, "2 ceil(log2 P) (a + n b) + ceil(log2 P) n c"),
    CostModel("ps", parameter_server_costs, "2(P-1) (a + n b) + (P-1) n c"),
    CostModel("ring-root", ring_root_costs,
              "(s + P - 2) (4a + 4g b + g c); s segments of g bytes (P = 2: s (2a + 2g b + g c))"),
    CostModel("multicolor", multicolor_costs,
              "busiest rank over k colour trees (2 per child + 2 per segment) + (h-1) fill stages"),
    CostModel("mpi", mpi_costs, "2 ceil(log2 P) a + 4(P-1)/P n b + (P-1)/P n c (the library's own choice)"),
    CostModel("nccl", nccl_costs, "4(P-1) a + 4(P-1)/P n b + (P-1)/P n c (NCCL's ring, in device memory)"),
)}

#: Seconds per message, per byte moved, per byte added, and per message that waits for a shared core.
PARAMETERS = ("a", "b", "c", "s")


def get_cost_model(name: str) -> CostModel:
    try:
        return COST_MODELS[name]
    except KeyError:
        raise DimdError(f"no cost model for allreduce algorithm {name!r}; "
                        f"modelled: {', '.join(COST_MODELS)}") from None


def features(algorithm: str, nbytes: float, ranks: int, *, cores: float | None = None,
             colors: int | None = None, segment_bytes: int | None = None) -> np.ndarray:
    """(L, X, R, W) for one allreduce, the factors of (a, b, c, s).

    With a core per rank (``cores`` None, or at least ``ranks``): the span,
    and W = 0. With fewer cores than ranks (``cores``: those the job's ranks
    run on, all nodes together): Brent's max(span, work / cores) for L, X, R,
    and W = the messages per core, work.messages / cores, each of which waits
    for its partner's time slice.
    """
    if ranks < 1:
        raise DimdError(f"ranks must be a positive integer, got {ranks}")
    if ranks == 1 or nbytes <= 0:
        return np.zeros(len(PARAMETERS))
    cost = get_cost_model(algorithm).costs(float(nbytes), int(ranks), colors=colors, segment_bytes=segment_bytes)
    span = cost.span.as_array()
    if cores is None or cores >= ranks:
        return np.append(span, 0.0)
    work = cost.work.as_array() / cores
    return np.append(np.maximum(span, work), work[0])
