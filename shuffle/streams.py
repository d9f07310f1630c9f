"""The random streams of a run, one per purpose, so that no two purposes draw the same numbers.

numpy's ``SeedSequence`` pads its entropy with zeros to four words, so
``default_rng([seed, 0])`` and ``default_rng([seed, 0, 0])`` are the same
generator. Keyed as ``[seed, round, group]`` and ``[seed, rank, epoch]``, the
store's placement of round 0 and the loader's permutation of epoch 0 were
one and the same permutation on a rank that held the whole set (one rank,
or a group of one): the loader's order undid the shuffle, and every batch of
the first epoch held records in the pack's class order. Each stream now
starts with a word naming its purpose, so keys of different purposes never
meet, whatever their values and lengths.
"""

from __future__ import annotations

import numpy as np

#: Where each record goes in a shuffle round: keyed (seed, round, group).
PLACEMENT = 1
#: Which records each batch of an epoch takes: keyed (seed, rank, epoch).
SAMPLER = 2
#: Each batch's random-resized crops and flips: keyed (seed, rank, epoch, step).
CROPS = 3


def stream(purpose: int, *key: int) -> np.random.Generator:
    """The generator of ``purpose`` (:data:`PLACEMENT`, :data:`SAMPLER`, :data:`CROPS`) for ``key``."""
    return np.random.default_rng([purpose, *map(int, key)])
