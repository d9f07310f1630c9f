"""The exception types the CLI turns into a one-line message and a non-zero exit code, and how an
exception is named inside such a message."""

from __future__ import annotations

import contextlib
from typing import Iterator


class DimdError(Exception):
    """A user-facing error: bad input, a missing file, a mismatch.

    The message names the file (or setting) and the problem, in one line, so a
    user can act on it without a traceback.
    """

    #: The CLI's exit status for it.
    exit_code = 1


class BadInput(DimdError):
    """A file or value given to a command that it cannot take (a foreign checkpoint, an image that does not
    decode): the CLI exits 2, as for a usage error."""

    exit_code = 2


@contextlib.contextmanager
def bad_input() -> Iterator[None]:
    """Inside it, a :class:`DimdError` is about what the user gave: it leaves as a :class:`BadInput`."""
    try:
        yield
    except BadInput:
        raise
    except DimdError as exc:
        raise BadInput(str(exc)) from None


class ConfigError(DimdError):
    """A configuration value the library refuses; ``field`` names the dataclass field.

    The message speaks of the field, since a library caller has no command
    line; the CLI maps ``field`` back to the option that set it and reports a
    usage error naming the flag (:func:`dimd.options.build_config`).
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


def describe(exc: BaseException) -> str:
    """An exception as the parenthesis of a one-line message: what the OS says for an ``OSError`` (its
    ``strerror``, without the path the message names already), else the first line of its text, else
    its type."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
