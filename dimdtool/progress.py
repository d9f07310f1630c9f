"""How the library reports progress without printing: a callback the CLI layer draws (:mod:`dimd.console`)."""

from __future__ import annotations

from typing import Callable

#: ``advance(n)``: ``n`` more items are done (images packed, records checked, images written).
Advance = Callable[[int], None]
