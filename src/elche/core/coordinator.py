"""The coordinator core: ``handle(event, now_s) -> list[Command]``.

Rules:

- The core never blocks, never reads a clock and never does IO. The shell
  feeds it events with the current monotonic time and executes the commands
  it returns, in order. Identical (config, events, times) give identical
  commands.
- Run states move forward only: ``FORMING -> TRAINING -> (FINISHING) ->
  CLOSING -> DONE`` (the run is complete once its final model is on disk),
  or ``-> SAVING -> DONE`` when the run cannot go on (from ``CLOSING`` too,
  when no rank could write the final model: the trained model is then kept
  as a bundle with nothing left to train).
- A rank is ``JOINING``, ``LIVE``, ``DEAD`` or ``ERRORED``; a join slot
  (``config.join_slots``) is ``VACANT`` until a rank joins the running run
  in it (``elche.core.joins``). A rank that sends
  something illegal is latched ``ERRORED`` and treated as lost; the run goes on
  with the others. An illegal *event* from the shell raises
  ``LocalProtocolError`` and leaves the state unchanged.
- Work is handed out in chunks from per-epoch pools (``elche.core.work``).
  ``sync`` gives every rank an equal partition; ``cadence`` and ``async`` give
  each rank chunks of its ElChe batch count, so a window takes every rank the
  same wall time.
- The averaging gate: every live rank has made its window (``cadence``,
  ``async``: ``batch_counts[r]`` steps; ``sync``: one step) or is *quiesced*
  (idle, with nothing it may take), and some rank made a step.
- Under ``cadence`` the next window is planned as the gate fires, and its
  first chunks (and the callbacks of an epoch end the round finishes) go
  out right behind the averaging order (``elche.core.ahead``).
- A rank never trains past its *budget* (steps since the last average): its
  batch count, plus the overshoot allowance under ``async``.
- When a rank dies its unaveraged work returns to the pools, roles
  re-resolve, collective groups re-form, and the run continues unless the
  failure threshold or the backend floor is crossed; then the coordinator
  writes the meta sidecar and tells the survivors to save and stop.

Theory of operation: events land in ``handle``; each handler updates state
and appends commands to ``self._out``; after every event ``_progress`` fires
the averaging gate if it is open. The coordinator keeps the run and rank
states and wires its collaborators, each the one owner of its part: the work
book (``work``), the planner (``planner``: budgets, chunks, epoch pools), the
round (``rounds``: the averaging protocol), the tuner (``tuning``: what a
closed round teaches the balancer), the callback requests (``callbacks``) and
the saves (``saves``).
"""

from __future__ import annotations

import math
from typing import assert_never

from elche.core import ahead, ending, failures, joins, journal, liveness
from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.callbacks import Callbacks
from elche.core.checkpoint import CheckpointMeta, SaveReason
from elche.core.commands import (
    AppendJournal,
    ArmTimer,
    Broadcast,
    Command,
    Emit,
    Notice,
    Send,
)
from elche.core.config import Backend, CoordinatorConfig
from elche.core.elche_state import ElCheState
from elche.core.errors import LocalProtocolError, RemoteProtocolError
from elche.core.events import (
    AverageComputed,
    Event,
    FrameRejected,
    MessageReceived,
    MetaWriteFailed,
    RankJoined,
    RankLost,
    Started,
    StopRequested,
    TimerFired,
)
from elche.core.ledger import WindowLedger
from elche.core.planner import Planner
from elche.core.rank import SaveKind
from elche.core.roles import CallbackRoles
from elche.core.rounds import Round
from elche.core.saves import Saves, reason_to_stop
from elche.core.scheduler import ElChe
from elche.core.stall import StallWatch
from elche.core.states import RankState, RankStates, RunState
from elche.core.telemetry import Telemetry
from elche.core.tuning import Tuner
from elche.core.work import WorkBook

__all__ = ["Coordinator", "RankState", "RunState"]

_Asked = tuple[tuple[int, int], ...]  # callbacks asked and unanswered: (epoch or version, rank)


class Coordinator:
    """The sans-IO coordinator of one training run.

    Args:
        config: the run's configuration.
        resume: a checkpoint meta to continue from, or None for a fresh run.
        last_save: the number of the last save at the run's save path (the
            one its meta names); this run numbers its saves after it (and
            after ``resume``'s), and its ranks keep that save's files until a
            newer one commits.

    Raises:
        ConfigError: ``resume`` does not fit ``config`` (``CheckpointMeta.check_fits``).
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        resume: CheckpointMeta | None = None,
        last_save: int = 0,
    ) -> None:
        if resume is not None:
            resume.check_fits(config)
        self.config = config
        every = config.slotted()  # the collaborators keep state for every rank id
        ws = every.world_size
        self.elche = ElChe.for_run(every)
        self.roles = CallbackRoles(config.callback_policy, ws, config.callback_rank)
        self.work = WorkBook(ws, config.num_samples, config.batch_size, config.epochs)
        self.planner = Planner(every, self.elche, self.work)
        self.ledger = WindowLedger(ws)
        self.callbacks = Callbacks(every, self.roles, self.ledger)
        self.tuner = Tuner(
            every, self.elche, self.callbacks, self.planner, self.work,
            ledger=self.ledger, saved=_balancer_state(resume, config),
        )  # fmt: skip
        self.saves = Saves(
            config, max(last_save, resume.save_seq if resume else 0), committed=last_save
        )
        self.failures = failures.UserFailures()
        self.round = Round(every, self.work)
        self.telemetry = Telemetry(every, self.roles)
        self.stall = StallWatch(config.stall_dump_s)
        self.state = RunState.FORMING
        self.rank_state = RankStates(config.world_size, config.join_slots)
        self.joins = joins.Joins(self, range(config.world_size, ws))
        self.hosts = [""] * ws
        self.last_seen_s = [0.0] * ws
        self.dead_ranks: list[int] = []
        self.lost_reasons: dict[int, str] = {}  # why each dead rank was declared lost
        self.refused: set[int] = set()  # dead ranks told so when they spoke again
        self.generation = 0
        self.rounds_done = 0
        # The number of the last round that closed (what its ranks hold as
        # ``Held.last_round``): rounds abandoned at a death have numbers too, so
        # it runs ahead of ``rounds_done``.
        self.last_round = 0
        self.global_step = 0
        self.rejected_frames = 0
        self.stale_messages = 0
        self.epochs_completed = 0
        self.outcome: str | None = None
        self.failure: m.Shutdown | None = None  # what a failed run told its ranks
        self.coordinator_restarts = 0  # coordinators before this one (``journal.restore``)
        self.restored_round: int | None = None  # the journal's round, if restored
        self.restored_dead: tuple[int, ...] = ()  # the ranks the journal had lost
        # An open epoch's reported losses (its ``EpochEnd`` says their mean): (sum, count).
        self.epoch_loss: dict[int, tuple[float, int]] = {}
        # (rounds done, open epochs, last round number, (evals, checkpoints) unanswered)
        # of the last record.
        self._journaled: tuple[int, tuple[int, ...], int, tuple[_Asked, _Asked]] | None = None
        self._start_epoch = 0
        self._resume = resume
        self._unsatisfied: set[int] = set()
        # Asked to stop while a round was in flight, or while a coordinator restored
        # from the journal waited for its ranks: it saves once the run trains again.
        self._stop_after_round: SaveReason | None = None
        # Batches of a window handed out ahead, and callback results, reported
        # while its round is in flight: their timing belongs to that window,
        # booked once the round closes.
        self._early: list[tuple[int, m.BatchDone | m.EvalResult | m.CheckpointResult]] = []
        self._asked_early = 0  # epochs done when their callbacks were asked ahead
        self._formation_deadline_s = math.inf
        self._now = 0.0
        self._out: list[Command] = []
        if resume is not None:
            self._apply_resume(resume)

    # -- public views --------------------------------------------------------

    @property
    def live(self) -> list[int]:
        return self.rank_state.live()

    @property
    def workers(self) -> list[int]:
        """Live ranks that may be given work (all but joiners not yet averaged)."""
        fresh = self.joins.fresh
        return [r for r in self.rank_state.live() if r not in fresh] if fresh else self.live

    @property
    def unsatisfied(self) -> frozenset[int]:
        """Live ranks the averaging gate still waits for (their window not made)."""
        return frozenset(self._unsatisfied)

    def handle(self, event: Event, now_s: float) -> list[Command]:
        """Feed one event; returns the commands to execute, in order.

        Args:
            event: what the shell observed.
            now_s: the current monotonic time in seconds.

        Returns:
            Commands for the shell. After ``Finish`` the coordinator is
            ``DONE`` and ignores further events.

        Raises:
            LocalProtocolError: the event names a rank outside the world;
                nothing changed.
        """
        if self.state is RunState.DONE:
            return []
        self._now = now_s
        self._out = []
        match event:
            case Started():
                restored = self.restored_round is not None  # its ranks rejoin, or are lost
                if restored:  # before it speaks: a successor of its own numbers past it
                    self._out.append(AppendJournal(record=journal.record_of(self), compact=True))
                window_s = journal.rejoin_timeout_s(self.config) if restored else None
                self._formation_deadline_s = now_s + (window_s or self.config.formation_timeout_s)
                self._arm()
            case RankJoined(rank=rank, host=host, held=held, layout=layout):
                self._check_rank(rank)
                self._on_join(rank, host, held, layout)
            case MessageReceived(rank=rank, message=message):
                self._check_rank(rank)
                self._on_message(rank, message)
            case RankLost(rank=rank, reason=reason):
                self._check_rank(rank)
                self._lose(rank, reason)
            case FrameRejected(reason=reason, rank=rank):
                self._on_rejected(reason, rank)
            case AverageComputed(round=number):
                self._on_average_computed(number)
            case TimerFired():
                self._on_timer()
            case StopRequested(reason=reason, host_lost=host_lost):
                ending.stop(self, reason, host_lost=host_lost)
            case MetaWriteFailed(seq=seq):  # the shell said why
                self._out += self.saves.meta_failed(seq, self.live)
            case _:
                assert_never(event)
        stop_as = self._stop_after_round
        if stop_as is not None and self.state is RunState.TRAINING and not self.round.in_flight:
            self._stop_after_round = None
            ending.save_and_stop(self, stop_as)  # the round it waited for is over
        if self.state is RunState.TRAINING and not self.round.in_flight:
            self.joins.admit_pending()
        if self.state is RunState.TRAINING:
            self._progress()
        out, self._out = self._out, []  # the commands are the shell's now, not state
        return out

    # -- formation -----------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.config.num_slots:
            raise LocalProtocolError(
                f"event names rank {rank}; world size is {self.config.world_size} "
                f"with {self.config.join_slots} join slot(s)"
            )

    @classmethod
    def restore(
        cls, config: CoordinatorConfig, record: journal.JournalRecord, *, last_save: int
    ) -> Coordinator:
        """A coordinator that goes on from the journal's ``record`` (``journal.restore``);
        ``last_save``: the save the meta at the save path names now."""
        core = journal.restore(config, record, last_save=last_save)
        core.joins.expect_rejoins()
        return core

    def _on_join(self, rank: int, host: str, held: m.Held | None = None, layout: str = "") -> None:
        if self.rank_state[rank] is RankState.VACANT:
            self.joins.request(rank, host, held, layout)
            return
        if self.state is not RunState.FORMING or self.rank_state[rank] is not RankState.JOINING:
            self._evict(rank, RemoteProtocolError("joined twice", rank=rank))
            return
        if self.restored_round is not None:
            try:
                if held is None:
                    raise RemoteProtocolError("rejoined holding nothing", rank=rank)
                journal.rebook(self, rank, held)
            except RemoteProtocolError as exc:
                self.rank_state[rank] = RankState.LIVE  # so that it is lost like a live one
                self._evict(rank, exc)
                return
        self.rank_state[rank] = RankState.LIVE
        self.hosts[rank] = host
        self.last_seen_s[rank] = self._now
        self._emit(tl.RankJoined(rank=rank, host=host))
        failures.maybe_form(self)

    def _begin_training(self) -> None:
        self.state = RunState.TRAINING
        self._emit(tl.RunStart(world_size=self.config.world_size, mode=self.config.mode.value))
        self._out += self.telemetry.start(self._now)
        self._arm()
        if self._resume is None:
            self._open_epoch(self._start_epoch)
        self._journal()
        self._send_progress(self.round.number)
        self._open_window()

    def _apply_resume(self, meta: CheckpointMeta) -> None:
        # At or past this run's plan the run is finished: it completes at once.
        start = self._start_epoch = self.epochs_completed = min(meta.epoch, self.config.epochs)
        self.global_step = meta.global_step
        self.rounds_done = self.last_round = meta.rounds_done
        self.round = Round(self.config, self.work, number=meta.rounds_done)
        self.work.resume(start, meta.coverage)
        if start < self.config.epochs and start not in self.work.pools:
            self._resume = None  # nothing started: a plain epoch open will do

    # -- messages --------------------------------------------------------------

    def _on_message(self, rank: int, message: m.RankMessage) -> None:
        if self.rank_state[rank] is not RankState.LIVE:
            self.stale_messages += 1
            liveness.refuse_lost(self, rank)
            return
        self.last_seen_s[rank] = self._now
        try:
            failures.screen(self, rank, message)  # non-finite losses and averages
            self._route(rank, message)
        except RemoteProtocolError as exc:
            self._evict(rank, exc)

    def _route(self, rank: int, message: m.RankMessage) -> None:
        match message:
            case m.BatchDone():
                self._on_batch(rank, message)
            case m.Batches(items=items):
                for item in items:
                    self._on_batch(rank, item)
            case m.SyncAck():
                self._on_sync_ack(rank, message)
            case m.SnapshotReady():
                self._on_snapshot(rank, message)
            case m.Heartbeat() | m.InitialState():  # InitialState: failures.screen
                pass
            case m.LrUpdate(lr=lr):
                self.tuner.note_lr(rank, lr)
            case m.EvalResult() | m.CheckpointResult() if self.planner.planned_ahead:
                self._early.append((rank, message))  # asked ahead: its cost is the next window's
            case m.EvalResult() | m.CheckpointResult():
                self._on_callback_result(rank, message)
            case m.EpochFnElapsed(elapsed_ms=elapsed_ms):
                self.callbacks.on_epoch_fn(rank, elapsed_ms)
            case m.StateSaved():
                self._on_state_saved(rank, message)
            case m.Exiting(reason=reason):
                if self.state is not RunState.DONE:
                    self._lose(rank, f"exited: {reason}" if reason else "exited")
            case m.Failed():
                failures.on_failed(self, rank, message)
            case m.Hello():
                raise RemoteProtocolError("sent Hello after joining", rank=rank)
            case _:
                assert_never(message)

    def _on_batch(self, rank: int, msg: m.BatchDone) -> None:
        # Batches still count while saving: the writer's model holds them.
        self.work.record_batch(rank, msg.epoch, msg.offset, msg.size)
        if self.planner.planned_ahead:  # the next window's, while its round is in flight
            self._early.append((rank, msg))
        else:
            self._time_batch(rank, msg)
        self.planner.note_progress(rank, self._now)
        self.telemetry.on_batch(rank, msg.size, msg.batch_ms, msg.loss)
        if msg.loss is not None and math.isfinite(msg.loss):
            total, count = self.epoch_loss.get(msg.epoch, (0.0, 0))
            self.epoch_loss[msg.epoch] = (total + msg.loss, count + 1)
        if self.work.busy_samples(rank) == 0:
            self._dispatch(rank)
            self._offer_reserve(rank)
        if rank in self._unsatisfied and self.planner.satisfied(rank):
            self._unsatisfied.discard(rank)
        if self._unsatisfied and not self.round.in_flight and not self.work.busy_samples(rank):
            self._out += self.telemetry.held(rank, self.work.steps_since_sync(rank))

    def _on_callback_result(self, rank: int, msg: m.EvalResult | m.CheckpointResult) -> None:
        if self.callbacks.answered_already(msg):  # asked again after a restore: answered twice
            self.stale_messages += 1
            self._out.append(self.callbacks.on_answered_twice(rank, msg))
            return
        if isinstance(msg, m.EvalResult):
            told = self.callbacks.on_eval_result(rank, msg, self.live)
            self._journal()  # answered: a successor does not ask for it again
            self._out += told
        else:
            told = self.callbacks.on_checkpoint_result(rank, msg, self.live)
            self._journal()  # answered (or asked of another rank): as a successor must know
            self._out += told
        self._maybe_close()

    def _time_batch(self, rank: int, msg: m.BatchDone) -> None:
        """Book a batch's timing and loss in its window's ledger."""
        self.ledger.record_batch(rank, msg.batch_ms, msg.data_ms)
        if msg.loss is not None and math.isfinite(msg.loss):
            self.ledger.record_batch_loss(rank, msg.loss)

    def _offer_reserve(self, asker: int) -> None:
        """Offer the epoch tail's reserve to the ranks already idle in it.

        A rank given batches holds the averaging gate again until it has
        trained them.
        """
        for rank in self.planner.reserve_takers():
            if rank != asker and rank not in self.joins.fresh:
                self._dispatch(rank)
                if not self.planner.satisfied(rank):
                    self._unsatisfied.add(rank)

    def _on_rejected(self, reason: str, rank: int | None) -> None:
        self.rejected_frames += 1
        # First one is news; after that, one line per thousand keeps logs sane.
        if self.rejected_frames == 1 or self.rejected_frames % 1000 == 0:
            who = "unknown peer" if rank is None else f"rank {rank}"
            self._notice(
                "warning",
                f"rejected frame from {who}: {reason} ({self.rejected_frames} rejected so far)",
            )

    # -- averaging -----------------------------------------------------------

    def _progress(self) -> None:
        if self.round.in_flight or self._unsatisfied:
            return
        if self.planner.probing and self.tuner.calibrate_in_window(self.live, self.dead_ranks):
            self._plan_window(continuing=True)  # the probe goes on as the first window
            if self._unsatisfied:
                return
        live = self.live
        if live and any(self.work.steps_since_sync(r) > 0 for r in live):
            self._out += self.round.start(set(live), self._now, self.generation)
            ahead.hand_out(self)
            if self.work.trained_epochs():  # the round may end them: their losses are all in
                self._journal()

    def _on_sync_ack(self, rank: int, msg: m.SyncAck) -> None:
        if self.round.late_ack(rank, msg):
            return  # its average of a round abandoned at a death: its steps are committed
        if not self.round.on_ack(rank, msg, self._now):
            self.stale_messages += 1
            return
        if msg.failed:  # its steps are unaveraged again: it counts its budget with them
            self.planner.round_failed(rank, self._now)
            if self.work.busy_samples(rank) > 0:
                budget, window = self.planner.budget[rank], self.planner.window_steps(rank)
                self._out.append(Send(rank=rank, message=m.SetBudget(budget=budget, window=window)))
        elif self.config.backend is Backend.COLLECTIVE:  # the ack committed its steps
            self.planner.averaged(rank, self.round.acks[rank], self._now)
        if self.round.complete(set(self.live)):
            # What a rank trained through the round is no cost of it: the
            # balancer sizes windows by what the round held the ranks.
            self._finish_round(held_until_s=self.round.held_until_s)
        elif self.round.broken(set(self.live)):
            self._regroup_broken_round()

    def _regroup_broken_round(self) -> None:
        """Every member's collective broke and none was lost: a member came to
        the round later than its peers waited (the collective timeout), and
        the group may be out of step. The round is abandoned as at a death
        and the same members form a new group to try it again."""
        live = sorted(self.live)
        self._notice(
            "warning",
            f"round {self.round.number}'s collective failed on every rank (none lost: "
            "a collective timeout); the group re-forms and the round is tried again",
        )
        self.round.close()
        self.planner.plan_afresh()
        self.generation += 1
        self._broadcast(m.Regroup(generation=self.generation, members=live))
        self._retry_abandoned(live)
        self._unsatisfied = {r for r in self.workers if not self.planner.satisfied(r)}

    def _on_snapshot(self, rank: int, msg: m.SnapshotReady) -> None:
        if not self.round.on_snapshot(rank, msg):
            self.stale_messages += 1
            return
        order = self.round.average(set(self.live))
        if order is not None:
            self._out.append(order)

    def _on_average_computed(self, number: int) -> None:
        live = set(self.live)
        self._out += self.round.on_average_computed(number, live)
        for rank, steps in self.round.snapshot_steps.items():  # committed now
            self.planner.averaged(rank, steps, self._now)
        if self.round.complete(live):
            self._finish_round()

    def _finish_round(self, *, held_until_s: float | None = None) -> None:
        rnd = self.round
        rnd.close()
        self.last_round = rnd.number
        if self.joins.fresh & set(rnd.acks):  # a joiner holds the consensus now: plan it in
            self.planner.plan_afresh()
        self.joins.averaged(rnd)  # a joiner's first round: its model is no replica's yet
        end_s = self._now if held_until_s is None else held_until_s
        sync_ms = (end_s - rnd.started_s) * 1000.0
        k_used, commands = self.tuner.close_round(
            rnd, sync_ms, self.live, set(self.dead_ranks), planned_ahead=self.planner.planned_ahead
        )
        self._out.extend(commands)
        results = ahead.book_early(self)  # the window handed out ahead is the ledger's now
        self.rounds_done += 1
        self.global_step += k_used
        serving = self.work.open_epochs()
        epoch = serving[0] if serving else min(self.epochs_completed, self.config.epochs - 1)
        self._out += self.telemetry.on_round(self._now, self.live, epoch)
        self._journal()
        self._send_progress(rnd.number)
        self._open_window()
        for rank, result in results:  # an eval asked ahead: after the end of its epoch
            self._on_callback_result(rank, result)
        self._journal()  # the epochs it settled: a successor does not settle them again

    def _journal(self) -> None:
        """Append the journal record of a new round, new open epochs, a round
        abandoned or a callback asked or answered (once each).

        Called before any work of the new window or epoch is sent: a rank can
        only hold batches of epochs the journal knows open. After an abandoned
        round: the next round's number is past it, as a successor must know.
        """
        if self.state not in (RunState.TRAINING, RunState.FINISHING, RunState.CLOSING):
            return
        asked = self.callbacks
        pending = (
            tuple(sorted(asked.pending_evals.items())),
            tuple(sorted(asked.pending_checkpoints.items())),
        )
        key = (self.rounds_done, tuple(self.work.open_epochs()), self.round.number, pending)
        if key == self._journaled:
            return
        compact = self._journaled is None or key[1] != self._journaled[1]
        self._journaled = key
        self._out.append(AppendJournal(record=journal.record_of(self), compact=compact))

    # -- windows, epochs and dispatch ----------------------------------------

    def _open_window(self) -> None:
        """A round closed (or training began): settle epochs, hand out work."""
        self._settle_epochs()
        if self.state is not RunState.TRAINING:
            return
        if self.work.serving_epoch() is None and not self.work.open_epochs():
            nxt = self.work.next_epoch_to_open()
            if nxt is None:
                self._end_of_training()
                return
            self._open_epoch(nxt)
        if not ahead.stands(self):  # a window handed out as the round started stands
            self._plan_window()

    def _plan_window(self, *, continuing: bool = False) -> None:
        live = self.workers
        plan = self.planner.open_window(live, continuing=continuing, now_s=self._now)
        for rank, update in zip(live, plan, strict=True):
            if update is not None:
                self._out.append(Send(rank=rank, message=update))
        self._send_progress(self.round.number)  # again: the shares of the budgets just planned
        for rank in live:
            self._dispatch(rank)
        self._unsatisfied = {r for r in self.workers if not self.planner.satisfied(r)}

    def _open_epoch(self, epoch: int) -> None:
        self.planner.open_epoch(epoch, set(self.workers))
        role = self.roles.take_dirty_epoch_role()
        if role is not None:
            self._broadcast(m.SetEpochCallbackRole(rank=role))
        self._emit(tl.EpochStart(epoch=epoch))
        self._journal()  # before its first chunk is sent

    def _dispatch(self, rank: int) -> None:
        """Give ``rank`` its next chunk if it is idle and may take one."""
        if self.rank_state[rank] is not RankState.LIVE or self.state is not RunState.TRAINING:
            return
        if rank in self.joins.fresh:  # it takes the consensus in the next round first
            return
        if self.planner.needs_next_epoch(rank):
            self._stream_ahead()
        chunk = self.planner.next_chunk(rank, self.workers, self._now)
        if chunk is not None:
            self._out.append(Send(rank=rank, message=chunk))

    def _stream_ahead(self) -> None:
        """Async: open the next epoch early (at most two open) so fast ranks keep streaming."""
        nxt = self.work.next_epoch_to_open()
        if nxt is not None and len(self.work.open_epochs()) < 2:
            self._open_epoch(nxt)

    def _settle_epochs(self) -> None:
        """End the epochs every sample of which an average holds, journaled first.

        The record says them ended, their callbacks asked and their checkpoint
        begun, before their ``EpochEnd`` is written: a coordinator lost between
        the two left a successor the record before, which ended them again
        (two ``EpochEnd`` for one epoch, the second without its loss).
        """
        out, self._out = self._out, []
        for epoch in self.work.finished_epochs():
            self._epoch_finished(epoch)
        ended, self._out = self._out, out
        if ended:
            self._journal()
        self._out += ended

    def _epoch_finished(self, epoch: int) -> None:
        total, count = self.epoch_loss.pop(epoch, (0.0, 0))
        loss = total / count if count else None
        self.epochs_completed = max(self.epochs_completed, epoch + 1)
        self._out += self.telemetry.epoch_ended(self._now, self.live, epoch)
        end = tl.EpochEnd(epoch=epoch, loss=loss, rounds_done=self.rounds_done, lr=self.tuner.lr)
        self._emit(end)
        self._broadcast(m.EpochDone(epoch=epoch, loss=loss))
        done = epoch + 1
        if done != self._asked_early:  # asked as the round that ends it started
            self._out += self.callbacks.at_epoch_end(done, self.workers)
        if self.callbacks.checkpoint_due(done) and self.config.save_path is not None:
            # A newer bundle supersedes one still being written.
            meta = ending.meta(self, SaveReason.CHECKPOINT)
            self._out += self.saves.start(SaveKind.CHECKPOINT, self.workers, self._now, meta=meta)

    def _end_of_training(self) -> None:
        if self.callbacks.pending or SaveKind.CHECKPOINT in self.saves:
            self.state = RunState.FINISHING
            return
        self.state = RunState.CLOSING
        self._out += self.saves.start(SaveKind.FINAL, self.workers, self._now)
        ending.settle(self)  # with no rank left nobody can write it

    def _maybe_close(self) -> None:
        """A callback answered: a finishing run may now be done."""
        if self.state is RunState.FINISHING:
            self._end_of_training()

    # -- failures --------------------------------------------------------------

    def _evict(self, rank: int, exc: RemoteProtocolError) -> None:
        self._notice("error", f"evicting rank {rank}: {exc}")
        self._lose(rank, f"protocol error: {exc}", errored=True)

    def _lose(self, rank: int, reason: str, *, errored: bool = False) -> None:
        state = self.rank_state[rank]
        self.joins.forget(rank)
        if state is RankState.VACANT:  # a join not admitted yet: its slot stays free
            return
        if state is RankState.DEAD or state is RankState.ERRORED or self.outcome is not None:
            return
        self.rank_state[rank] = RankState.ERRORED if errored else RankState.DEAD
        self.dead_ranks.append(rank)
        self.lost_reasons[rank] = reason
        self._emit(tl.RankLost(rank=rank, reason=reason))
        if self.state is RunState.FORMING:
            failures.lost_forming(self, rank, reason)
            return
        if self.state in (RunState.SAVING, RunState.CLOSING):
            self._out += self.saves.lost(rank, self.workers)
            ending.settle(self)
            return
        self.round.leave(rank)  # what an average already holds stays committed
        reissued = self.work.forfeit(rank)
        self.elche.retire(rank)
        self.planner.note_rank_lost(rank)
        live = self.workers  # the survivors holding the consensus (a fresh joiner does not)
        self._notice(
            "warning",
            f"rank {rank} lost ({reason}); {reissued} samples go back to the "
            f"{len(live)} survivor(s)",
        )
        self.roles.on_death(rank, live, self.elche.smoothed_ms_per_batch)
        self._out += self.telemetry.roles_moved()
        # Training over, a lone survivor holds the final consensus: it finishes the run.
        over = self.state is RunState.FINISHING
        reason_to_save = (
            None if over else reason_to_stop(self.config, len(self.dead_ranks), len(live))
        )
        if reason_to_save is not None:
            ending.save_and_stop(self, reason_to_save)
            return
        self._out += self.saves.lost(rank, live)
        ending.settle(self)
        self._out += self.callbacks.on_death(rank, self.workers)
        self._after_death()
        self._maybe_close()  # what the dead rank owed may have been all that was left

    def _after_death(self) -> None:
        rnd = self.round
        live = set(self.live)
        self.planner.plan_afresh()  # a window planned ahead held the dead rank's share
        if self.config.backend is Backend.COLLECTIVE:
            self.generation += 1
            self._broadcast(m.Regroup(generation=self.generation, members=sorted(live)))
        self._out += rnd.after_death(live)
        if rnd.in_flight and rnd.complete(live):
            self._finish_round()
            return
        role = self.roles.take_dirty_epoch_role()
        if role is not None:
            self._broadcast(m.SetEpochCallbackRole(rank=role))
        if self.state is RunState.TRAINING:
            self.planner.forget_tail_plan()
            if not rnd.in_flight:
                self._retry_abandoned(sorted(live))
            self._unsatisfied = {r for r in self.workers if not self.planner.satisfied(r)}

    def _retry_abandoned(self, survivors: list[int]) -> None:
        """The round was abandoned: a window handed out ahead waits for its retry,
        and the journal hears that its number is spent."""
        self._journal()
        for rank, update in zip(survivors, self.planner.undo_ahead(survivors), strict=True):
            if update is not None:
                self._out.append(Send(rank=rank, message=update))
        for rank in survivors:
            self.planner.note_work_returned(rank)
            self._dispatch(rank)

    def _on_state_saved(self, rank: int, msg: m.StateSaved) -> None:
        out = self.saves.answered(rank, msg, self.workers)
        if out is None:
            self.stale_messages += 1
            return
        self._out += out
        ending.settle(self)

    # -- timers ----------------------------------------------------------------

    def _on_timer(self) -> None:
        liveness.on_timer(self)

    def _arm(self) -> None:
        self._out.append(ArmTimer(deadline_s=self._now + self.config.heartbeat_interval_s))

    # -- output helpers --------------------------------------------------------

    def _send_progress(self, round_number: int, *, expected: bool = False) -> None:
        """Tell each live rank the global progress after ``round_number``, its share
        of the next window and where that window ends (``m.GlobalProgress``).

        ``expected``: the round has just started, with the next window handed
        out behind it: the samples are those it averages if every member takes
        part (its close says the exact count).
        """
        work = self.work
        samples = work.samples_reported() if expected else work.samples_averaged()
        counts = self.planner.window_counts(self.workers)
        total = sum(counts.values())
        horizon = 0  # while the probe streams, the first window's size is not known yet
        if not self.planner.probing:
            horizon = samples + total * self.config.batch_size
            opened = work.open_epochs()
            if opened:  # a window ends by the end of its epoch (its tail is one window)
                horizon = min(horizon, (opened[-1] + 1) * work.num_samples)
        for rank, count in counts.items():
            message = m.GlobalProgress(
                round=round_number, samples=samples, share=count / total, horizon=horizon
            )
            self._out.append(Send(rank=rank, message=message))

    def _end_ranks(self, message: m.Shutdown) -> None:
        """The run is over: the last ``Shutdown`` to every live rank, and to every join
        still waiting to be admitted (which would otherwise wait out its silence)."""
        ranks = (*self.live, *sorted(self.joins.pending))
        if ranks:
            self._out.append(Broadcast(ranks=ranks, message=message))

    def _broadcast(self, message: m.CoordMessage) -> None:
        ranks = tuple(self.live)
        if ranks:
            self._out.append(Broadcast(ranks=ranks, message=message))

    def _notice(self, level: str, text: str) -> None:
        self._out.append(Notice(level=level, text=text))

    def _emit(self, event: tl.TimelineEvent) -> None:
        self._out.append(Emit(event=event))


def _balancer_state(resume: CheckpointMeta | None, config: CoordinatorConfig) -> ElCheState | None:
    """The balancer's saved state, if it is for this many ranks (else it starts afresh),
    over this run's rank ids: the saving run may have had other ``join_slots``."""
    if resume is None or resume.world_size != config.world_size or resume.elche_state is None:
        return None
    return resume.elche_state.for_slots(config.num_slots)
