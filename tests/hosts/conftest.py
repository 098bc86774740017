"""Tests on several hosts built as network namespaces (``elche.testing.hosts``).

Every test here is marked ``hosts`` and skips, with the reason, where a rig
cannot be built. Stale rigs of crashed runs are swept once per session.
"""

from __future__ import annotations

import pytest

from elche.testing.hosts import missing, sweep_stale


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = missing()
    for item in items:
        if "tests/hosts/" not in item.nodeid:
            continue
        item.add_marker(pytest.mark.hosts)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"no host rig: {reason}"))


@pytest.fixture(scope="session", autouse=True)
def _sweep() -> None:
    sweep_stale()
