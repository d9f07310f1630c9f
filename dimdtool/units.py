"""Human-readable sizes: parse ``64K``/``16M`` and format byte counts."""

from __future__ import annotations

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

