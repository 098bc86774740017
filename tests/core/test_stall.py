"""The stall watchdog (``elche.core.stall``): a dump when nothing moves, repeated."""

from __future__ import annotations

from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.commands import Command, Emit, Notice
from elche.core.events import TimerFired
from elche.core.stall import StallWatch
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
    budget = [h.core.planner.budget[r] for r in range(2)]
    h.train(0, budget[0])
    h.train(1, budget[1])
    assert h.core.round.in_flight
    _tick(h, 1.0)
    (stalled,) = _stalls(_tick(h, 3.0))
    assert f"round {h.core.round.number}" in stalled.waiting_for
    assert "answers from ranks [0, 1]" in stalled.waiting_for


def test_no_dump_before_training_or_without_live_ranks() -> None:
    h = Harness(stall_dump_s=1.0)
    h.feed(TimerFired(), at=0.0)
    assert _stalls(h.feed(TimerFired(), at=5.0)) == []  # still forming
    watch = StallWatch(1.0)
    assert watch.interval_s == 1.0


def test_the_default_is_the_reference_two_minutes() -> None:
    assert Harness().cfg.stall_dump_s == 120.0
