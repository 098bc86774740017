"""Coordinator state machine: events in, commands out, state asserted after each."""

from __future__ import annotations

import pytest

from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.checkpoint import SaveReason
from elche.core.commands import (
    ArmTimer,
    AverageSnapshots,
    Broadcast,
    Emit,
    Finish,
    Notice,
    Send,
    WriteMeta,
)
from elche.core.config import Mode, SchedulerConfig
from elche.core.coordinator import RankState, RunState
from elche.core.errors import LocalProtocolError
from elche.core.events import (
    AverageComputed,
    FrameRejected,
    RankJoined,
    RankLost,
    Started,
    TimerFired,
)
from elche.core.planner import PROBE_STEPS
from elche.core.rank import SaveKind
from elche.core.roles import Role
from tests.core.harness import Harness, messages, of, state_saved


def acked_round(h: Harness, number: int, steps: dict[int, int]) -> None:
    for rank, k in steps.items():
        h.send(rank, m.SyncAck(round=number, steps=k, divergence=0.001))


# -- formation ---------------------------------------------------------------


def test_nothing_is_dispatched_until_every_rank_joined() -> None:
    h = Harness(world_size=3)
    out = h.feed(Started())
    assert of(out, ArmTimer)
    h.feed(RankJoined(rank=0))
    out = h.feed(RankJoined(rank=1))
    assert not messages(out, m.AssignChunk)
    assert h.core.state is RunState.FORMING
    out = h.feed(RankJoined(rank=2))
    assert h.core.state is RunState.TRAINING
    assert [len(h.received(r, m.AssignChunk)) for r in range(3)] == [1, 1, 1]
    # The epoch role goes out once, before any work.
    assert messages(out, m.SetEpochCallbackRole) == [m.SetEpochCallbackRole(rank=0)]


def test_formation_timeout_names_how_many_joined() -> None:
    h = Harness(world_size=3, formation_timeout_s=10.0)
    h.feed(Started(), at=0.0)
    h.feed(RankJoined(rank=0))
    out = h.feed(TimerFired(), at=10.5)
    finish = of(out, Finish)
    assert finish == [Finish(outcome="failed", reason=finish[0].reason)]  # type: ignore[attr-defined]
    assert "1/3 ranks joined" in finish[0].reason  # type: ignore[attr-defined]
    assert h.core.state is RunState.DONE
    assert h.feed(TimerFired(), at=20.0) == []


def test_ranks_that_joined_hear_the_coordinator_while_the_others_are_awaited() -> None:
    # A rank gives a silent coordinator up: while the run forms (or a restarted
    # coordinator waits for a stalled rank to rejoin), those in it get heartbeats.
    h = Harness(world_size=3, formation_timeout_s=60.0)
    h.feed(Started(), at=0.0)
    h.feed(RankJoined(rank=0))
    h.feed(RankJoined(rank=2))
    out = h.feed(TimerFired(), at=1.0)
    assert Broadcast(ranks=(0, 2), message=m.CoordHeartbeat()) in out
    assert of(out, ArmTimer)
    assert h.core.state is RunState.FORMING


def test_event_for_a_rank_outside_the_world_raises_and_changes_nothing() -> None:
    h = Harness()
    h.form()
    before = (h.core.state, list(h.core.rank_state), h.core.rounds_done)
    with pytest.raises(LocalProtocolError):
        h.feed(RankLost(rank=7, reason="?"))
    assert (h.core.state, list(h.core.rank_state), h.core.rounds_done) == before


# -- the averaging gate ------------------------------------------------------


def test_first_window_is_a_short_probe() -> None:
    h = Harness()
    h.form()
    chunk = h.received(0, m.AssignChunk)[0]
    assert chunk.size == PROBE_STEPS * 32  # type: ignore[attr-defined]
    assert chunk.budget == PROBE_STEPS  # type: ignore[attr-defined]


def test_the_probe_goes_on_as_the_first_window() -> None:
    h = Harness(num_samples=6400)
    h.form()
    out = h.train(0, PROBE_STEPS + 3)  # the fast rank streams on, a batch at a time
    assert [c.size for c in messages(out, m.AssignChunk)] == [32] * 4  # type: ignore[attr-defined]
    assert not h.core.elche.is_calibrated
    out = h.train(1, PROBE_STEPS, batch_ms=40.0)  # the last probe step calibrates: no round
    assert not messages(out, m.SyncNow) and h.core.rounds_done == 0
    assert h.core.elche.batch_counts == (40, 10)
    # The window counts from the steps each made (each has one more in flight).
    assert h.core.planner.budget == [5 + 40, 2 + 10]
    budgets = [m.SetBudget(budget=45, window=45), m.SetBudget(budget=12, window=12)]
    assert messages(out, m.SetBudget) == budgets


def test_cadence_gate_waits_for_every_rank_then_fires_once() -> None:
    h = Harness(num_samples=6400)
    h.form()
    h.train(0, PROBE_STEPS)
    h.train(1, PROBE_STEPS)
    out = h.train(0, h.quota(0) - PROBE_STEPS) + h.train(1, h.quota(1) - PROBE_STEPS - 1)
    assert not messages(out, m.SyncNow)  # one step short holds the gate
    out = h.train(1, 1)
    assert messages(out, m.SyncNow) == [m.SyncNow(round=1, generation=0)]
    assert of(out, Broadcast)[-1].ranks == (0, 1)  # type: ignore[attr-defined]
    assert h.core.round.in_flight


def test_gate_counts_steps_not_wall_time() -> None:
    h = Harness()
    h.form()
    out = h.train_window({0: 1e6, 1: 1e6})
    assert messages(out, m.SyncNow)


def test_acks_close_the_round_and_calibrate_counts_by_speed() -> None:
    h = Harness(num_samples=6400, scheduler=SchedulerConfig(max_anchor=10))  # no growth
    h.form()
    trained = h.train_window({0: 10.0, 1: 40.0})
    assert h.core.elche.batch_counts == (40, 10)  # 4x faster rank does 4x the steps
    steps = {r: h.core.work.steps_since_sync(r) for r in (0, 1)}
    assert steps == {0: PROBE_STEPS + 40, 1: PROBE_STEPS + 10}
    # The next window's work goes out right behind SyncNow, counted as each
    # rank will count it after the average.
    sync = next(i for i, c in enumerate(trained) if messages([c], m.SyncNow))
    chunks = messages(trained[sync:], m.AssignChunk)
    assert [(c.size, c.budget) for c in chunks] == [(40 * 32, 40), (10 * 32, 10)]  # type: ignore[attr-defined]
    out: list = []
    for rank in (0, 1):
        out += h.send(rank, m.SyncAck(round=1, steps=steps[rank], divergence=0.001))
    assert not h.core.round.in_flight
    assert h.core.rounds_done == 1
    assert h.core.global_step == sum(steps.values())
    assert messages(out, m.AssignChunk) == []  # nothing more: the window stands
    assert h.core.planner.budget == [40, 10]
    # Roles move to the fastest rank at the first calibration (it already is 0).
    assert h.core.roles.holder(Role.EVAL) == 0
    assert any(isinstance(c, Emit) and isinstance(c.event, tl.SyncEnd) for c in out)


def _first_round(probe_ms: dict[int, float], window_ms: dict[int, float]) -> Harness:
    """Two ranks' probes at ``probe_ms``, the rest of the first window at
    ``window_ms``, then the round's acks; the roles checked before the acks."""
    h = Harness(num_samples=6400)
    h.form()
    for rank, ms in probe_ms.items():
        h.train(rank, PROBE_STEPS, batch_ms=ms)  # the probe calibrates, mid-window
    assert h.core.elche.is_calibrated
    assert {h.core.roles.holder(role) for role in Role} == {0}  # not on the probe's pace
    assert not h.core.roles.elected
    h.train_window(window_ms)
    acked_round(h, 1, {r: h.core.work.steps_since_sync(r) for r in (0, 1)})
    assert h.core.rounds_done == 1 and h.core.roles.elected
    return h


def test_roles_follow_pace_at_the_first_round_close() -> None:
    h = _first_round({0: 40.0, 1: 10.0}, {0: 40.0, 1: 10.0})
    assert {h.core.roles.holder(role) for role in Role} == {1}
    assert h.core.roles.epoch_role_dirty


def test_a_probe_of_two_steps_does_not_hand_the_roles_to_a_slower_rank() -> None:
    # The probe's two steps said rank 1 by far (a busy moment on rank 0); the
    # whole window says rank 0, if only just: the roles stay on it.
    h = _first_round({0: 400.0, 1: 10.0}, {0: 8.0, 1: 10.0})
    assert {h.core.roles.holder(role) for role in Role} == {0}


def _tail_of_51() -> Harness:
    """A run whose second window is a 51-batch epoch tail at paces 10 and 40 ms.

    105 batches: the first window (the probes, then counts (40, 10)) takes
    54 and leaves 51, one too many for a window; list scheduling at the two
    paces gives the tail [41, 10]. Of it, 2 slow steps in fast batches (8)
    are held back from the batches that end last, leaving the plan [35, 8].
    The window opens at t = 1 s.
    """
    h = Harness(num_samples=105 * 32, scheduler=SchedulerConfig(max_anchor=10))
    h.form()
    h.train_window({0: 10.0, 1: 40.0})
    h.now = 1.0
    acked_round(h, 1, {0: PROBE_STEPS + 40, 1: PROBE_STEPS + 10})
    assert h.core.elche.batch_counts == (40, 10)
    assert h.core.planner.tail_reserve == 8
    plan = h.core.planner.tail_plan
    assert plan is not None
    queued = [sum(size for _, _, size in h.chunks[r]) // 32 for r in range(2)]
    assert [queued[r] + plan[r] for r in range(2)] == [35, 8]
    return h


def test_a_short_last_window_is_folded_into_the_epoch_tail() -> None:
    # 94 batches at 10 and 30 ms: the first window (probes, then counts
    # (30, 10)) takes 44. The 50 left would make a full window and a
    # 10-batch one; under 1.5 windows they are one tail instead, split by
    # list scheduling on the paces: [38, 12] (both end by 380 ms), of which
    # 6 (2 slow steps in fast batches) are held back from the last ends.
    h = Harness(num_samples=94 * 32, scheduler=SchedulerConfig(max_anchor=10))
    h.form()
    h.train_window({0: 10.0, 1: 30.0})
    assert h.core.elche.batch_counts == (30, 10)
    # Round 1 started (89 left at the calibration made the first window a
    # full one) and the tail went out with it, as the window after it.
    acked_round(h, 1, {0: PROBE_STEPS + 30, 1: PROBE_STEPS + 10})
    plan = h.core.planner.tail_plan
    assert plan is not None and h.core.planner.tail_reserve == 6
    queued = [sum(size for _, _, size in h.chunks[r]) // 32 for r in range(2)]
    assert [queued[r] + plan[r] for r in range(2)] == [33, 11]
    h.run_to_end({0: 10.0, 1: 30.0})
    assert h.core.rounds_done == 2 and h.core.state is RunState.DONE


def test_cadence_tail_window_is_averaged_in_one_round() -> None:
    h = _tail_of_51()
    h.now = 1.32  # rank 1 on its pace
    h.train(1, 8)
    h.now = 1.35
    out = h.train(0, 35)
    assert not messages(out, m.SyncNow)  # the reserve is not trained yet
    h.now = 1.40
    h.train(1, 2)
    out = h.train(0, 5)
    assert not messages(out, m.SyncNow)
    out = h.train(0, 1)
    assert messages(out, m.SyncNow) == [m.SyncNow(round=2, generation=0)]
    acked_round(h, 2, {0: 41, 1: 10})
    assert h.core.state is not RunState.TRAINING  # the epoch (the run) ended in that round
    assert h.core.rounds_done == 2
    assert h.core.planner.tail_reserve == 0


def test_reserve_goes_to_whoever_would_end_each_batch_soonest() -> None:
    h = _tail_of_51()
    h.now = 1.32  # rank 1 frees at 320 ms; rank 0 is due at 350 (its assignment + 35 x 10)
    out = h.train(1, 8)
    # List scheduling of the 8 held: rank 1 ends one at 360 (ties go to the
    # asker) and one at 400; rank 0 the other six, by 410.
    assert [c.size for c in messages(out, m.AssignChunk)] == [2 * 32]  # type: ignore[attr-defined]
    assert h.core.planner.tail_reserve == 6
    h.now = 1.35
    out = h.train(0, 35)  # its planned 9 were assigned on the way: the last chunk is reserve
    assert messages(out, m.AssignChunk)[-1].size == 6 * 32  # type: ignore[attr-defined]
    assert h.core.planner.tail_reserve == 0


def test_a_rank_ahead_of_its_pace_takes_more_of_the_reserve() -> None:
    h = _tail_of_51()
    h.now = 1.20  # rank 1 finished its 8 in 200 ms instead of 320
    out = h.train(1, 8)
    # Rank 1 ends reserve batches at 240, 280, 320 and 360 (ties to the
    # asker) before rank 0, due at 350, ends one at 360; rank 0 gets four.
    assert [c.size for c in messages(out, m.AssignChunk)] == [4 * 32]  # type: ignore[attr-defined]
    h.now = 1.30  # rank 0's report is news: it is counted from here
    h.train(0, 30)
    assert h.core.planner.tail_reserve == 4
    h.now = 1.35
    out = h.train(0, 5)  # due at 350, ends the last four by 390; rank 1 would end one at 400
    assert [c.size for c in messages(out, m.AssignChunk)] == [4 * 32]  # type: ignore[attr-defined]


def test_a_rank_behind_its_pace_leaves_the_reserve_to_the_others() -> None:
    h = _tail_of_51()
    h.now = 1.10
    h.train(0, 10)  # rank 0 at 10 ms a batch: due at 100 + 25 x 10 = 350
    h.now = 1.50  # rank 1 took 500 ms for its 8 (pace 320)
    out = h.train(1, 8)
    # Rank 1 would end one at 540; rank 0, due at 350, ends all eight by 430.
    assert not messages(out, m.AssignChunk)
    assert h.core.planner.quiesced[1]
    h.now = 1.51
    out = h.train(0, 16)  # idle: its planned 24 come, and the idle rank 1 is offered the reserve
    # Rank 0 is due at 1.51 + 24 x 10 = 1.75, so rank 1 ends six held
    # batches first (1.55 ... 1.75: ties to it); rank 0 asks for the rest.
    assert [c.size for c in messages(out, m.AssignChunk)] == [24 * 32, 6 * 32]  # type: ignore[attr-defined]
    assert not h.core.planner.quiesced[1]
    out = h.train(0, 9)
    assert [c.size for c in messages(out, m.AssignChunk)] == [2 * 32]  # type: ignore[attr-defined]
    assert not messages(h.train(0, 2), m.SyncNow)  # the gate waits for rank 1's six
    assert messages(h.train(1, 6), m.SyncNow)


def test_an_idle_rank_is_offered_the_reserve_a_late_rank_would_take() -> None:
    h = _tail_of_51()
    h.now = 1.35  # rank 0 frees at 350; rank 1, assigned at 1.0, is due at 1.32
    out = h.train(0, 35)
    assert [c.size for c in messages(out, m.AssignChunk)] == [24 * 32, 6 * 32]  # type: ignore[attr-defined]
    h.now = 1.41
    out = h.train(0, 6)  # the two left are held for rank 1: due, it ends them at 1.36 and 1.40
    assert not messages(out, m.AssignChunk)
    assert h.core.planner.quiesced[0]
    h.now = 1.60  # rank 1 ran late: its 8 took 600 ms, not 320
    out = h.train(1, 8)
    # Rank 0, idle since 1.41, ends both held batches (1.61, 1.62) before
    # rank 1 could end one (1.64): they go to rank 0, and the gate waits for it.
    chunks = [
        (c.rank, c.message.size)
        for c in out
        if isinstance(c, Send) and isinstance(c.message, m.AssignChunk)
    ]
    assert chunks == [(0, 2 * 32)]
    assert not messages(out, m.SyncNow)
    h.now = 1.62
    assert messages(h.train(0, 2), m.SyncNow)


def test_sync_gate_fires_after_one_step_each() -> None:
    h = Harness(mode=Mode.SYNC)
    h.form()
    sizes = [c.size for r in range(2) for c in h.received(r, m.AssignChunk)]  # type: ignore[attr-defined]
    assert sizes == [320, 320]  # equal partitions
    out = h.train(0, 1) + h.train(1, 1)
    assert messages(out, m.SyncNow)


def test_stale_ack_is_counted_and_ignored() -> None:
    h = Harness()
    h.form()
    h.train_window()
    out = h.send(0, m.SyncAck(round=9, steps=1))
    assert out == []
    assert h.core.stale_messages == 1
    assert h.core.round.in_flight


# -- protocol errors and hostile input -----------------------------------------


def test_batch_outside_assigned_work_evicts_the_rank_and_the_run_goes_on() -> None:
    h = Harness(world_size=3, num_samples=960)
    h.form()
    out = h.send(1, m.BatchDone(epoch=0, offset=999, size=32, batch_ms=1.0))
    assert h.core.rank_state[1] is RankState.ERRORED
    assert h.core.dead_ranks == [1]
    assert any(isinstance(c, Notice) and "evicting rank 1" in c.text for c in out)
    assert messages(out, m.Regroup) == [m.Regroup(generation=1, members=[0, 2])]
    assert h.core.state is RunState.TRAINING
    # Its chunk goes to a survivor in the next window.
    h.train_window()
    acked_round(h, 1, {r: h.core.work.steps_since_sync(r) for r in (0, 2)})
    reissued = [c.offset for r in (0, 2) for c in h.received(r, m.AssignChunk)]  # type: ignore[attr-defined]
    assert h.received(1, m.AssignChunk)[0].offset in reissued  # type: ignore[attr-defined]


def test_rejected_frames_are_counted_and_logged_sparingly() -> None:
    h = Harness()
    h.form()
    notices = []
    for _ in range(2000):
        notices += of(h.feed(FrameRejected(reason="bad tag")), Notice)
    assert h.core.rejected_frames == 2000
    assert len(notices) == 3  # the first, the 1000th and the 2000th
    assert h.core.state is RunState.TRAINING


def test_hello_after_joining_is_a_protocol_error() -> None:
    h = Harness()
    h.form()
    h.send(0, m.Hello(rank=0, world_size=2))
    assert h.core.rank_state[0] is RankState.ERRORED


# -- liveness and death --------------------------------------------------------


def silence_rank_2(h: Harness) -> None:
    """Ranks 0 and 1 keep talking for 5 s; rank 2 says nothing."""
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        h.feed(TimerFired(), at=t)
        h.send(0, m.Heartbeat())
        h.send(1, m.Heartbeat())


def test_silent_rank_is_declared_dead_and_its_work_reissued() -> None:
    h = Harness(world_size=3, num_samples=960, heartbeat_timeout_s=5.0)
    h.form()
    lost_offset = h.received(2, m.AssignChunk)[0].offset  # type: ignore[attr-defined]
    silence_rank_2(h)
    out = h.feed(TimerFired(), at=6.0)
    assert h.core.rank_state[2] is RankState.DEAD
    assert any(isinstance(c, Notice) and "heartbeat stale" in c.text for c in out)
    out = h.train_window()
    assert messages(out, m.SyncNow)  # the gate no longer waits for rank 2
    acked_round(h, 1, {r: h.core.work.steps_since_sync(r) for r in (0, 1)})
    offsets = [c.offset for r in (0, 1) for c in h.received(r, m.AssignChunk)]  # type: ignore[attr-defined]
    assert lost_offset in offsets


def test_a_rank_declared_lost_that_speaks_again_is_refused_once() -> None:
    h = Harness(world_size=3, num_samples=960, heartbeat_timeout_s=5.0)
    h.form()
    silence_rank_2(h)
    h.feed(TimerFired(), at=6.0)  # rank 2: heartbeat stale (a host cut off, say)
    out = h.send(2, m.Heartbeat())  # the host is back
    refusals = messages(out, m.Shutdown)
    assert len(refusals) == 1 and [s.rank for s in out if isinstance(s, Send)] == [2]
    assert refusals[0].writer == -1 and not refusals[0].failure
    assert refusals[0].refused.startswith("declared lost (heartbeat stale")
    assert h.send(2, m.BatchDone(epoch=0, offset=0, size=32, batch_ms=1.0)) == []  # once
    assert h.core.stale_messages == 2  # nothing it says enters the run
    assert h.core.rank_state[2] is RankState.DEAD and h.core.outcome is None
    h.run_to_end()
    ends = [c.event for c in of(h.log, Emit) if isinstance(c.event, tl.RunEnd)]  # type: ignore[attr-defined]
    assert [(e.outcome, e.stale_messages) for e in ends] == [("completed", 2)]  # the summary's


def test_death_mid_collective_abandons_the_round_and_regroups() -> None:
    h = Harness(world_size=3, num_samples=960)
    h.form()
    h.train_window()
    assert h.core.round.in_flight
    out = h.feed(RankLost(rank=2, reason="process killed"))
    assert messages(out, m.Regroup) == [m.Regroup(generation=1, members=[0, 1])]
    assert h.core.round.members == {0, 1}
    # The survivors train what rank 2 had trained, then the gate fires again.
    assert not messages(out, m.SyncNow)
    out = h.train_window()
    assert messages(out, m.SyncNow) == [m.SyncNow(round=2, generation=1)]


def test_single_survivor_of_a_collective_run_saves_then_finishes() -> None:
    h = Harness(save_path="/tmp/run")
    h.form()
    out = h.feed(RankLost(rank=1, reason="process killed"))
    assert messages(out, m.ShutdownWithSave) == [
        m.ShutdownWithSave(reason="single_survivor", writer=0, seq=1)
    ]
    assert h.core.state is RunState.SAVING
    assert not of(out, WriteMeta)  # the meta waits for the writer's answer
    out = h.answer_saves()
    meta = of(out, WriteMeta)[0].meta  # type: ignore[attr-defined]
    assert meta.save_seq == 1 and meta.files.model.name == "run.s1.0.model"
    assert messages(out, m.Shutdown) == [
        m.Shutdown(writer=-1, saved="single_survivor")
    ]  # held ranks exit
    assert meta.reason is SaveReason.SINGLE_SURVIVOR
    assert meta.epoch == 0 and meta.coverage[0].total_samples == 640
    assert of(out, Finish) == [Finish(outcome="saved_and_shutdown", reason="single_survivor")]


def test_max_failures_saves_even_with_survivors() -> None:
    h = Harness(world_size=3, num_samples=960, max_failures=1, mode=Mode.CPU_CADENCE)
    h.form()
    out = h.feed(RankLost(rank=2, reason="exit 1"))
    assert messages(out, m.ShutdownWithSave)[0].reason == "max_failure_exceeded"  # type: ignore[attr-defined]
    h.send(0, state_saved(h.core.saves.rounds[SaveKind.SHUTDOWN], 0))
    out = h.feed(RankLost(rank=1, reason="exit 1"))
    assert of(out, Finish)[0].outcome == "saved_and_shutdown"  # type: ignore[attr-defined]


def test_coordinator_backend_keeps_running_with_one_survivor() -> None:
    h = Harness(mode=Mode.CPU_CADENCE)
    h.form()
    h.feed(RankLost(rank=1, reason="exit"))
    assert h.core.state is RunState.TRAINING


# -- coordinator-backend rounds ------------------------------------------------


def test_coordinator_round_snapshot_average_update_ack() -> None:
    h = Harness(mode=Mode.CPU_CADENCE)
    h.form()
    out = h.train_window()
    assert messages(out, m.RequestParams) == [m.RequestParams(round=1)]
    steps = {r: h.core.work.steps_since_sync(r) for r in (0, 1)}
    h.send(0, m.SnapshotReady(round=1, steps=steps[0]))
    out = h.send(1, m.SnapshotReady(round=1, steps=steps[1]))
    mass = ((0, float(steps[0])), (1, float(steps[1])))
    assert of(out, AverageSnapshots) == [
        AverageSnapshots(round=1, param_mass=mass, buffer_mass=((0, 1.0), (1, 1.0)))
    ]
    out = h.feed(AverageComputed(round=1))
    assert [c.rank for c in of(out, Send)] == [0, 1]  # type: ignore[attr-defined]
    assert messages(out, m.Update) == [m.Update(round=1), m.Update(round=1)]
    acked_round(h, 1, steps)
    assert h.core.rounds_done == 1 and not h.core.round.in_flight


def test_snapshot_claiming_more_steps_than_made_evicts() -> None:
    h = Harness(mode=Mode.CPU_CADENCE, world_size=3, num_samples=960)
    h.form()
    h.train_window()
    h.send(2, m.SnapshotReady(round=1, steps=99))
    assert h.core.rank_state[2] is RankState.ERRORED


def test_average_computed_for_unknown_round_is_a_local_error() -> None:
    h = Harness(mode=Mode.CPU_CADENCE)
    h.form()
    with pytest.raises(LocalProtocolError):
        h.feed(AverageComputed(round=5))


def test_async_update_carries_the_easgd_blend() -> None:
    h = Harness(mode=Mode.CPU_ASYNC)
    h.form()
    assert h.received(0, m.AssignChunk)[0].budget == PROBE_STEPS + 3  # type: ignore[attr-defined]
    h.train(0, PROBE_STEPS)
    h.train(1, PROBE_STEPS)
    h.send(0, m.SnapshotReady(round=1, steps=2))
    h.send(1, m.SnapshotReady(round=1, steps=2))
    out = h.feed(AverageComputed(round=1))
    assert messages(out, m.Update)[0] == m.Update(round=1, alpha=0.5)


def test_async_opens_the_next_epoch_early_but_keeps_at_most_two_open() -> None:
    h = Harness(mode=Mode.CPU_ASYNC, num_samples=64, epochs=3)  # one batch per rank
    out = h.form()
    out += h.train(0, 1)  # epoch 0 has nothing left to hand out: epoch 1 opens for rank 0
    assigned = messages(out, m.AssignChunk)
    assert [chunk.epoch for chunk in assigned] == [0, 0, 1]  # type: ignore[attr-defined]
    out += h.train(0, 2)  # rank 0 takes its epoch-1 batch, then steals rank 1's
    starts = [e.event.epoch for e in of(out, Emit) if isinstance(e.event, tl.EpochStart)]
    assert starts == [0, 1]  # epoch 0 still waits for rank 1's batch: no third epoch
    assert h.core.work.open_epochs() == [0, 1]
    assert h.core.planner.quiesced[0]


# -- end of run, callbacks -----------------------------------------------------


def test_a_full_run_ends_with_shutdown_and_every_sample_committed() -> None:
    h = Harness(epochs=2)
    out = h.form() + h.run_to_end()
    assert of(out, Finish) == [Finish(outcome="completed")]
    assert messages(out, m.Shutdown)
    assert h.core.epochs_completed == 2
    assert h.core.work.pools == {}  # finished epochs keep no pool
    assert sum(h.core.work.samples_committed) == 2 * 640
    assert h.core.work.samples_missing(2) == 0
    assert [msg.epoch for msg in messages(out, m.EpochDone)] == [0, 1]  # type: ignore[attr-defined]


def test_eval_goes_to_the_eval_role_only_and_its_result_to_everyone() -> None:
    h = Harness(epochs=1, has_eval_fn=True)
    out = h.form() + h.run_to_end()
    assert h.core.state is RunState.FINISHING  # waits for the final eval
    evals = [(c.rank, c.message) for c in of(out, Send) if isinstance(c.message, m.RunEval)]  # type: ignore[attr-defined]
    assert evals == [(0, m.RunEval(epoch=1))]
    out = h.send(0, m.EvalResult(epoch=1, metric=0.97, elapsed_ms=120.0))
    assert messages(out, m.EvalBroadcast) == [m.EvalBroadcast(epoch=1, metric=0.97)]
    assert not of(out, Finish)  # complete once the final model is on disk
    assert of(h.answer_saves(), Finish) == [Finish(outcome="completed")]
    assert h.core.roles.cost.eval_ms == 120.0


def test_failed_eval_is_logged_and_not_broadcast() -> None:
    h = Harness(epochs=1, has_eval_fn=True)
    h.form()
    h.run_to_end()
    out = h.send(0, m.EvalResult(epoch=1, metric=float("nan"), elapsed_ms=5.0, error="boom"))
    assert not messages(out, m.EvalBroadcast)
    notices = [c.text for c in out if isinstance(c, Notice)]
    assert notices == ["eval_fn failed on rank 0 after epoch 0: boom"]  # numbered from 0
    assert of(h.answer_saves(), Finish)


def test_failed_checkpoint_retries_on_the_next_live_rank_then_gives_up() -> None:
    h = Harness(world_size=3, num_samples=960, epochs=1, checkpoint_every=1)
    h.form()
    h.run_to_end()
    assert h.core.state is RunState.FINISHING
    out = h.send(0, m.CheckpointResult(version=1, elapsed_ms=1.0, error="disk full"))
    retry = [(c.rank, c.message) for c in of(out, Send)]  # type: ignore[attr-defined]
    assert retry == [(1, m.RunCheckpoint(version=1))]
    h.send(1, m.CheckpointResult(version=1, elapsed_ms=1.0, error="disk full"))
    out = h.send(2, m.CheckpointResult(version=1, elapsed_ms=1.0, error="disk full"))
    assert any(isinstance(c, Notice) and "giving up" in c.text for c in out)
    assert of(h.answer_saves(), Finish) == [Finish(outcome="completed")]


def test_checkpoint_cadence_writes_a_meta_at_the_epoch_boundary() -> None:
    h = Harness(epochs=2, checkpoint_every=1, save_path="/tmp/x")
    out = h.form() + h.run_to_end()
    metas = [c.meta for c in of(out, WriteMeta)]  # type: ignore[attr-defined]
    assert [meta.reason for meta in metas] == [SaveReason.CHECKPOINT] * 2
    assert [meta.epoch for meta in metas] == [1, 2]
    assert metas[0].coverage == ()


def test_done_coordinator_ignores_everything() -> None:
    h = Harness()
    h.form()
    h.run_to_end()
    assert h.core.state is RunState.DONE
    assert h.feed(RankLost(rank=0, reason="late")) == []
    assert h.core.dead_ranks == []


def test_lr_cliff_nudges_the_anchor_down() -> None:
    h = Harness(num_samples=64_000, epochs=1)
    h.form()
    kinds: list[str] = []
    for number in range(1, 9):
        for rank in (0, 1):
            h.send(rank, m.LrUpdate(lr=0.1 if number < 7 else 0.001))
        h.train_window()
        out = []
        for rank in (0, 1):
            out += h.send(rank, m.SyncAck(round=number, steps=h.core.work.steps_since_sync(rank)))
        kinds += [type(c.event).__name__ for c in of(out, Emit)]  # type: ignore[attr-defined]
    assert "MetaNudge" in kinds
    assert h.core.elche.anchor < 10


def test_a_lone_rank_holds_nothing_back() -> None:
    h = Harness(world_size=1, num_samples=12 * 32)  # a 10-batch tail, one window
    h.form()
    h.train(0, PROBE_STEPS)  # the calibration: one batch is in flight, 9 are left
    assert h.core.rounds_done == 0
    h.train(0, 1)
    assert h.core.planner.tail_plan == {0: 0}  # all of it went out in one chunk
    assert [size for _, _, size in h.chunks[0]] == [9 * 32]
    assert h.core.planner.tail_reserve == 0
