"""Terminal output for the CLI: rich on a terminal, plain lines under a batch scheduler.

Only the CLI layer imports this module; the library reports progress through
plain callbacks (``advance(n)``) and never prints.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable, Iterator, Sequence, TextIO, TypeVar

from dimd.progress import Advance


def is_terminal(stream: TextIO = sys.stderr) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


def stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _ignore(n: int = 1) -> None:
    """``advance`` when progress is off."""


@contextlib.contextmanager
def progress(total: int | None, description: str, *, unit: str = "items", enabled: bool = True,
             interval: float = 10.0, stream: TextIO | None = None,
             status: Callable[[], str] | None = None) -> Iterator[Advance]:
    """Yield ``advance(n)``: a rich bar with rate on a terminal, else a line every ``interval`` s.

    ``status()``, if given, is shown after the count (e.g. the archives read so far).
    """
    stream = stream or sys.stderr
    if not enabled:
        yield _ignore
        return
    if is_terminal(stream):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[status]}"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                   TimeRemainingColumn()]
        with Progress(*columns, console=stderr_console(), transient=False) as bar:
            task = bar.add_task(description, total=total, rate="", status=status() if status else "")
            start = time.perf_counter()
            done = 0

            def advance(n: int = 1) -> None:
                nonlocal done
                done += n
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.update(task, advance=n, rate=f"{format_rate(done / elapsed)} {unit}/s",
                           status=status() if status else "")

            yield advance
        return
    yield from _plain_progress(total, description, unit, interval, stream, status)


_Bar = TypeVar("_Bar", bound="LateProgress")


class LateProgress:
    """A progress bar that starts once its total is known (a source listed, a run planned): ``advance(n)``
    before :meth:`start` does nothing. A context: the bar ends with it."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._bar = contextlib.ExitStack()
        self._advance: Advance = _ignore

    def __enter__(self: _Bar) -> _Bar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bar.__exit__(*exc)   # an error ends the bar without its closing line

    def start(self, total: int | None, description: str, *, unit: str = "items",
              status: Callable[[], str] | None = None) -> None:
        """Show the bar (:func:`progress`'s, with its arguments) from now on."""
        self._advance = self._bar.enter_context(progress(total, description, unit=unit, enabled=self.enabled,
                                                         status=status))

    def advance(self, n: int = 1) -> None:
        self._advance(n)


def format_rate(rate: float) -> str:
    """A rate with the digits that matter: ``1,234``, ``12``, ``0.42`` (never ``0`` for a slow one)."""
    return f"{rate:,.0f}" if rate >= 10 or rate == 0 else f"{rate:.2g}"


def write_line(stream: TextIO, text: str) -> None:
    """``text`` and its newline in one write: under a launcher that forwards stdout and stderr
    separately, a line written in two pieces can be split by the other stream's next line."""
    stream.write(text + "\n")
    stream.flush()


def _plain_progress(total: int | None, description: str, unit: str, interval: float,
                    stream: TextIO, status: Callable[[], str] | None = None) -> Iterator[Advance]:
    start = last = time.perf_counter()
    done = 0

    def line() -> str:
        elapsed = max(time.perf_counter() - start, 1e-9)
        rate = done / elapsed
        extra = f" {status()}," if status else ""
        if total:
            eta = (total - done) / rate if rate > 0 else float("inf")
            return (f"{description}: {done}/{total} {unit} ({100 * done / total:.0f}%),{extra} "
                    f"{format_rate(rate)} {unit}/s, {elapsed:.0f}s elapsed, eta {eta:.0f}s")
        return f"{description}: {done} {unit},{extra} {format_rate(rate)} {unit}/s, {elapsed:.0f}s elapsed"

    def advance(n: int = 1) -> None:
        nonlocal done, last
        done += n
        now = time.perf_counter()
        if now - last >= interval:
            last = now
            write_line(stream, line())

    yield advance
    write_line(stream, line())


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 0) -> None:
    """A rich table on stdout (plain columns when stdout is not a terminal: logs, batch jobs);
    the first ``left`` columns hold names and are left-justified, the others numbers."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=200, color_system=None)
    table = Table(title=title, title_justify="left", box=None, pad_edge=False)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i < left else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    console.print(table)
