"""The stall watchdog (``elche.core.stall``): a dump when nothing moves, repeated."""

from __future__ import annotations

from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.commands import Command, Emit, Notice
from elche.core.coordinator import Coordinator
from elche.core.events import RankLost, Started, TimerFired
from elche.core.rank import SaveKind
from elche.core.stall import StallWatch, describe_ranks, waiting_for
from tests.core.harness import Harness


def _stalls(out: list[Command]) -> list[tl.Stalled]:
    return [c.event for c in out if isinstance(c, Emit) and isinstance(c.event, tl.Stalled)]


def _tick(h: Harness, at: float) -> list[Command]:
    # Heartbeats keep both ranks alive; they are not progress.
    h.send(0, m.Heartbeat())
    h.send(1, m.Heartbeat())
    return h.feed(TimerFired(), at=at)


def test_no_progress_for_the_interval_dumps_and_repeats_while_it_lasts() -> None:
    h = Harness(stall_dump_s=3.0, heartbeat_timeout_s=50.0)
    h.form()
    h.train(0, 1)  # rank 0 reported a batch; rank 1 never does
    assert _stalls(_tick(h, 1.0)) == []  # the first check only arms the watch
    assert _stalls(_tick(h, 3.5)) == []
    out = _tick(h, 4.0)
    (stalled,) = _stalls(out)
    assert stalled.silent_s == 3.0
    assert "ranks [0, 1] to finish their windows" in stalled.waiting_for
    assert stalled.ranks[0].startswith("rank 0: live on ")
    assert "1 steps of a" in stalled.ranks[0]
    notice = next(c for c in out if isinstance(c, Notice))
    assert notice.level == "warning" and notice.text.startswith("[stall-watch] no progress for 3 s")
    assert _stalls(_tick(h, 5.0)) == []  # once per interval
    assert [s.silent_s for s in _stalls(_tick(h, 7.0))] == [6.0]  # it repeats
    h.train(1, 1)  # progress rearms it
    assert _stalls(_tick(h, 8.0)) == []
    assert _stalls(_tick(h, 10.0)) == []
    assert len(_stalls(_tick(h, 11.0))) == 1


def test_a_round_in_flight_names_the_ranks_it_waits_for() -> None:
    h = Harness(stall_dump_s=2.0, heartbeat_timeout_s=50.0)
    h.form()
    h.train_window()
    assert h.core.round.in_flight
    _tick(h, 1.0)
    (stalled,) = _stalls(_tick(h, 3.0))
    assert f"round {h.core.round.number}" in stalled.waiting_for
    assert "answers from ranks [0, 1]" in stalled.waiting_for


def test_the_default_is_the_reference_two_minutes() -> None:
    assert Harness().cfg.stall_dump_s == 120.0


def test_what_the_coordinator_waits_for_names_callbacks_saves_and_dead_ranks() -> None:
    h = Harness(world_size=3)
    h.form()
    h.feed(RankLost(rank=1, reason="gone"))  # two survivors: the run goes on
    core: Coordinator = h.core
    core._unsatisfied = set()  # a description of a hand-set state
    assert waiting_for(core).startswith("nothing it knows of")
    core.callbacks.pending_evals[3] = 0
    core.callbacks.pending_checkpoints[2] = 0
    core.saves.start(SaveKind.FINAL, [0, 2], 0.0)
    text = waiting_for(core)
    assert "the eval after epoch 3 from rank 0" in text
    assert "checkpoint v2 from rank 0" in text
    assert "the final save" in text
    assert describe_ranks(core, 0.0)[1] == "rank 1: dead"


def test_the_watch_is_quiet_before_training() -> None:
    h = Harness(stall_dump_s=1.0)
    h.feed(Started())
    watch = StallWatch(1.0)
    assert watch.check(h.core, 0.0) == []  # arms
    assert watch.check(h.core, 5.0) == []  # forming: no ranks live, nothing to dump


# -- a round in flight too long: the run stops, saved (``elche.core.liveness``) --


def _stalled_round(out: list[Command]) -> bool:
    return any(isinstance(c, Notice) and c.text.endswith("stalled") for c in out)


def _ticks_until_stalled(h: Harness, until: float) -> float | None:
    """Heartbeats and timer ticks every 10 s up to ``until``: when the round stalled."""
    at = h.now
    while at < until:
        at += 10.0
        if _stalled_round(_tick(h, at)):
            return at
    return None


def test_a_round_in_flight_past_the_bound_stops_the_run_and_a_late_answer_evicts_nobody() -> None:
    h = Harness(heartbeat_timeout_s=20.0)
    h.form()
    h.train_window()  # 10 ms steps
    number = h.core.round.number
    assert h.core.round.in_flight
    assert _ticks_until_stalled(h, 400.0) == 310.0  # past max(10 x 20 s, 300 s)
    assert h.received(0, m.ShutdownWithSave)[-1].reason == "reduce_stall"
    stale = h.core.stale_messages
    # Rank 0's answer, when its step ends, is for a round closed meanwhile: it was
    # taken for a protocol error ("acknowledged before its update") and rank 0 was
    # evicted during the stop; it is stale.
    h.send(0, m.SyncAck(round=number, steps=h.core.work.steps_since_sync(0)))
    assert h.core.stale_messages == stale + 1
    assert 0 in h.core.live and not h.core.dead_ranks


def test_a_round_waits_for_steps_of_minutes_three_of_its_slowest_members_steps() -> None:
    # A member serves the round once its step in progress ends: a rank whose steps
    # take 200 s (a slow CPU beside GPUs, a large model) stopped every run it was
    # in as stalled, at 300 s.
    h = Harness(heartbeat_timeout_s=20.0)
    h.form()
    h.train_window(ms={1: 200_000.0})
    assert h.core.round.in_flight
    assert _ticks_until_stalled(h, 700.0) == 610.0  # past 3 x 200 s
