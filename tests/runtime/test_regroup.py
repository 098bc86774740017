"""``Worker._regroup`` when the group store's host goes silent as the survivors gather.

The store lives in the coordinator's process: a store that answers nothing
means the coordinator's host is off the network, which the rank's control
connection finds out within ``coordinator_timeout_s`` (``CoordinatorLost``),
and the rank then keeps its state and stops. These tests call the method on
a stand-in whose parts play the membership, the protocol and the bridge.
"""

from __future__ import annotations

import functools
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest

from elche.core import rank as r
from elche.core.config import Backend
from elche.runtime import groups
from elche.runtime.bridge import CoordinatorLost
from elche.runtime.worker import Worker


class _Silent:
    """A membership whose gathering ends on a store that answers nothing."""

    store_lost = False

    def leave(self) -> None:
        pass

    def form(self, generation: int, members: list[int], **_: Any) -> bool:
        raise groups.StoreUnanswered("h0:29500", 10.0)


def stand_in(news_after: int | None, timeout_s: float = 30.0) -> SimpleNamespace:
    """A rank re-forming generation 2 of [0, 1]; its bridge tells it the coordinator is lost
    after ``news_after`` looks (None: never)."""
    order = r.FormGroup(generation=2, members=(0, 1))
    state = SimpleNamespace(action=order, looks=0)

    def get(wait_s: float | None) -> CoordinatorLost | None:
        state.looks += 1
        if news_after is not None and state.looks == news_after:
            return CoordinatorLost(reason="no word from the coordinator for 30 s")
        return None

    def handle(item: object) -> None:  # as rank_saves.coordinator_lost ends the rank
        assert isinstance(item, CoordinatorLost)
        state.action = r.Done(reason="coordinator lost")

    worker = SimpleNamespace(
        mode=SimpleNamespace(backend=Backend.COLLECTIVE),
        membership=_Silent(),
        proto=SimpleNamespace(next_action=lambda: state.action),
        bridge=SimpleNamespace(get=get),
        spec=SimpleNamespace(rank=1, coordinator_timeout_s=timeout_s),
        _handle=handle,
        _after_round=deque(),
        state=state,
    )
    worker._drain = functools.partial(Worker._drain, worker)
    worker._superseded = functools.partial(Worker._superseded, worker)
    return worker


def test_a_silent_store_is_followed_by_the_news_that_the_coordinator_is_lost() -> None:
    # The gathering's calls to the store end after 10 s, sooner than the control
    # connection's 10-30 s: the rank failed on the store's silence (its state not
    # kept) instead of following its lost coordinator.
    worker = stand_in(news_after=5)
    assert Worker._regroup(worker, 2, [0, 1]) is False  # type: ignore[arg-type]
    assert worker.state.action == r.Done(reason="coordinator lost")


def test_a_silent_store_with_no_news_in_the_coordinators_time_fails_the_rank() -> None:
    worker = stand_in(news_after=None, timeout_s=0.3)
    with pytest.raises(groups.StoreUnanswered):
        Worker._regroup(worker, 2, [0, 1])  # type: ignore[arg-type]
    assert worker.state.looks > 1  # it waited for news first
