"""The states of a run and of each of its ranks, as the coordinator keeps them.

``RankState``: a join slot no rank took yet (``VACANT``), a rank that has not
said ``Hello`` (``JOINING``), one that trains (``LIVE``), and one the run goes
on without (``DEAD``: lost; ``ERRORED``: evicted for a protocol error).
``RunState``: forming, training, finishing (the last callbacks), saving (a
save-and-shutdown), closing (the final model on its way to disk), done.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

__all__ = ["RankState", "RankStates", "RunState"]


class RankState(enum.Enum):
    VACANT = "vacant"  # a join slot no rank took yet
    JOINING = "joining"
    LIVE = "live"
    DEAD = "dead"
    ERRORED = "errored"


class RunState(enum.Enum):
    FORMING = "forming"
    TRAINING = "training"
    FINISHING = "finishing"  # all epochs done; waiting for final callbacks
    SAVING = "saving"  # save-and-shutdown broadcast; waiting for StateSaved
    CLOSING = "closing"  # training over; waiting for the final model on disk
    DONE = "done"


class RankStates:
    """Each rank's state, indexed by rank; knows its live ranks without a scan.

    The live list is rebuilt only after a state changes: at a thousand ranks
    the coordinator asks for it on every batch report.
    """

    def __init__(self, world_size: int, slots: int = 0) -> None:
        self._states = [RankState.JOINING] * world_size + [RankState.VACANT] * slots
        self._live: list[int] | None = None

    def __getitem__(self, rank: int) -> RankState:
        return self._states[rank]

    def __setitem__(self, rank: int, state: RankState) -> None:
        self._states[rank] = state
        self._live = None

    def __iter__(self) -> Iterator[RankState]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def live(self) -> list[int]:
        """Live ranks in ascending order (a fresh list: callers may keep it)."""
        if self._live is None:
            self._live = [r for r, s in enumerate(self._states) if s is RankState.LIVE]
        return list(self._live)
