"""A virtual-time driver of the coordinator core.

Theory of operation. The simulator plays the IO shell and every rank. Time is
virtual: an event heap holds (time, seq, action) entries and the loop jumps
straight to the next one, so hours of training take seconds. Each simulated
rank runs the real rank rules (``elche.core.rank.RankProtocol``, the same
state machine the worker drives) and adds only virtual time:

- a batch at speed ``s`` takes ``base_ms / s`` (times a seeded jitter
  factor); messages that arrive meanwhile are taken, and the protocol is
  asked what to do next when the step ends, as a real rank drains its
  messages between steps;
- collective rounds complete only when every member of the current group has
  entered; a dead member hangs the collective until ``Regroup`` (or a
  shutdown) arrives, which the rank then leaves, as a real collective errors
  out once its peer is gone. With ``overlap`` (the runtime's default) a rank
  launches its round and trains on; it lands the round at the first step
  boundary after the collective completed, or waits for it when its
  protocol says ``Land`` (work that arrives meanwhile lets it train on). A
  member killed while a round travels breaks the ring: on some survivors
  (seeded, at least one) the round fails at once, as gloo's does when the
  peer's sockets close; the others' waits on a live peer until the
  ``Regroup``, when the first leave the old group (a stalled member's round
  hangs until ``Regroup`` on every survivor);
- coordinator-backend rounds upload a snapshot, the "coordinator" averages for
  ``sync_ms``, and the rank loads the result when its step ends.

Messages travel with a small latency. A killed rank is noticed after
``exit_detect_ms`` (the launcher's child watch); a stalled one only through
the heartbeat timeout. A fault (``elche.core.faults``) fires at its virtual
``at_s``, or when its rank is about to train the batch at ``at_epoch``,
whichever comes first, and once.

A ``Join`` fault starts a new rank in its join slot at its ``at_s``: it says
``Hello`` (``RankJoined``), heartbeats, and from then on runs the rank rules
like the others. A coordinator restarted from its journal keeps no joined
ranks: it refuses a joined rank's rejoin, and the rank stops (its held work
goes back to the pools, as a lost rank's).

A ``KillCoordinator`` fault loses the coordinator: whatever it had not sent
yet and whatever is on its way to it is gone; after ``exit_detect_ms`` the
shell restores a new one from the journal it kept (``Coordinator.restore``),
tells it of the ranks lost meanwhile, and each live rank rejoins at its next
step boundary with what it holds (``RankProtocol.rejoin``), as a real rank
does when the new coordinator asks. A coordinator lost before the run formed
(no journal yet) is not restarted: the fault is ignored.

Besides driving the core, the simulator keeps its own ground truth of which
trained batches reached a consensus model. ``SimResult.lost_samples`` and
``duplicated_samples`` come from that truth, not from the core's books, so a
bookkeeping bug in the core shows up as a non-zero count.
"""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import assert_never

import msgspec

from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.checkpoint import CheckpointMeta, SaveReason
from elche.core.commands import (
    AppendJournal,
    ArmTimer,
    AverageSnapshots,
    Broadcast,
    Command,
    Emit,
    Finish,
    Notice,
    ReformFirstGroup,
    Send,
    WriteMeta,
)
from elche.core.config import CallbackPolicy, CoordinatorConfig, Mode, SchedulerConfig
from elche.core.coordinator import Coordinator
from elche.core.errors import ConfigError
from elche.core.events import (
    AverageComputed,
    Event,
    MessageReceived,
    RankJoined,
    RankLost,
    Started,
    StopRequested,
    TimerFired,
)
from elche.core.faults import (
    FailCheckpoint,
    FaultPlan,
    FillSavePath,
    Join,
    Kill,
    KillCoordinator,
    SlowDown,
    Stall,
    StopLauncher,
    position,
)
from elche.core.journal import JournalRecord
from elche.core.rank import (
    Average,
    Callback,
    Discard,
    Done,
    FormGroup,
    Hold,
    Land,
    Load,
    RankProtocol,
    RankStage,
    Save,
    SaveKind,
    StartEpoch,
    Train,
    Upload,
)
from elche.sim.result import RankResult, SimResult, coverage_errors

__all__ = ["TICK_EVENTS", "SimConfig", "SimError", "Simulation", "simulate"]

TICK_EVENTS = 1 << 12  # ``Simulation.run``'s ``tick`` comes after this many events

Batch = tuple[int, int, int]  # (epoch, offset, size)


class SimError(RuntimeError):
    """The simulated run did not end (a liveness bug in the core)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """One simulated run.

    Args:
        speeds: per-rank speed as a fraction of the fastest (1.0).
        base_ms: solo step time at speed 1.
        sync_ms: cost of one averaging round (collective or coordinator).
        jitter: relative standard deviation of each step's time.
        latency_ms: one-way message latency.
        exit_detect_ms: how fast a killed process is noticed.
        callback_rank: ``"fastest"`` (the default policy) or the rank that
            eval and checkpoint are pinned to.
        overlap: collective rounds are launched and trained through, as
            ``elche.train(overlap=True)`` makes them.
    """

    speeds: tuple[float, ...]
    mode: Mode = Mode.CADENCE
    epochs: int = 3
    samples: int = 30_000
    batch_size: int = 32
    base_ms: float = 10.0
    sync_ms: float = 5.0
    jitter: float = 0.0
    seed: int = 0
    faults: FaultPlan = FaultPlan()
    latency_ms: float = 0.05
    exit_detect_ms: float = 100.0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    max_failures: int | None = None
    scheduler: SchedulerConfig = SchedulerConfig()
    eval_every: int | None = None
    eval_ms: float = 0.0
    checkpoint_every: int | None = None
    checkpoint_ms: float = 0.0
    save_path: str | None = "sim-bundle"
    resume: CheckpointMeta | None = None
    max_virtual_s: float = 1e7
    callback_rank: int | str = "fastest"
    overlap: bool = True

    def __post_init__(self) -> None:
        if not self.speeds:
            raise ConfigError("speeds", "need at least one rank")
        for speed in self.speeds:
            if not (isinstance(speed, int | float) and 0 < speed <= 1):
                raise ConfigError("speeds", f"each speed must be in (0, 1], got {speed!r}")
        if not (self.base_ms > 0 and math.isfinite(self.base_ms)):  # 0 and -1 alike
            raise ConfigError("base_ms", f"must be a finite number > 0, got {self.base_ms}")
        for field_name in ("sync_ms", "latency_ms", "exit_detect_ms"):
            value = getattr(self, field_name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(field_name, f"must be a finite number >= 0, got {value}")
        if not 0 <= self.jitter < 1:
            raise ConfigError("jitter", f"must be in [0, 1), got {self.jitter}")
        self._check_length()
        self.faults.check(len(self.speeds), joins=True)
        if not isinstance(self.overlap, bool):
            raise ConfigError("overlap", f"must be True or False, got {self.overlap!r}")
        if self.callback_rank != "fastest" and not isinstance(self.callback_rank, int):
            raise ConfigError(
                "callback_rank", f"must be 'fastest' or a rank, got {self.callback_rank!r}"
            )

    def _check_length(self) -> None:
        """Refuse a run that lasts longer than ``max_virtual_s`` at the least: the
        slowest rank's one step, or every sample trained at the speeds' sum with no
        round's cost. It would run for hours, every rank's heartbeat simulated each
        virtual second, and then fail. (Bad counts are the coordinator's to refuse.)"""
        base_s, slowest = self.base_ms / 1000, min(self.speeds)
        limit = f"past the simulator's limit of {self.max_virtual_s:g} virtual s"
        if base_s > self.max_virtual_s:
            raise ConfigError("base_ms", f"a step lasts {base_s:.3g} virtual s, {limit}")
        if base_s / slowest > self.max_virtual_s:
            raise ConfigError(
                "speeds", f"a step at speed {slowest:g} lasts {base_s / slowest:.3g} virtual s "
                f"(base_ms {self.base_ms:g} / {slowest:g}), {limit}; give speeds of at least "
                f"{base_s / self.max_virtual_s:.3g} or a shorter base_ms"
            )  # fmt: skip
        counts = (self.epochs, self.samples, self.batch_size)
        if not all(isinstance(n, int) and n > 0 for n in counts):
            return
        steps = self.epochs * math.ceil(self.samples / self.batch_size)
        least_s = steps * base_s / sum(self.speeds)
        if least_s > self.max_virtual_s:
            raise ConfigError(
                "epochs", f"{self.epochs} epoch(s) of {self.samples} samples in steps of "
                f"{self.batch_size}, {self.base_ms:g} ms each at speed 1, take at least "
                f"{least_s:.3g} virtual s on these speeds, {limit}; give fewer epochs or "
                "samples, a larger batch size or a shorter base_ms"
            )  # fmt: skip

    def coordinator_config(self) -> CoordinatorConfig:
        pinned = self.callback_rank if isinstance(self.callback_rank, int) else None
        return CoordinatorConfig(
            mode=self.mode,
            world_size=len(self.speeds),
            num_samples=self.samples,
            batch_size=self.batch_size,
            epochs=self.epochs,
            seed=self.seed,
            scheduler=self.scheduler,
            heartbeat_interval_s=self.heartbeat_interval_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            max_failures=self.max_failures,
            has_eval_fn=self.eval_every is not None,
            eval_every=self.eval_every or 1,
            checkpoint_every=self.checkpoint_every,
            save_path=self.save_path,
            callback_policy=CallbackPolicy.FASTEST if pinned is None else CallbackPolicy.PINNED,
            callback_rank=pinned or 0,
            join_slots=self.faults.join_slots(len(self.speeds)),
        )


@dataclass(slots=True)
class _Rank:
    """A simulated worker process: the rank protocol plus virtual-time IO.

    ``working`` is true while an action takes virtual time (a step, a
    callback, a collective); the protocol is asked nothing meanwhile.
    """

    rank: int
    speed: float
    proto: RankProtocol
    alive: bool = True
    stalled: bool = False
    finished: bool = False
    working: bool = False
    token: int = 0
    in_collective: bool = False
    # A launched round: its number and the batches it averages; whether its
    # collective completed; whether the rank waits for it (``Land``).
    flight: tuple[int, list[Batch]] | None = None
    flight_done: bool = False
    flight_ok: bool = True  # done: completed (True) or failed (False)
    through_ms: float = 0.0  # trained while the flight travelled
    landing: bool = False
    rejoin_due: bool = False  # a restored coordinator waits for its Hello
    snapshot: list[Batch] = field(default_factory=list)  # ground truth of the upload
    uncommitted: deque[Batch] = field(default_factory=deque)
    busy_s: float = 0.0
    stopped_at_s: float | None = None
    joined: bool = True  # a join slot's rank: False until its Join fires
    started_s: float | None = None  # when it joined (a joined rank)

    @property
    def active(self) -> bool:
        return self.alive and not self.stalled and not self.finished and self.joined


class Simulation:
    """Drives one ``Coordinator`` with simulated ranks in virtual time.

    Args:
        config: the simulated run.
        record_trace: keep every event and the commands it produced in ``trace``.
        core: drive this coordinator instead of a new one made from ``config``
            (a test can script the coordinator's side of the protocol).
    """

    def __init__(
        self, config: SimConfig, *, record_trace: bool = False, core: Coordinator | None = None
    ) -> None:
        self.config = config
        self.core = core or Coordinator(config.coordinator_config(), resume=config.resume)
        self.now = 0.0
        self.ranks = [
            _Rank(
                rank=r,
                speed=s,
                proto=RankProtocol(r, mode=config.mode, batch_size=config.batch_size),
            )
            for r, s in enumerate(config.speeds)
        ]
        world = len(config.speeds)
        joins = {f.rank: f.speed for f in config.faults.faults if isinstance(f, Join)}
        for r in range(world, world + config.faults.join_slots(world)):
            proto = RankProtocol(r, mode=config.mode, batch_size=config.batch_size)
            self.ranks.append(_Rank(rank=r, speed=joins.get(r, 1.0), proto=proto, joined=False))
        self.rng = random.Random(config.seed)
        self._ring_rng = random.Random(config.seed + 1)  # which survivors a broken ring tells first
        self.notices: list[tuple[float, str, str]] = []
        self.timeline: list[tl.TimelineEvent] = []  # stamped with virtual time
        self.trace: list[str] | None = [] if record_trace else None
        self.metas: list[CheckpointMeta] = []
        self.journal: list[JournalRecord] = []  # since the last compaction
        self.committed: dict[int, list[tuple[int, int]]] = {}
        self.committed_by_rank = [0] * len(self.ranks)
        self.finish: Finish | None = None
        self.started_s: float | None = None  # RunStart: every rank joined
        self.end: tl.RunEnd | None = None  # the core's account of the run
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._timer_token = 0
        self._group = set(range(world))
        self._collective: dict[int, int] | None = None  # rank -> steps entered with
        self._collective_round = -1
        self._averaging: dict[int, list[Batch]] = {}
        self._core_gen = 0  # coordinators lost so far: what was sent to an older one is gone
        self._joined_gen = [0] * len(self.ranks)  # the coordinator each rank has joined
        faults = config.faults.faults
        self._fail_checkpoint = {f.rank for f in faults if f.from_start}
        self._disk_full = False  # FillSavePath: every bundle write fails from then on
        self._fired: set[int] = set()  # indices into faults
        self._by_progress = {  # rank -> indices of its faults with a progress trigger
            r: [i for i, f in enumerate(faults) if f.rank == r and f.at_epoch is not None]
            for r in range(len(self.ranks))
        }

    # -- the loop --------------------------------------------------------------

    def run(
        self, tick: Callable[[Simulation], None] | None = None, *, every: int = TICK_EVENTS
    ) -> SimResult:
        """Run to the end; returns the measured result. ``tick`` is called with this
        simulation after each ``every`` events (a progress display's cue).

        Raises:
            SimError: the run did not finish (no event left, or past
                ``max_virtual_s``).
        """
        self._to_core(Started())
        for rank in range(len(self.config.speeds)):
            self._to_core(RankJoined(rank=rank, host="sim"))
            self._at(self.config.heartbeat_interval_s, functools.partial(self._heartbeat, rank))
        for index, fault in enumerate(self.config.faults.faults):
            if fault.at_s is not None:
                self._at(fault.at_s, functools.partial(self._fault, index))
        events = 0
        while self.finish is None:
            if not self._heap:
                raise SimError(f"simulation stalled at {self.now:.3f} s with nothing scheduled")
            events += 1
            if tick is not None and events % every == 0:
                tick(self)
            when, _, action = heapq.heappop(self._heap)
            if when > self.config.max_virtual_s:
                raise SimError(f"simulation passed {self.config.max_virtual_s} virtual seconds")
            self.now = when
            action()
        return self._result()

    def _at(self, when: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, action))

    def _after_ms(self, delay_ms: float, action: Callable[[], None]) -> None:
        self._at(self.now + delay_ms / 1000.0, action)

    # -- the shell side --------------------------------------------------------

    def _to_core(self, event: Event) -> None:
        gen = self._core_gen
        self._after_ms(self.config.latency_ms, lambda: self._deliver(event, gen))

    def _deliver(self, event: Event, gen: int) -> None:
        if gen == self._core_gen:  # else it was on its way to a coordinator that is gone
            self._core_handle(event)

    def _core_handle(self, event: Event) -> None:
        if self.finish is not None:
            return
        commands = self.core.handle(event, self.now)
        if self.trace is not None:
            self.trace.append(f"{self.now:.6f} {event!r} -> {commands!r}")
        for command in commands:
            self._execute(command)

    def _execute(self, command: Command) -> None:
        match command:
            case Send(rank=rank, message=message):
                self._to_rank(rank, message)
            case Broadcast(ranks=ranks, message=message):
                for rank in ranks:
                    self._to_rank(rank, message)
            case ArmTimer(deadline_s=deadline):
                self._timer_token += 1
                token = self._timer_token
                self._at(max(deadline, self.now), lambda: self._timer(token))
            case AverageSnapshots(round=number, param_mass=mass):
                self._start_average(number, [r for r, _ in mass])
            case WriteMeta(meta=meta):
                self.metas.append(meta)
            case AppendJournal(record=record, compact=compact):
                if compact:
                    self.journal.clear()
                self.journal.append(record)
            case Notice(level=level, text=text):
                self.notices.append((self.now, level, text))
            case Emit(event=event):
                self.timeline.append(msgspec.structs.replace(event, t=self.now))
                if isinstance(event, tl.RunStart):
                    self.started_s = self.now
                elif isinstance(event, tl.RunEnd):
                    self.end = event
            case ReformFirstGroup():
                pass  # simulated ranks form no store-made group to wait in
            case Finish():
                self.finish = command
            case _:
                assert_never(command)

    def _timer(self, token: int) -> None:
        if token == self._timer_token:
            self._core_handle(TimerFired())

    def _start_average(self, number: int, holders: list[int]) -> None:
        self._averaging = {r: list(self.ranks[r].snapshot) for r in holders}
        gen = self._core_gen

        def done() -> None:
            if gen != self._core_gen:  # the coordinator died averaging: no rank got it
                return
            for rank, batches in sorted(self._averaging.items()):
                self._commit(rank, batches)
            self._averaging = {}
            self._core_handle(AverageComputed(round=number))

        self._after_ms(self.config.sync_ms, done)

    def _commit(self, rank: int, batches: list[Batch]) -> None:
        """Ground truth: these batches of ``rank`` are in a consensus model."""
        sim_rank = self.ranks[rank]
        for batch in batches:
            epoch, offset, size = batch
            self.committed.setdefault(epoch, []).append((offset, size))
            self.committed_by_rank[rank] += size
            if sim_rank.uncommitted and sim_rank.uncommitted[0] == batch:
                sim_rank.uncommitted.popleft()

    # -- faults ----------------------------------------------------------------

    def _fault(self, index: int) -> None:
        """Fire fault ``index`` of the plan (once; a gone rank ignores it)."""
        if index in self._fired:
            return
        self._fired.add(index)
        fault = self.config.faults.faults[index]
        rank = self.ranks[fault.rank]
        if isinstance(fault, Join) and not rank.joined and self.finish is None:
            self._join(rank)
        if not rank.active:
            return
        match fault:
            case Join():
                pass  # joined above
            case KillCoordinator():
                self._lose_coordinator()
            case Kill():
                self._stop(rank)
                rank.alive = False
                self._break_flights(fault.rank)
                reason = "process killed by SIGKILL"
                self._after_ms(
                    self.config.exit_detect_ms,
                    lambda: self._core_handle(RankLost(rank=fault.rank, reason=reason)),
                )
            case Stall():
                self._stop(rank)
                rank.stalled = True
            case SlowDown(speed=speed):
                rank.speed = speed
            case FailCheckpoint():
                self._fail_checkpoint.add(fault.rank)
            case StopLauncher():  # the launcher asks the coordinator to stop, as on SIGTERM
                self._core_handle(StopRequested(reason="SIGTERM"))
            case FillSavePath():
                self._disk_full = True
            case _:
                assert_never(fault)

    def _join(self, r: _Rank) -> None:
        """A new process says Hello in join slot ``r.rank`` and starts heartbeating."""
        r.joined = True
        r.started_s = self.now
        self._joined_gen[r.rank] = self._core_gen
        self._to_core(RankJoined(rank=r.rank, host="sim"))
        self._at(self.now + self.config.heartbeat_interval_s, lambda: self._heartbeat(r.rank))

    def _lose_coordinator(self) -> None:
        if not self.journal or self.finish is not None:
            return
        self._core_gen += 1
        self._timer_token += 1  # its timers died with it
        self._averaging = {}
        self._after_ms(self.config.exit_detect_ms, self._restore_coordinator)

    def _restore_coordinator(self) -> None:
        if self.finish is not None:
            return
        record = self.journal[-1]
        last_save = max((meta.save_seq for meta in self.metas), default=0)  # (all commit here)
        self.core = Coordinator.restore(self.core.config, record, last_save=last_save)
        self._core_handle(Started())
        for r in self.ranks:
            if not r.alive and r.rank not in record.dead_ranks:  # the launcher saw it go
                self._core_handle(RankLost(rank=r.rank, reason="process killed by SIGKILL"))
            elif r.active:
                r.rejoin_due = True
                self._next(r)

    def _rejoin(self, r: _Rank) -> None:
        r.rejoin_due = False
        r.snapshot = []
        hello = r.proto.rejoin(world_size=len(self.ranks), host="sim")
        self._joined_gen[r.rank] = self._core_gen
        self._to_core(RankJoined(rank=r.rank, host="sim", held=hello.held))

    def _progress_faults(self, r: _Rank, action: Train) -> None:
        """Before ``r`` trains ``action``: fire its faults whose ``at_epoch`` is reached."""
        pending = self._by_progress[r.rank]
        if not pending:
            return
        at = position(epoch=action.epoch, offset=action.offset, num_samples=self.config.samples)
        faults = self.config.faults.faults
        for index in [i for i in pending if faults[i].due(epoch=at)]:
            pending.remove(index)
            self._fault(index)

    def _stop(self, rank: _Rank) -> None:
        rank.token += 1
        rank.working = False
        rank.uncommitted.clear()
        rank.stopped_at_s = self.now

    # -- the ranks -------------------------------------------------------------

    def _to_rank(self, rank: int, message: m.CoordMessage) -> None:
        self._after_ms(self.config.latency_ms, lambda: self._on_rank_message(rank, message))

    def _send(self, rank: int, message: m.RankMessage) -> None:
        if self._joined_gen[rank] == self._core_gen:  # else no coordinator it joined hears it
            self._to_core(MessageReceived(rank=rank, message=message))

    def _heartbeat(self, rank: int) -> None:
        sim_rank = self.ranks[rank]
        if sim_rank.active and self.finish is None:
            self._send(rank, m.Heartbeat(step=sim_rank.proto.steps_since_sync))
            self._at(self.now + self.config.heartbeat_interval_s, lambda: self._heartbeat(rank))

    def _on_rank_message(self, rank: int, message: m.CoordMessage) -> None:
        r = self.ranks[rank]
        if not r.active:
            return
        if isinstance(message, m.Regroup):
            self._group = set(message.members)
            self._collective = None  # abandoned with the old group
        leaving = isinstance(message, m.Regroup | m.Shutdown | m.ShutdownWithSave)
        if r.in_collective and not r.flight_done and leaving:
            # The collective hangs on a dead member; a real one errors out
            # once its peer's process is gone, and the rank moves on (a
            # launched one: its step in progress goes on).
            self._send(r.rank, r.proto.average_failed())
            if r.flight is None or r.landing:
                r.working = False
            r.in_collective = r.landing = False
            r.flight = None
        r.proto.handle(message)
        if r.landing and not isinstance(r.proto.next_action(), Land):
            r.landing = r.working = False  # work came behind the round: train on while it travels
        if r.proto.stage is RankStage.DONE:
            self._finished(r)  # a step in flight is never reported, as on a real rank
        self._next(r)

    def _divergence(self, steps: int) -> float:
        # Synthetic: replicas drift apart roughly with the square root of the
        # steps taken apart; small enough that the guard stays Stable.
        return 0.002 * math.sqrt(max(steps, 1)) * (1.0 + 0.05 * self.rng.gauss(0.0, 1.0))

    def _next(self, r: _Rank) -> None:
        """At a step boundary: do what the rank's protocol says, until it waits."""
        while r.active and not r.working:
            if r.rejoin_due:
                if r.flight is not None:  # as a real rank does: it lands its round first
                    self._land_or_wait(r)
                    continue
                self._rejoin(r)
            action = r.proto.next_action()
            match action:
                case Hold():
                    return
                case Done():
                    self._finished(r)
                case Discard():  # a simulated rank writes no files
                    r.proto.discarded()
                case Save(kind=kind) if self._disk_full and kind is not SaveKind.FINAL:
                    error = "OSError: [Errno 28] No space left on device (simulated)"
                    self._send(r.rank, r.proto.saved(files=[], error=error))  # (final: run dir)
                case Save(writer=writer, kind=kind):
                    if writer and kind is SaveKind.SHUTDOWN:  # its unaveraged steps are saved
                        self._commit(r.rank, list(r.uncommitted))
                    self._send(r.rank, r.proto.saved(files=action.nominal_files(r.rank)))
                case FormGroup(generation=generation):
                    r.proto.regrouped(generation)
                case Load(steps=steps):
                    ack = r.proto.loaded(divergence=self._divergence(steps))
                    r.snapshot = []
                    self._send(r.rank, ack)
                case Average(round=number, steps=steps):
                    if self.config.overlap and len(self._group) > 1:  # a world of one: at once
                        r.proto.launched()
                        r.flight = (number, list(r.uncommitted))
                    self._enter_collective(r, number, steps)
                case Upload():
                    r.snapshot = list(r.uncommitted)
                    self._send(r.rank, r.proto.uploaded())
                case Callback(request=request):
                    self._run_callback(r, request)
                case Train():
                    self._progress_faults(r, action)
                    if r.active:
                        self._train(r, action)
                case StartEpoch():
                    raise AssertionError("simulated ranks run no epoch_fn")
                case Land():
                    self._land_or_wait(r)
                case _:
                    assert_never(action)

    def _finished(self, r: _Rank) -> None:
        r.finished = True
        r.stopped_at_s = self.now

    def _train(self, r: _Rank, action: Train) -> None:
        factor = max(0.1, 1.0 + self.config.jitter * self.rng.gauss(0.0, 1.0))
        duration_ms = self.config.base_ms / r.speed * factor
        r.working = True
        token = r.token
        self._after_ms(duration_ms, lambda: self._batch_done(r, token, action, duration_ms))

    def _batch_done(self, r: _Rank, token: int, action: Train, duration_ms: float) -> None:
        if token != r.token or not r.active:
            return
        r.working = False
        r.busy_s += duration_ms / 1000.0
        if r.flight is not None:
            r.through_ms += duration_ms
        r.uncommitted.append((action.epoch, action.offset, action.size))
        self._send(r.rank, r.proto.trained(action, batch_ms=duration_ms, data_ms=0.0, loss=None))
        if r.flight_done:  # its round completed during the step
            self._land(r)
        self._next(r)

    def _run_callback(self, r: _Rank, request: m.RunEval | m.RunCheckpoint) -> None:
        elapsed_ms = (
            self.config.eval_ms if isinstance(request, m.RunEval) else self.config.checkpoint_ms
        )
        r.working = True
        token = r.token

        def done() -> None:
            if token != r.token or not r.active:
                return
            r.working = False
            r.busy_s += elapsed_ms / 1000.0
            reply: m.RankMessage
            if isinstance(request, m.RunEval):
                reply = r.proto.evaluated(metric=1.0, elapsed_ms=elapsed_ms, error=None)
            else:
                error = "disk full (simulated)" if r.rank in self._fail_checkpoint else None
                reply = r.proto.checkpointed(elapsed_ms=elapsed_ms, error=error)
            self._send(r.rank, reply)
            self._next(r)

        self._after_ms(elapsed_ms, done)

    def _enter_collective(self, r: _Rank, number: int, steps: int) -> None:
        if self._collective is None or self._collective_round != number:
            self._collective = {}
            self._collective_round = number
        r.in_collective = True
        r.working = r.flight is None  # a launched round: the rank trains on
        self._collective[r.rank] = steps
        if set(self._collective) >= self._group:
            entered = dict(self._collective)
            self._after_ms(self.config.sync_ms, lambda: self._finish_collective(number, entered))

    def _finish_collective(self, number: int, entered: dict[int, int]) -> None:
        if self._collective_round != number or self._collective is None:
            return  # abandoned by a regroup
        if not all(self.ranks[r].active for r in entered):
            return  # a member vanished mid-collective: it hangs until Regroup
        self._collective = None
        for rank, steps in sorted(entered.items()):
            r = self.ranks[rank]
            if r.flight is not None:
                r.flight_done = True
                if r.landing:  # else it lands when its step ends
                    self._land(r)
                    self._next(r)
                continue
            self._commit(rank, list(r.uncommitted))
            r.in_collective = r.working = False
            self._send(rank, r.proto.averaged(divergence=self._divergence(steps)))
            self._next(r)

    def _break_flights(self, dead: int) -> None:
        """Rank ``dead`` was killed: the launched rounds of its group fail, on
        some survivors at once (their sockets to it closed), on the others at
        the ``Regroup``."""
        if dead not in self._group:
            return
        waiting = [r for r in self.ranks if r.active and r.flight is not None and not r.flight_done]
        told = [r for r in waiting if self._ring_rng.random() < 0.5] or waiting[:1]
        for r in told:  # the rest wait on a live peer until the Regroup (_on_rank_message)
            r.flight_done, r.flight_ok = True, False
            if r.landing:
                self._land(r)
                self._next(r)

    def _land_or_wait(self, r: _Rank) -> None:
        """``Land``: apply the launched round now if it completed, else wait for it."""
        if r.flight_done:
            self._land(r)
        else:
            r.landing = r.working = True

    def _land(self, r: _Rank) -> None:
        """The launched round completed: the batches before its launch are in the consensus."""
        assert r.flight is not None
        _, batches = r.flight
        ok, r.flight_ok = r.flight_ok, True
        through_ms, r.through_ms = r.through_ms, 0.0
        r.flight, r.flight_done = None, False
        r.in_collective = r.landing = r.working = False
        if not ok:  # the collective failed: its steps count in the round tried next
            self._send(r.rank, r.proto.average_failed())
            return
        self._commit(r.rank, batches)
        divergence = self._divergence(len(batches))
        self._send(r.rank, r.proto.averaged(divergence=divergence, through_ms=through_ms))

    # -- result ----------------------------------------------------------------

    def _result(self) -> SimResult:
        assert self.finish is not None and self.end is not None
        account = self.end
        started = self.started_s if self.started_s is not None else 0.0
        wall_s = max(self.now - started, 1e-9)
        cfg = self.config
        final = [meta for meta in self.metas if meta.reason is not SaveReason.CHECKPOINT]
        saved = final[-1] if final else None
        lost, duplicated = coverage_errors(
            self.committed,
            num_samples=cfg.samples,
            epochs=range(cfg.resume.epoch if cfg.resume else 0, cfg.epochs),
            resumed=cfg.resume,
            saved=saved if account.outcome == "saved_and_shutdown" else None,
        )
        trained = sum(self.committed_by_rank)
        ideal = sum(cfg.speeds) * cfg.batch_size * 1000.0 / cfg.base_ms
        per_rank = []
        for r in self.ranks:
            if not r.joined:
                continue  # its Join never fired
            end = r.stopped_at_s if r.stopped_at_s is not None else self.now
            active_s = max(end - max(started, r.started_s or 0.0), 0.0)
            per_rank.append(
                RankResult(
                    rank=r.rank,
                    speed=cfg.speeds[r.rank] if r.rank < len(cfg.speeds) else r.speed,
                    samples=self.committed_by_rank[r.rank],
                    busy_s=round(r.busy_s, 6),
                    idle_s=round(max(active_s - r.busy_s, 0.0), 6),
                )
            )
        throughput = trained / wall_s
        return SimResult(
            mode=cfg.mode.value,
            world_size=len(cfg.speeds),
            epochs_completed=account.epochs_completed,
            samples_trained=trained,
            virtual_wall_s=round(wall_s, 6),
            throughput=round(throughput, 3),
            ideal_throughput=round(ideal, 3),
            efficiency=round(throughput / ideal, 4),
            syncs=account.rounds_done,
            lost_samples=lost,
            duplicated_samples=duplicated,
            dead_ranks=list(account.dead_ranks),
            outcome=account.outcome,
            reason=account.reason,
            per_rank=per_rank,
            rejected_frames=account.rejected_frames,
            stale_messages=account.stale_messages,
            anchor=account.anchor,
            saved_meta=saved,
            joined_ranks=list(account.joined_ranks),
        )


def simulate(config: SimConfig) -> SimResult:
    """Run one simulation to its end."""
    return Simulation(config).run()
