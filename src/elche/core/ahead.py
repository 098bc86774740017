"""Work ahead of the round: the next window goes out with the averaging order.

Rules:

- Under ``cadence``, as the averaging gate fires, the coordinator plans the
  next window (``Planner.open_window(ahead=True)``: each rank's window counts
  from the steps the round will commit) and sends each rank its first chunk
  right behind ``SyncNow`` / ``RequestParams``, its budget as the rank will
  count it after the average (a rank that still holds work hears that budget
  in a ``SetBudget``). A rank serves the round before it trains
  (``elche.core.rank``), so it trains on as soon as its average lands,
  instead of after the round's last acknowledgement and the coordinator's
  answer (~3-5 ms of every round on two loaded cores, per rank).
- At an epoch's end the next epoch opens then, and the callbacks of the
  epoch end are asked with the round: a rank runs a callback asked while a
  round is pending once it applied that round, before its new work.
- Not before the balancer's first calibration (no pace to size the window
  by; the callback roles, elected as the first calibrated round closes, may
  move then: a rank runs whatever callback it is asked, and results count
  from any rank), not for the run's last round, and not when the round ends
  an epoch whose bundle is due (its ranks must save the consensus alone) or
  whose next one starts with callback slack (``Tuner.boundary_slack``).
- Each acknowledgement (collective) or the average (coordinator backend)
  rebases the rank's window to count from zero (``Planner.averaged``).
  Batches and callback results reported while the round is in flight are
  the next window's: booked in the ledger once the round closes
  (``book_early``), the results once the epoch the round ends has ended (an
  epoch's ``Eval`` follows its ``EpochEnd``: a reader of the timeline that
  met the eval first had no epoch to put it on). The window then stands
  (``stands``): the round's feedback (ElChe's counts, the guard's verdict)
  sizes the one after it.
- A death plans the window afresh when the round closes; a round abandoned
  by a death takes the plan back (``Planner.undo_ahead``: each survivor
  holding work hears its budget before the plan again) and the work handed
  out stays with its ranks for the round tried next; a joiner's first round
  plans afresh too, with the joiner in it.

Theory of operation: functions of the ``Coordinator`` (``core``), which
calls them with itself to keep its own module small.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elche.core import messages as m
from elche.core.commands import Send
from elche.core.config import Policy

if TYPE_CHECKING:
    from elche.core.coordinator import Coordinator

__all__ = ["book_early", "hand_out", "stands"]


def hand_out(core: Coordinator) -> None:
    """The round just started: hand the next window's first work out behind it."""
    if core.config.policy is not Policy.CADENCE or not core.elche.is_calibrated:
        return
    work = core.work
    if work.serving_epoch() is None:  # every sample of the open epoch is trained
        opened, nxt = work.open_epochs(), work.next_epoch_to_open()
        if nxt is None or len(opened) != 1:
            return
        done = opened[0] + 1
        if core.config.save_path is not None and core.callbacks.checkpoint_due(done):
            return
        if core.tuner.boundary_slack(core.live, opened, starts_epoch=True) is not None:
            return
        core._out += core.callbacks.at_epoch_end(done, core.workers)
        core._asked_early = done
        core._open_epoch(nxt)
    plan = core.planner.open_window(core.workers, ahead=True, now_s=core._now)
    for rank, update in zip(core.workers, plan, strict=True):
        if update is not None:  # a rank that holds work: its budget after the average
            core._out.append(Send(rank=rank, message=update))
    # Before the work: the progress a rank counts the new window's steps from.
    core._send_progress(core.round.number, expected=True)
    for rank in core.workers:
        core._dispatch(rank)


def book_early(core: Coordinator) -> list[tuple[int, m.EvalResult | m.CheckpointResult]]:
    """The round closed: book the batches its ranks reported of the next window
    meanwhile. Returns the callback results they reported meanwhile, which the
    coordinator takes once the epoch the round ends has ended."""
    early, core._early = core._early, []
    results: list[tuple[int, m.EvalResult | m.CheckpointResult]] = []
    for rank, msg in early:
        if isinstance(msg, m.BatchDone):
            core._time_batch(rank, msg)
        else:
            results.append((rank, msg))
    return results


def stands(core: Coordinator) -> bool:
    """The round closed: hand out what the window planned ahead still owes; False if none was."""
    planner = core.planner
    if not planner.planned_ahead:
        return False
    planner.planned_ahead = False
    core._send_progress(core.round.number)
    for rank in core.workers:
        core._dispatch(rank)
    core._unsatisfied = {r for r in core.workers if not planner.satisfied(r)}
    return True
