"""``cadence``: the next window's work goes out right behind ``SyncNow``.

A rank serves its round before it trains, so work handed out with the round
starts the moment the rank's average lands. These tests pin who gets it,
when not, what the round's acknowledgement does to its count, and that an
abandoned round leaves nothing stuck.
"""

from __future__ import annotations

from elche.core import messages as m
from elche.core.commands import Command, Emit
from elche.core.config import SchedulerConfig
from elche.core.coordinator import RunState
from elche.core.events import RankLost
from elche.core.planner import PROBE_STEPS
from elche.core.roles import Role
from elche.core.timeline import EpochEnd, Eval
from tests.core.harness import Harness, messages


def _after(out: list[Command], kind: type) -> list[Command]:
    """The commands from the first ``kind`` message on."""
    at = next(i for i, c in enumerate(out) if messages([c], kind))
    return out[at:]


def _first_round(h: Harness) -> list[Command]:
    """Train the probe and the first window of a 2-rank run at 10 and 40 ms a batch."""
    h.form()
    return h.train_window({0: 10.0, 1: 40.0})


def _runs_to_the_end_averaging_every_sample_once(
    h: Harness, ms: dict[int, float], samples: int
) -> None:
    """The survivors train to the end; every sample of the run averaged exactly once."""
    h.run_to_end(ms)
    assert h.core.state is RunState.DONE
    averaged = sorted(h.in_averages)
    assert len(averaged) == len(set(averaged))  # no batch averaged twice
    assert sum(size for _, _, size in averaged) == samples  # and every sample once


def test_a_mid_epoch_round_hands_every_rank_its_next_work_counted_after_the_average() -> None:
    h = Harness(num_samples=6400, scheduler=SchedulerConfig(max_anchor=10))
    out = _after(_first_round(h), m.SyncNow)
    chunks = {c.rank: c.message for c in out if messages([c], m.AssignChunk)}  # type: ignore[attr-defined]
    assert sorted(chunks) == [0, 1]
    assert [(chunks[r].budget, chunks[r].window) for r in (0, 1)] == [(40, 40), (10, 10)]  # type: ignore[attr-defined]
    # Until the round commits, the coordinator counts the window on top of it.
    first = [PROBE_STEPS + 40, PROBE_STEPS + 10]
    assert h.core.planner.budget == [first[0] + 40, first[1] + 10]
    h.send(0, m.SyncAck(round=1, steps=first[0]))
    assert h.core.planner.budget == [40, first[1] + 10]  # rank 0's average landed
    h.train(0, 3)  # rank 0 trains on while rank 1 is still in the round
    assert h.core.ledger.steps(0) == first[0]  # its batches are the next window's timing
    h.send(1, m.SyncAck(round=1, steps=first[1]))
    assert not h.core.round.in_flight and h.core.planner.budget == [40, 10]
    assert h.core.ledger.steps(0) == 3


def _ack(h: Harness) -> list[Command]:
    """Every member acknowledges the round in flight, its steps as the coordinator counts them."""
    out: list[Command] = []
    rnd = h.core.round
    for rank in sorted(rnd.members):
        out += h.send(rank, m.SyncAck(round=rnd.number, steps=h.core.work.steps_since_sync(rank)))
    return out


def _to_the_round_that_ends_epoch_0(h: Harness) -> list[Command]:
    """Train (and average) until the round that ends epoch 0 starts; what that start sent."""
    h.form()
    while True:
        out = h.train_window({0: 10.0, 1: 40.0})
        rnd, pools = h.core.round, h.core.work.pools
        if rnd.in_flight and 0 in pools and pools[0].remaining() == 0:
            return _after(out, m.SyncNow)
        _ack(h)


def test_the_epoch_ends_callbacks_are_asked_with_the_round_that_ends_it() -> None:
    h = Harness(num_samples=32 * 60, epochs=2, has_eval_fn=True)
    ahead = _to_the_round_that_ends_epoch_0(h)
    assert h.core.work.open_epochs() == [0, 1]  # epoch 1 opened as that round started
    evaluator = h.core.roles.holder(Role.EVAL)
    to_evaluator = [c.message for c in ahead if getattr(c, "rank", None) == evaluator]  # type: ignore[attr-defined]
    kinds = [type(msg) for msg in to_evaluator if isinstance(msg, m.RunEval | m.AssignChunk)]
    assert kinds == [m.RunEval, m.AssignChunk]  # its eval first, then epoch 1's work
    assert {c.rank for c in ahead if messages([c], m.AssignChunk)} == {0, 1}  # type: ignore[attr-defined]
    # The evaluator applies the round and reports its eval before the other
    # rank acknowledges: the result waits for the round (its cost is the
    # next window's), and the epoch's end asks nothing twice.
    rnd, other = h.core.round, 1 - evaluator
    h.send(evaluator, m.SyncAck(round=rnd.number, steps=h.core.work.steps_since_sync(evaluator)))
    early = h.send(evaluator, m.EvalResult(epoch=1, metric=0.5, elapsed_ms=3.0))
    assert messages(early, m.EvalBroadcast) == []
    steps = h.core.work.steps_since_sync(other)
    closing = h.send(other, m.SyncAck(round=rnd.number, steps=steps))
    assert messages(closing, m.RunEval) == []
    assert messages(closing, m.EvalBroadcast) == [m.EvalBroadcast(epoch=1, metric=0.5)]


def test_an_eval_answered_before_the_round_that_ends_its_epoch_closes_follows_the_epochs_end() -> (
    None
):
    # Its Eval was written before the epoch's EpochEnd: the run's per-epoch
    # metrics (result.epochs, metrics_fn) had no epoch to put it on and lost it.
    h = Harness(num_samples=32 * 60, epochs=2, has_eval_fn=True)
    _to_the_round_that_ends_epoch_0(h)
    evaluator = h.core.roles.holder(Role.EVAL)
    h.send(evaluator, m.EvalResult(epoch=1, metric=0.5, elapsed_ms=3.0))
    closing = _ack(h)
    told = [c.event for c in closing if isinstance(c, Emit)]  # type: ignore[attr-defined]
    assert [type(e) for e in told if isinstance(e, EpochEnd | Eval)] == [EpochEnd, Eval]


def test_no_work_goes_ahead_of_a_round_whose_epoch_end_saves_a_bundle() -> None:
    h = Harness(num_samples=32 * 60, epochs=2, checkpoint_every=1, save_path="b")
    ahead = _to_the_round_that_ends_epoch_0(h)
    assert h.core.work.open_epochs() == [0]  # the bundle holds the consensus of epoch 0 alone
    assert messages(ahead, m.AssignChunk) == []


def test_an_abandoned_round_keeps_the_work_it_handed_out_for_the_round_tried_next() -> None:
    ms = {0: 10.0, 1: 20.0, 2: 40.0}
    h = Harness(world_size=3, num_samples=32 * 300, scheduler=SchedulerConfig(max_anchor=10))
    h.form()
    ahead = _after(h.train_window(ms), m.SyncNow)
    assert {c.rank for c in ahead if messages([c], m.AssignChunk)} == {0, 1, 2}  # type: ignore[attr-defined]
    steps = [h.core.work.steps_since_sync(r) for r in range(3)]
    h.feed(RankLost(rank=2, reason="process killed"))  # before anyone acknowledged
    # Round 1 was abandoned; round 2 (the new group) started at once, with the
    # survivors' steps and the work they were handed still queued.
    rnd = h.core.round
    assert rnd.in_flight and rnd.number == 2 and rnd.members == {0, 1}
    assert [h.core.work.steps_since_sync(r) for r in (0, 1)] == steps[:2]
    assert all(h.chunks[r] for r in (0, 1))
    _runs_to_the_end_averaging_every_sample_once(h, ms, 32 * 300)


def test_a_death_that_completes_the_round_plans_the_next_window_without_the_dead() -> None:
    ms = {0: 10.0, 1: 20.0, 2: 40.0}
    h = Harness(world_size=3, num_samples=32 * 60, epochs=2)
    h.form()
    h.train_window(ms)  # the round that ends epoch 0; epoch 1's tail went out with it
    rnd = h.core.round
    for rank in (0, 2):
        h.send(rank, m.SyncAck(round=rnd.number, steps=h.core.work.steps_since_sync(rank)))
    h.feed(RankLost(rank=1, reason="process killed"))  # the others' acks complete the round
    assert not h.core.round.in_flight and h.core.rounds_done == 1
    tail = h.core.planner.tail_plan
    assert tail is None or 1 not in tail  # planned afresh, for the survivors
    # A plan holding the dead rank's share hung here.
    _runs_to_the_end_averaging_every_sample_once(h, {0: 10.0, 2: 40.0}, 2 * 32 * 60)


def _told_budget(h: Harness, rank: int) -> int:
    """The budget ``rank`` counts by: the last one it was told."""
    told = [msg for msg in h.inbox[rank] if isinstance(msg, m.AssignChunk | m.SetBudget)]
    return told[-1].budget  # type: ignore[union-attr]  # both carry one


def _a_round_planned_ahead(h: Harness, ms: dict[int, float]) -> None:
    """Train and average until a round is in flight with the next window handed out."""
    h.form()
    while True:
        h.train_window(ms)
        if h.core.round.in_flight and h.core.planner.planned_ahead:
            return
        _ack(h)


def test_an_abandoned_round_tells_each_survivor_its_budget_before_the_plan_again() -> None:
    """A rank whose unaveraged steps had reached the budget handed out ahead
    (counted after an average that never came) held while the coordinator
    waited for its window: neither moved again."""
    ms = {0: 10.0, 1: 20.0, 2: 40.0}
    h = Harness(world_size=3, num_samples=32 * 60, epochs=2)
    _a_round_planned_ahead(h, ms)
    h.feed(RankLost(rank=2, reason="process killed"))  # before anyone acknowledged
    assert not h.core.round.in_flight  # abandoned; the survivors' windows are not done
    for rank in (0, 1):
        assert h.chunks[rank]  # the work handed out ahead stays with them
        assert _told_budget(h, rank) == h.core.planner.budget[rank]
    _runs_to_the_end_averaging_every_sample_once(h, {0: 10.0, 1: 20.0}, 2 * 32 * 60)


def test_a_rank_that_holds_work_as_a_round_starts_hears_its_budget_after_that_average() -> None:
    ms = {0: 10.0, 1: 20.0, 2: 40.0}
    h = Harness(world_size=3, num_samples=32 * 300, scheduler=SchedulerConfig(max_anchor=10))
    _a_round_planned_ahead(h, ms)
    h.feed(RankLost(rank=2, reason="process killed"))
    # Round 2 started at once, the survivors holding round 1's work ahead.
    assert h.core.round.in_flight and h.core.planner.planned_ahead
    assert all(h.chunks[r] for r in (0, 1))
    _ack(h)
    for rank in (0, 1):  # counted from zero, as the rank counts after its average
        assert _told_budget(h, rank) == h.core.planner.budget[rank]


def test_a_member_whose_collective_broke_while_others_got_the_average_is_closed_out() -> None:
    """A peer lost mid-collective can leave some members with the average and
    another waiting out its timeout; that one answers ``failed`` and the
    round closes without its steps, which count in the next round."""
    ms = {0: 10.0, 1: 20.0, 2: 40.0}
    h = Harness(world_size=3, num_samples=32 * 60, epochs=2)
    _a_round_planned_ahead(h, ms)
    rnd = h.core.round
    unaveraged = h.core.work.steps_since_sync(2)
    h.send(0, m.SyncAck(round=rnd.number, steps=h.core.work.steps_since_sync(0)))
    h.feed(RankLost(rank=1, reason="process killed"))  # rank 0's ack: the round stands
    assert h.core.round.in_flight  # waiting for rank 2
    h.inbox[2].clear()
    h.send(2, m.SyncAck(round=rnd.number, steps=0, failed=True))
    assert not h.core.round.in_flight and h.core.rounds_done == 1
    assert h.core.work.steps_since_sync(2) == unaveraged  # nothing of it committed
    if h.chunks[2]:  # it counts its budget with those steps, as the coordinator does
        assert _told_budget(h, 2) == h.core.planner.budget[2]
    _runs_to_the_end_averaging_every_sample_once(h, {0: 10.0, 2: 40.0}, 2 * 32 * 60)


def test_failed_answers_alone_close_no_round() -> None:
    ms = {0: 10.0, 1: 20.0, 2: 40.0}
    h = Harness(world_size=3, num_samples=32 * 60, epochs=2)
    _a_round_planned_ahead(h, ms)
    rnd = h.core.round
    for rank in (0, 2):  # gloo told them at once; the coordinator has not seen the death
        h.send(rank, m.SyncAck(round=rnd.number, steps=0, failed=True))
    assert h.core.round.in_flight and h.core.rounds_done == 0
    h.feed(RankLost(rank=1, reason="process killed"))
    assert h.core.rounds_done == 0  # abandoned, to be tried again by the survivors
    _runs_to_the_end_averaging_every_sample_once(h, {0: 10.0, 2: 40.0}, 2 * 32 * 60)


def test_a_round_that_failed_on_every_member_with_none_lost_is_tried_again_in_a_new_group() -> None:
    """A member that came to the round later than its peers waited (a long
    step or eval, a slow link) makes every collective time out, nobody lost:
    the round waited forever for an average no member had."""
    ms = {0: 10.0, 1: 20.0, 2: 40.0}
    h = Harness(world_size=3, num_samples=32 * 60, epochs=2)
    _a_round_planned_ahead(h, ms)
    rnd, generation = h.core.round, h.core.generation
    steps = [h.core.work.steps_since_sync(r) for r in range(3)]
    for rank in (0, 2):
        h.send(rank, m.SyncAck(round=rnd.number, steps=0, failed=True))
    assert h.core.round.in_flight  # rank 1 may still get the average... or fail too
    out = h.send(1, m.SyncAck(round=rnd.number, steps=0, failed=True))
    assert h.core.generation == generation + 1
    regroups = [c.message for c in out if messages([c], m.Regroup)]  # type: ignore[attr-defined]
    assert regroups == [m.Regroup(generation=generation + 1, members=[0, 1, 2])]
    assert h.core.rounds_done == 0 and h.core.dead_ranks == []
    assert [h.core.work.steps_since_sync(r) for r in range(3)] == steps  # nothing committed
    for rank in range(3):  # the work handed out ahead stays, counted before the plan again
        if h.chunks[rank]:
            assert _told_budget(h, rank) == h.core.planner.budget[rank]
    _runs_to_the_end_averaging_every_sample_once(h, ms, 2 * 32 * 60)


def test_a_failed_answer_before_the_death_leaves_the_abandoned_round_its_undo() -> None:
    """Under torchrun: rank 1 dies while round 1 travels; rank 0's collective
    breaks at once and it answers failed; rank 2's breaks only when rank 0
    leaves the group at the Regroup, after the round was abandoned. Rank 0's
    answer had been taken as a commit that ended the plan ahead, so the death
    undid nothing: rank 2 kept the budget handed out ahead, below its
    unaveraged steps, and held while the coordinator waited for its window."""
    ms = {0: 10.0, 1: 20.0, 2: 40.0}
    h = Harness(world_size=3, num_samples=32 * 60, epochs=2)
    _a_round_planned_ahead(h, ms)
    rnd = h.core.round
    h.send(0, m.SyncAck(round=rnd.number, steps=0, failed=True))
    h.feed(RankLost(rank=1, reason="heartbeat stale"))
    assert not h.core.round.in_flight  # abandoned
    h.send(2, m.SyncAck(round=rnd.number, steps=0, failed=True))  # stale now
    for rank in (0, 2):
        if h.chunks[rank]:
            assert _told_budget(h, rank) == h.core.planner.budget[rank]
    _runs_to_the_end_averaging_every_sample_once(h, {0: 10.0, 2: 40.0}, 2 * 32 * 60)


def test_a_survivor_that_landed_the_average_after_the_death_abandoned_the_round_keeps_it() -> None:
    """The collective completed on every member just before rank 1 died;
    rank 0 landed it (at its step's end) after the coordinator had abandoned
    the round, so its acknowledgement came after the round closed. It was
    taken for an ack before any update and rank 0 was evicted with rank 1."""
    ms = {0: 10.0, 1: 20.0, 2: 40.0}
    h = Harness(world_size=3, num_samples=32 * 60, epochs=2)
    _a_round_planned_ahead(h, ms)
    number = h.core.round.number
    steps = h.core.work.steps_since_sync(0)
    h.feed(RankLost(rank=1, reason="process killed"))  # before anyone acknowledged
    h.send(0, m.SyncAck(round=number, steps=steps))
    assert h.core.dead_ranks == [1] and h.core.live == [0, 2]
    assert h.core.work.steps_since_sync(0) == 0  # its steps are in the average it holds
    h.send(2, m.SyncAck(round=number, steps=0, failed=True))  # the other: broken, stale
    _runs_to_the_end_averaging_every_sample_once(h, {0: 10.0, 2: 40.0}, 2 * 32 * 60)
