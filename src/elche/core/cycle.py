"""One averaging round, from trigger to the last acknowledgement.

Rules:

- At most one round is in flight. It opens with the live ranks as members.
- Collective backend: ``SyncNow`` goes to the members; each answers
  ``SyncAck`` after the all-reduce. A collective completes for all members
  or for none, so the first ack proves it completed.
- Coordinator backend: ``RequestParams`` goes to the members; each uploads a
  snapshot and says ``SnapshotReady``. Once every live member has, the shell
  averages (``AverageSnapshots`` -> ``AverageComputed``), ``Update`` goes out,
  and each member answers ``SyncAck``.
- A member that dies leaves the round. A collective round it leaves before
  any ack was seen is abandoned: the group re-forms and the gate fires again.
- The round closes when every live member has acked.

Theory of operation: ``RoundPhase`` below is the round's state (named apart
from the balancer's lifecycle ``Phase``); the coordinator moves it and asks
``ready_to_average``/``complete`` what to do next.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Round", "RoundPhase"]


class RoundPhase(enum.Enum):
    """Where the averaging round stands; ``IDLE`` between rounds."""

    IDLE = "idle"
    COLLECTING = "collecting"  # waiting for acks (collective) or snapshots (coordinator)
    AVERAGING = "averaging"  # coordinator backend: the shell is averaging
    APPLYING = "applying"  # coordinator backend: Update sent, waiting for acks


@dataclass(slots=True)
class Round:
    """State of the current (or last) averaging round."""

    number: int = 0
    phase: RoundPhase = RoundPhase.IDLE
    started_s: float = 0.0
    members: set[int] = field(default_factory=set)
    snapshot_steps: dict[int, int] = field(default_factory=dict)
    acks: dict[int, int] = field(default_factory=dict)
    divergence: dict[int, float] = field(default_factory=dict)
    pre_norms: dict[int, float] = field(default_factory=dict)
    post_norm: float | None = None

    @property
    def in_flight(self) -> bool:
        return self.phase is not RoundPhase.IDLE

    def open(self, members: set[int], now_s: float) -> int:
        """Start round ``number + 1`` with ``members``; returns its number."""
        self.number += 1
        self.phase = RoundPhase.COLLECTING
        self.started_s = now_s
        self.members = set(members)
        self.snapshot_steps.clear()
        self.acks.clear()
        self.divergence.clear()
        self.pre_norms.clear()
        self.post_norm = None
        return self.number

    def close(self) -> None:
        self.phase = RoundPhase.IDLE

    def record_snapshot(self, rank: int, steps: int) -> None:
        """Coordinator backend: ``rank`` uploaded a snapshot of ``steps`` steps."""
        self.snapshot_steps[rank] = steps

    def begin_averaging(self) -> None:
        """Coordinator backend: the shell is averaging the snapshots."""
        self.phase = RoundPhase.AVERAGING

    def begin_applying(self) -> None:
        """Coordinator backend: the average is out (``Update``); acks follow."""
        self.phase = RoundPhase.APPLYING

    def leave(self, rank: int) -> int:
        """``rank`` died: it leaves the round; returns its steps that still count.

        A snapshot the shell is already averaging is in the consensus, so its
        steps count. A snapshot uploaded to a round that has not started
        averaging is dropped instead: the round may never complete, and its
        samples go back to the pool with the rest.
        """
        if not self.in_flight or rank not in self.members:
            return 0
        held = 0
        if self.phase is RoundPhase.AVERAGING:
            held = self.snapshot_steps.get(rank, 0)
        elif self.phase is RoundPhase.COLLECTING:
            self.snapshot_steps.pop(rank, None)
        self.members.discard(rank)
        return held

    def record_ack(
        self,
        rank: int,
        steps: int,
        divergence: float | None,
        pre_norm: float | None,
        post_norm: float | None,
    ) -> None:
        self.acks[rank] = steps
        if divergence is not None:
            self.divergence[rank] = divergence
        if pre_norm is not None:
            self.pre_norms[rank] = pre_norm
        if post_norm is not None and self.post_norm is None:
            self.post_norm = post_norm

    def ready_to_average(self, live: set[int]) -> bool:
        """Coordinator backend: every live member uploaded its snapshot."""
        return self.phase is RoundPhase.COLLECTING and all(
            r in self.snapshot_steps for r in self.members & live
        )

    def complete(self, live: set[int]) -> bool:
        """Every live member acknowledged the round."""
        waiting = self.phase is RoundPhase.COLLECTING or self.phase is RoundPhase.APPLYING
        return waiting and all(r in self.acks for r in self.members & live)
