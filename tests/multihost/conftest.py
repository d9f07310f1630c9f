"""Jobs across two hosts, h1 and h2: network namespaces made by tests/multihost/run.sh (root).

``run.sh`` makes the hosts, runs these tests with ``MULTIHOST_PREFIX`` set and
removes the hosts on every way out; without it the tests here are skipped.
Every job starts on h1 (its launcher too) and reaches h2 through ``on-host``,
the launchers' stand-in for ssh, so no traffic leaves the two namespaces
(``multihost.py`` starts them).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MULTIHOST_PREFIX"):
        return
    skip = pytest.mark.skip(reason="needs the namespace hosts: run tests/multihost/run.sh as root")
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)
