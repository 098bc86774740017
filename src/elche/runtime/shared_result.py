"""The run's result on every launched rank: rank 0 publishes it, the others read it.

Under ``elche run`` and ``torchrun`` only rank 0 (which hosts the
coordinator) can build the run's summary and per-epoch metrics, once the
coordinator has finished. Rank 0 serves a ``torch.distributed.TCPStore`` on
a free port (its address travels with the coordinator's over the process
group); every other rank waits there for the result and says it has read
it, and rank 0 keeps the store up until each rank has (at most ``HOLD_S``:
a rank that died reads nothing, and one that comes later gets no summary).
A rank that leaves without the result (its own error) says so at once.

A reader's every call to the store runs on a thread of its own and is
waited for with a bound (``elche.runtime.store_calls``): torch's client
does not keep its timeout when rank 0's host is off the network (a wait
that times out asks the store to cancel it and reads the answer with no
timeout), so a rank that lost rank 0's host for good never ended. A reader
looks for the result every ``_POLL_S`` rather than waiting in one call: a
look unanswered for ``SILENT_S`` says the host is off the network
(``BoardSilent``), and the rank ends then instead of at the end of rank 0's
time to publish (a minute).

Under ``torchrun`` each rank trains in a child of its worker process
(``launched._supervises``); a worker whose child died says so on the board
(``say_exit``), and rank 0, watching (``watch_ranks``), tells its
coordinator, which loses that rank at once rather than when its heartbeats
go stale. The other way, rank 0 posts each rank the run declared lost for
its silence, and that rank's worker, looking (``hung``), kills its hung child.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from elche.runtime.store_calls import GRACE_S, SILENT_S, bounded

__all__ = ["BoardSilent", "ResultBoard"]

_RESULT_KEY = "elche/result"
_GONE_KEY = "elche/gone"
_EXITS_KEY = "elche/exits"  # how many ranks said their process ended
_EXIT_KEY = "elche/exit/"  # + the rank: its process's exit code
_HUNG_KEY = "elche/hung/"  # + the rank: why the run declared it lost for its silence
# How often rank 0 looks for the ranks' exits on the board.
_WATCH_S = 0.2
# How long rank 0 keeps the result up for ranks that have not read it yet. The
# others finish training before rank 0 (it waits for the coordinator), so they
# are waiting when it publishes; a rank that died reads nothing, and a run
# whose launcher is gone must end within the orphan bound (ORPHAN_GRACE_S).
HOLD_S = 2.0
_POLL_S = 0.05
_TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]  # exported at runtime


class BoardSilent(TimeoutError):
    """Rank 0's host answered no look at the result board in ``SILENT_S``."""

    def __init__(self, where: str) -> None:
        super().__init__(f"rank 0's host at {where} did not answer in {SILENT_S:g} s")


class ResultBoard:
    """One run's result board (see the module docstring)."""

    def __init__(self, store: Any) -> None:  # a TCPStore
        self.store = store
        self._watching: tuple[threading.Thread, threading.Event] | None = None
        self._unanswered = False  # a look at ``hung`` went unanswered: no more looks

    @classmethod
    def serve(cls) -> ResultBoard:
        """Rank 0: a board on a free port of every interface (``port`` says which)."""
        store = _TCPStore(
            "0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        return cls(store)

    @classmethod
    def join(cls, host: str, port: int, timeout_s: float) -> ResultBoard:
        """Another rank: the board rank 0 serves at ``host:port``."""
        store = _TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store)

    @property
    def port(self) -> int:
        return int(self.store.port)

    def publish(self, result: dict[str, object], *, readers: int) -> None:
        """Rank 0: put the result up and hold it until ``readers`` ranks read it."""
        self.store.set(_RESULT_KEY, json.dumps(result, default=str))
        deadline = time.monotonic() + HOLD_S
        while self.store.add(_GONE_KEY, 0) < readers and time.monotonic() < deadline:
            time.sleep(_POLL_S)  # polling a counter: the store has no wait-for-count

    def read(self, timeout_s: float) -> dict[str, object] | None:
        """Another rank: the result rank 0 published (None: none came in ``timeout_s``,
        or the board closed without one).

        Raises:
            BoardSilent: rank 0's host did not answer a look at the board in
                ``SILENT_S``: it is off the network, and no result can come.
        """

        def look(call: Callable[[], T]) -> T | None:
            answered, answer = _bounded(call, SILENT_S)
            if not answered:  # (a client stuck in a call takes no other: no leave)
                raise BoardSilent(self.where)
            return answer

        deadline = time.monotonic() + timeout_s
        doc: object = None
        while (there := look(lambda: self.store.check([_RESULT_KEY]))) is False:
            if time.monotonic() > deadline:  # nothing in time
                break
            time.sleep(_POLL_S)  # the store has no wait that a silent host cannot hold
        if there:  # (None: the board closed)
            doc = look(lambda: json.loads(self.store.get(_RESULT_KEY)))
        self.leave()
        return doc if isinstance(doc, dict) else None

    @property
    def where(self) -> str:
        """The board's address, ``HOST:PORT``."""
        return f"{self.store.host}:{self.store.port}"

    def say_exit(self, rank: int, code: int | None) -> None:
        """Another rank's worker: rank ``rank``'s process ended with ``code`` (negative:
        the signal that ended it)."""

        def say() -> None:
            self.store.set(f"{_EXIT_KEY}{rank}", str(code))
            self.store.add(_EXITS_KEY, 1)

        _bounded(say, GRACE_S)  # (rank 0 gone, or its host cut off: nobody to tell)

    def hung(self, rank: int) -> str | None:
        """Another rank's worker: why the run declared ``rank`` lost for its silence, if
        rank 0 posted it (``watch_ranks``). A look unanswered in ``GRACE_S`` (rank 0's
        host cut off) ends the looks: None from then on."""
        key = f"{_HUNG_KEY}{rank}"
        if self._unanswered:
            return None
        answered, why = _bounded(
            lambda: self.store.get(key).decode() if self.store.check([key]) else None, GRACE_S
        )
        self._unanswered = not answered
        return why

    def watch_ranks(
        self,
        ranks: Iterable[int],
        on_exit: Callable[[int, int | None], None],
        silent_losses: Callable[[], list[tuple[int, str]]],
    ) -> None:
        """Rank 0: call ``on_exit(rank, code)`` for each of ``ranks`` whose process ended
        (``say_exit``), and post each rank that ``silent_losses`` gives (the run's new
        declarations, rank and why) for its worker (``hung``), on a thread of its own
        with its own connection to the board, until ``stop_watching``."""
        try:
            watcher = _TCPStore(
                "127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=_WATCH_S * 10)
            )
        except RuntimeError:  # torch's DistNetworkError: the ranks' heartbeats tell instead
            return
        pending = set(ranks)
        stop = threading.Event()

        def watch() -> None:
            seen = 0
            while not stop.wait(_WATCH_S):  # the store has no notification
                try:
                    for rank, why in silent_losses():
                        watcher.set(f"{_HUNG_KEY}{rank}", why)
                    said = watcher.add(_EXITS_KEY, 0)
                    if said == seen or not pending:
                        continue
                    seen = said
                    for rank in sorted(pending):
                        if watcher.check([f"{_EXIT_KEY}{rank}"]):
                            pending.discard(rank)
                            code = watcher.get(f"{_EXIT_KEY}{rank}").decode()
                            on_exit(rank, None if code == "None" else int(code))
                except RuntimeError:  # the board is closed: the run is over
                    return

        thread = threading.Thread(target=watch, name="elche-ranks-board", daemon=True)
        thread.start()
        self._watching = (thread, stop)
        # A daemon thread still inside a store call as the interpreter ends is torn
        # down through torch's C++ frames, which aborts the process (SIGABRT).
        atexit.register(self.stop_watching)

    def stop_watching(self) -> None:
        """Rank 0, the run over: end ``watch_ranks``'s thread (its call in progress
        ends within the watcher's timeout)."""
        if self._watching is not None:
            thread, stop = self._watching
            stop.set()
            thread.join(timeout=_WATCH_S * 10 + 1.0)
            self._watching = None

    def leave(self) -> None:
        """Another rank: this rank reads nothing more (said within ``GRACE_S``, or not:
        rank 0 holds the result only ``HOLD_S`` for it anyway)."""
        _bounded(lambda: self.store.add(_GONE_KEY, 1), GRACE_S)


T = TypeVar("T")


def _bounded(call: Callable[[], T], timeout_s: float) -> tuple[bool, T | None]:
    """``bounded(call, timeout_s)``: whether ``call`` ended in time, and what it
    returned (None when it raised torch's store error, a ``RuntimeError``, or bad JSON)."""
    try:
        return bounded(call, timeout_s)
    except (RuntimeError, ValueError):  # DistStoreError is a RuntimeError
        return True, None
