"""Labels and class names: bounded before anything is built from them.

A label read from a list file or a Caffe Datum sets how many classes there
are; unchecked, a typo like ``99999999999999999999`` would build that many
class names. The policy (docs/policies.md):

* with ``--classes-file``, a label must be in ``0..N-1`` for its N names;
* without one, a label must be at most :data:`MAX_LABEL`, and the classes
  are named ``"0".."max"``; if more than :data:`MAX_EMPTY_CLASSES` of those
  would hold no record and they outnumber the used ones, the labels are a
  mistake, not a data set, and the pack is refused (name the classes with
  ``--classes-file`` to go beyond).

In a list file a bad label is an error at its line (before any work); in an
LMDB the datum is skipped and named, like any other bad record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from dimd.errors import DimdError

#: The largest label accepted without --classes-file (a million classes: above any public data set).
MAX_LABEL = 999_999
#: Without --classes-file, this many empty classes below the largest label are tolerated
#: (a validation subset of ImageNet's 1,000 classes), more only if most classes are used.
MAX_EMPTY_CLASSES = 1_000
_DIGITS = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class LabelBound:
    """The labels a source may use: ``0..limit-1``; ``named`` when class names set the limit, and
    ``named_by`` says where those names came from."""

    limit: int
    named: bool
    named_by: str = "the classes file"

    @classmethod
    def for_classes(cls, classes: list[str] | None, named_by: str = "the classes file") -> "LabelBound":
        return cls(len(classes), True, named_by) if classes is not None else cls(MAX_LABEL + 1, False)

    def problem(self, label: int, shown: str | None = None) -> str | None:
        """Why ``label`` is refused, or None; ``shown`` is the label as the input wrote it."""
        shown = shown if shown is not None else str(label)
        if label < 0:
            return f"negative label {shown}"
        if label < self.limit:
            return None
        if self.named:
            return f"label {shown} but {self.named_by} names only {self.limit} classes"
        return (f"label {shown} is above {MAX_LABEL:,}, the largest dimd accepts without "
                f"`classes_file`")


#: What :func:`parse_label` returns for a label of more than 18 digits: beyond every bound.
TOO_LARGE = 10**18


def parse_label(text: str) -> int | None:
    """A label field of ASCII digits as an int (:data:`TOO_LARGE` if huge), or None if it is not one."""
    if not _DIGITS.fullmatch(text):
        return None
    return int(text) if len(text) <= 18 else TOO_LARGE


def numbered_classes(labels: np.ndarray, where: str,
                     name_of: Callable[[int], str] | None = None) -> list[str]:
    """Class names ``"0".."max"`` for labels without a classes file; refuse a sparse label set.

    ``labels`` must already be bounded (:class:`LabelBound`), so the count
    array below is at most a few MB. ``name_of(i)`` (record ``i``'s name) lets
    the error name the record with the largest label.
    """
    if not len(labels):
        return []
    counts = np.bincount(np.asarray(labels, np.int64))
    empty = int(np.count_nonzero(counts == 0))
    used = len(counts) - empty
    if empty > MAX_EMPTY_CLASSES and empty > used:
        largest = f" ({name_of(int(np.argmax(labels)))} has it)" if name_of is not None else ""
        raise DimdError(f"{where}: labels go up to {len(counts) - 1:,}{largest} but only {used:,} of "
                        f"them are used, so {empty:,} classes would be empty; fix the labels, or name "
                        f"the classes with `classes_file`")
    return [str(i) for i in range(len(counts))]
