"""Human-readable sizes and times: parse ``64K``/``16M``, format byte counts and seconds."""

from __future__ import annotations

import math
import re

from dimd.errors import DimdError

_SUFFIXES = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
             "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30,
             "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse ``8``, ``64K``, ``1.5M``, ``2GiB`` (binary units) into bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if not match or match.group(2).upper() not in _SUFFIXES:
        raise DimdError(f"invalid size {text!r}: expected a number with an optional K, M, G or T suffix")
    return int(float(match.group(1)) * _SUFFIXES[match.group(2).upper()])


def format_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``; exact bytes below 1 KiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")



def format_seconds(value: float | None) -> str:
    """Seconds with a unit that keeps three significant figures (``-`` for none or not finite)."""
    if value is None or not math.isfinite(value):
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f} s"
    for scale, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(value) >= scale or unit == "us":
            return f"{value / scale:.3g} {unit}"
    raise AssertionError("unreachable")
