"""Ranks that join a running run (``elche.core.joins``), driven by hand."""

from __future__ import annotations

import pytest

from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.commands import Broadcast, Emit, Send
from elche.core.config import Mode
from elche.core.coordinator import RankState, RunState
from elche.core.errors import ConfigError
from elche.core.events import RankJoined, RankLost, StopRequested

from .harness import Harness, config, messages


def _run_end(h: Harness) -> tl.RunEnd:
    ends = [c.event for c in h.log if isinstance(c, Emit) and isinstance(c.event, tl.RunEnd)]
    assert len(ends) == 1
    return ends[0]


def _every_sample_once(h: Harness) -> None:
    for epoch in range(h.cfg.epochs):
        spans = [(offset, size) for e, offset, size in h.in_averages if e == epoch]
        positions = sorted(p for offset, size in spans for p in range(offset, offset + size))
        assert positions == list(range(h.cfg.num_samples)), f"epoch {epoch}"


def test_a_join_takes_the_consensus_in_the_next_round_then_gets_its_share() -> None:
    h = Harness(world_size=2, join_slots=2, num_samples=3200, epochs=2)
    h.form()
    out = h.feed(RankJoined(rank=2, host="late-host"))
    # Admitted at once (no round in flight): the group re-forms with it.
    (regroup,) = messages(out, m.Regroup)
    assert isinstance(regroup, m.Regroup)
    assert regroup.members == [0, 1, 2]
    assert [c.ranks for c in out if isinstance(c, Broadcast)] == [(0, 1, 2)]
    assert h.core.live == [0, 1, 2] and h.core.workers == [0, 1]
    assert not h.received(2, m.AssignChunk)  # no work before it holds the consensus
    assert h.core.rank_state[3] is RankState.VACANT
    # Its first round: a member with zero steps, before any work.
    h.run_to_end(until=lambda: bool(h.received(2, m.AssignChunk)))
    first_sync = next(i for i, x in enumerate(h.inbox[2]) if isinstance(x, m.SyncNow))
    first_work = next(i for i, x in enumerate(h.inbox[2]) if isinstance(x, m.AssignChunk))
    assert first_sync < first_work
    assert h.core.workers == [0, 1, 2]
    h.run_to_end(ms={0: 10.0, 1: 10.0, 2: 10.0})
    end = _run_end(h)
    assert end.outcome == "completed" and end.lost_samples == 0
    assert end.joined_ranks == (2,)
    assert len(end.samples_per_rank) == 3  # rank 3's slot was never used
    assert end.samples_per_rank[2] > 0
    _every_sample_once(h)


def test_a_joiner_whose_first_collective_failed_takes_the_consensus_in_the_next_round() -> None:
    """A peer lost mid-ring can leave the old members with the average and
    the joiner without it: the joiner still holds no replica's model, so it
    gets no work (nor a callback role, nor the final save) until a round it
    acknowledged; it was taken as holding the consensus for being a member."""
    h = Harness(world_size=2, join_slots=1, num_samples=3200, epochs=2)
    h.form()
    h.feed(RankJoined(rank=2, host="late-host"))
    h.run_to_end(until=lambda: h.core.round.in_flight and 2 in h.core.round.members)
    number = h.core.round.number
    h.send(2, m.SyncAck(round=number, steps=0, failed=True))
    for rank in (0, 1):
        h.send(rank, m.SyncAck(round=number, steps=h.core.work.steps_since_sync(rank)))
    assert not h.core.round.in_flight and h.core.workers == [0, 1]
    assert not h.received(2, m.AssignChunk)
    h.run_to_end(until=lambda: h.core.workers == [0, 1, 2])
    assert h.core.rounds_done > 1  # the next round it acknowledged
    h.run_to_end(ms={0: 10.0, 1: 10.0, 2: 10.0})
    end = _run_end(h)
    assert end.outcome == "completed" and end.lost_samples == 0
    assert end.samples_per_rank[2] > 0
    _every_sample_once(h)


def test_a_join_during_a_round_waits_for_the_round_to_close() -> None:
    h = Harness(world_size=2, join_slots=1, num_samples=3200, epochs=1)
    h.form()
    h.train_window()
    assert h.core.round.in_flight
    out = h.feed(RankJoined(rank=2))
    assert not messages(out, m.Regroup) and h.core.rank_state[2] is RankState.VACANT
    number = h.core.round.number
    out = []
    for rank in (0, 1):
        steps = h.core.work.steps_since_sync(rank)
        out += h.send(rank, m.SyncAck(round=number, steps=steps))
    (regroup,) = messages(out, m.Regroup)
    assert isinstance(regroup, m.Regroup) and regroup.members == [0, 1, 2]
    assert h.core.live == [0, 1, 2]


def test_a_join_after_training_is_refused() -> None:
    h = Harness(world_size=2, join_slots=1, num_samples=640, epochs=1)
    h.form()
    h.run_to_end(final=False)
    assert h.core.state is RunState.CLOSING
    out = h.feed(RankJoined(rank=2))
    assert [c for c in out if isinstance(c, Send) and c.rank == 2] == [
        Send(rank=2, message=m.Shutdown(writer=-1, refused="training is over"))
    ]
    assert h.core.rank_state[2] is RankState.VACANT


def test_a_joined_rank_rejoining_a_restarted_coordinator_is_refused() -> None:
    h = Harness(world_size=2, join_slots=1)
    h.form()
    held = m.Held(last_round=0, averaged=(), since=((0, 0, 32),))
    out = h.feed(RankJoined(rank=2, held=held))
    assert messages(out, m.Shutdown) == [
        m.Shutdown(writer=-1, refused="a restarted coordinator formed without it; join again")
    ]
    assert h.core.live == [0, 1]


def test_a_joined_rank_rejoining_a_restarted_coordinator_holding_nothing_joins_again() -> None:
    # Admitted just before its coordinator was lost, it had trained nothing: it was
    # refused all the same ("join again"), with no work of it to hand out again.
    h = Harness(world_size=2, join_slots=1)
    h.form()
    out = h.feed(RankJoined(rank=2, held=m.Held(last_round=0)))
    assert not messages(out, m.Shutdown)
    assert [c.members for c in messages(out, m.Regroup)] == [[0, 1, 2]]  # type: ignore[attr-defined]
    assert h.core.live == [0, 1, 2]


def test_a_joiner_lost_before_admission_is_no_dead_rank() -> None:
    h = Harness(world_size=2, join_slots=1)
    h.form()
    h.train_window()
    h.feed(RankJoined(rank=2))
    h.feed(RankLost(rank=2, reason="gone"))
    assert h.core.dead_ranks == [] and h.core.rank_state[2] is RankState.VACANT
    h.run_to_end()
    assert _run_end(h).joined_ranks == ()


def test_a_joined_rank_that_dies_gives_its_work_back() -> None:
    h = Harness(world_size=2, join_slots=1, num_samples=3200, epochs=1)
    h.form()
    h.feed(RankJoined(rank=2))
    h.run_to_end(until=lambda: h.core.work.steps_since_sync(2) > 0)
    h.feed(RankLost(rank=2, reason="killed"))
    h.run_to_end()
    end = _run_end(h)
    assert end.outcome == "completed" and end.dead_ranks == (2,) and end.joined_ranks == (2,)
    _every_sample_once(h)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"join_slots": -1}, "join_slots"),
        ({"join_slots": 2, "mode": Mode.CPU_CADENCE}, "join_slots"),
    ],
)
def test_bad_join_slots_are_config_errors(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        config(**overrides)
    assert info.value.field == field


def test_a_join_still_waiting_when_the_run_stops_hears_how_it_ended() -> None:
    # Not live, it was told nothing: it waited out its silence and raised
    # RankExcluded ("lost the coordinator") beside a run that was saved.
    h = Harness(world_size=2, join_slots=1, num_samples=3200, epochs=2, save_path="/b/run")
    h.form()
    h.train_window()
    h.feed(RankJoined(rank=2))
    h.feed(StopRequested(reason="SIGTERM"))  # the round first, then the save: not admitted
    number = h.core.round.number
    for rank in (0, 1):
        h.send(rank, m.SyncAck(round=number, steps=h.core.work.steps_since_sync(rank)))
    assert h.core.rank_state[2] is RankState.VACANT
    out = h.answer_saves()
    ends = [c for c in out if isinstance(c, Broadcast) and isinstance(c.message, m.Shutdown)]
    assert ends == [
        Broadcast(ranks=(0, 1, 2), message=m.Shutdown(writer=-1, saved="graceful_shutdown"))
    ]


def test_a_join_whose_model_has_another_layout_is_refused_and_the_run_goes_on() -> None:
    # Its first round joined tensors of other sizes: gloo aborted the run's ranks.
    h = Harness(world_size=2, join_slots=2, num_samples=3200, epochs=2)
    h.form()
    for rank in (0, 1):
        h.send(rank, m.InitialState(fingerprint="weights", layout="run-model"))
    out = h.feed(RankJoined(rank=2, host="late-host", layout="another-model"))
    (shutdown,) = messages(out, m.Shutdown)
    assert isinstance(shutdown, m.Shutdown) and "built another model" in (shutdown.refused or "")
    assert not messages(out, m.Regroup)
    assert h.core.live == [0, 1] and h.core.rank_state[2] is RankState.VACANT
    out = h.feed(RankJoined(rank=3, host="late-host", layout="run-model"))
    assert [c.members for c in messages(out, m.Regroup)] == [[0, 1, 3]]  # type: ignore[attr-defined]
    h.run_to_end(ms={0: 10.0, 1: 10.0, 3: 10.0})
    end = _run_end(h)
    assert end.outcome == "completed" and end.joined_ranks == (3,)
    _every_sample_once(h)
