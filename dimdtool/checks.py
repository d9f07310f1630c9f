"""Field checks for the frozen config dataclasses: one wording for every range and choice.

Each check reads ``getattr(config, name)`` and raises
:class:`~dimd.errors.ConfigError` naming the field, so a config rejects
nonsense whether it came from the command line or from Python::

    def __post_init__(self) -> None:
        at_least(self, "epochs", 1)
        in_range(self, "momentum", 0.0, 1.0, high_open=True)
        one_of(self, "schedule", SCHEDULES)

A :class:`Rule` is a rule between settings (CUDA graphs need a GPU): the
config refuses an explicit request that breaks it, a run applies it to its
defaults, both in its one wording.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from dimd.errors import ConfigError


def _value(config: Any, name: str) -> Any:
    return getattr(config, name)


def finite(config: Any, name: str) -> None:
    """A float field must not be inf or nan (None passes: it means "automatic")."""
    value = _value(config, name)
    if value is not None and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number (got {value})")


def at_least(config: Any, name: str, low: float, *, optional: bool = False) -> None:
    """``value >= low`` (and finite); ``optional``: None is allowed."""
    value = _value(config, name)
    if value is None and optional:
        return
    finite(config, name)
    if value is None or value < low:
        raise ConfigError(name, f"must be at least {low} (got {value})")


def positive(config: Any, name: str, *, optional: bool = False) -> None:
    """``value > 0`` (and finite); ``optional``: None is allowed."""
    value = _value(config, name)
    if value is None and optional:
        return
    finite(config, name)
    if value is None or not value > 0:
        raise ConfigError(name, f"must be positive (got {value})")


def in_range(config: Any, name: str, low: float, high: float, *, low_open: bool = False,
             high_open: bool = False, optional: bool = False) -> None:
    """``low <= value <= high``, either end open on request."""
    value = _value(config, name)
    if value is None and optional:
        return
    finite(config, name)
    above = value is not None and (value > low if low_open else value >= low)
    below = value is not None and (value < high if high_open else value <= high)
    if not (above and below):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ConfigError(name, f"must be in {interval} (got {value})")


def one_of(config: Any, name: str, choices: Iterable[Any], *, optional: bool = False) -> None:
    value = _value(config, name)
    if value is None and optional:
        return
    allowed = tuple(choices)
    if value not in allowed:
        raise ConfigError(name, f"must be one of {', '.join(map(str, allowed))} (got {value!r})")


def require(ok: bool, name: str, problem: str) -> None:
    """A check no helper above covers (a relation between fields, say)."""
    if not ok:
        raise ConfigError(name, problem)


@dataclass(frozen=True)
class Rule:
    """What one rule says of a run: whether what it governs can be on, why (one clause, for the JSON), and the
    refusal of an explicit request that breaks it: ``problem``, said of the setting ``field``.

    A config refuses what it was explicitly asked for (:meth:`check`); a run applies the rule to its defaults
    (``on``, ``why``) and refuses with :attr:`refusal` what only it can tell (the device ``auto`` found).
    """

    on: bool
    why: str
    field: str
    problem: str

    @property
    def refusal(self) -> str:
        """The one line that refuses an explicit request (the command line shows the field as its flag)."""
        return f"`{self.field}` {self.problem}"

    def check(self) -> None:
        """Refuse, naming the field, an explicit request this rule does not allow."""
        require(self.on, self.field, self.problem)
