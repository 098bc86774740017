"""``Bridge.wake``: a rank waiting for its launched round takes messages and is
woken the moment the round completes (the collective's thread calls it)."""

from __future__ import annotations

import queue
import threading

from elche.core import messages as m
from elche.runtime.bridge import Bridge


def _inbox_only() -> Bridge:
    """The bridge's inbox without its socket and IO thread (``get`` and ``wake`` use no more)."""
    bridge = Bridge.__new__(Bridge)
    bridge.inbox = queue.Queue()
    return bridge


def test_a_wake_from_another_thread_ends_a_long_wait_with_nothing() -> None:
    bridge = _inbox_only()
    threading.Thread(target=bridge.wake).start()
    assert bridge.get(None) is None  # (without the wake: blocked for good)


def test_a_stale_wake_hides_no_message_behind_it() -> None:
    bridge = _inbox_only()
    bridge.wake()
    item = (m.Regroup(generation=1, members=[0, 1]), [])
    bridge.inbox.put(item)
    assert bridge.get(0.0) == item
    assert bridge.get(0.0) is None
