"""The coordinator's journal: what a new coordinator needs to go on with a run.

Rules:

- After the run forms and after every averaging round the coordinator asks
  the shell to append one ``JournalRecord`` (``AppendJournal``): the rounds
  done, the global step, per open epoch the sample ranges no completed average
  holds (the same ``EpochCoverage`` a checkpoint meta keeps), the balancer's
  and the guard's state, the callback roles, the ranks lost, the collective
  group's generation and the last save's number. Each record is whole: the
  newest one alone rebuilds the coordinator.
- The journal is bounded by the epochs open: a record whose open epochs differ
  from the previous record's is written with ``compact=True`` and replaces
  the file's records (the shell rewrites the file atomically).
- A restarted coordinator (``restore``) appends its own record first, before
  it sends a frame: the count of coordinators in it is what the next
  successor numbers its frames past (``transport.SEQ_SHIFT_PER_RESTART``). One
  killed while its ranks rejoin left them frames numbered past the journal's
  count, and a successor that read the same count was refused by every rank
  (a replayed frame) and the run lost its coordinator for good.
- A restarted coordinator starts ``FORMING`` with the ranks the
  record names live; a rank that has not rejoined within ``rejoin_timeout_s``
  (two heartbeat timeouts) is lost, its work served again. The ranks rejoin
  and say what they hold (``Held``): the
  last averaging round they applied, the batches that round averaged on
  them, and the batches they trained since. Rounds are known by their number
  (abandoned rounds have numbers too), the record's being the last one that
  closed. A round the journal does not know (numbered past it: it closed
  after the last record) is booked as committed; the batches since
  stay the rank's, uncommitted, for the next average. Everything else no
  average holds is served again, once.
- The evals and checkpoints asked for and not answered are in the record (an
  answer is journaled before it is broadcast); the restored coordinator asks
  them again once its ranks have rejoined (they forgot its predecessor's
  orders), and takes one answer per eval and checkpoint: another is counted
  stale and said (``Callbacks.on_answered_twice``).
- An epoch is journaled ended (its callbacks asked, its checkpoint begun)
  before its ``EpochEnd`` is written, so a successor ends each epoch at most
  once (a coordinator lost between the two leaves no ``EpochEnd``); the
  open epochs' reported losses are in the record, so it ends one the lost
  coordinator did not end with its loss. A round that may end an epoch
  (every sample of it trained, ``WorkBook.trained_epochs``) is journaled as
  it starts, with all that epoch's losses: an epoch one window long has no
  record between its opening and its round's.

Theory of operation: ``record_of`` reads a coordinator's state into a
record; ``restore`` builds a coordinator from one through the checkpoint
resume path (``CheckpointMeta``) and then puts back what a meta does not keep.
``rebook`` (called on each rejoin) hands a rank's held batches back to it in
the work book.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from elche.core.checkpoint import CheckpointMeta, EpochCoverage, SaveReason
from elche.core.config import CoordinatorConfig
from elche.core.elche_state import ElCheState
from elche.core.errors import ConfigError, RemoteProtocolError
from elche.core.messages import Held

if TYPE_CHECKING:
    from elche.core.coordinator import Coordinator

__all__ = ["REJOIN_TIMEOUTS", "JournalRecord", "rebook", "record_of", "rejoin_timeout_s", "restore"]

# A restarted coordinator gives the ranks the journal names live this many
# heartbeat timeouts to rejoin (at most ``formation_timeout_s``), then declares
# the missing ones lost and re-issues their work. A live rank's IO thread
# reconnects within a heartbeat interval of the new coordinator coming up,
# whatever its training does; one still silent after two heartbeat timeouts is
# stalled or gone, as a live run would judge it after one.
REJOIN_TIMEOUTS = 2


def rejoin_timeout_s(config: CoordinatorConfig) -> float:
    """How long a restarted coordinator waits for a rank to rejoin (``REJOIN_TIMEOUTS``)."""
    return min(REJOIN_TIMEOUTS * config.heartbeat_timeout_s, config.formation_timeout_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalRecord:
    """One whole account of a run's position, written after each round."""

    rounds_done: int
    global_step: int
    epochs_completed: int
    next_epoch: int  # the next epoch to open (epochs below it were opened)
    coverage: tuple[EpochCoverage, ...]
    elche_state: ElCheState
    roles: tuple[tuple[str, int], ...]  # (role name, rank)
    roles_elected: bool
    dead_ranks: tuple[int, ...]
    generation: int
    save_seq: int
    samples_committed: tuple[int, ...]
    coordinator_restarts: int = 0
    # The number of the last round that closed (``Coordinator.last_round``);
    # -1 in a record written before it was kept (then ``rounds_done``).
    last_round: int = -1
    # The number of the last round opened (closed or abandoned): a round a
    # rank applied after the record is numbered past ``last_round`` and at
    # most one past this; -1 in a record written before it was kept.
    opened_round: int = -1
    # Steps with a non-finite loss, and the steps and samples ``nonfinite="skip"``
    # left out: the run's summary counts them all (0 in a record written before).
    nonfinite_steps: int = 0
    skipped_steps: int = 0
    skipped_samples: int = 0
    # Rank 0's model's layout (``InitialState.layout``): a join is checked against it.
    layout: str = ""
    # The evals asked for and not answered: (epoch, as ``RunEval`` counts it, the
    # rank asked). A successor asks them again, or a lost coordinator's final
    # eval would be skipped on the way to the final save.
    pending_evals: tuple[tuple[int, int], ...] = ()
    # The checkpoints asked for and not answered: (version, the rank asked). A
    # successor asks them again: the ranks forget their orders as they rejoin.
    pending_checkpoints: tuple[tuple[int, int], ...] = ()
    # The losses the open epochs' batches reported: (epoch, sum, count). A successor
    # ends an epoch with their mean, not with no loss (empty in a record written before).
    epoch_loss: tuple[tuple[int, float, int], ...] = ()

    @property
    def open_epochs(self) -> tuple[int, ...]:
        return tuple(c.epoch for c in self.coverage)


def record_of(core: Coordinator) -> JournalRecord:
    """The journal record of ``core``'s state right now."""
    return JournalRecord(
        rounds_done=core.rounds_done,
        global_step=core.global_step,
        epochs_completed=core.epochs_completed,
        next_epoch=_next_epoch(core),
        coverage=core.work.coverage(),
        elche_state=core.tuner.saved_state(),
        roles=tuple((role.value, rank) for role, rank in core.roles.roles.items()),
        roles_elected=core.roles.elected,
        dead_ranks=tuple(sorted(core.dead_ranks)),
        generation=core.generation,
        save_seq=core.saves.seq,
        samples_committed=tuple(core.work.samples_committed),
        coordinator_restarts=core.coordinator_restarts,
        last_round=core.last_round,
        opened_round=core.round.number,
        layout=core.failures.layouts.get(0, ""),
        nonfinite_steps=core.failures.num_nonfinite,
        skipped_steps=core.failures.num_skipped_steps,
        skipped_samples=core.failures.num_skipped_samples,
        pending_evals=tuple(sorted(core.callbacks.pending_evals.items())),
        pending_checkpoints=tuple(sorted(core.callbacks.pending_checkpoints.items())),
        epoch_loss=tuple((e, total, n) for e, (total, n) in sorted(core.epoch_loss.items())),
    )


def _next_epoch(core: Coordinator) -> int:
    nxt = core.work.next_epoch_to_open()
    return core.config.epochs if nxt is None else nxt


def restore(config: CoordinatorConfig, record: JournalRecord, *, last_save: int) -> Coordinator:
    """A coordinator that goes on with the run ``record`` describes.

    It is ``FORMING``: the ranks the record names live rejoin it (``RankJoined``
    with what they hold), the others stay lost. Its saves are numbered after
    the record's; ``last_save`` is the save the meta at the save path names
    (the record does not know whether its last save committed), whose files
    the ranks keep.

    Raises:
        ConfigError: the record does not fit ``config`` (another world size,
            an epoch past the plan, a rank outside the world).
    """
    from elche.core.coordinator import Coordinator, RankState
    from elche.core.roles import Role
    from elche.core.rounds import Round

    ws = config.num_slots  # every rank id, the join slots' too
    if len(record.samples_committed) != ws:
        raise ConfigError(
            "journal", f"is for {len(record.samples_committed)} ranks; this run has {ws}"
        )
    if any(not 0 <= r < ws for r in record.dead_ranks):
        raise ConfigError("journal", f"dead_ranks {record.dead_ranks} must lie in [0, {ws})")
    open_epochs = record.open_epochs
    meta = CheckpointMeta(
        epoch=open_epochs[0] if open_epochs else record.epochs_completed,
        global_step=record.global_step,
        rounds_done=record.rounds_done,
        world_size=config.world_size,
        reason=SaveReason.CHECKPOINT,
        seed=config.seed,
        order=config.order,
        batch_size=config.batch_size,
        epochs=config.epochs,
        mode=config.mode.value,
        elche_state=record.elche_state,
        coverage=record.coverage,
        save_seq=record.save_seq,
    )
    core = Coordinator(config, resume=meta, last_save=last_save)
    core.work.resume(record.next_epoch, ())  # epochs opened before stay opened
    core.epochs_completed = record.epochs_completed
    core.work.samples_committed[:] = record.samples_committed
    core.generation = record.generation
    core.coordinator_restarts = record.coordinator_restarts + 1
    for name, rank in record.roles:
        core.roles.roles[Role(name)] = rank
    core.roles.elected = record.roles_elected
    for rank in record.dead_ranks:
        core.rank_state[rank] = RankState.DEAD
        core.dead_ranks.append(rank)
        core.elche.retire(rank)
        core.planner.note_rank_lost(rank)
    core.restored_round = record.last_round if record.last_round >= 0 else record.rounds_done
    core.last_round = core.restored_round
    opened = max(record.opened_round, core.restored_round)
    core.round = Round(config, core.work, number=opened)  # new rounds number past it
    core.restored_dead = record.dead_ranks
    if record.layout:
        core.failures.layouts[0] = record.layout
    core.failures.num_nonfinite = record.nonfinite_steps
    core.failures.num_skipped_steps = record.skipped_steps
    core.failures.num_skipped_samples = record.skipped_samples
    core.callbacks.pending_evals = dict(record.pending_evals)
    core.callbacks.pending_checkpoints = dict(record.pending_checkpoints)
    core.epoch_loss = {e: (total, n) for e, total, n in record.epoch_loss}
    return core


def rebook(core: Coordinator, rank: int, held: Held) -> None:
    """Give ``rank`` back the batches it holds, as the journal left the books.

    Raises:
        RemoteProtocolError: the rank names a round the journal cannot have
            missed, or a batch no average holds that is not free to give it.
    """
    from elche.core.rounds import Round

    journal_round = core.restored_round
    assert journal_round is not None  # only a restored coordinator rebooks
    later = held.last_round > journal_round  # a round that closed after the last record
    newest = core.round.number + 1  # the first round the journal did not open
    if not journal_round <= held.last_round <= newest or (
        later and core.last_round not in (journal_round, held.last_round)
    ):
        raise RemoteProtocolError(
            f"rejoined at round {held.last_round}; the journal is at round {journal_round}",
            rank=rank,
        )
    if later:  # (at most one round can: the next one starts once it closed here)
        if core.last_round == journal_round:
            core.rounds_done += 1
            core.last_round = held.last_round
            core.round = Round(core.config, core.work, number=held.last_round)
        for epoch, offset, size in held.averaged:
            core.work.claim(rank, epoch, offset, size)
        core.work.commit(rank, len(held.averaged))
    for epoch, offset, size in held.since:
        core.work.claim(rank, epoch, offset, size)
