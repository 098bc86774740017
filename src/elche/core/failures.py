"""Failures on the user's own code: when a rank's exception ends the run.

Rules:

- A rank that catches an exception from the user's code (``model_fn``,
  ``optimizer_fn``, ``step_fn``, the collate, ``epoch_fn``) tells the
  coordinator ``Failed`` and stops. The exception is the *user's error*, and
  the run fails at once (outcome ``"failed"``, the error in ``RunEnd``), when:

  - the rank failed before its first training step: every rank runs the same
    code on the same kind of batch, so a model that cannot be built or a first
    step that raises is no accident of one rank; or
  - every rank that is still live has failed, all with the same exception
    type, or losing this rank would end the run anyway (too few left) and
    every rank that failed so far failed with that type.

- Otherwise (one rank's one-off error mid-run) the rank is lost like a
  crashed one: its work goes back to the survivors and the run goes on.
- A rank *lost* before the run forms (a crash, not a ``Failed``) is survived
  when enough ranks remain (``SaveAndShutdown.reason_to_stop``): the run forms
  with the others. When too few remain, the run fails before training.

Theory of operation: ``UserFailures.note`` is the decision (pure, on the
reports alone). The functions below are the coordinator's handlers for these
cases (``Coordinator`` calls them with itself, to keep its module small):
``on_failed`` for a ``Failed`` message, ``lost_forming`` for a rank lost
while the run forms, ``maybe_form`` after each join or such loss, and
``fail`` to end a run that has nothing to save (every live rank is told
``Shutdown(failure=...)``, so none waits for a coordinator that is gone).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from elche.core import messages as m
from elche.core.commands import Notice, Send
from elche.core.config import Backend
from elche.core.messages import UserError

if TYPE_CHECKING:
    from elche.core.coordinator import Coordinator

__all__ = ["UserFailures", "fail", "failure_text", "lost_forming", "maybe_form", "on_failed"]


def failure_text(error: UserError) -> str:
    """The one-line account of a user error, for the run's reason and logs."""
    return (
        f"rank {error.rank} failed on the user's code in epoch {error.epoch}: "
        f"{error.error_type}: {error.message}"
    )


class UserFailures:
    """The ``Failed`` reports of one run, by rank."""

    def __init__(self) -> None:
        self.failed: dict[int, m.Failed] = {}

    def note(
        self, rank: int, message: m.Failed, *, others: Sequence[int], run_stops: bool
    ) -> UserError | None:
        """Record ``rank``'s failure; returns the user error that ends the run, or None.

        Args:
            rank: the rank that failed.
            message: its report.
            others: the live ranks other than ``rank``.
            run_stops: losing ``rank`` leaves too few ranks to go on.
        """
        self.failed[rank] = message
        error = UserError(
            rank=rank,
            epoch=message.epoch,
            error_type=message.error_type,
            message=message.message,
            traceback=message.traceback,
        )
        if message.before_first_step:
            return error
        same = {report.error_type for report in self.failed.values()} == {message.error_type}
        # A failed rank is lost, so no live rank left means every rank has failed.
        if same and (not others or run_stops):
            return error
        return None


def on_failed(core: Coordinator, rank: int, message: m.Failed) -> None:
    """``rank`` failed on the user's code: lose it, or end the run with the error."""
    what = f"{message.error_type}: {message.message}"
    core._out.append(Send(rank=rank, message=m.Shutdown(failure=what)))  # the report is in
    others = [r for r in core.live if r != rank]
    stops = core.saving.reason_to_stop(len(core.dead_ranks) + 1, len(others)) is not None
    error = core.failures.note(rank, message, others=others, run_stops=stops)
    if error is None:
        core._lose(rank, f"failed: {what}")
        return
    from elche.core.coordinator import RankState

    core.rank_state[rank] = RankState.DEAD
    core.dead_ranks.append(rank)
    fail(core, failure_text(error), user_error=error)


def lost_forming(core: Coordinator, rank: int, reason: str) -> None:
    """A rank lost before the run formed: the run forms without it, if enough are left."""
    from elche.core.coordinator import RankState

    left = [r for r, s in enumerate(core.rank_state) if s in (RankState.JOINING, RankState.LIVE)]
    why = core.saving.reason_to_stop(len(core.dead_ranks), len(left))
    if why is not None:
        fail(core, f"rank {rank} lost before the run formed ({reason}); {why.value}")
        return
    core.elche.retire(rank)
    core.roles.on_death(rank, left, core.elche.smoothed_ms_per_batch)
    text = f"rank {rank} lost before the run formed ({reason}); it forms with the {len(left)} left"
    core._out.append(Notice(level="warning", text=text))
    maybe_form(core)


def maybe_form(core: Coordinator) -> None:
    """Every rank joined or was lost: train with those who joined.

    A collective run that lost a rank first re-forms its group without it
    (under a launcher the ranks' first group holds every rank).
    """
    from elche.core.coordinator import RankState

    if any(s is RankState.JOINING for s in core.rank_state):
        return
    if core.dead_ranks and core.config.backend is Backend.COLLECTIVE:
        core.generation += 1
        core._broadcast(m.Regroup(generation=core.generation, members=core.live))
    core._begin_training()


def fail(core: Coordinator, reason: str, *, user_error: UserError | None = None) -> None:
    """End a run that cannot start or go on and has nothing to save."""
    core._out.append(Notice(level="error", text=f"the run failed: {reason}"))
    core.failure = m.Shutdown(failure=reason, user_error=user_error)
    core._broadcast(core.failure)
    core._finish("failed", reason, user_error)
