"""The result board (``elche.runtime.shared_result``): the run's result, rank exits, hung ranks.

Under torchrun a worker whose rank's process died says so on the board, and
rank 0 tells its coordinator; before, the coordinator learned it only when
the rank's heartbeats went stale, every other rank waiting for it.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from elche.runtime import shared_result
from elche.runtime.shared_result import BoardSilent, ResultBoard


def test_rank_0_hears_each_ranks_exit_once_with_its_code() -> None:
    board = ResultBoard.serve()
    heard: queue.Queue[tuple[int, int | None]] = queue.Queue()
    board.watch_ranks(range(1, 4), lambda rank, code: heard.put((rank, code)), list)
    worker = ResultBoard.join("127.0.0.1", board.port, timeout_s=10.0)
    worker.say_exit(2, -9)  # SIGKILLed
    worker.say_exit(3, None)  # (no exit code known)
    got = {heard.get(timeout=30), heard.get(timeout=30)}
    assert got == {(2, -9), (3, None)}
    worker.say_exit(1, 1)
    assert heard.get(timeout=30) == (1, 1)
    assert heard.empty()


def test_a_reader_gets_the_result_rank_0_publishes_while_it_waits() -> None:
    board = ResultBoard.serve()
    reader = ResultBoard.join("127.0.0.1", board.port, timeout_s=10.0)
    published = threading.Thread(target=board.publish, args=({"summary": {"x": 1}},),
                                 kwargs={"readers": 1})  # fmt: skip
    published.start()
    assert reader.read(timeout_s=30.0) == {"summary": {"x": 1}}
    published.join()


def test_a_reader_gives_up_when_none_comes_in_its_time() -> None:
    board = ResultBoard.serve()
    reader = ResultBoard.join("127.0.0.1", board.port, timeout_s=10.0)
    assert reader.read(timeout_s=0.2) is None


class _SilentStore:
    """A store client whose host dropped off the network: its calls never end."""

    host, port = "h0", 29500

    def __init__(self) -> None:
        self.released = threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.released.wait()
        return False


def test_a_reader_whose_rank_0s_host_is_silent_stops_waiting_saying_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It used to wait out rank 0's whole time to publish (a minute and more) in
    # one call, though no result could come.
    monkeypatch.setattr(shared_result, "SILENT_S", 0.2)
    store = _SilentStore()
    try:
        with pytest.raises(
            BoardSilent, match=r"^rank 0's host at h0:29500 did not answer in 0.2 s$"
        ):
            ResultBoard(store).read(timeout_s=600.0)
    finally:
        store.released.set()


def test_a_worker_hears_that_its_rank_hung_once_rank_0_posts_it() -> None:
    # Under torchrun a worker waited for its hung rank's process for good; rank 0 now
    # posts each rank the run declared lost for its silence, as the run declares it.
    board = ResultBoard.serve()
    declared: queue.Queue[tuple[int, str]] = queue.Queue()

    def silent_losses() -> list[tuple[int, str]]:  # the run's new declarations
        try:
            return [declared.get_nowait()]
        except queue.Empty:
            return []

    board.watch_ranks(range(1, 3), lambda rank, code: None, silent_losses)
    worker = ResultBoard.join("127.0.0.1", board.port, timeout_s=10.0)
    assert worker.hung(2) is None
    declared.put((2, "heartbeat stale: silent for 3.1 s"))
    deadline = time.monotonic() + 30.0
    while (said := worker.hung(2)) is None:
        assert time.monotonic() < deadline, "never posted"
        time.sleep(0.05)  # polling for a condition, with a deadline
    assert said == "heartbeat stale: silent for 3.1 s"
    assert worker.hung(1) is None
    board.stop_watching()


def test_a_worker_whose_look_is_unanswered_looks_no_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each look runs on a thread of its own: one per look at a host cut off would pile up.
    monkeypatch.setattr(shared_result, "GRACE_S", 0.2)
    store = _SilentStore()
    board = ResultBoard(store)
    try:
        assert board.hung(1) is None
        calls = threading.active_count()
        assert board.hung(1) is None  # at once, no thread more
        assert threading.active_count() == calls
    finally:
        store.released.set()
