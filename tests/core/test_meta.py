"""The LR-aware meta-controller, as pinned by floDl 0.7.0's lr_event_meta tests."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from elche.core.elche_state import Phase
from elche.core.errors import ConfigError
from elche.core.meta import (
    BASE_FACTOR,
    SUSTAIN_K,
    LrEventMeta,
    MetaConfig,
    effective_factor,
)
from elche.core.verdicts import NudgeDown, Stable, SuppressGrowth, Verdict

OK: Verdict = Stable()
NUDGE: Verdict = NudgeDown(factor=0.5)
SUPPRESS: Verdict = SuppressGrowth()


def run(
    meta: LrEventMeta, phase: Phase, seq: Sequence[tuple[float, int, Verdict]]
) -> NudgeDown | None:
    """Feed ``(lr, anchor, verdict)`` cycles; return the last result."""
    last = None
    for lr, anchor, verdict in seq:
        last = meta.observe(lr, anchor, verdict, phase)
    return last


def factor_of(action: NudgeDown | None) -> float:
    assert action is not None, "expected a nudge"
    return action.factor


# -- windows -------------------------------------------------------------------


def test_single_observation_is_noop() -> None:
    assert LrEventMeta().observe(0.1, 100, OK, Phase.STABLE) is None


def test_windows_are_capped_and_guard_cap_raised_to_five() -> None:
    meta = LrEventMeta(MetaConfig(lr_window_cap=3, anchor_window_cap=3, guard_window_cap=3))
    for i in range(7):
        meta.observe(0.1 * i, 100 + i, OK, Phase.STABLE)
    assert meta.lr_window == pytest.approx((0.4, 0.5, 0.6))
    assert meta.anchor_window == (104, 105, 106)
    assert len(meta.guard_window) == 5


def test_zero_cap_records_nothing() -> None:
    meta = LrEventMeta(MetaConfig(lr_window_cap=0, anchor_window_cap=0))
    assert run(meta, Phase.STABLE, [(0.1, 100, OK), (0.01, 50, OK)]) is None
    assert meta.lr_window == ()
    assert meta.anchor_window == ()


def test_config_defaults_and_validation() -> None:
    cfg = MetaConfig()
    assert (cfg.lr_window_cap, cfg.anchor_window_cap, cfg.guard_window_cap) == (3, 5, 5)
    assert (cfg.sharp_drop_threshold, cfg.min_factor, cfg.max_factor) == (0.3, 0.1, 0.95)
    with pytest.raises(ConfigError, match="lr_window_cap"):
        MetaConfig(lr_window_cap=-1)
    with pytest.raises(ConfigError, match="min_factor"):
        MetaConfig(min_factor=0.9, max_factor=0.5)
    with pytest.raises(ConfigError, match="sharp_drop_threshold"):
        MetaConfig(sharp_drop_threshold=-0.1)


def test_probe_silences_both_watchers() -> None:
    meta = LrEventMeta()
    assert run(meta, Phase.PROBE, [(0.1, 100, NUDGE)] * 5 + [(0.01, 100, NUDGE)]) is None


# -- LR cliff ------------------------------------------------------------------


def test_lr_cliff_fires_on_10x_drop() -> None:
    action = run(LrEventMeta(), Phase.STABLE, [(0.1, 100, OK), (0.01, 100, OK)])
    assert factor_of(action) == pytest.approx(0.5)


def test_lr_cliff_fires_in_warmup() -> None:
    action = run(LrEventMeta(), Phase.WARMUP, [(0.1, 100, OK), (0.01, 100, OK)])
    assert factor_of(action) == pytest.approx(0.5)


def test_lr_cliff_silent_on_smooth_decay() -> None:
    seq = [(0.1 * 0.98**i, 100, OK) for i in range(10)]
    assert run(LrEventMeta(), Phase.STABLE, seq) is None


def test_lr_cliff_silent_on_lr_rise() -> None:
    assert run(LrEventMeta(), Phase.STABLE, [(0.001, 100, OK), (0.1, 100, OK)]) is None


def test_lr_cliff_silent_with_short_window() -> None:
    assert LrEventMeta().observe(0.1, 100, OK, Phase.STABLE) is None


@pytest.mark.parametrize(("new_lr", "fires"), [(0.75, False), (0.65, True)])
def test_lr_cliff_threshold_boundary(new_lr: float, fires: bool) -> None:
    # A 25 % drop stays silent, 35 % fires (the drop must exceed 0.3).
    action = run(LrEventMeta(), Phase.STABLE, [(1.0, 100, OK), (new_lr, 100, OK)])
    assert (action is not None) is fires


# -- convergence pattern -------------------------------------------------------


def test_three_sustained_at_stable_fire() -> None:
    action = run(LrEventMeta(), Phase.STABLE, [(0.1, 100, NUDGE)] * 3)
    assert factor_of(action) == pytest.approx(0.5)


def test_isolated_nudge_is_silent() -> None:
    seq = [(0.1, 100, OK), (0.1, 100, NUDGE), (0.1, 100, OK), (0.1, 100, OK)]
    assert run(LrEventMeta(), Phase.STABLE, seq) is None


def test_two_are_not_enough_at_stable() -> None:
    seq = [(0.1, 100, OK), (0.1, 100, NUDGE), (0.1, 100, NUDGE)]
    assert run(LrEventMeta(), Phase.STABLE, seq) is None


def test_mature_needs_only_two() -> None:
    seq = [(0.1, 100, OK), (0.1, 100, SUPPRESS), (0.1, 100, SUPPRESS)]
    assert factor_of(run(LrEventMeta(), Phase.MATURE, seq)) == pytest.approx(0.7)


def test_warmup_needs_five() -> None:
    meta = LrEventMeta()
    assert run(meta, Phase.WARMUP, [(0.1, 100, SUPPRESS)] * 4) is None
    assert factor_of(meta.observe(0.1, 100, SUPPRESS, Phase.WARMUP)) == pytest.approx(0.3)


def test_mixed_kinds_fire() -> None:
    seq = [(0.1, 100, SUPPRESS), (0.1, 100, NUDGE), (0.1, 100, SUPPRESS)]
    assert run(LrEventMeta(), Phase.STABLE, seq) is not None


def test_per_phase_tables() -> None:
    assert [BASE_FACTOR[p] for p in Phase] == [0.3, 0.3, 0.5, 0.7]
    assert [SUSTAIN_K[p] for p in Phase] == [5, 5, 3, 2]


# -- anchor trend and factors --------------------------------------------------


@pytest.mark.parametrize(
    ("anchors", "sign"),
    [([100, 110, 120, 130, 140], 1), ([100, 80, 60, 40, 20], -1), ([100] * 5, 0), ([100], 0)],
)
def test_anchor_trend(anchors: list[int], sign: int) -> None:
    meta = LrEventMeta()
    for a in anchors:
        meta.observe(0.1, a, OK, Phase.STABLE)
    trend = meta.anchor_trend()
    assert (trend > 0) - (trend < 0) == sign


def test_anchor_trend_value() -> None:
    meta = LrEventMeta()
    run(meta, Phase.STABLE, [(0.1, a, OK) for a in (100, 100, 100, 100, 50)])
    assert meta.anchor_trend() == pytest.approx((50 - 90) / 90)


def test_is_settled() -> None:
    meta = LrEventMeta()
    run(meta, Phase.STABLE, [(0.1, 100, OK)] * 5)
    assert meta.is_settled()
    run(meta, Phase.STABLE, [(0.1, 150, OK)])  # window (100 x4, 150): trend 40/110 = 0.36
    assert not meta.is_settled()


@pytest.mark.parametrize(("trend", "expected"), [(0.0, 0.5), (-0.5, 0.75), (0.5, 0.25)])
def test_effective_factor_symmetric(trend: float, expected: float) -> None:
    assert effective_factor(0.5, trend) == pytest.approx(expected)


def test_effective_factor_clamps() -> None:
    assert effective_factor(0.5, 5.0) == pytest.approx(0.1)
    assert effective_factor(0.5, -5.0) == pytest.approx(0.95)
    assert effective_factor(0.5, 5.0, lo=0.2) == pytest.approx(0.2)


def test_compound_at_mature() -> None:
    meta = LrEventMeta()
    run(meta, Phase.MATURE, [(0.1, 100, NUDGE), (0.1, 100, NUDGE)])
    action = meta.observe(0.01, 100, NUDGE, Phase.MATURE)
    assert factor_of(action) == pytest.approx(0.35)  # cliff 0.5 x Mature 0.7


def test_compound_is_clamped() -> None:
    # Derived: anchors (100..400, 1000) give trend 1.5, so both factors clamp to 0.1
    # and their product 0.01 clamps back up to the 0.1 floor.
    meta = LrEventMeta()
    seq = [(0.1, a, SUPPRESS) for a in (100, 200, 300, 400)] + [(0.01, 1000, SUPPRESS)]
    assert factor_of(run(meta, Phase.WARMUP, seq)) == pytest.approx(0.1)


def test_trend_dampens_nudge_after_cliff() -> None:
    meta = LrEventMeta()
    run(meta, Phase.STABLE, [(0.1, 100, OK)] * 4)
    factor = factor_of(meta.observe(0.01, 50, OK, Phase.STABLE))
    # Derived: trend = (50 - 90) / 90 = -0.444 -> 0.5 + 0.5 * 0.444 = 0.722.
    assert factor == pytest.approx(0.5 + 0.5 * 40 / 90)
    assert 0.5 < factor < 0.95


def test_trend_amplifies_nudge_during_climb() -> None:
    meta = LrEventMeta()
    run(meta, Phase.STABLE, [(0.1, a, OK) for a in (100, 110, 120, 130, 140)])
    factor = factor_of(meta.observe(0.01, 140, OK, Phase.STABLE))
    # Derived: window (110..140, 140), mean 128 -> trend 0.09375 -> 0.5 - 0.5 * 0.09375.
    assert factor == pytest.approx(0.453125)
    assert 0.1 < factor < 0.5
