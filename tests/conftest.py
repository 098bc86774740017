"""The suite's process-wide settings (bytecode caches, temporary files) and its order.

With ``PYTHONDONTWRITEBYTECODE`` set (as some CI images set it), every
pytest worker would rewrite and compile all ~100 test modules anew at
collection (about 7 s of CPU each), and every rank process a test starts
would compile elche's modules anew. Caches are written here, for pytest's
workers and the processes the tests start, as they are by default.

A run given no directory keeps its record in a fresh ``elche-run-*`` under
the temporary directory, as a user's run does (``elche.api``); the suite makes
about two hundred. Its processes' temporary directory is one under pytest's
own base (``TMPDIR``), which pytest prunes as it prunes its other runs' files,
instead of ``/tmp`` itself.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

HOSTS = "tests/hosts/"  # the several-hosts tests (``pytest_collection_modifyitems``)

sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


@pytest.hookimpl(trylast=True)  # after pytest's tmp_path plugin set up its factory
def pytest_configure(config: pytest.Config) -> None:
    """The controller's ``TMPDIR``, inherited by its workers and every process they start."""
    if hasattr(config, "workerinput"):  # an xdist worker: its controller set it
        return
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None:  # pytest run with -p no:tmpdir
        return
    scratch = factory.getbasetemp() / "tmp"
    scratch.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(scratch)
    tempfile.tempdir = None  # computed again from TMPDIR


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each worker's share of the suite opens with its share of the slow tests.

    ``pytest-xdist``'s ``worksteal`` hands each worker a contiguous part of the
    list and lets an idle worker take from the end of another's: in collection
    order the real-process tests (``tests/promises`` and others) came last, so
    the suite ended with both workers in its longest tests. Opening each part
    with slow tests leaves the short ones to fill the end.

    The several-hosts tests (``HOSTS``) are the longest, 10-110 s each, and
    spend most of it waiting on the network's timeouts: they open the slow
    tests, so that each part starts with its share of them; at the end of a
    part they would be the suite's tail. (All of them in one part, one after
    another, left that part's other slow tests behind them: 638 s in all.)
    """
    parts = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in xdist's workers
    hosts = [item for item in items if item.nodeid.startswith(HOSTS)]
    rest = [item for item in items if not item.nodeid.startswith(HOSTS)]
    slow = hosts + [item for item in rest if item.get_closest_marker("slow")]
    fast = [item for item in rest if not item.get_closest_marker("slow")]
    share = len(fast) // parts
    ordered: list[pytest.Item] = []
    for part in range(parts):
        end = len(fast) if part == parts - 1 else (part + 1) * share
        ordered += slow[part::parts] + fast[part * share : end]
    items[:] = ordered
