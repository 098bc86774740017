"""How a run ends: the save that stops it, the saves settled, the last record.

Rules:

- A stop asked for (``StopRequested``) saves a training run once the round
  in flight ends; a run not formed fails, and one restored from the journal
  saves once its ranks have rejoined (``stop``).
- A run that cannot go on asks its survivors to save and stop
  (``save_and_stop``); the meta follows their answers.
- A save nothing more will come for is acted on (``settle``): a checkpoint
  bundle is committed or said unwritten while training goes on; a final
  model unwritten is kept as a bundle with nothing left to train; any other
  ends the run (``finish``): failed, saved and shut down, or completed.
- A run that cannot start or go on and has nothing to save fails
  (``fail``): every live rank is told ``Shutdown(failure=...)``, so none
  waits for a coordinator that is gone.

Theory of operation: the coordinator calls these with itself, as it does
``elche.core.failures`` and ``elche.core.liveness``, to keep its module small;
they read and change its state and append to its commands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.checkpoint import CheckpointMeta, SaveReason
from elche.core.commands import Finish, Notice
from elche.core.rank import SaveKind
from elche.core.saves import SaveRound
from elche.core.states import RunState

if TYPE_CHECKING:
    from elche.core.coordinator import Coordinator

__all__ = ["fail", "finish", "meta", "save_and_stop", "settle", "stop"]


def save_and_stop(core: Coordinator, reason: SaveReason) -> None:
    """Ask the survivors to save and stop; the meta follows their answers."""
    if core.state in (RunState.SAVING, RunState.CLOSING, RunState.DONE):
        return
    core.state = RunState.SAVING
    if reason is SaveReason.GRACEFUL_SHUTDOWN:  # asked to stop: the launcher tells the user
        core._notice("info", "stopping on request; saving state")
    else:
        core._notice("error", f"run cannot continue ({reason.value}); saving state and stopping")
    core._out += core.saves.start(SaveKind.SHUTDOWN, core.workers, core._now, reason=reason)
    settle(core)


def settle(core: Coordinator) -> None:
    """Act on the saves nothing more will come for (see ``elche.core.saves``)."""
    stem = core.config.save_path
    for save in core.saves.take_settled():
        if not save.committed:  # its files, whole or not, are of use to nobody
            core._out += core.saves.discard(save, core.live)
        if save.kind is SaveKind.CHECKPOINT:
            if not save.committed:
                text = f"checkpoint bundle {save.seq} was not written ({save.failure()})"
                core._notice("error", text + "; training goes on")
            elif stem is not None and save.meta is not None:
                core._out.append(core.saves.commit(stem, save.meta, save))
            core._maybe_close()
            continue
        if save.kind is SaveKind.FINAL and not save.committed and _keep_trained(core, save):
            continue
        cause = save.reason or SaveReason.GRACEFUL_SHUTDOWN
        reason = cause.value
        if cause is SaveReason.FINAL_MODEL_UNWRITTEN:
            reason += f": the final model could not be written ({core.saves.unwritten_final})"
        # The held ranks exit, told how the run ended (a rank not asked to save, a
        # joiner not yet in a round, knows nothing else): failed, saved, or completed.
        if not save.committed:
            what = "the final model" if save.kind is SaveKind.FINAL else f"{reason}: the bundle"
            failure = f"{what} could not be written ({save.failure()})"
            core._end_ranks(m.Shutdown(writer=-1, failure=failure))
            finish(core, "failed", failure)
            continue
        saved = cause.value if save.kind is SaveKind.SHUTDOWN else ""
        core._end_ranks(m.Shutdown(writer=-1, saved=saved))
        if save.kind is SaveKind.FINAL:
            finish(core, "completed")
        else:
            assert save.writer is not None  # a committed save has its writer
            if not core.failures.restored:  # else the ranks saved their last consensus
                # The canonical model holds the writer's unaveraged steps.
                core.work.commit(save.writer, core.work.steps_since_sync(save.writer))
            if stem is not None:
                core._out.append(core.saves.commit(stem, meta(core, cause), save))
            finish(core, "saved_and_shutdown", reason)


def _keep_trained(core: Coordinator, final: SaveRound) -> bool:
    """No rank could write the final model: the trained model is saved as a
    bundle with nothing left to train instead (resuming it writes the final
    model), unless its writers never answered or no rank is left. Returns
    whether that save started.
    """
    if final.timed_out or not core.workers or core.config.save_path is None:
        return False
    core.saves.unwritten_final = final.failure()
    core._notice(
        "error", f"the final model could not be written ({core.saves.unwritten_final}); "
        "saving the trained model as a bundle instead",
    )  # fmt: skip
    core.state = RunState.SAVING
    reason = SaveReason.FINAL_MODEL_UNWRITTEN
    core._out += core.saves.start(SaveKind.SHUTDOWN, core.workers, core._now, reason=reason)
    return True


def stop(core: Coordinator, reason: str, *, host_lost: bool) -> None:
    """Asked to stop: a training run saves; one whose training is over completes.

    A round in flight ends first: a rank already inside its collective
    cannot hear the save order until its peers join it, and peers told to
    save instead never would (it would wait out the collective timeout,
    and the stop would save nothing). A coordinator restored from the
    journal saves once its ranks have rejoined: they hold what the run
    trained, which a stop before forming would throw away.
    """
    save_as = SaveReason.COORDINATOR_HOST_LOST if host_lost else SaveReason.GRACEFUL_SHUTDOWN
    stopping = f"stopping ({reason})" if host_lost else "stopping on request"
    if core.state is RunState.FORMING and core.restored_round is not None:
        core._stop_after_round = save_as  # its ranks hold the run: save once they rejoin
        core._notice("info", f"{stopping} once the ranks have rejoined")
    elif core.state is RunState.FORMING:
        fail(core, f"stopped before the run formed ({reason})")
    elif core.state is RunState.TRAINING and core.round.in_flight:
        core._stop_after_round = save_as
        number = core.round.number
        core._notice("info", f"{stopping} once averaging round {number} ends")
    elif core.state is RunState.TRAINING:
        save_and_stop(core, save_as)


def meta(core: Coordinator, reason: SaveReason) -> CheckpointMeta:
    open_epochs = core.work.open_epochs()
    return CheckpointMeta(
        epoch=open_epochs[0] if open_epochs else core.epochs_completed,
        global_step=core.global_step,
        rounds_done=core.rounds_done,
        world_size=core.config.world_size,
        reason=reason,
        seed=core.config.seed,
        order=core.config.order,
        batch_size=core.config.batch_size,
        epochs=core.config.epochs,
        mode=core.config.mode.value,
        elche_state=core.tuner.saved_state(),
        coverage=core.work.coverage(),
    )


def finish(
    core: Coordinator, outcome: str, reason: str = "", user_error: tl.UserError | None = None
) -> None:
    """The run is over: ``RunEnd`` says how, and ``Finish`` tells the shell."""
    core.state = RunState.DONE
    core.outcome = outcome
    done = core.epochs_completed
    core._emit(
        tl.RunEnd(
            outcome=outcome,
            reason=reason,
            epochs_completed=done,
            rounds_done=core.rounds_done,
            lost_samples=core.work.samples_missing(done),
            dead_ranks=tuple(sorted(core.dead_ranks)),
            rejected_frames=core.rejected_frames,
            stale_messages=core.stale_messages,
            anchor=core.elche.anchor,
            samples_per_rank=tuple(core.work.samples_committed[: core.joins.ranks_used()]),
            user_error=user_error or core.failures.stopped_by,
            coordinator_restarts=core.coordinator_restarts,
            joined_ranks=tuple(core.joins.joined),
            skipped_steps=core.failures.num_skipped_steps,
            skipped_samples=core.failures.num_skipped_samples,
        )
    )
    core._out.append(Finish(outcome=outcome, reason=reason))


def fail(core: Coordinator, reason: str, *, user_error: m.UserError | None = None) -> None:
    """End a run that cannot start or go on and has nothing to save."""
    core._out.append(Notice(level="error", text=f"the run failed: {reason}"))
    core.failure = m.Shutdown(failure=reason, user_error=user_error)
    core._end_ranks(core.failure)
    finish(core, "failed", reason, user_error)
