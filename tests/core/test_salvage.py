"""A lost coordinator that is not restarted: the journal and the ranks' own state make a
bundle that resumes exactly once, or say why they cannot (``elche.core.salvage``)."""

from __future__ import annotations

import dataclasses

import pytest

from elche.core import messages as m
from elche.core.checkpoint import EpochCoverage, SaveReason
from elche.core.commands import Finish
from elche.core.config import Mode
from elche.core.coordinator import Coordinator
from elche.core.salvage import LocalState, SalvageRefused, salvage
from tests.core.harness import Harness, config, of
from tests.core.test_journal import (
    STOP,
    assert_exactly_once,
    records,
    run_end,
    trained_past_round,
)


def states(h: Harness, ranks: list[int] | None = None) -> list[LocalState]:
    """What each rank keeps when it loses the coordinator: its model is the last
    round's consensus."""
    return [
        LocalState(rank=r, consensus_round=h.last_round[r], held=h.held(r), has_model=True)
        for r in (range(h.cfg.world_size) if ranks is None else ranks)
    ]


@pytest.mark.parametrize("mode", [Mode.CADENCE, Mode.SYNC])
@pytest.mark.parametrize("unjournaled", [False, True])
def test_the_salvaged_bundle_resumes_to_every_sample_exactly_once(
    mode: Mode, unjournaled: bool
) -> None:
    h, ms = trained_past_round(mode, STOP)
    cfg, stop = h.cfg, STOP
    # Unjournaled: the coordinator died after the ranks applied a round, before its record.
    record = [r for r in records(h) if r.rounds_done == stop - unjournaled][-1]

    plan = salvage(cfg, record, states(h))
    assert plan.writer == 0 and plan.meta.rounds_done == stop
    assert plan.meta.reason is SaveReason.COORDINATOR_LOST
    assert plan.meta.coverage == h.core.work.coverage()  # what round ``stop``'s consensus lacks
    assert plan.samples_per_rank == tuple(h.core.work.samples_committed)

    h2 = Harness(cfg)
    h2.core = Coordinator(cfg, resume=plan.meta)
    h2.form()
    h2.run_to_end(ms)
    assert of(h2.log, Finish) == [Finish(outcome="completed")]
    assert run_end(h2).lost_samples == 0
    assert_exactly_once(h, h, h2)


def test_a_round_the_journal_missed_needs_every_live_rank_to_say_what_it_averaged() -> None:
    h = Harness(world_size=3, epochs=2, num_samples=3840)
    h.form()
    h.run_to_end(until=lambda: h.core.rounds_done >= 3)
    record = [r for r in records(h) if r.rounds_done == 2][-1]
    with pytest.raises(SalvageRefused, match=r"round 3 closed after .* ranks \[2\]"):
        salvage(h.cfg, record, states(h, [0, 1]))
    # A rank whose consensus is the journal's round makes the bundle without them.
    behind = dataclasses.replace(states(h, [1])[0], consensus_round=2)
    plan = salvage(h.cfg, record, [*states(h, [0]), behind])
    assert plan.writer == 1 and plan.meta.coverage == record.coverage
    assert plan.dead_ranks == (2,)  # it left nothing: lost, as a dead rank is


def test_no_model_of_the_journal_round_or_the_next_commits_nothing() -> None:
    h = Harness(world_size=2, epochs=2, num_samples=1280)
    h.form()
    h.run_to_end(until=lambda: h.core.rounds_done >= 3)
    record = records(h)[-1]
    old = [dataclasses.replace(s, consensus_round=1) for s in states(h)]
    with pytest.raises(SalvageRefused, match=r"round 3 .*models of rounds \[1\]"):
        salvage(h.cfg, record, old)
    unwritten = [dataclasses.replace(s, has_model=False) for s in states(h)]
    with pytest.raises(SalvageRefused, match="no rank holds"):
        salvage(h.cfg, record, unwritten)


def test_a_resumed_runs_start_is_its_bundles_round_and_a_filled_epoch_is_done() -> None:
    cfg = config(world_size=2, epochs=3, num_samples=64, batch_size=8)
    h = Harness(cfg)
    h.form()
    h.run_to_end(until=lambda: h.core.rounds_done >= 1)
    record = dataclasses.replace(
        records(h)[-1],
        rounds_done=7,
        coverage=(EpochCoverage(epoch=1, total_samples=64, uncovered=((0, 8), (32, 8))),),
        epochs_completed=1,
    )
    fresh = [LocalState(rank=r, consensus_round=0, held=m.Held(), has_model=True) for r in (0, 1)]
    assert salvage(cfg, record, fresh, start_round=7).meta.rounds_done == 7
    filled = [
        LocalState(rank=0, consensus_round=8, held=m.Held(last_round=8, averaged=((1, 0, 8),)),
                   has_model=True),
        LocalState(rank=1, consensus_round=8, held=m.Held(last_round=8, averaged=((1, 32, 8),)),
                   has_model=True),
    ]  # fmt: skip
    plan = salvage(cfg, record, filled)
    assert plan.meta.coverage == () and plan.meta.epoch == 2 == plan.epochs_completed
    assert plan.meta.global_step == record.global_step + 2
