"""The per-window ledger, as pinned by floDl 0.7.0's window_ledger tests."""

from __future__ import annotations

import math

import pytest

from elche.core.errors import ConfigError
from elche.core.ledger import WindowLedger
from elche.core.scheduler import ElChe


def test_first_batch_fills_then_marginal_accumulates() -> None:
    led = WindowLedger(2)
    led.record_batch(0, 10.0, 5.0)
    assert led.steps(0) == 1
    assert led.wall_ms(0) == 10.0
    assert not led.has_delivered_sample(0)
    assert led.fill_excess_ms(0) == 0.0
    led.record_batch(0, 8.0, 2.0)
    led.record_batch(0, 8.0, 2.0)
    assert led.steps(0) == 3
    assert led.has_delivered_sample(0)
    assert (led.delivered_ms(0), led.delivered_batches(0)) == (20.0, 2)
    assert led.fill_excess_ms(0) == pytest.approx(5.0)  # first 15 - marginal 10
    assert led.steps(1) == 0


def test_fill_excess_clamps_at_zero() -> None:
    led = WindowLedger(1)
    led.record_batch(0, 1.0, 0.0)
    led.record_batch(0, 8.0, 2.0)
    assert led.fill_excess_ms(0) == 0.0


def test_absorb_callback_cost_clamps_and_ignores_oob() -> None:
    led = WindowLedger(1)
    led.record_batch(0, 10.0, 0.0)
    led.record_batch(0, 10.0, 5.0)
    led.absorb_callback_cost(0, 12.0)
    assert (led.wall_ms(0), led.delivered_ms(0)) == (8.0, 3.0)
    led.absorb_callback_cost(0, 100.0)
    assert (led.wall_ms(0), led.delivered_ms(0)) == (0.0, 0.0)
    led.absorb_callback_cost(7, 1.0)
    led.absorb_callback_cost(-1, 1.0)


def test_record_batch_ignores_oob_rank() -> None:
    led = WindowLedger(1)
    led.record_batch(3, 1.0, 1.0)
    led.record_batch(-1, 1.0, 1.0)
    assert led.total_steps() == 0
    assert led.steps(3) == 0


def test_resets_are_split_steps_vs_timing() -> None:
    led = WindowLedger(2)
    led.record_batch(0, 10.0, 5.0)
    led.record_batch(0, 10.0, 5.0)
    led.record_batch(1, 4.0, 1.0)
    led.reset_timing()
    assert led.wall_ms(0) == 0.0
    assert not led.has_delivered_sample(0)
    assert led.fill_excess_ms(0) == 0.0
    assert led.all_steps() == (2, 1)
    led.reset_steps()
    assert led.all_steps() == (0, 0)


def test_cohort_step_stats() -> None:
    led = WindowLedger(3)
    led.record_batch(0, 1.0, 0.0)
    led.record_batch(0, 1.0, 0.0)
    led.record_batch(2, 1.0, 0.0)
    assert (led.min_steps(), led.max_steps(), led.total_steps()) == (0, 2, 3)


def test_mean_loss_absent_until_reported() -> None:
    led = WindowLedger(2)
    assert led.mean_loss(0) is None
    led.record_batch_loss(0, 0.4)
    led.record_batch_loss(0, 0.6)
    assert led.mean_loss(0) == pytest.approx(0.5)
    assert led.mean_loss(1) is None
    led.record_batch_loss(9, 1.0)
    assert led.mean_loss(9) is None


def test_non_finite_loss_never_poisons_the_mean() -> None:
    led = WindowLedger(1)
    for loss in (0.5, math.nan, math.inf, -math.inf):
        led.record_batch_loss(0, loss)
    assert led.mean_loss(0) == 0.5


def test_loss_resets_with_timing_not_steps() -> None:
    led = WindowLedger(1)
    led.record_batch_loss(0, 2.0)
    led.reset_steps()
    assert led.mean_loss(0) == 2.0
    led.reset_timing()
    assert led.mean_loss(0) is None
    led.record_batch_loss(0, 4.0)
    assert led.mean_loss(0) == 4.0


def test_per_batch_wall_is_infinite_when_cold() -> None:
    led = WindowLedger(2)
    assert led.per_batch_wall_ms(0) == math.inf
    assert led.per_batch_wall_ms(5) == math.inf
    led.record_batch(0, 10.0, 3.0)
    led.record_batch(0, 20.0, 3.0)
    assert led.per_batch_wall_ms(0) == 15.0


def test_rejects_empty_world() -> None:
    with pytest.raises(ConfigError, match="world_size"):
        WindowLedger(0)


# -- building the WindowReport -------------------------------------------------


def _ledger(batches: dict[int, list[tuple[float, float]]], world_size: int = 3) -> WindowLedger:
    led = WindowLedger(world_size)
    for rank, frames in batches.items():
        for batch_ms, data_ms in frames:
            led.record_batch(rank, batch_ms, data_ms)
    return led


def test_report_is_coherent_when_every_mover_has_a_sample() -> None:
    led = _ledger({0: [(10.0, 5.0), (8.0, 2.0), (8.0, 2.0)], 1: [(20.0, 0.0), (20.0, 0.0)]})
    r = led.build_window_report(dead=(), delivered_capable=True, sync_ms=7.0)
    assert r.delivered_coherent  # rank 2 never moved: it does not block
    assert r.wall_ms == (26.0, 40.0, 0.0)
    assert r.steps == (3, 2, 0)
    assert r.delivered_ms == (20.0, 20.0, 0.0)
    assert r.delivered_batches == (2, 1, 0)
    assert r.fill_ms == pytest.approx((5.0, 0.0, 0.0))
    assert r.sync_ms == 7.0


def test_one_mover_without_sample_breaks_coherence() -> None:
    led = _ledger({0: [(10.0, 0.0), (10.0, 0.0)], 1: [(20.0, 0.0)]})
    r = led.build_window_report(dead=(), delivered_capable=True, sync_ms=1.0)
    assert not r.delivered_coherent
    assert led.build_window_report(dead={1}, delivered_capable=True, sync_ms=1.0).delivered_coherent


def test_mode_without_delivered_feed_is_never_coherent() -> None:
    led = _ledger({0: [(10.0, 0.0), (10.0, 0.0)]})
    assert not led.build_window_report(
        dead=(), delivered_capable=False, sync_ms=1.0
    ).delivered_coherent


def test_report_feeds_elche_on_the_delivered_scale() -> None:
    led = _ledger({0: [(10.0, 5.0)] + [(10.0, 10.0)] * 4, 1: [(40.0, 0.0)] * 5}, world_size=2)
    c = ElChe(2, 4)
    c.report_window(led.build_window_report(dead=(), delivered_capable=True, sync_ms=1.0))
    assert c.ms_per_batch() == (20.0, 40.0)  # rank 0 pays 10 ms of data wait per batch
    assert c.batch_counts == (8, 4)
