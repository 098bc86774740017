"""What the coordinator costs per decision: ``elche sim --cost``.

The simulator drives the real ``Coordinator`` in virtual time; this module
times every ``handle`` call on the real clock, so a run at 3, 64 or 1024
simulated ranks says how many microseconds the coordinator spends

- per batch report (``BatchDone``: book the batch, maybe hand out the next
  chunk, offer the epoch tail's reserve), and
- per averaging round (every call a round is made of: the ranks' ``SyncAck``
  or ``SnapshotReady``, the shell's ``AverageComputed``; the last of them
  re-plans every rank's window), summed over the round.

The time is the coordinator's alone: the simulator's own bookkeeping is
outside the timed calls.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from elche.core import messages as m
from elche.core.checkpoint import CheckpointMeta
from elche.core.commands import Command
from elche.core.config import CoordinatorConfig
from elche.core.coordinator import Coordinator
from elche.core.events import AverageComputed, Event, MessageReceived

__all__ = ["TimedCoordinator"]

_ROUND_MESSAGES = (m.SyncAck, m.SnapshotReady)


class TimedCoordinator(Coordinator):
    """A ``Coordinator`` that keeps the wall time of each ``handle`` by kind."""

    def __init__(self, config: CoordinatorConfig, *, resume: CheckpointMeta | None = None) -> None:
        super().__init__(config, resume=resume)
        self.calls: dict[str, int] = defaultdict(int)
        self.spent_ns: dict[str, int] = defaultdict(int)

    def handle(self, event: Event, now_s: float) -> list[Command]:
        kind = _kind(event)
        started = time.perf_counter_ns()
        try:
            return super().handle(event, now_s)
        finally:
            self.spent_ns[kind] += time.perf_counter_ns() - started
            self.calls[kind] += 1

    def report(self, rounds: int) -> dict[str, Any]:
        """The costs as JSON: headline figures and every kind of call.

        Args:
            rounds: averaging rounds the run completed (the summary's ``syncs``).
        """
        round_ns = sum(ns for kind, ns in self.spent_ns.items() if kind in _round_kinds())
        batches = self.calls.get("BatchDone", 0)
        return {
            "batch_report_us": _us(self.spent_ns.get("BatchDone", 0), batches),
            "round_us": _us(round_ns, rounds),
            "total_s": round(sum(self.spent_ns.values()) / 1e9, 3),
            "calls": {
                kind: {"count": n, "mean_us": _us(self.spent_ns[kind], n)}
                for kind, n in sorted(self.calls.items())
            },
        }


def _kind(event: Event) -> str:
    if isinstance(event, MessageReceived):
        return type(event.message).__name__
    return type(event).__name__


def _round_kinds() -> set[str]:
    return {cls.__name__ for cls in _ROUND_MESSAGES} | {AverageComputed.__name__}


def _us(ns: int, count: int) -> float:
    return round(ns / count / 1000.0, 2) if count else 0.0
