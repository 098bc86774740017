"""A bundle without a coordinator: what the journal and the ranks' own state can commit.

When a lost coordinator cannot be restarted (restarts used up, its successor
would not start), each rank writes what it holds and stops: its last consensus
model (the model as the last averaging round it applied left it), its
optimizer state, and what ``Held`` says on a rejoin (the round, that round's
batches of its own, the batches trained since). The launching process then
reads the journal and those states and, when they agree, commits a real
bundle: a meta like the one a coordinator writes, naming the files.

Rules:

- The journal's newest record is at round ``N``: its coverage is exactly the
  samples the consensus of round ``N`` lacks. A rank whose consensus is of
  round ``N`` writes the bundle's model, and the meta keeps that coverage.
- A round ``N + 1`` can have closed after the record (the coordinator died
  before journaling it). If no rank's consensus is of round ``N``, but every
  rank the journal counts live applied round ``N + 1`` and said which of its
  batches that round averaged, the model is round ``N + 1``'s and those
  batches leave the coverage.
- Anything else (no state from a rank the round needs, a consensus older than
  the journal, no model written) commits nothing: ``SalvageRefused`` says why,
  and the ranks' files stay where they are.

Theory of operation: ``salvage`` is pure. The shell
(``elche.runtime.salvage``) reads the journal and the ranks' state files,
calls it, renames the writer's model and every optimizer state to the numbered
names of a save, and writes the meta last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elche.core.checkpoint import CheckpointMeta, EpochCoverage, SaveReason
from elche.core.config import CoordinatorConfig
from elche.core.dispatch import coalesce
from elche.core.journal import JournalRecord
from elche.core.messages import Held

__all__ = ["LocalState", "Salvage", "SalvageRefused", "salvage"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalState:
    """What one rank wrote when it lost the coordinator for good.

    ``consensus_round``: the round whose consensus its model file holds (0:
    the run's start); ``held``: what it would say on a rejoin; ``has_model``:
    its model file is on disk.
    """

    rank: int
    consensus_round: int
    held: Held
    has_model: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Salvage:
    """The bundle to commit: whose model, the meta (no files yet), the run's account."""

    writer: int
    meta: CheckpointMeta
    samples_per_rank: tuple[int, ...]
    dead_ranks: tuple[int, ...]
    epochs_completed: int


class SalvageRefused(Exception):
    """No bundle can be committed honestly; the message says why."""


def salvage(
    config: CoordinatorConfig,
    record: JournalRecord,
    states: Sequence[LocalState],
    *,
    start_round: int = 0,
) -> Salvage:
    """The bundle ``states`` and the journal's ``record`` can commit (module rules).

    Args:
        config: the run's configuration.
        record: the journal's newest record.
        states: the states the ranks wrote (a rank that wrote none is lost).
        start_round: the round the run started at (a resumed run's bundle's).

    Raises:
        SalvageRefused: no bundle fits what is known; the message says why.
    """
    by_rank = {s.rank: s for s in states}
    live = [r for r in range(config.world_size) if r not in record.dead_ranks]
    journal_round = record.rounds_done

    def round_of(state: LocalState) -> int:
        return state.consensus_round if state.consensus_round > 0 else start_round

    at = [s.rank for s in states if s.has_model and round_of(s) == journal_round]
    if at:
        return _bundle(config, record, by_rank, writer=min(at), rounds_done=journal_round)
    later = [s.rank for s in states if s.has_model and round_of(s) == journal_round + 1]
    if not later:
        held = sorted({round_of(s) for s in states if s.has_model})
        raise SalvageRefused(
            f"no rank holds the consensus of the journal's round {journal_round} "
            f"(models of rounds {held})"
        )
    missing = [
        r for r in live if r not in by_rank or by_rank[r].held.last_round != journal_round + 1
    ]
    if missing:
        raise SalvageRefused(
            f"round {journal_round + 1} closed after the journal's last record, and ranks "
            f"{missing} cannot say what it averaged on them"
        )
    averaged = tuple(batch for r in live for batch in by_rank[r].held.averaged)
    return _bundle(
        config, record, by_rank, writer=min(later), rounds_done=journal_round + 1,
        averaged=averaged,
    )  # fmt: skip


def _bundle(
    config: CoordinatorConfig,
    record: JournalRecord,
    by_rank: dict[int, LocalState],
    *,
    writer: int,
    rounds_done: int,
    averaged: tuple[tuple[int, int, int], ...] = (),
) -> Salvage:
    live = [r for r in range(config.world_size) if r not in record.dead_ranks]
    coverage = _without(record.coverage, averaged)
    samples = list(record.samples_committed)
    for rank in live:
        if rounds_done > record.rounds_done:
            samples[rank] += sum(size for _, _, size in by_rank[rank].held.averaged)
    # An epoch whose last holes that round filled is done: the run goes on after it.
    done = max((c.epoch + 1 for c in record.coverage), default=record.epochs_completed)
    meta = CheckpointMeta(
        epoch=coverage[0].epoch if coverage else min(done, config.epochs),
        global_step=record.global_step + len(averaged),
        rounds_done=rounds_done,
        world_size=config.world_size,
        reason=SaveReason.COORDINATOR_LOST,
        seed=config.seed,
        order=config.order,
        batch_size=config.batch_size,
        epochs=config.epochs,
        mode=config.mode.value,
        elche_state=record.elche_state,
        coverage=coverage,
        save_seq=record.save_seq,
    )
    dead = sorted({*record.dead_ranks, *(r for r in live if r not in by_rank)})
    return Salvage(
        writer=writer,
        meta=meta,
        samples_per_rank=tuple(samples),
        dead_ranks=tuple(dead),
        epochs_completed=meta.epoch,
    )


def _without(
    coverage: Sequence[EpochCoverage], batches: Sequence[tuple[int, int, int]]
) -> tuple[EpochCoverage, ...]:
    """``coverage`` less ``batches``; an epoch left with no holes is dropped (it is done)."""
    out: list[EpochCoverage] = []
    for started in coverage:
        holes = [(offset, size) for offset, size in started.uncovered]
        for epoch, offset, size in batches:
            if epoch == started.epoch:
                holes = _cut(holes, offset, offset + size)
        if holes:
            out.append(
                EpochCoverage(
                    epoch=started.epoch,
                    total_samples=started.total_samples,
                    uncovered=tuple(coalesce(holes)),
                )
            )
    return tuple(out)


def _cut(holes: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """``holes`` with the positions ``[start, end)`` taken out."""
    out: list[tuple[int, int]] = []
    for offset, size in holes:
        stop = offset + size
        if stop <= start or offset >= end:
            out.append((offset, size))
            continue
        if offset < start:
            out.append((offset, start - offset))
        if stop > end:
            out.append((end, stop - end))
    return out
