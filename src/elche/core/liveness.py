"""Liveness: the coordinator's heartbeat timer, and ranks it went on without.

Rules:

- Every ``heartbeat_interval_s`` the coordinator's timer fires. While the run
  forms, it fails the run at ``formation_timeout_s`` (a restored coordinator
  instead declares lost the ranks that did not rejoin in time) and tells the
  ranks that joined that it is up. Afterwards it settles overdue saves,
  declares lost every live rank silent for more than
  ``heartbeat_timeout_s``, ends a round in flight past
  ``max(10 x heartbeat_timeout_s, STALL_FLOOR_S)`` with a save, runs the
  stall watch, and sends every rank a heartbeat. A member serves the round
  once its step in progress ends, so a round whose members make long steps
  (a slow CPU beside GPUs, a large model) is given ``STALL_STEPS`` of its
  slowest member's measured step as well.
- A rank declared lost that speaks again (a host cut off, then back) is
  refused once: ``Shutdown(refused=why)``; what it sends stays counted as
  stale and never enters the run.

Theory of operation: functions of the ``Coordinator`` (``core``), which
calls them with itself to keep its own module small.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elche.core import ending, journal
from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.checkpoint import SaveReason
from elche.core.commands import Send
from elche.core.states import RankState, RunState

if TYPE_CHECKING:
    from elche.core.coordinator import Coordinator

__all__ = ["SILENT_LOSSES", "STALL_FLOOR_S", "lost_for_silence", "on_timer", "refuse_lost"]

# How the reasons of the ranks lost for their silence begin: such a rank's process
# may still be there, hung, and its launcher kills it (``lost_for_silence``).
SILENT_LOSSES = ("heartbeat stale", "did not rejoin")

# A round in flight longer than this is a stall (reference: max(10 x hb, 300 s)).
STALL_FLOOR_S = 300.0
# ... or this many of its slowest member's steps (smoothed), when that is longer.
STALL_STEPS = 3


def lost_for_silence(event: tl.TimelineEvent) -> tl.RankLost | None:
    """``event`` when it declares a rank lost for its silence (``SILENT_LOSSES``): that
    rank's process may still be there, hung, and whoever started it kills it."""
    if isinstance(event, tl.RankLost) and event.reason.startswith(SILENT_LOSSES):
        return event
    return None


def on_timer(core: Coordinator) -> None:
    """The heartbeat timer: formation's deadline, overdue saves, stale ranks, a
    stalled round and the stall watch; then heartbeats to the ranks."""
    now = core._now
    if core.state is RunState.FORMING:
        if now >= core._formation_deadline_s and core.restored_round is not None:
            for rank, state in enumerate(core.rank_state):  # a lost coordinator's ranks
                if state is RankState.JOINING and core.state is RunState.FORMING:
                    core._lose(
                        rank,
                        "did not rejoin the restarted coordinator within "
                        f"{journal.rejoin_timeout_s(core.config):g} s",
                    )
            return
        if now >= core._formation_deadline_s:
            joined = sum(s is RankState.LIVE for s in core.rank_state)
            ending.fail(
                core,
                f"formation timed out: {joined}/{core.config.world_size} ranks joined "
                f"within {core.config.formation_timeout_s:g} s (formation_timeout_s: each "
                "rank builds its model first)",
            )
            return
        # The ranks that joined wait for the rest: tell them this coordinator is up.
        core._broadcast(m.CoordHeartbeat())
        core._arm()
        return
    late = core.saves.overdue(now, core.workers)
    if late:
        core._out += late
        ending.settle(core)
        if core.outcome is not None:
            return
    timeout = core.config.heartbeat_timeout_s
    for rank in core.live:
        silent_s = now - core.last_seen_s[rank]
        if silent_s > timeout:
            core._lose(rank, f"heartbeat stale: silent for {silent_s:.1f} s")
    paces = core.elche.ms_per_batch()
    slowest_s = max((paces[r] for r in core.round.members if r < len(paces)), default=0.0) / 1e3
    stalled = now - core.round.started_s > max(10 * timeout, STALL_FLOOR_S, STALL_STEPS * slowest_s)
    if core.state is RunState.TRAINING and core.round.in_flight and stalled:
        core._notice("error", f"averaging round {core.round.number} stalled")
        core.round.close()
        ending.save_and_stop(core, SaveReason.REDUCE_STALL)
    if core.outcome is None:
        core._out += core.stall.check(core, now)
        core._broadcast(m.CoordHeartbeat())
        core._arm()


def refuse_lost(core: Coordinator, rank: int) -> None:
    """A rank declared lost speaks again (a host cut off, then back): tell it, once,
    that the run goes on without it; its frames stay counted as stale."""
    reason = core.lost_reasons.get(rank)
    if reason is None or rank in core.refused or core.outcome is not None:
        return
    core.refused.add(rank)
    why = f"declared lost ({reason}); the run went on without it"
    core._notice("warning", f"refused rank {rank}: it was {why}")
    core._out.append(Send(rank=rank, message=m.Shutdown(writer=-1, refused=why)))
