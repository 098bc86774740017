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

  In the second case, while ranks that have not failed are left, what was
  trained is not thrown away: the rank is lost as a crashed one would be,
  the survivors save a bundle (the save a crash that left too few ranks
  makes: ``SaveReason.SINGLE_SURVIVOR``, ``MAX_FAILURE_EXCEEDED``), and the
  run ends ``saved_and_shutdown`` with the error in ``RunEnd``: the run's
  ``TrainingError`` names the bundle that resumes it once the code is fixed.

- Otherwise (one rank's one-off error mid-run) the rank is lost like a
  crashed one: its work goes back to the survivors and the run goes on.
- A non-finite loss (``BatchDone.nonfinite``: the rank did not apply that
  step) under ``nonfinite="stop"``, or a non-finite average (a ``SyncAck``
  whose ``post_norm`` is NaN or infinite) under either policy, saves and
  stops the run (``SaveReason.NONFINITE``): every rank restores the last
  finite consensus it holds before it saves, so the writer's unaveraged steps
  are *not* in the bundle and stay to be trained on resume. The run's
  ``user_error`` says what happened (``error_type`` ``"NonFiniteLoss"``).
  Under ``nonfinite="skip"`` such a step is skipped and the run goes on.
- Each rank reports a hash of the model ``model_fn`` built
  (``InitialState``); ranks whose hash differs from rank 0's are named in a
  warning once every rank reported (collective runs start from rank 0's weights, broadcast over
  the group before training). Ranks whose model has another *layout* (parameter
  or buffer names, shapes or dtypes: a ``model_fn`` that builds by rank) end the
  run once every rank reported, before any average: no average can join their
  models, and a rank left out would lose what it trained. The error names them
  (``error_type`` ``"ValueError"``).
- A rank *lost* before the run forms (a crash, not a ``Failed``) is survived
  when enough ranks remain (``elche.core.saves.reason_to_stop``): the run forms
  with the others. When too few remain, the run fails before training.

Theory of operation: ``UserFailures.note`` is the decision (pure, on the
reports alone). The functions below are the coordinator's handlers for these
cases (``Coordinator`` calls them with itself, to keep its module small):
``on_failed`` for a ``Failed`` message, ``lost_forming`` for a rank lost
while the run forms, and ``maybe_form`` after each join or such loss; a run
that has nothing to save ends through ``elche.core.ending.fail``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from elche.core import ending
from elche.core import messages as m
from elche.core.checkpoint import SaveReason
from elche.core.commands import Notice, ReformFirstGroup, Send
from elche.core.config import Backend
from elche.core.messages import UserError
from elche.core.saves import reason_to_stop

if TYPE_CHECKING:
    from elche.core.coordinator import Coordinator

__all__ = [
    "UserFailures",
    "failure_text",
    "lost_forming",
    "maybe_form",
    "on_failed",
    "screen",
    "skipped_text",
]


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
        self.num_nonfinite = 0  # steps with a non-finite loss
        self.num_skipped_steps = 0  # those of them nonfinite="skip" left out
        self.num_skipped_samples = 0  # the samples of those steps
        self.restored = False  # the ranks restore their last consensus before saving
        # The user error that stopped the run, which saved a bundle (a non-finite
        # value, or an exception that left too few ranks).
        self.stopped_by: UserError | None = None
        self.fingerprints: dict[int, str] = {}  # each rank's initial weights, hashed
        self.warned: set[int] = set()  # ranks already named for different initial weights
        self.layouts: dict[int, str] = {}  # each rank's model's names, shapes and dtypes, hashed

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


def screen(core: Coordinator, rank: int, message: m.RankMessage) -> None:
    """Look for non-finite losses and averages in ``rank``'s ``message``."""
    match message:
        case m.BatchDone(nonfinite=True, epoch=epoch, size=size):
            _nonfinite_loss(core, rank, epoch, size)
        case m.Batches(items=items):
            for item in items:
                if item.nonfinite:
                    _nonfinite_loss(core, rank, item.epoch, item.size)
        case m.InitialState(fingerprint=fingerprint, layout=layout):
            _initial_state(core, rank, fingerprint, layout)
        case m.SyncAck(post_norm=post) if post is not None and not math.isfinite(post):
            open_epochs = core.work.open_epochs()
            epoch = open_epochs[0] if open_epochs else core.epochs_completed
            _stop_nonfinite(core, rank, epoch, f"the average of round {message.round} is {post}")
        case _:
            pass


def _initial_state(core: Coordinator, rank: int, fingerprint: str, layout: str) -> None:
    """Once every rank reported, end the run if a rank's model has another layout than
    rank 0's, else warn naming those whose initial weights differ from rank 0's."""
    state = core.failures
    state.fingerprints[rank] = fingerprint
    state.layouts[rank] = layout
    reference = state.fingerprints.get(0)
    waiting = set(range(core.config.world_size)) - set(core.dead_ranks) - set(state.fingerprints)
    if reference is None or waiting:
        return
    if _other_layouts(core):
        return
    odd = sorted(
        r for r, f in state.fingerprints.items() if f != reference and r not in state.warned
    )
    if not odd:
        return
    state.warned.update(odd)
    what = (
        "rank 0's weights are the run's start (broadcast to every rank)"
        if core.config.backend is Backend.COLLECTIVE
        else "the first average brings them together"
    )
    text = (
        f"ranks {odd} built initial weights different from rank 0's; {what}. Seed inside "
        "model_fn (torch.manual_seed) so that every rank builds the same model"
    )
    core._out.append(Notice(level="warning", text=text))


def _other_layouts(core: Coordinator) -> bool:
    """End the run if some rank's model has another layout than rank 0's; whether it did."""
    from elche.core.coordinator import RunState

    layouts = core.failures.layouts
    odd = sorted(r for r, layout in layouts.items() if layout and layout != layouts[0])
    if not (odd and layouts[0] and core.state in (RunState.FORMING, RunState.TRAINING)):
        return False
    error = UserError(
        rank=odd[0],
        epoch=core.epochs_completed,
        error_type="ValueError",
        message=f"model_fn built another model on ranks {odd} than on rank 0: other "
        "parameter or buffer names, shapes or dtypes. model_fn must build the same model "
        "on every rank (only the device may differ)",
    )
    ending.fail(core, failure_text(error), user_error=error)
    return True


def skipped_text(rank: int, epoch: int, num_skipped: int) -> str | None:
    """The warning for the ``num_skipped``-th step skipped under ``nonfinite="skip"`` (one
    on ``rank`` in ``epoch``): said for the first and every hundredth, else None."""
    if num_skipped != 1 and num_skipped % 100 != 0:
        return None
    return (
        f"rank {rank}: a non-finite loss in epoch {epoch}; that step was skipped "
        f"({num_skipped} so far, nonfinite='skip')"
    )


def _nonfinite_loss(core: Coordinator, rank: int, epoch: int, size: int) -> None:
    state = core.failures
    state.num_nonfinite += 1
    if core.config.nonfinite == "stop":
        _stop_nonfinite(core, rank, epoch, "the loss is not finite")
        return
    state.num_skipped_steps += 1
    state.num_skipped_samples += size
    text = skipped_text(rank, epoch, state.num_skipped_steps)
    if text is not None:
        core._out.append(Notice(level="warning", text=text))


def _stop_nonfinite(core: Coordinator, rank: int, epoch: int, what: str) -> None:
    from elche.core.coordinator import RunState

    if core.state not in (RunState.TRAINING, RunState.FINISHING):
        return  # already saving
    state = core.failures
    state.restored = True
    state.stopped_by = UserError(
        rank=rank,
        epoch=epoch,
        error_type="NonFiniteLoss",
        message=f"{what} on rank {rank} in epoch {epoch}; the bundle holds the last finite "
        "consensus (nonfinite='skip' skips such steps instead)",
    )
    core._out.append(Notice(level="error", text=f"rank {rank}: {what} in epoch {epoch}"))
    ending.save_and_stop(core, SaveReason.NONFINITE)


def on_failed(core: Coordinator, rank: int, message: m.Failed) -> None:
    """``rank`` failed on the user's code: lose it, or end the run with the error."""
    what = f"{message.error_type}: {message.message}"
    core._out.append(Send(rank=rank, message=m.Shutdown(failure=what)))  # the report is in
    others = [r for r in core.live if r != rank]
    stops = reason_to_stop(core.config, len(core.dead_ranks) + 1, len(others)) is not None
    error = core.failures.note(rank, message, others=others, run_stops=stops)
    from elche.core.coordinator import RankState, RunState

    if error is None or core.state is RunState.SAVING:  # a save under way finishes first
        core._lose(rank, f"failed: {what}")
        return
    if others and core.state is RunState.TRAINING and not message.before_first_step:
        core.failures.stopped_by = error  # the survivors save what was trained
        core._lose(rank, f"failed: {what}")
        return
    core.rank_state[rank] = RankState.DEAD
    core.dead_ranks.append(rank)
    ending.fail(core, failure_text(error), user_error=error)


def lost_forming(core: Coordinator, rank: int, reason: str) -> None:
    """A rank lost before the run formed: the run forms without it, if enough are left."""
    from elche.core.coordinator import RankState

    left = [r for r, s in enumerate(core.rank_state) if s in (RankState.JOINING, RankState.LIVE)]
    why = reason_to_stop(core.config, len(core.dead_ranks), len(left))
    if why is not None:
        ending.fail(core, f"rank {rank} lost before the run formed ({reason}); {why.value}")
        return
    core.elche.retire(rank)
    core.roles.on_death(rank, left, core.elche.smoothed_ms_per_batch)
    text = f"rank {rank} lost before the run formed ({reason}); it forms with the {len(left)} left"
    core._out.append(Notice(level="warning", text=text))
    first_group = all(core.rank_state[r] is RankState.JOINING for r in left)  # none joined
    if core.config.backend is Backend.COLLECTIVE and core.restored_round is None and first_group:
        # The ranks may be gathering for their first group (a rank joins once it
        # formed), where they would wait for this one until their collective
        # timeout: they form a new generation without it.
        core.generation += 1
        core._out.append(ReformFirstGroup(generation=core.generation, members=tuple(left)))
    maybe_form(core)


def maybe_form(core: Coordinator) -> None:
    """Every rank joined or was lost: train with those who joined.

    A collective run that lost a rank first re-forms its group without it
    (under a launcher the ranks' first group holds every rank).
    """
    from elche.core.coordinator import RankState

    if any(s is RankState.JOINING for s in core.rank_state):
        return
    # A restored coordinator's ranks kept their group: it re-forms only without
    # ranks lost since, or without the ranks that had joined the run (the
    # journal keeps no joins: elche.core.joins).
    lost = set(core.dead_ranks) - set(core.restored_dead)
    joinable = core.restored_round is not None and core.config.join_slots > 0
    if (lost or joinable) and core.config.backend is Backend.COLLECTIVE:
        core.generation += 1
        core._broadcast(m.Regroup(generation=core.generation, members=core.live))
    if joinable:
        core.joins.release_roles()
    if core.restored_round is not None:  # the evals its predecessor never heard back
        core._out += core.callbacks.ask_again(core.workers)
    core._begin_training()
