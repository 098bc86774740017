"""Per-rank window records, throttles and role moves (``elche.core.telemetry``)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elche.core import timeline as tl
from elche.core.commands import Command, Emit
from elche.core.config import CallbackPolicy, Mode
from elche.core.roles import CallbackRoles, Role
from elche.core.telemetry import REPORTS_PER_EPOCH, Telemetry
from elche.sim.engine import SimConfig, Simulation
from tests.core.harness import config


def _events(out: list[Command]) -> list[tl.TimelineEvent]:
    return [c.event for c in out if isinstance(c, Emit)]


def _telemetry(mode: Mode = Mode.CADENCE) -> tuple[Telemetry, CallbackRoles]:
    cfg = config(world_size=2, num_samples=640, batch_size=32, mode=mode)  # 20 batches an epoch
    roles = CallbackRoles(CallbackPolicy.FASTEST, 2)
    return Telemetry(cfg, roles), roles


def test_a_record_is_due_after_a_quarter_epoch_of_batches() -> None:
    tel, _ = _telemetry()
    tel.start(10.0)
    assert tel.every_batches == 20 // REPORTS_PER_EPOCH
    for _ in range(3):
        tel.on_batch(0, 32, 100.0, 0.5)
    tel.on_batch(1, 16, 200.0, None)
    assert tel.on_round(10.5, [0, 1], epoch=0) == []  # 4 batches < 5: not yet
    tel.on_batch(0, 32, 100.0, 1.5)
    records = _events(tel.on_round(11.0, [0, 1], epoch=0))
    assert records == [
        tl.RankWindow(
            rank=0, epoch=0, span_s=1.0, batches=4, samples=128, loss=0.75,
            samples_per_s=128.0, share=0.8, compute_ms_per_batch=100.0, idle_pct=60.0,
        ),
        tl.RankWindow(
            rank=1, epoch=0, span_s=1.0, batches=1, samples=16, loss=None,
            samples_per_s=16.0, share=0.2, compute_ms_per_batch=200.0, idle_pct=80.0,
        ),
    ]  # fmt: skip
    # The next span starts at the record, empty.
    assert tel.on_round(12.0, [0, 1], epoch=0) == []


def test_a_dead_rank_with_nothing_in_the_span_gets_no_record() -> None:
    tel, _ = _telemetry()
    tel.start(0.0)
    for _ in range(5):
        tel.on_batch(0, 32, 10.0, 0.1)
    records = _events(tel.on_round(1.0, [0], epoch=0))
    assert [r.rank for r in records if isinstance(r, tl.RankWindow)] == [0]


def test_idle_is_floored_at_zero_and_no_records_before_the_start() -> None:
    tel, _ = _telemetry()
    for _ in range(5):
        tel.on_batch(0, 32, 1000.0, 0.1)
    assert tel.on_round(1.0, [0, 1], epoch=0) == []  # training never began
    tel.start(1.0)
    records = _events(tel.on_round(1.5, [0, 1], epoch=0))
    first = records[0]
    assert isinstance(first, tl.RankWindow) and first.idle_pct == 0.0


@pytest.mark.parametrize(("mode", "expected"), [(Mode.CADENCE, 1), (Mode.SYNC, 0)])
def test_a_throttle_is_once_per_round_and_never_under_sync(mode: Mode, expected: int) -> None:
    tel, _ = _telemetry(mode)
    first = _events(tel.held(0, steps=7)) + _events(tel.held(0, steps=7))
    assert first == [tl.Throttle(rank=0, steps=7)] * expected
    tel.on_round(1.0, [0, 1], epoch=0)
    assert len(_events(tel.held(0, steps=7))) == expected


def test_roles_moved_is_emitted_once_per_change() -> None:
    tel, roles = _telemetry()
    assert tel.roles_moved() == []
    roles.on_death(0, [1], lambda r: 5.0)
    assert _events(tel.roles_moved()) == [
        tl.RolesMoved(epoch_rank=1, eval_rank=1, checkpoint_rank=1)
    ]
    assert tel.roles_moved() == []
    assert roles.holder(Role.EVAL) == 1


def test_the_simulator_records_windows_for_every_rank_a_few_times_an_epoch() -> None:
    sim = Simulation(SimConfig(speeds=(1.0, 0.5, 0.25), epochs=3, samples=1437))
    sim.run()
    kinds = Counter(type(e).__name__ for e in sim.timeline)
    assert kinds["RankJoined"] == 3
    windows = [e for e in sim.timeline if isinstance(e, tl.RankWindow)]
    assert {w.rank for w in windows} == {0, 1, 2}
    assert 3 <= len(windows) <= 3 * 3 * REPORTS_PER_EPOCH
    # Shares of one record sum to 1; the fast rank takes the larger share.
    by_t: dict[float, list[tl.RankWindow]] = {}
    for w in windows:
        by_t.setdefault(w.t, []).append(w)
    for group in by_t.values():
        assert sum(w.share for w in group) == pytest.approx(1.0, abs=1e-3)
        shares = {w.rank: w.share for w in group}
        assert shares[0] > shares[2]


@settings(max_examples=40, deadline=None)
@given(
    speeds=st.lists(st.sampled_from([1.0, 0.8, 0.5, 0.25]), min_size=2, max_size=4),
    mode=st.sampled_from(list(Mode)),
    epochs=st.integers(1, 3),
    samples=st.integers(100, 1500),
    noise=st.tuples(st.sampled_from([0.0, 0.3]), st.integers(0, 2**16)),
)
def test_every_trained_sample_is_in_one_window_of_its_epoch_before_the_epochs_end(
    speeds: list[float], mode: Mode, epochs: int, samples: int, noise: tuple[float, int]
) -> None:
    """The tail of each epoch is recorded before its ``EpochEnd`` (under ``sync``
    a round closes every step, so the last quarter-epoch's records were never
    due and the run's last batches were in no record)."""
    jitter, seed = noise
    cfg = SimConfig(
        speeds=tuple(speeds), mode=mode, epochs=epochs, samples=samples, jitter=jitter, seed=seed
    )
    sim = Simulation(cfg)
    sim.run()
    ended: set[int] = set()
    recorded = 0
    for event in sim.timeline:
        if isinstance(event, tl.RankWindow):
            assert event.epoch not in ended
            recorded += event.samples
        elif isinstance(event, tl.EpochEnd):
            ended.add(event.epoch)
    assert ended == set(range(epochs))
    assert recorded == epochs * samples
