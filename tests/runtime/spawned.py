"""Real gloo ranks for the runtime's tests: spawned processes, one budget for all."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable


def run_spawned(
    target: Callable[..., None], ranks: list[tuple[object, ...]], budget_s: float
) -> None:
    """Run ``target(*args)`` in one spawned process per entry of ``ranks``; wait up
    to ``budget_s`` for all, kill what is left, and require every one to exit 0."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args) for args in ranks]
    for p in procs:
        p.start()
    deadline = time.monotonic() + budget_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0] * len(procs)
