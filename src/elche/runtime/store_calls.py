"""Calls to torch's TCPStore client that end, whatever the network does.

torch's client does not keep its timeout when the store's host drops off
the network silently (power lost, a cable pulled: no reset, packets
vanish): a call that waits for an answer waits until TCP gives the
connection up, a quarter of an hour later. (Tried across namespace hosts
with a 5 s timeout: ``add``, ``check``, ``get``, ``compare_set`` and
``wait`` still waited after 40 s; ``set``, which reads no answer,
returned.) So a call that must end runs on a thread of its own and is
waited for with a bound (``bounded``); one that does not end in time is
left to its thread, and its client with it: a client stuck in a call
takes no other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import TypeVar

__all__ = ["GRACE_S", "SILENT_S", "bounded"]

# How long past its own timeout a call to the store may take before the caller
# gives up on it (torch's own error, had it kept its timeout, comes first).
GRACE_S = 5.0
# A call the store's side answers without waiting (``set``, ``check``, ``add``,
# ``compare_set``, ``get`` of a key that is there) takes milliseconds while the
# store's host is on the network: its server answers on a thread of its own,
# however busy its process is. One unanswered this long says the host is off it.
SILENT_S = 10.0

T = TypeVar("T")


def bounded(call: Callable[[], T], timeout_s: float) -> tuple[bool, T | None]:
    """``call()`` on a thread: whether it ended within ``timeout_s`` (else the thread
    is left to it), and what it returned. What it raised is raised here, in the
    caller's thread."""
    done: Future[T] = Future()

    def attempt() -> None:
        try:
            done.set_result(call())
        except BaseException as exc:  # raised by ``result``, in the caller's thread
            done.set_exception(exc)

    threading.Thread(target=attempt, name="elche-store-call", daemon=True).start()
    if not wait([done], timeout=timeout_s).done:
        return False, None
    return True, done.result()
