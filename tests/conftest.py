"""The suite's process-wide setting (bytecode caches are written) and its order.

With ``PYTHONDONTWRITEBYTECODE`` set (as some CI images set it), every
pytest worker would rewrite and compile all ~100 test modules anew at
collection (about 7 s of CPU each), and every rank process a test starts
would compile elche's modules anew. Caches are written here, for pytest's
workers and the processes the tests start, as they are by default.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each worker's share of the suite opens with its share of the slow tests.

    ``pytest-xdist``'s ``worksteal`` hands each worker a contiguous part of the
    list and lets an idle worker take from the end of another's: in collection
    order the real-process tests (``tests/promises`` and others) came last, so
    the suite ended with both workers in its longest tests. Opening each part
    with slow tests leaves the short ones to fill the end.
    """
    parts = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in xdist's workers
    slow = [item for item in items if item.get_closest_marker("slow")]
    fast = [item for item in items if not item.get_closest_marker("slow")]
    share = len(fast) // parts
    ordered: list[pytest.Item] = []
    for part in range(parts):
        end = len(fast) if part == parts - 1 else (part + 1) * share
        ordered += slow[part::parts] + fast[part * share : end]
    items[:] = ordered
