"""One averaging round, from trigger to the last acknowledgement.

Rules:

- At most one round is in flight. It opens with the live ranks as members.
- Collective backend: ``SyncNow`` goes to the members; each answers
  ``SyncAck`` after the all-reduce. A collective completes for all members
  or for none, so the first ack proves it completed, and the steps it
  reports are committed at once.
- Coordinator backend: ``RequestParams`` goes to the members; each uploads a
  snapshot and says ``SnapshotReady``. Once every live member has, the shell
  averages (``AverageSnapshots`` -> ``AverageComputed``), the snapshots'
  steps are committed, ``Update`` goes out, and each member answers
  ``SyncAck``. The last average of the run is loaded as is, not blended:
  the final model is the consensus.
- An ack for another round, from a non-member, repeated or for a round
  closed before it came (a stalled round), and a snapshot outside
  ``COLLECTING``, are stale: ignored (the coordinator counts them).
  An ack before the update, a snapshot in a collective mode or one claiming
  more steps than the rank made are protocol errors.
- A member that dies leaves the round. Its snapshot counts if the shell is
  already averaging it; uploaded earlier, it is dropped with the rest of the
  rank's work (the round may never complete). A collective round it leaves
  before any ack was seen is abandoned: the group re-forms and the gate
  fires again.
- The round closes when every live member has acked.

Theory of operation: ``RoundPhase`` below is the round's state (named apart
from the balancer's lifecycle ``Phase``). ``Round`` moves it on each message
and returns the commands the protocol sends; the coordinator decides when a
round starts and, once ``complete`` says so, closes it.
"""

from __future__ import annotations

import enum

from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.commands import AverageSnapshots, Broadcast, Command, Emit, Send
from elche.core.config import Backend, CoordinatorConfig
from elche.core.errors import LocalProtocolError, RemoteProtocolError
from elche.core.work import WorkBook

__all__ = ["Round", "RoundPhase"]


class RoundPhase(enum.Enum):
    """Where the averaging round stands; ``IDLE`` between rounds."""

    IDLE = "idle"
    COLLECTING = "collecting"  # waiting for acks (collective) or snapshots (coordinator)
    AVERAGING = "averaging"  # coordinator backend: the shell is averaging
    APPLYING = "applying"  # coordinator backend: Update sent, waiting for acks


class Round:
    """State of the current (or last) averaging round, and its protocol.

    Args:
        config: the run's configuration (backend, averaging weights, blend).
        work: the work book a completed average commits batches to.
        number: rounds completed before (a resumed run continues the count).
    """

    def __init__(self, config: CoordinatorConfig, work: WorkBook, *, number: int = 0) -> None:
        self.config = config
        self.work = work
        self.number = number
        self.phase = RoundPhase.IDLE
        self.started_s = 0.0
        # The latest moment an acknowledged member was held by the round: its
        # ack's arrival less what it trained through (``SyncAck.through_ms``).
        self.held_until_s = 0.0
        self.members: set[int] = set()
        self.snapshot_steps: dict[int, int] = {}
        self.acks: dict[int, int] = {}
        self.failed: set[int] = set()  # members whose collective broke (``SyncAck.failed``)
        self.divergence: dict[int, float] = {}
        self.pre_norms: dict[int, float] = {}
        self.post_norm: float | None = None
        # The last round abandoned at a death: its number, and the members that
        # had not answered (one may have landed the average before it heard).
        self.abandoned: tuple[int, set[int]] | None = None

    @property
    def in_flight(self) -> bool:
        return self.phase is not RoundPhase.IDLE

    def start(self, members: set[int], now_s: float, generation: int) -> list[Command]:
        """Open round ``number + 1`` with ``members``; returns its trigger.

        Args:
            members: the live ranks.
            now_s: the coordinator's clock (the round's start).
            generation: the collective group the members are in.
        """
        number = self._open(members, now_s)
        ranks = tuple(sorted(members))
        trigger: m.CoordMessage = m.RequestParams(round=number)
        if self.config.backend is Backend.COLLECTIVE:
            trigger = m.SyncNow(round=number, generation=generation)
        return [
            Emit(event=tl.SyncStart(round=number)),
            Broadcast(ranks=ranks, message=trigger),
        ]

    def close(self) -> None:
        self.phase = RoundPhase.IDLE

    def on_ack(self, rank: int, msg: m.SyncAck, now_s: float | None = None) -> bool:
        """Book ``rank``'s acknowledgement (arrived at ``now_s``, if timed); False
        if it is stale (nothing changed).

        Raises:
            RemoteProtocolError: the rank acknowledged before its update; the
                round is unchanged.
        """
        answered = rank in self.acks or rank in self.failed
        if msg.round != self.number or rank not in self.members or answered:
            return False
        if not self.in_flight:  # closed unanswered (it stalled: the run stops without it)
            return False
        if msg.failed:  # its model holds none of the round: nothing committed
            if self.phase is not RoundPhase.COLLECTING:
                return False
            self.failed.add(rank)
            return True
        if self.phase is RoundPhase.COLLECTING and self.config.backend is Backend.COLLECTIVE:
            committed = self.work.commit(rank, msg.steps)
        elif self.phase is RoundPhase.APPLYING:
            committed = self.snapshot_steps.get(rank, 0)
        else:
            raise RemoteProtocolError(
                f"acknowledged round {msg.round} before its update", rank=rank
            )
        self.acks[rank] = committed
        if now_s is not None:
            held = max(now_s - max(msg.through_ms, 0.0) / 1000.0, self.started_s)
            self.held_until_s = max(self.held_until_s, held)
        if msg.divergence is not None:
            self.divergence[rank] = msg.divergence
        if msg.pre_norm is not None:
            self.pre_norms[rank] = msg.pre_norm
        if msg.post_norm is not None and self.post_norm is None:
            self.post_norm = msg.post_norm
        return True

    def on_snapshot(self, rank: int, msg: m.SnapshotReady) -> bool:
        """Coordinator backend: book ``rank``'s upload; False if it is stale.

        Raises:
            RemoteProtocolError: a snapshot in a collective mode, or one
                claiming more steps than the rank made since the last
                average; the round is unchanged.
        """
        if self.config.backend is not Backend.COORDINATOR:
            raise RemoteProtocolError("sent a snapshot in a collective mode", rank=rank)
        collecting = self.phase is RoundPhase.COLLECTING
        if msg.round != self.number or rank not in self.members or not collecting:
            return False
        made = self.work.steps_since_sync(rank)
        if not 0 <= msg.steps <= made:
            raise RemoteProtocolError(
                f"snapshot claims {msg.steps} steps; it made {made} since the last average",
                rank=rank,
            )
        self.snapshot_steps[rank] = msg.steps
        return True

    def average(self, live: set[int]) -> AverageSnapshots | None:
        """Coordinator backend: the averaging order, once every live member uploaded.

        Parameters weigh ``steps ** gamma``, buffers 1 per rank that moved.
        """
        if not self.ready_to_average(live):
            return None
        self.phase = RoundPhase.AVERAGING
        gamma = self.config.scheduler.gamma
        steps = self.snapshot_steps
        holders = sorted(steps)
        return AverageSnapshots(
            round=self.number,
            param_mass=tuple((r, float(steps[r]) ** gamma if steps[r] else 0.0) for r in holders),
            buffer_mass=tuple((r, 1.0 if steps[r] else 0.0) for r in holders),
        )

    def on_average_computed(self, number: int, live: set[int]) -> list[Command]:
        """The shell averaged ``round``: commit it and send the update.

        Raises:
            LocalProtocolError: no such average is running; nothing changed.
        """
        if self.phase is not RoundPhase.AVERAGING or number != self.number:
            raise LocalProtocolError(f"AverageComputed({number}) but no such average is running")
        for rank, steps in sorted(self.snapshot_steps.items()):
            if rank in live:
                self.work.commit(rank, steps)
        self.phase = RoundPhase.APPLYING
        alpha = None if self.work.all_done() else self.config.blend_alpha
        update = m.Update(round=number, alpha=alpha)
        return [Send(rank=rank, message=update) for rank in sorted(self.members & live)]

    def leave(self, rank: int) -> None:
        """``rank`` died: it leaves the round, and the work book keeps what counts."""
        if not self.in_flight or rank not in self.members:
            return
        if self.phase is RoundPhase.AVERAGING and rank in self.snapshot_steps:
            self.work.commit(rank, self.snapshot_steps[rank])
        elif self.phase is RoundPhase.COLLECTING:
            self.snapshot_steps.pop(rank, None)
        self.members.discard(rank)

    def after_death(self, live: set[int]) -> list[Command]:
        """A member died and left: what the round does without it.

        Collective: a round nobody acknowledged yet is abandoned (the group
        re-forms and the gate fires again). Coordinator backend: the other
        members' uploads may now be all there is to average.
        """
        if self.config.backend is Backend.COLLECTIVE:
            if self.in_flight and not self.acks:
                self.abandoned = (self.number, self.members - self.failed)
                self.close()
            return []
        order = self.average(live)
        return [] if order is None else [order]

    def ready_to_average(self, live: set[int]) -> bool:
        """Coordinator backend: every live member uploaded its snapshot."""
        return self.phase is RoundPhase.COLLECTING and all(
            r in self.snapshot_steps for r in self.members & live
        )

    def complete(self, live: set[int]) -> bool:
        """Every live member acknowledged the round, at least one with the average
        (a member whose collective broke answered ``failed``)."""
        waiting = self.phase is RoundPhase.COLLECTING or self.phase is RoundPhase.APPLYING
        answered = all(r in self.acks or r in self.failed for r in self.members & live)
        return waiting and bool(self.acks) and answered

    def late_ack(self, rank: int, msg: m.SyncAck) -> bool:
        """Book ``rank``'s average of the round abandoned at a death, if that is
        what ``msg`` is; whether it was.

        The collective can complete on every member just before one dies: a
        survivor that lands it after the death abandoned the round holds the
        average and has counted its steps averaged, so they are committed as
        it says (the round stays abandoned; the dead member's batches, in
        that average too, go back to the pools with the rest of its work).
        """
        if self.abandoned is None or msg.failed:
            return False
        number, unanswered = self.abandoned
        if msg.round != number or rank not in unanswered:
            return False
        unanswered.discard(rank)
        self.work.commit(rank, msg.steps)
        return True

    def broken(self, live: set[int]) -> bool:
        """Every live member answered ``failed``, none with the average (a
        collective timeout: no member lost, the group out of step)."""
        waiting = self.members & live
        return self.phase is RoundPhase.COLLECTING and not self.acks and waiting <= self.failed

    def _open(self, members: set[int], now_s: float) -> int:
        self.number += 1
        self.phase = RoundPhase.COLLECTING
        self.started_s = self.held_until_s = now_s
        self.members = set(members)
        self.snapshot_steps.clear()
        self.acks.clear()
        self.failed.clear()
        self.divergence.clear()
        self.pre_norms.clear()
        self.post_norm = None
        return self.number
