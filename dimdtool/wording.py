"""How a library line names a setting: by its config field (`stall_timeout`), or by the running command's flag.

A library caller sets fields, so the library's messages name them in
backquotes. Under the command line the same setting is a flag
(``--stall-timeout``): the command layer passes its flags in
(:func:`flags_named`) for as long as the command runs, and a line the
library prints itself, from a thread the command's context cannot reach
(:func:`dimd.stall.end_job`), names the flag. Nothing here imports click.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator, Mapping

#: A config field mentioned in a message: `name`.
FIELD_MENTION = re.compile(r"`([a-z][a-z0-9_]*)`")

#: The running command's flag for each config field; empty for a library caller.
_flags: Mapping[str, str] = {}


def name_settings(message: str, flags: Mapping[str, str] | None = None) -> str:
    """``message`` with each `field` it mentions replaced by its flag in ``flags`` (default: the running
    command's, see :func:`flags_named`); a field without a flag stays as it is."""
    named = _flags if flags is None else flags
    return FIELD_MENTION.sub(lambda m: named.get(m.group(1), m.group(0)), message)


@contextlib.contextmanager
def flags_named(flags: Mapping[str, str]) -> Iterator[None]:
    """While a command runs: the library's own lines name its ``flags`` instead of the config fields."""
    global _flags
    before, _flags = _flags, dict(flags)
    try:
        yield
    finally:
        _flags = before
