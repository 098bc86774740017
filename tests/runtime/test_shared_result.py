"""The result board's reports of rank exits (``elche.runtime.shared_result``).

Under torchrun a worker whose rank's process died says so on the board, and
rank 0 tells its coordinator; before, the coordinator learned it only when
the rank's heartbeats went stale, every other rank waiting for it.
"""

from __future__ import annotations

import queue

from elche.runtime.shared_result import ResultBoard


def test_rank_0_hears_each_ranks_exit_once_with_its_code() -> None:
    board = ResultBoard.serve()
    heard: queue.Queue[tuple[int, int | None]] = queue.Queue()
    board.watch_exits(range(1, 4), lambda rank, code: heard.put((rank, code)))
    worker = ResultBoard.join("127.0.0.1", board.port, timeout_s=10.0)
    worker.say_exit(2, -9)  # SIGKILLed
    worker.say_exit(3, None)  # (no exit code known)
    got = {heard.get(timeout=30), heard.get(timeout=30)}
    assert got == {(2, -9), (3, None)}
    worker.say_exit(1, 1)
    assert heard.get(timeout=30) == (1, 1)
    assert heard.empty()
