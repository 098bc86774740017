"""Save and shutdown: how a run that cannot go on stops without losing work.

Rules:

- The run cannot go on once ``max_failures`` ranks have died, when no rank
  is left, or when fewer ranks are live than the backend needs
  (``min_live_ranks``: a collective group needs two). The coordinator also
  stops this way when an averaging round stalls, and when it is asked to
  stop (``StopRequested``: ``SaveReason.GRACEFUL_SHUTDOWN``).
- Every survivor is told ``ShutdownWithSave``; the lowest live rank writes
  the canonical model. Its unaveraged steps are in that model, so once it
  confirms the save they count as covered.
- The save is over when every survivor has answered ``StateSaved`` or died,
  or when one heartbeat timeout has passed since it began. Only then is the
  meta sidecar written, so it never claims more than was saved.

Theory of operation: the coordinator moves to ``RunState.SAVING`` and calls
``begin``; it feeds each answer (``answered``) and each death (``lost``) and
asks ``overdue`` on every timer; once ``done``, it writes the meta for
``reason`` and finishes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from elche.core import messages as m
from elche.core.checkpoint import SaveReason
from elche.core.commands import Broadcast, Command, Notice
from elche.core.config import CoordinatorConfig

__all__ = ["SaveAndShutdown"]


class SaveAndShutdown:
    """Who still owes a save, who writes the model, and until when to wait.

    Args:
        config: the run's configuration (failure threshold, backend floor,
            heartbeat timeout).
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.cause: SaveReason | None = None
        self.writer: int | None = None  # the rank that writes the canonical model
        self.awaiting: set[int] = set()
        self.deadline_s = math.inf

    @property
    def reason(self) -> SaveReason:
        """Why the run stopped (a graceful shutdown unless a failure said)."""
        return self.cause or SaveReason.GRACEFUL_SHUTDOWN

    @property
    def done(self) -> bool:
        """Every survivor answered (or died)."""
        return not self.awaiting

    def reason_to_stop(self, num_dead: int, num_live: int) -> SaveReason | None:
        """Why the run cannot go on after a death, or None if it can."""
        limit = self.config.max_failures
        if limit is not None and num_dead >= limit:
            return SaveReason.MAX_FAILURE_EXCEEDED
        if num_live == 0:
            return SaveReason.ALL_RANKS_LOST
        if num_live < self.config.min_live_ranks:
            return SaveReason.SINGLE_SURVIVOR
        return None

    def begin(self, reason: SaveReason, live: Sequence[int], now_s: float) -> list[Command]:
        """Ask the ``live`` ranks to save and stop; returns the orders."""
        self.cause = reason
        if reason is SaveReason.GRACEFUL_SHUTDOWN:  # asked to stop: the launcher tells the user
            out: list[Command] = [Notice(level="info", text="stopping on request; saving state")]
        else:
            text = f"run cannot continue ({reason.value}); saving state and stopping"
            out = [Notice(level="error", text=text)]
        if not live:
            return out
        self.writer = min(live)
        order = m.ShutdownWithSave(reason=reason.value, writer=self.writer)
        out.append(Broadcast(ranks=tuple(live), message=order))
        self.awaiting = set(live)
        self.deadline_s = now_s + self.config.heartbeat_timeout_s
        return out

    def answered(self, rank: int, error: str | None) -> list[Command]:
        """``rank`` answered ``StateSaved``; returns a notice if its save failed."""
        self.awaiting.discard(rank)
        if error is None:
            return []
        return [Notice(level="error", text=f"rank {rank} could not save its state: {error}")]

    def lost(self, rank: int) -> None:
        """``rank`` died while saving: nobody waits for it any more."""
        self.awaiting.discard(rank)

    def overdue(self, now_s: float) -> Notice | None:
        """The notice to log if the save deadline has passed, else None."""
        if now_s < self.deadline_s:
            return None
        return Notice(level="error", text=f"ranks {sorted(self.awaiting)} never confirmed a save")
