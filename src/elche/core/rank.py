"""The rank's side of the control protocol, as a sans-IO state machine.

Every driver of a rank runs these rules: the real worker
(``elche.runtime.worker``), the simulator's ranks (``elche.sim.engine``) and
the test fake (``elche.testing.fake_rank``). Each keeps only its own IO:
torch and pacing, virtual time and ground truth, scripted test behaviour.
So what the simulator proves about ranks is what real ranks do.

Rules:

- ``AssignChunk`` queues a chunk and sets the budget and the window;
  ``SetBudget`` sets them. A rank trains its chunks front to back, one batch
  of at most ``batch_size`` samples at a time, while its steps since the last
  average are below the budget; then it holds.
- ``SyncNow`` (collective) and ``RequestParams`` (coordinator backend) make
  an averaging round pending; a newer request replaces an older one. A
  request of the other backend than the run's mode is stale. The
  rank serves it before anything else it would do next.
- After uploading a snapshot, a rank of a holding policy (``sync``,
  ``cadence``) waits for the round's ``Update``; an ``async`` rank trains on.
  An ``Update`` for any round but the one uploaded is stale: counted, ignored.
- ``RunEval`` and ``RunCheckpoint`` queue callbacks, run in arrival order
  after a pending round and before training. One that arrives while a round
  is asked of the rank (the coordinator asks an epoch end's callbacks with
  the round that ends it) waits until the rank applied that round, or a
  later one if it was abandoned; so does one that arrives after that round
  failed on the rank (before the coordinator heard): a callback sees the
  consensus.
- With ``epoch_fn``, a rank runs it once before its first batch of each
  epoch it has not started yet.
- A driver may *launch* a collective round (``launched``) and train on
  while it is in flight: the round holds the steps made before it, the
  window counts from it. ``Land`` asks the driver to wait for it and apply
  it (``averaged`` or ``average_failed``) before anything but training: a
  save, a regroup, an epoch start, or running out of work. The driver may
  land it sooner, once it completed. Callbacks wait for it: they run on
  the consensus it brings (the driver sets the rank's own steps since
  aside until they ran).
- ``Regroup`` abandons a pending collective of the old group and re-forms
  the group; a rank not among its members was declared dead and stops. A
  launched one still lands first, and the ``Land`` says a ``Regroup``
  waits: the driver drops the collective (``average_failed``) unless it
  completed, so a lost member never holds the others for the collective's
  timeout.
- Saves are numbered and confirmed. ``SaveState`` (a periodic bundle) makes
  the rank write its state and answer ``StateSaved``, then train on; it is
  served right after a pending round. ``ShutdownWithSave`` (the run cannot go
  on) and a ``Shutdown`` naming this rank the final writer make it save and
  answer, then hold (``HELD``): a rank that wrote nothing yet may still be
  named the writer when the first one dies. A ``Shutdown`` with writer -1
  stops the rank (``saved: <reason>`` where it was held for a save or the
  message's ``saved`` says the run stopped short, else ``completed``); one
  naming another rank holds it; one with a ``failure`` (the run failed) stops
  it with ``failed: ...``. Once stopped, the rank ignores messages.
- ``DiscardSave`` (a save that will never commit) makes the rank remove that
  save's files in its folder, before anything else, in every stage but
  ``DONE``: a held rank too, so a stop whose bundle failed leaves none. A
  save of that number not started yet is dropped.
- The user's code raising on the rank (``failed``) stops it and makes the
  ``Failed`` report, which says whether the rank had trained a step yet.
- A rank keeps what its model holds: the last round it applied, its own
  batches that round averaged, and those it trained since. ``Rejoin`` (a
  coordinator restarted from the journal) is answered by the driver with
  ``rejoin``: the rank drops its queued chunks, its pending round and
  callbacks, and says ``Hello`` again with what it holds (``m.Held``); the
  new coordinator books it and hands out work afresh. A saving or held rank
  trains again: the new coordinator orders the save it needs anew.
- With a plan (``planned_samples``), ``progress`` tracks the run's global
  progress (``elche.core.progress``): every trained batch, every average the
  rank took part in and every ``GlobalProgress`` feed it.

Theory of operation. A driver loops: feed each message it received to
``handle``, ask ``next_action`` what to do, do that action's IO, and report
it done with the action's completion method (``trained``, ``averaged``,
``uploaded``, ``loaded``, ``evaluated``, ``checkpointed``,
``started_epoch``, ``regrouped``, ``saved``, ``discarded``), which returns the
message to send. ``next_action`` only looks: asking twice gives the same answer, and a
driver whose action takes time (the simulator's) asks nothing until it
completes, while messages may still arrive. Priority, first match wins::

    Discard > Done > Land(anything but training is next) > Save(stopping)
         > Hold(held) > FormGroup > Load > Hold(waiting for Update)
         > Average | Upload > Save(periodic) > Callback > StartEpoch
         > Train > Hold

A completion whose precondition does not hold (``averaged`` with no
collective pending, ``trained`` for a batch that is not the front chunk's
next) raises ``LocalProtocolError`` (a driver bug) and leaves the state
unchanged.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict, Unpack, assert_never

from elche.core import messages as m
from elche.core.config import Backend, Mode, Policy
from elche.core.errors import LocalProtocolError
from elche.core.progress import ProgressTracker
from elche.core.work import Chunk

# How a rank's stop reason begins when the run went on without it.
REFUSED = "refused: "
COORDINATOR_LOST = "coordinator lost: "  # a stop_reason: why the rank gave its coordinator up
SAVED = "saved: "  # a stop_reason: the run stopped short and saved (the save's reason follows)
FAILED = "failed: "  # a stop_reason: the run failed (why follows)
# Why a rank gives a round up unfinished at a ``Regroup`` (``Land.regroup``).
REGROUPED = "its group re-forms without a lost member"

__all__ = [
    "COORDINATOR_LOST",
    "FAILED",
    "REFUSED",
    "REGROUPED",
    "SAVED",
    "Average",
    "Callback",
    "Discard",
    "Done",
    "FormGroup",
    "Hold",
    "Land",
    "Load",
    "RankAction",
    "RankProtocol",
    "RankStage",
    "Save",
    "SaveKind",
    "StartEpoch",
    "Train",
    "Upload",
    "round_given_up",
]


class RankStage(enum.Enum):
    """Where a rank is in its run (forward only, except the update wait)."""

    TRAINING = "training"  # the normal state: train, hold, average, run callbacks
    WAITING_UPDATE = "waiting_update"  # uploaded a snapshot, holds for the Update
    SAVING = "saving"  # told to save and stop
    HELD = "held"  # saved (or not the writer); waits for the last Shutdown
    DONE = "done"


# -- actions: what the rank does next ------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Train:
    """Train positions ``[offset, offset + size)`` of ``epoch``, then ``trained``."""

    epoch: int
    offset: int
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StartEpoch:
    """Run ``epoch_fn`` for ``epoch``, then ``started_epoch``."""

    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Average:
    """Join the collective of round ``round`` with ``steps``, then ``averaged``."""

    round: int
    generation: int
    steps: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Land:
    """Wait for the launched collective of round ``round``, then ``averaged``
    (or ``average_failed``); ``steps`` went into it.

    With ``regroup`` a ``Regroup`` waits: a member of the round's group was
    lost, and a collective that has not completed yet may never complete (a
    member cut off sends nothing, and its peers would wait out the
    collective's timeout). The driver drops it then (``average_failed``)
    instead of waiting; one that completed it lands as always.
    """

    round: int
    steps: int
    regroup: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Upload:
    """Upload a snapshot for round ``round`` (``steps`` in it), then ``uploaded``."""

    round: int
    steps: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Load:
    """Load round ``round``'s average (blend by ``alpha``; None: overwrite), then ``loaded``.

    ``steps`` went into the snapshot this average replaces.
    """

    round: int
    alpha: float | None
    steps: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Callback:
    """Run the user's callback, then ``evaluated`` or ``checkpointed``."""

    request: m.RunEval | m.RunCheckpoint


@dataclass(frozen=True, slots=True, kw_only=True)
class FormGroup:
    """Leave the old collective group and form ``generation``, then ``regrouped``."""

    generation: int
    members: tuple[int, ...]


class SaveKind(enum.Enum):
    """What a save writes and what the rank does after it."""

    CHECKPOINT = "checkpoint"  # a periodic bundle; training goes on
    SHUTDOWN = "shutdown"  # the run cannot go on: a bundle, then hold
    FINAL = "final"  # the completed run's model, then hold


@dataclass(frozen=True, slots=True, kw_only=True)
class Save:
    """Write save ``seq``, then ``saved``.

    ``FINAL`` writes the model alone; the bundle kinds write the rank's
    optimizer state and, if ``writer``, the canonical model. Files of other
    saves than ``seq`` and ``keep`` may go.
    """

    kind: SaveKind
    seq: int
    writer: bool
    keep: int = 0
    reason: str = ""

    def nominal_files(self, rank: int) -> list[m.SavedFile]:
        """What a driver that writes no files (the simulator, the test fake) reports."""
        kinds = ["final"] if self.kind is SaveKind.FINAL else ["optim"]
        kinds += ["model"] if self.writer and self.kind is not SaveKind.FINAL else []
        return [
            m.SavedFile(kind=kind, name=f"nominal.s{self.seq}.rank{rank}.{kind}", size=0,
                        sha256="0" * 64)
            for kind in kinds
        ]  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class Discard:
    """Remove the files of save ``seq`` (it will never commit), then ``discarded``."""

    seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Hold:
    """Nothing to do: wait for the next message."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Done:
    """The rank has stopped; ``reason`` says why."""

    reason: str


RankAction = (
    Train | StartEpoch | Average | Land | Upload | Load | Callback | FormGroup | Save | Discard
    | Hold | Done
)  # fmt: skip

_HOLD = Hold()


class Norms(TypedDict, total=False):
    """What an averaging completion may report about the average, for the guards."""

    divergence: float | None  # this rank's relative distance from the average
    pre_norm: float | None  # the parameters' norm before averaging
    post_norm: float | None  # the average's norm
    through_ms: float  # trained while the launched round travelled (not its cost)


def round_given_up(message: m.CoordMessage) -> str | None:
    """Why ``message``, come while a rank waits for a round's collectives, gives
    the round up (None: it does not), as ``Land.regroup`` does a launched one.

    A ``Regroup`` (a member was lost: one cut off would hold the collectives
    to their timeout), or a ``Shutdown`` that stops the rank (the run goes on
    without it, or failed). The driver answers ``average_failed`` and then
    handles the message.
    """
    match message:
        case m.Regroup():
            return REGROUPED
        case m.Shutdown(refused=refused) if refused:
            return "the run goes on without this rank"
        case m.Shutdown(failure=failure) if failure:
            return "the run failed"
        case _:
            return None


class RankProtocol:
    """One rank's protocol state (see the module docstring).

    Args:
        rank: this rank.
        mode: the run's mode; its policy decides whether an upload holds.
        batch_size: samples per step (the last batch of a chunk may be short).
        runs_epoch_fn: the rank has an ``epoch_fn`` to run at each epoch start.
        planned_samples: ``epochs × num_samples``: track the global progress
            (``progress``); None: not tracked.
        world_size: ranks in the run (the progress estimate's first share).

    Raises:
        ValueError: ``batch_size`` below 1.
    """

    def __init__(
        self,
        rank: int,
        *,
        mode: Mode,
        batch_size: int,
        runs_epoch_fn: bool = False,
        planned_samples: int | None = None,
        world_size: int = 1,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.rank = rank
        self.mode = mode
        self.batch_size = batch_size
        self.runs_epoch_fn = runs_epoch_fn
        self.stage = RankStage.TRAINING
        self.stop_reason: str | None = None
        self.chunks: deque[Chunk] = deque()
        self.budget = 0  # no training before the first AssignChunk
        self.window = 0  # steps that complete the window (0: the budget does)
        self.steps_since_sync = 0
        self.epoch_started = -1  # the last epoch whose epoch_fn ran
        self.num_stale = 0  # messages ignored as stale
        self.num_steps = 0  # training steps done in this run
        self.user_error: m.UserError | None = None  # the run failed on it (Shutdown)
        self.progress: ProgressTracker | None = None
        if planned_samples is not None:
            self.progress = ProgressTracker(
                planned_samples=planned_samples, reference_batch=batch_size, world_size=world_size
            )
        self._collective_mode = mode.backend is Backend.COLLECTIVE
        self._request: m.SyncNow | m.RequestParams | None = None
        # A collective launched and in flight: (its request, steps and batches in it).
        self._launched: tuple[m.SyncNow, int, int] | None = None
        # The last collective round that failed here: a callback asked after it
        # (the coordinator may not know yet) waits for the round tried next.
        self._failed = 0
        # Each callback with the round its model must hold first (0: none).
        self._callbacks: deque[tuple[int, m.RunEval | m.RunCheckpoint]] = deque()
        self._uploaded: tuple[int, int] | None = None  # (round, steps) of the snapshot out
        self._update: m.Update | None = None
        self._regroup: m.Regroup | None = None
        self._save: Save | None = None  # a save to make now
        self._discards: deque[int] = deque()  # saves whose files go (DiscardSave)
        self._held_for: str | None = None  # the stop reason once a held rank is let go
        self.last_round = 0  # the last averaging round applied
        self._averaged: list[tuple[int, int, int]] = []  # this rank's batches in it
        self._since: list[tuple[int, int, int]] = []  # trained after it

    # -- inbound -------------------------------------------------------------

    def handle(self, message: m.CoordMessage) -> None:
        """Take one message from the coordinator.

        Raises nothing: every message is legal in every state (a stale one is
        counted in ``num_stale`` and ignored); after ``Done`` all are ignored.
        """
        if self.stage is RankStage.DONE:
            return
        if isinstance(message, m.DiscardSave):
            self._on_discard(message.seq)
            return
        if self.stage is RankStage.SAVING:  # only a new writer's order or a failure counts
            if isinstance(message, m.Shutdown | m.ShutdownWithSave) and (
                message.writer == self.rank or (isinstance(message, m.Shutdown) and message.failure)
            ):
                self._on_shutdown(message)
            return
        if self.stage is RankStage.HELD:
            if isinstance(message, m.Shutdown | m.ShutdownWithSave):
                self._on_shutdown(message)
            return
        match message:
            case m.AssignChunk(epoch=epoch, offset=offset, size=size):
                self.chunks.append(Chunk(epoch=epoch, offset=offset, size=size, cursor=offset))
                self.budget, self.window = message.budget, message.window
            case m.SetBudget(budget=budget, window=window):
                self.budget, self.window = budget, window
            case m.SyncNow() | m.RequestParams():
                if isinstance(message, m.SyncNow) is self._collective_mode:
                    self._request = message
                else:  # a request of the other backend: no round this run can have
                    self.num_stale += 1
            case m.Update(round=number):
                if self._uploaded is None or self._uploaded[0] != number:
                    self.num_stale += 1
                else:
                    self._update = message
            case m.RunEval() | m.RunCheckpoint():
                self._callbacks.append((self._round_pending(), message))
            case m.Regroup(members=members):
                self._on_regroup(message, members)
            case m.Shutdown() | m.ShutdownWithSave():
                self._on_shutdown(message)
            case m.SaveState(seq=seq, writer=writer, keep=keep):
                writes = writer == self.rank
                self._save = Save(kind=SaveKind.CHECKPOINT, seq=seq, writer=writes, keep=keep)
            case m.SetEpochCallbackRole() | m.EvalBroadcast() | m.EpochDone():
                pass
            case m.GlobalProgress():
                if self.progress is not None:
                    self.progress.confirmed(message)
            case m.CoordHeartbeat() | m.Rejoin():  # Rejoin: the driver answers ``rejoin``
                pass
            case _:
                assert_never(message)

    def _on_discard(self, seq: int) -> None:
        if seq not in self._discards:
            self._discards.append(seq)
        if self._save is not None and self._save.seq == seq and self.stage is RankStage.TRAINING:
            self._save = None  # not started: nothing of it to write

    def _on_shutdown(self, message: m.Shutdown | m.ShutdownWithSave) -> None:
        writes = message.writer == self.rank
        if isinstance(message, m.ShutdownWithSave):
            self._save = Save(
                kind=SaveKind.SHUTDOWN, seq=message.seq, writer=writes, keep=message.keep,
                reason=message.reason,
            )  # fmt: skip
            self.stage = RankStage.SAVING
        elif message.failure:
            self.user_error = message.user_error
            self._stop(f"{FAILED}{message.failure}")
        elif message.refused:
            self._stop(f"{REFUSED}{message.refused}")
        elif message.writer < 0:  # (a rank asked to save knows why: held for it)
            self._stop(
                self._held_for or (f"{SAVED}{message.saved}" if message.saved else "completed")
            )
        elif writes:
            self._save = Save(kind=SaveKind.FINAL, seq=message.seq, writer=True)
            self.stage = RankStage.SAVING
        else:
            self._save = None  # a periodic save still pending is moot now
            self.stage = RankStage.HELD

    def _on_regroup(self, message: m.Regroup, members: list[int]) -> None:
        if self.rank not in members:
            self._stop(f"{REFUSED}the coordinator declared this rank dead")
            return
        if isinstance(self._request, m.SyncNow):
            self._request = None  # that round was abandoned with the old group
        self._regroup = message

    def rejoin(self, *, world_size: int, host: str = "", pid: int = 0) -> m.Hello:
        """A restarted coordinator asked: forget its predecessor's orders, say what is held.

        Returns:
            The ``Hello`` to send (with ``held``).
        """
        self.chunks.clear()
        self._request = self._update = self._uploaded = self._launched = None
        self._failed = 0  # the new coordinator asks its callbacks afresh
        self._callbacks.clear()
        if self.stage is not RankStage.DONE:  # the new coordinator gives its own orders
            self.stage = RankStage.TRAINING  # (an Update that never came, a save it repeats)
            self._save = None
            self._held_for = None
        self.budget = self.window = 0
        return m.Hello(rank=self.rank, world_size=world_size, host=host, pid=pid, held=self.held())

    def held(self) -> m.Held:
        """What this rank's model holds: the last round applied, that round's
        batches of its own, the batches trained since."""
        return m.Held(
            last_round=self.last_round, averaged=tuple(self._averaged), since=tuple(self._since)
        )

    @property
    def averaged_batches(self) -> tuple[tuple[int, int, int], ...]:
        """This rank's ``(epoch, offset, size)`` batches that round ``last_round`` averaged."""
        return tuple(self._averaged)

    def _applied(self, number: int, steps: int) -> None:
        """Round ``number`` averaged this rank's first ``steps`` batches since the last."""
        self.last_round = number
        self._averaged, self._since = self._since[:steps], self._since[steps:]

    def coordinator_lost(self, reason: str) -> None:
        """The driver lost the coordinator: the rank stops (after its own save)."""
        self._stop(f"{COORDINATOR_LOST}{reason}")

    def _stop(self, reason: str) -> None:
        self.stage = RankStage.DONE
        self.stop_reason = reason

    # -- what next -------------------------------------------------------------

    def next_action(self) -> RankAction:
        """The first thing that applies, in the priority of the module docstring.

        Pure: the state does not change until the action's completion is called.
        """
        if self._discards:
            return Discard(seq=self._discards[0])
        if self.stage is RankStage.DONE:
            assert self.stop_reason is not None
            return Done(reason=self.stop_reason)
        if self._launched is not None and not self._trains_on():
            request, steps, _ = self._launched
            return Land(round=request.round, steps=steps, regroup=self._regroup is not None)
        if self.stage is RankStage.SAVING:
            assert self._save is not None  # SAVING is entered with its order
            return self._save
        if self.stage is RankStage.HELD:
            return _HOLD
        if self._regroup is not None:
            regroup = self._regroup
            return FormGroup(generation=regroup.generation, members=tuple(regroup.members))
        if self._update is not None:
            assert self._uploaded is not None  # only the uploaded round's Update is kept
            return Load(round=self._update.round, alpha=self._update.alpha, steps=self._uploaded[1])
        if self.stage is RankStage.WAITING_UPDATE:
            return _HOLD
        if self._request is not None:
            return self._serve(self._request)
        if self._save is not None:
            return self._save
        if self._callbacks and self._launched is None and self._callbacks[0][0] <= self.last_round:
            return Callback(request=self._callbacks[0][1])
        if self.steps_since_sync >= self.budget or not self.chunks:
            return _HOLD
        chunk = self.chunks[0]
        if self.runs_epoch_fn and chunk.epoch > self.epoch_started:
            return StartEpoch(epoch=chunk.epoch)
        return Train(epoch=chunk.epoch, offset=chunk.cursor, size=min(self.batch_size, chunk.left))

    def _trains_on(self) -> bool:
        """A launched round may stay in flight: the next action is a training step."""
        if self.stage is not RankStage.TRAINING:
            return False
        if self._regroup or self._update or self._request or self._save:
            return False
        if self.steps_since_sync >= self.budget or not self.chunks:
            return False
        return not (self.runs_epoch_fn and self.chunks[0].epoch > self.epoch_started)

    @property
    def in_flight(self) -> int:
        """The round of the collective launched and not applied yet (0: none)."""
        return self._launched[0].round if self._launched is not None else 0

    def _serve(self, request: m.SyncNow | m.RequestParams) -> Average | Upload:
        if isinstance(request, m.SyncNow):
            return Average(
                round=request.round, generation=request.generation, steps=self.steps_since_sync
            )
        return Upload(round=request.round, steps=self.steps_since_sync)

    @property
    def report_due(self) -> bool:
        """The rank's steps just completed its window or budget, or it ran out of work."""
        steps = self.steps_since_sync
        return steps in (self.window, self.budget) or not self.chunks

    # -- completions -------------------------------------------------------------

    def _illegal(self, completion: str, why: str) -> LocalProtocolError:
        return LocalProtocolError(f"rank {self.rank}: {completion}() but {why}")

    def trained(
        self,
        action: Train,
        *,
        batch_ms: float,
        data_ms: float,
        loss: float | None,
        nonfinite: bool = False,
    ) -> m.BatchDone:
        """The ``action``'s batch is done; returns its report.

        ``nonfinite``: its loss was NaN or infinite and the step was not applied.

        Legal while saving too: a step in flight when ``ShutdownWithSave``
        came is reported before the save.

        Raises:
            LocalProtocolError: ``action`` is not the front chunk's next batch.
        """
        chunk = self.chunks[0] if self.chunks else None
        if (
            self.stage not in (RankStage.TRAINING, RankStage.SAVING)
            or chunk is None
            or (chunk.epoch, chunk.cursor) != (action.epoch, action.offset)
            or not 0 < action.size <= chunk.left
        ):
            raise self._illegal("trained", f"{action!r} is not the next batch ({chunk!r})")
        chunk.cursor += action.size
        if chunk.left == 0:
            self.chunks.popleft()
        self._since.append((action.epoch, action.offset, action.size))  # booked as trained
        self.steps_since_sync += 1
        self.num_steps += 1
        if self.progress is not None:
            self.progress.trained(action.size)
        return m.BatchDone(
            epoch=action.epoch,
            offset=action.offset,
            size=action.size,
            batch_ms=batch_ms,
            data_ms=data_ms,
            loss=loss,
            nonfinite=nonfinite,
        )

    def started_epoch(self, *, elapsed_ms: float, lr: float | None) -> list[m.RankMessage]:
        """``epoch_fn`` ran; returns its cost report and, if known, the learning rate.

        Raises:
            LocalProtocolError: no epoch is waiting for its ``epoch_fn``.
        """
        if not (self.runs_epoch_fn and self.chunks and self.chunks[0].epoch > self.epoch_started):
            raise self._illegal("started_epoch", "no epoch is starting")
        epoch = self.epoch_started = self.chunks[0].epoch
        out: list[m.RankMessage] = [m.EpochFnElapsed(epoch=epoch, elapsed_ms=elapsed_ms)]
        if lr is not None:
            out.append(m.LrUpdate(lr=lr))
        return out

    def _collective(self, completion: str) -> m.SyncNow:
        if not isinstance(self._request, m.SyncNow):
            raise self._illegal(completion, "no collective round is pending")
        return self._request

    def launched(self) -> None:
        """The pending collective is launched with every step since the last
        one; the rank may train on while it is in flight (``Land``).

        Raises:
            LocalProtocolError: no collective round is pending, or one is in flight.
        """
        request = self._collective("launched")
        if self._launched is not None:
            raise self._illegal("launched", f"round {self.in_flight} is in flight")
        self._launched = (request, self.steps_since_sync, len(self._since))
        self._request = None
        self.steps_since_sync = 0
        if self.progress is not None:  # what the round averages: the samples before now
            self.progress.averaged(request.round)

    def averaged(self, **norms: Unpack[Norms]) -> m.SyncAck:
        """The collective completed: the launched one with the steps it was
        launched with, or the pending one with every step since the last one.

        Returns:
            The acknowledgement to send.

        Raises:
            LocalProtocolError: no collective round is pending or in flight.
        """
        if self._launched is not None:  # (counted in progress at its launch)
            request, steps, batches = self._launched
            self._launched = None
        else:
            request = self._collective("averaged")
            steps, batches = self.steps_since_sync, len(self._since)
            self._request = None
            self.steps_since_sync = 0
            if self.progress is not None:
                self.progress.averaged(request.round)
        self._applied(request.round, batches)
        return m.SyncAck(round=request.round, steps=steps, **norms)

    def average_failed(self) -> m.SyncAck:
        """The collective broke (a peer vanished): drop the round, keep the steps.

        The coordinator abandons the round and sends ``Regroup``, or, if
        other members got the average, closes it without this rank's steps.

        Returns:
            The ``failed`` acknowledgement to send.

        Raises:
            LocalProtocolError: no collective round is pending or in flight.
        """
        if self._launched is not None:
            self.steps_since_sync += self._launched[1]  # unaveraged again
            self._failed = self._launched[0].round
            self._launched = None
            if self.progress is not None:
                self.progress.failed(self._failed)
        else:
            self._failed = self._collective("average_failed").round
            self._request = None
        return m.SyncAck(round=self._failed, steps=0, failed=True)

    def uploaded(self) -> m.SnapshotReady:
        """The snapshot the pending ``RequestParams`` asked for is taken.

        A holding policy now waits for the round's ``Update``.

        Returns:
            The announcement to send with the snapshot.

        Raises:
            LocalProtocolError: no snapshot is requested.
        """
        request = self._request
        if not isinstance(request, m.RequestParams):
            raise self._illegal("uploaded", "no snapshot is requested")
        self._request = None
        self._uploaded = (request.round, self.steps_since_sync)
        if self.progress is not None:  # the samples in the snapshot are the ones before it
            self.progress.averaged(request.round)
        if self.mode.policy is not Policy.ASYNC:
            self.stage = RankStage.WAITING_UPDATE
        return m.SnapshotReady(round=request.round, steps=self.steps_since_sync)

    def loaded(self, **norms: Unpack[Norms]) -> m.SyncAck:
        """The ``Update``'s average is in the model; its snapshot's steps are averaged.

        Returns:
            The acknowledgement to send.

        Raises:
            LocalProtocolError: no ``Update`` is waiting.
        """
        update, uploaded = self._update, self._uploaded
        if update is None or uploaded is None:
            raise self._illegal("loaded", "no Update is waiting")
        self._update = self._uploaded = None
        self.steps_since_sync -= uploaded[1]
        self._applied(update.round, uploaded[1])
        if self.stage is RankStage.WAITING_UPDATE:
            self.stage = RankStage.TRAINING
        return m.SyncAck(round=update.round, steps=uploaded[1], **norms)

    def evaluated(self, *, metric: float, elapsed_ms: float, error: str | None) -> m.EvalResult:
        """The ``RunEval`` callback ran; returns its result.

        Raises:
            LocalProtocolError: the front callback is not an eval.
        """
        request = self._callback_done("evaluated")
        if not isinstance(request, m.RunEval):
            raise self._illegal("evaluated", f"the front callback is {request!r}")
        self._callbacks.popleft()
        return m.EvalResult(epoch=request.epoch, metric=metric, elapsed_ms=elapsed_ms, error=error)

    def checkpointed(self, *, elapsed_ms: float, error: str | None) -> m.CheckpointResult:
        """The ``RunCheckpoint`` callback ran; returns its result.

        Raises:
            LocalProtocolError: the front callback is not a checkpoint.
        """
        request = self._callback_done("checkpointed")
        if not isinstance(request, m.RunCheckpoint):
            raise self._illegal("checkpointed", f"the front callback is {request!r}")
        self._callbacks.popleft()
        return m.CheckpointResult(version=request.version, elapsed_ms=elapsed_ms, error=error)

    def _callback_done(self, completion: str) -> m.RunEval | m.RunCheckpoint:
        if not self._callbacks or self._launched or self._callbacks[0][0] > self.last_round:
            raise self._illegal(completion, "no callback is due")
        return self._callbacks[0][1]

    def _round_pending(self) -> int:
        """The round asked of this rank and not applied yet (0: none)."""
        if self._request is not None:
            return self._request.round
        if self._launched is not None:
            return self._launched[0].round
        return self._uploaded[0] if self._uploaded is not None else self._failed

    def regrouped(self, generation: int) -> None:
        """The group of generation ``generation`` is formed (or left, for a world of one).

        A newer ``Regroup`` that came while it formed stays waiting: its
        members may have formed that generation with peers that had all
        gathered for it when the newer order came (``elche.runtime.groups``).

        Raises:
            LocalProtocolError: no ``Regroup`` is waiting.
        """
        if self._regroup is None:
            raise self._illegal("regrouped", "no Regroup is waiting")
        if self._regroup.generation <= generation:
            self._regroup = None

    def failed(self, *, error_type: str, message: str, traceback: str, epoch: int) -> m.Failed:
        """The user's code raised on this rank; the rank stops. Legal in any state.

        Returns:
            The report to send before the rank exits.
        """
        self._stop(f"{FAILED}{error_type}: {message}")
        return m.Failed(
            error_type=error_type,
            message=message,
            traceback=traceback,
            epoch=epoch,
            before_first_step=self.num_steps == 0,
        )

    def saved(self, *, files: Sequence[m.SavedFile] = (), error: str | None = None) -> m.StateSaved:
        """The save asked for is written durably (``files``) or failed (``error``).

        A periodic save goes back to training; the others hold for the last
        ``Shutdown``.

        Returns:
            The answer to send.

        Raises:
            LocalProtocolError: no save was asked for.
        """
        if self._save is None:
            raise self._illegal("saved", "no save was asked for")
        order, self._save = self._save, None
        if order.kind is SaveKind.SHUTDOWN:
            self._held_for = f"{SAVED}{order.reason}"
        if order.kind is not SaveKind.CHECKPOINT:
            self.stage = RankStage.HELD
        return m.StateSaved(seq=order.seq, files=list(files), error=error, writer=order.writer)

    def discarded(self) -> None:
        """The files of the save ``Discard`` named are removed.

        Raises:
            LocalProtocolError: no discard was asked for.
        """
        if not self._discards:
            raise self._illegal("discarded", "no discard was asked for")
        self._discards.popleft()
