"""Global progress: the coordinator's exact counts and each rank's estimate between them."""

from __future__ import annotations

import json

import pytest

from elche.core import messages as m
from elche.core.checkpoint import CheckpointMeta
from elche.core.commands import Broadcast, Command, Send
from elche.core.config import Mode
from elche.core.coordinator import Coordinator
from elche.core.progress import Progress, ProgressTracker
from elche.core.rank import RankProtocol, Train
from elche.core.states import RunState
from tests.core.harness import Harness, messages
from tests.core.test_issue12_promises import meta_doc


def test_the_coordinator_confirms_the_exact_samples_after_every_round() -> None:
    h = Harness(world_size=2, num_samples=640, epochs=2)
    out = h.form()
    start = messages(out, m.GlobalProgress)
    assert {(p.round, p.samples) for p in start} == {(0, 0)}  # type: ignore[attr-defined]
    assert {c.rank for c in out if isinstance(c, Send) and c.message in start} == {0, 1}
    h.run_to_end(ms={0: 10.0, 1: 30.0})
    for rank in (0, 1):
        confirmed = h.received(rank, m.GlobalProgress)
        samples = [p.samples for p in confirmed]  # type: ignore[attr-defined]
        rounds = [p.round for p in confirmed]  # type: ignore[attr-defined]
        assert samples == sorted(samples) and samples[-1] == 2 * 640
        # After every round (and again once its budgets are planned), in order.
        assert rounds == sorted(rounds) and set(rounds) == set(range(rounds[-1] + 1))
        assert all(0 < p.share <= 1 for p in confirmed)  # type: ignore[attr-defined]
    for a, b in zip(h.received(0, m.GlobalProgress), h.received(1, m.GlobalProgress), strict=True):
        assert a.samples == b.samples  # type: ignore[attr-defined]
        assert a.share + b.share == pytest.approx(1.0)  # type: ignore[attr-defined]


def test_a_faster_rank_gets_a_bigger_share_once_measured() -> None:
    h = Harness(world_size=2, num_samples=6400, epochs=1)
    h.form()
    h.run_to_end(ms={0: 10.0, 1: 40.0})
    shares = [p.share for p in h.received(0, m.GlobalProgress)]  # type: ignore[attr-defined]
    assert max(shares) > 0.6


def test_the_estimate_counts_own_samples_by_share_from_the_confirmed_average() -> None:
    t = ProgressTracker(planned_samples=1000, reference_batch=10, world_size=2)
    t.trained(40)
    assert t.now().samples == 80  # before any word: share 1/2
    t.averaged(1)  # round 1 averaged with 40 own samples in it
    t.trained(20)  # trained on before the confirmation came
    t.confirmed(m.GlobalProgress(round=1, samples=100, share=0.25))
    p = t.now()
    assert (p.samples, p.exact_samples, p.step) == (100 + 20 * 4, 100, 18)
    assert p.fraction == pytest.approx(0.18)


def test_the_estimate_never_goes_back_nor_past_the_plan_until_confirmed() -> None:
    t = ProgressTracker(planned_samples=100, reference_batch=10, world_size=1)
    t.trained(60)
    t.averaged(1)
    t.confirmed(m.GlobalProgress(round=1, samples=40, share=1.0))  # others were slower
    assert t.now().samples == 60
    t.trained(80)
    assert t.now().samples == 99  # the plan's end only when the coordinator says so
    t.confirmed(m.GlobalProgress(round=2, samples=100, share=1.0))
    assert t.now().fraction == 1.0


def test_a_rank_alone_says_the_plan_is_done_itself() -> None:
    t = ProgressTracker(planned_samples=100, reference_batch=10, world_size=1)
    t.trained(100)
    assert t.now().samples == 99  # no coordinator's word
    t.finished()
    assert t.now() == Progress(
        samples=100, step=10, fraction=1.0, planned_samples=100, exact_samples=100
    )


def test_the_rank_protocol_feeds_its_tracker() -> None:
    p = RankProtocol(0, mode=Mode.CADENCE, batch_size=10, planned_samples=200, world_size=2)
    p.handle(m.AssignChunk(epoch=0, offset=0, size=40, budget=4))
    p.handle(m.GlobalProgress(round=0, samples=0, share=0.5))
    for offset in (0, 10):
        p.trained(Train(epoch=0, offset=offset, size=10), batch_ms=1.0, data_ms=0.0, loss=1.0)
    assert p.progress is not None and p.progress.now().samples == 40
    p.handle(m.SyncNow(round=1, generation=0))
    p.averaged()
    p.handle(m.GlobalProgress(round=1, samples=50, share=0.5))
    assert p.progress.now().samples == 50
    assert RankProtocol(0, mode=Mode.CADENCE, batch_size=10).progress is None


def test_a_second_word_on_the_same_round_counts_from_the_same_average() -> None:
    t = ProgressTracker(planned_samples=1000, reference_batch=10, world_size=2)
    t.trained(40)
    t.averaged(1)
    t.confirmed(m.GlobalProgress(round=1, samples=100, share=0.5))
    t.trained(10)
    t.confirmed(m.GlobalProgress(round=1, samples=100, share=0.25))  # the planned budgets
    assert t.now().samples == 100 + 10 * 4


def test_a_resumed_run_starts_from_the_samples_its_bundle_covers() -> None:
    meta = CheckpointMeta.from_json(json.dumps(meta_doc()))  # epoch 1 half done, of 3
    h = Harness(num_samples=640, epochs=3, seed=42)
    h.core = Coordinator(h.cfg, resume=meta)
    first = messages(h.form(), m.GlobalProgress)[0]
    assert (first.round, first.samples) == (8, 640 + 320)  # type: ignore[attr-defined]


def test_the_estimate_holds_at_the_end_of_the_window_until_the_round_confirms() -> None:
    t = ProgressTracker(planned_samples=1000, reference_batch=10, world_size=2)
    t.confirmed(m.GlobalProgress(round=0, samples=0, share=0.5, horizon=100))
    t.trained(40)
    assert t.now().samples == 80
    t.trained(30)  # faster than its share said, or filling a late peer's wait
    assert t.now().samples == 100  # the window's end, not 140: the peers are not past it
    t.averaged(1)
    t.trained(10)  # the next window, trained through the round
    assert t.now().samples == 100
    t.confirmed(m.GlobalProgress(round=1, samples=120, share=0.25, horizon=200))
    assert t.now().samples == 120 + 10 * 4
    t.trained(100)
    assert t.now().samples == 200
    t.confirmed(m.GlobalProgress(round=2, samples=90, share=0.5, horizon=150))  # a death
    assert t.now().samples == 200  # never backwards


def test_the_next_window_goes_out_with_the_progress_its_steps_count_from() -> None:
    h = Harness(world_size=2, num_samples=6400, epochs=2)
    h.form()
    handed = 0
    horizon = None  # where the window being trained ends, as the last close said
    while h.core.state is RunState.TRAINING:
        started = h.train_window({0: 10.0, 1: 30.0})
        rnd = h.core.round
        assert rnd.in_flight
        closed: list[Command] = []
        for rank in sorted(rnd.members):
            steps = h.core.work.steps_since_sync(rank)
            closed += h.send(rank, m.SyncAck(round=rnd.number, steps=steps))
        exact = _progress_of(closed, rnd.number)
        if horizon is not None:  # the window ended where its horizon said
            assert all(p.samples == horizon for p in exact.values())
        # Behind the round's order, before each rank's first chunk of the next
        # window: the progress its steps count from, as the close confirms it.
        ahead = _progress_of(started, rnd.number)
        if ahead:
            handed += 1
            assert ahead == exact
            order = next(i for i, c in enumerate(started) if _message(c, m.SyncNow))
            for rank, progress in ahead.items():
                sent = [c for c in started[order:] if isinstance(c, Send) and c.rank == rank]
                told = [c.message for c in sent]
                chunks = [i for i, x in enumerate(told) if isinstance(x, m.AssignChunk)]
                assert all(told.index(progress) < i for i in chunks)
        if exact:
            (horizon,) = {p.horizon for p in exact.values()}
            assert all(p.samples <= horizon for p in exact.values())
    assert handed >= 3


def _message(command: Command, kind: type) -> bool:
    return isinstance(command, Send | Broadcast) and isinstance(command.message, kind)


def _progress_of(commands: list[Command], round_number: int) -> dict[int, m.GlobalProgress]:
    """Each rank's ``GlobalProgress`` on ``round_number`` among ``commands``."""
    return {
        c.rank: c.message
        for c in commands
        if isinstance(c, Send)
        and isinstance(c.message, m.GlobalProgress)
        and c.message.round == round_number
    }
