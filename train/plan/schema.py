"""What every JSON the planner reads must hold, checked in one pass before any arithmetic.

Each planner input is a dimd result envelope (``bench-allreduce``, ``plan-batch
step-time``, ``comm``, ``convergence``). Its ``result`` is checked against a
declared shape: which fields, which types, which bounds. A value that breaks
it (a null result, a NaN or negative cost, sizes written as text, a list
where an object belongs) stops the step with one line that names the file and
the field's path, instead of a traceback or a silent "-" further on::

    check(document["result"], COMM_RESULT, "comm.json")
    -> comm.json: `result.algorithms.ring.parameters.a` must be a finite number >= 0, got nan
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

from dimd.errors import DimdError


@dataclass(frozen=True)
class Num:
    """A finite number (not a boolean), at least ``low`` when given."""

    low: float | None = None
    integer: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        return kind + (f" >= {self.low:g}" if self.low is not None else "")

    def fits(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not isinstance(value, int):
            return False
        return math.isfinite(value) and (self.low is None or value >= self.low)


@dataclass(frozen=True)
class Text:
    def describe(self) -> str:
        return "a string"

    def fits(self, value: Any) -> bool:
        return isinstance(value, str)


@dataclass(frozen=True)
class Flag:
    def describe(self) -> str:
        return "true or false"

    def fits(self, value: Any) -> bool:
        return isinstance(value, bool)


@dataclass(frozen=True)
class Optional:
    """The field may be missing or null; when present it must fit ``spec``."""

    spec: "Spec"


@dataclass(frozen=True)
class ListOf:
    item: "Spec"
    min_length: int = 0


@dataclass(frozen=True)
class MapOf:
    """An object whose every value fits ``value`` (names are free: algorithms, say)."""

    value: "Spec"
    min_length: int = 0


Spec = Union[Num, Text, Flag, Optional, ListOf, MapOf, dict]

INT = Num(integer=True)
COUNT = Num(low=1, integer=True)
SIZE = Num(low=0, integer=True)
NONNEGATIVE = Num(low=0)


def _type_name(value: Any) -> str:
    return "null" if value is None else {dict: "an object", list: "a list", str: "a string",
                                         bool: "a boolean"}.get(type(value), repr(value)[:40])


def _shown(value: Any) -> str:
    return repr(value)[:40] if isinstance(value, (int, float, str)) and not isinstance(value, bool) \
        else _type_name(value)


def check(value: Any, spec: Spec, source: str, path: str = "result") -> None:
    """Raise one DimdError naming ``source`` and the first field of ``value`` that does not fit ``spec``."""
    def fail(expected: str) -> None:
        raise DimdError(f"{source}: `{path}` must be {expected}, got {_shown(value)}")

    if isinstance(spec, Optional):
        if value is not None:
            check(value, spec.spec, source, path)
    elif isinstance(spec, dict):
        if not isinstance(value, dict):
            fail("an object with " + ", ".join(f"'{k}'" for k, s in spec.items() if not isinstance(s, Optional)))
        for key, field_spec in spec.items():
            if key not in value and not isinstance(field_spec, Optional):
                raise DimdError(f"{source}: `{path}` has no '{key}' (it must be {describe(field_spec)})")
            check(value.get(key), field_spec, source, f"{path}.{key}")
    elif isinstance(spec, ListOf):
        if not isinstance(value, list) or len(value) < spec.min_length:
            fail(f"a list of {describe(spec.item)}" + (f" (at least {spec.min_length})" if spec.min_length else ""))
        for i, item in enumerate(value):
            check(item, spec.item, source, f"{path}[{i}]")
    elif isinstance(spec, MapOf):
        if not isinstance(value, dict) or len(value) < spec.min_length:
            fail("an object of named entries" + (f" (at least {spec.min_length})" if spec.min_length else ""))
        for key, item in value.items():
            check(item, spec.value, source, f"{path}.{key}")
    elif not spec.fits(value):
        fail(spec.describe())


def describe(spec: Spec) -> str:
    if isinstance(spec, Optional):
        return describe(spec.spec) + " or null"
    if isinstance(spec, dict):
        return "an object"
    if isinstance(spec, ListOf):
        return f"a list of {describe(spec.item)}"
    if isinstance(spec, MapOf):
        return "an object of named entries"
    return spec.describe()


# -- the planner's inputs ------------------------------------------------------------------------

#: A ``bench-allreduce`` result, as ``plan-batch comm`` reads it (sizes in bytes, times in µs).
BENCH_RESULT: dict = {
    "world_size": COUNT,
    "gradient_bytes": Optional(SIZE),
    "rows": ListOf({"algorithm": Text(), "bytes": SIZE, "time_us": NONNEGATIVE, "wrong": Optional(SIZE)}),
}
#: The envelope fields of a ``bench-allreduce`` result that the fit reads besides its result.
BENCH_MPI: dict = {"cores": Optional(COUNT), "local_ranks": Optional(COUNT)}
BENCH_PARAMETERS: dict = {"colors": Optional(COUNT), "segment_bytes": Optional(COUNT), "device": Optional(Text())}

#: A ``plan-batch step-time`` result: c, gamma, M_T and the per-batch medians fitted.
STEP_RESULT: dict = {
    "overhead": NONNEGATIVE,
    "gamma": NONNEGATIVE,
    "m_t": Num(low=0),
    "batches": ListOf({"batch": COUNT}, min_length=1),
}

#: A ``plan-batch comm`` result: each algorithm's fitted (a, b, c, s) and the ranks measured.
COMM_PARAMETERS: dict = {"a": NONNEGATIVE, "b": NONNEGATIVE, "c": NONNEGATIVE, "s": NONNEGATIVE}
COMM_RESULT: dict = {
    "algorithms": MapOf({"parameters": COMM_PARAMETERS,
                         "holdout": Optional({"median_abs_error": Optional(NONNEGATIVE)})}, min_length=1),
    "gradient_bytes": COUNT,
    "ranks_measured": ListOf(COUNT, min_length=1),
}

#: A ``plan-batch convergence`` result: N_inf, alpha and the batches that reached the target.
CONVERGENCE_RESULT: dict = {
    "optimizer": Optional(Text()),
    "n_inf": Num(low=0),
    "alpha": NONNEGATIVE,
    "batches": ListOf({"batch": COUNT, "in_fit": Optional(Flag())}, min_length=1),
}
