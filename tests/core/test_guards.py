"""Divergence and the convergence guards, as pinned by floDl 0.7.0's tests."""

from __future__ import annotations

import math
import struct

import pytest

from elche.core.errors import ConfigError
from elche.core.guards import (
    DivergenceReport,
    Guard,
    GuardKind,
    LambdaEstimator,
    MsfGuard,
    NoGuard,
    TrendGuard,
    build_guard,
    divergence,
)
from elche.core.verdicts import NudgeDown, Stable, SuppressGrowth, Verdict

LN2 = math.log(2.0)


def rep(*deltas: float) -> DivergenceReport:
    return DivergenceReport(deltas=deltas)


def feed(guard: Guard, values: list[float]) -> list[Verdict]:
    return [guard.report(rep(v), 8, 4) for v in values]


def doubling(guard: Guard, events: int, start: float = 1e-4) -> list[Verdict]:
    """Feed a divergence that doubles every window: λ = ln 2 / 4 per step."""
    return feed(guard, [start * 2.0**i for i in range(1, events + 1)])


# -- divergence ----------------------------------------------------------------


def test_divergence_empty_is_zero() -> None:
    assert divergence([], []) == (0.0, 0.0, 0.0)


def test_divergence_length_mismatch() -> None:
    with pytest.raises(ValueError, match="post has"):
        divergence([1.0, 2.0], [1.0])


def test_divergence_hand_computed() -> None:
    # pre = [3, 4] (norm 5), post = [6, 8] (norm 10): ‖pre − post‖ = 5, ratio 0.5.
    d, pre_norm, post_norm = divergence([3.0, 4.0], [6.0, 8.0])
    assert (d, pre_norm, post_norm) == (0.5, 5.0, 10.0)


def test_divergence_zero_post_is_guarded() -> None:
    assert divergence([1.0, 1.0], [0.0, 0.0]) == (0.0, math.sqrt(2.0), 0.0)


def _bf16(x: float) -> float:
    """Round-toward-zero to bfloat16 (the top 16 bits of a float32)."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    (out,) = struct.unpack("<f", struct.pack("<I", bits & 0xFFFF0000))
    return float(out)


def test_divergence_bf16_consensus_parity() -> None:
    # A consensus shipped as bf16 is measured in float64: a replica holding exactly
    # that consensus reads zero divergence, and the norms agree with float64 math.
    post = [_bf16(0.1 * i - 1.3) for i in range(32)]
    d, pre_norm, post_norm = divergence(post, post)
    assert d == 0.0
    assert pre_norm == post_norm == math.sqrt(math.fsum(q * q for q in post))
    exact = divergence([0.1 * i - 1.3 for i in range(32)], [0.2 * i for i in range(32)])
    wire = divergence([0.1 * i - 1.3 for i in range(32)], [_bf16(0.2 * i) for i in range(32)])
    assert wire[2] == pytest.approx(exact[2], rel=2**-7)  # bf16 keeps 8 mantissa bits


# -- DivergenceReport ----------------------------------------------------------


def test_max_relative_delta_picks_worst_rank() -> None:
    assert rep(0.01, 0.05, 0.03).max_relative_delta() == 0.05


def test_max_relative_delta_empty_and_negative_is_zero() -> None:
    assert rep().max_relative_delta() == 0.0
    assert rep(-1.0).max_relative_delta() == 0.0


def test_cosine_none_without_norms() -> None:
    r = rep(0.01, 0.02)
    assert r.cosine(0) is None
    assert r.magnitude_shift(0) is None


def test_cosine_near_one_for_small_delta() -> None:
    r = DivergenceReport(deltas=(0.001,), pre_norms=(10.0,), post_norm=10.0)
    cos = r.cosine(0)
    assert cos is not None
    assert cos > 0.999


def test_cosine_edges() -> None:
    r = DivergenceReport(deltas=(0.5, 0.5), pre_norms=(0.0, 1.0), post_norm=1.0)
    assert r.cosine(0) == 0.0  # zero replica: no direction
    assert r.cosine(1) == pytest.approx((1 + 1 - 0.25) / 2)
    assert r.cosine(5) is None
    assert DivergenceReport(deltas=(0.1,), pre_norms=(1.0,), post_norm=0.0).cosine(0) is None


def test_magnitude_shifts() -> None:
    r = DivergenceReport(deltas=(0.01, 0.02), pre_norms=(10.5, 9.8), post_norm=10.0)
    assert r.magnitude_shift(0) == pytest.approx(0.5)
    assert r.magnitude_shift(1) == pytest.approx(-0.2)


def test_report_rejects_ragged_norms() -> None:
    with pytest.raises(ValueError, match="pre_norms"):
        DivergenceReport(deltas=(0.1, 0.2), pre_norms=(1.0,), post_norm=1.0)


# -- NoGuard -------------------------------------------------------------------


def test_no_guard_is_always_stable_and_silent() -> None:
    g = NoGuard()
    assert feed(g, [0.5] * 10) == [Stable()] * 10
    assert g.telemetry() == ()
    assert g.trend_history() is None
    g.reset()


# -- TrendGuard ----------------------------------------------------------------


def test_trend_default_threshold_is_0_01() -> None:
    g = TrendGuard()
    assert g.threshold == 0.01
    assert feed(g, [0.011, 0.012, 0.013])[-1] == SuppressGrowth()


def test_trend_three_rises_above_threshold_suppress() -> None:
    assert feed(TrendGuard(0.01), [0.02, 0.03, 0.04]) == [Stable(), Stable(), SuppressGrowth()]


def test_trend_non_rising_is_stable() -> None:
    assert feed(TrendGuard(0.01), [0.05, 0.04, 0.06])[-1] == Stable()
    assert feed(TrendGuard(0.01), [0.02, 0.03, 0.03])[-1] == Stable(), "rises are strict"


def test_trend_below_threshold_is_stable() -> None:
    assert feed(TrendGuard(0.10), [0.01, 0.02, 0.03])[-1] == Stable()


def test_trend_never_nudges() -> None:
    verdicts = feed(TrendGuard(0.0), [0.1 * 2**i for i in range(20)])
    assert not any(isinstance(v, NudgeDown) for v in verdicts)


def test_trend_history_capped_at_5() -> None:
    g = TrendGuard(0.01)
    feed(g, [i * 0.01 for i in range(10)])
    assert g.history == (0.05, 0.06, 0.07, 0.08, 0.09)


def test_trend_reset_clears_history() -> None:
    g = TrendGuard(0.01)
    feed(g, [0.05] * 5)
    g.reset()
    assert g.history == ()
    assert g.telemetry() == ()


def test_trend_telemetry_is_newest() -> None:
    g = TrendGuard(0.01)
    feed(g, [0.02, 0.03])
    assert g.telemetry() == (("d_history_last", 0.03),)


def test_trend_history_snapshot_roundtrip() -> None:
    g = TrendGuard(0.01)
    feed(g, [0.01, 0.02, 0.03, 0.04, 0.05])
    snap = g.trend_history()
    assert snap == (0.01, 0.02, 0.03, 0.04, 0.05)
    assert TrendGuard(0.01, snap).history == g.history


def test_trend_with_history_skips_warmup() -> None:
    assert TrendGuard(0.01).report(rep(0.05), 8, 4) == Stable()
    warm = TrendGuard(0.01, [0.02, 0.03, 0.04])
    assert warm.report(rep(0.05), 8, 4) == SuppressGrowth()


def test_trend_with_history_truncates_oversize() -> None:
    assert TrendGuard(0.01, [float(i) for i in range(10)]).history == (5.0, 6.0, 7.0, 8.0, 9.0)


def test_trend_empty_history_is_none() -> None:
    assert TrendGuard().trend_history() is None


def test_trend_rejects_nan_threshold() -> None:
    with pytest.raises(ConfigError, match="divergence_threshold"):
        TrendGuard(math.nan)


# -- LambdaEstimator -----------------------------------------------------------


def test_lambda_first_event_is_none() -> None:
    s = LambdaEstimator().observe(0.05, 8, 4)
    assert s.lambda_raw is None
    assert s.lambda_ema is None
    assert (s.d_raw, s.k_used, s.k_max) == (0.05, 8, 4)


@pytest.mark.parametrize(
    ("first", "second", "expected"), [(0.01, 0.02, LN2 / 4), (0.04, 0.02, -LN2 / 4)]
)
def test_lambda_growth_and_decay_use_k_max(first: float, second: float, expected: float) -> None:
    e = LambdaEstimator()
    e.observe(first, 8, 4)
    assert e.observe(second, 8, 4).lambda_raw == pytest.approx(expected, abs=1e-12)


def test_lambda_independent_of_k_used() -> None:
    two, three = LambdaEstimator(), LambdaEstimator()
    two.observe(0.01, 8, 4)
    three.observe(0.01, 12, 4)
    assert two.observe(0.02, 8, 4).lambda_raw == three.observe(0.02, 12, 4).lambda_raw


def test_lambda_noise_floor_breaks_pairing_only() -> None:
    e = LambdaEstimator()
    e.observe(0.01, 8, 4)
    assert e.observe(0.02, 8, 4).lambda_ema == pytest.approx(LN2 / 4)
    assert e.observe(1e-12, 8, 4).lambda_raw is None
    after = e.observe(0.02, 8, 4)
    assert after.lambda_raw is None, "no pairing across a sub-floor reading"
    assert after.lambda_ema == pytest.approx(LN2 / 4), "the EMA survives"
    assert e.observe(0.04, 8, 4).lambda_raw == pytest.approx(LN2 / 4)


def test_lambda_zero_k_max_gives_no_rate() -> None:
    e = LambdaEstimator()
    e.observe(0.01, 0, 0)
    assert e.observe(0.02, 0, 0).lambda_raw is None


def test_lambda_ema_bias_corrected_at_warmup() -> None:
    e = LambdaEstimator()
    e.observe(1.0, 1, 1)
    s = e.observe(math.e, 1, 1)
    assert s.lambda_raw == pytest.approx(1.0)
    assert s.lambda_ema == pytest.approx(1.0)
    assert e.raw_ema == pytest.approx(0.1)  # (1 − 0.9) · 1 before correction


def test_lambda_ema_smooths() -> None:
    e = LambdaEstimator()
    d = 1.0
    e.observe(d, 1, 1)
    for _ in range(200):
        d *= math.e
        e.observe(d, 1, 1)
    assert e.raw_ema == pytest.approx(1.0, abs=1e-3)
    e.observe(d, 1, 1)  # λ = 0 once: the EMA moves only a tenth of the way
    assert e.raw_ema == pytest.approx(0.9, abs=1e-3)


def test_lambda_alpha_clamps() -> None:
    assert LambdaEstimator(alpha=math.nan).alpha == 0.9
    assert LambdaEstimator(alpha=5.0).alpha == 1.0
    assert LambdaEstimator(alpha=-1.0).alpha == 2.0**-52


# -- MsfGuard ------------------------------------------------------------------


def test_msf_starts_stable() -> None:
    assert MsfGuard().report(rep(0.01), 8, 4) == Stable()


def test_msf_suppress_fires_after_sustain() -> None:
    # λ_ema = ln2/4 from the 2nd report on; the 3rd report above 1e-3 is the 4th.
    verdicts = doubling(MsfGuard().without_nudge(), 4)
    assert verdicts == [Stable(), Stable(), Stable(), SuppressGrowth()]


def test_msf_nudge_fires_and_wins_over_suppress() -> None:
    verdicts = doubling(MsfGuard(nudge_threshold=1e-3), 4)
    assert verdicts[-1] == NudgeDown(factor=0.5)


def test_msf_streaks_fire_independently() -> None:
    # Derived: λ_ema = ln2/4 ≈ 0.17 clears both bars from report 2. Both streaks hit
    # 3 at report 4; the nudge wins and resets only its own streak, so the suppress
    # streak (now 4) fires on report 5, and the pattern repeats with period 3.
    verdicts = doubling(MsfGuard(), 8)
    nudge, sup, ok = NudgeDown(factor=0.5), SuppressGrowth(), Stable()
    assert verdicts == [ok, ok, ok, nudge, sup, ok, nudge, sup]


def test_msf_decaying_never_fires() -> None:
    g = MsfGuard()
    assert set(feed(g, [0.5 * 0.5**i for i in range(1, 31)])) == {Stable()}


def test_msf_without_nudge_disables_hard_trigger() -> None:
    verdicts = doubling(MsfGuard(suppress_threshold=1e-3).without_nudge(), 20)
    assert not any(isinstance(v, NudgeDown) for v in verdicts)
    assert SuppressGrowth() in verdicts


def test_msf_telemetry_keys() -> None:
    g = MsfGuard()
    assert g.telemetry() == ()
    g.report(rep(0.01), 8, 4)
    assert g.telemetry() == ()
    g.report(rep(0.02), 8, 4)
    assert [k for k, _ in g.telemetry()] == ["lambda_raw", "lambda_ema"]
    assert g.trend_history() is None


def test_msf_reset_clears_state() -> None:
    g = MsfGuard()
    feed(g, [0.01, 0.02])
    g.reset()
    assert g.report(rep(0.04), 8, 4) == Stable()
    assert g.last_sample is not None
    assert g.last_sample.lambda_raw is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"suppress_sustain": 0}, "suppress_sustain"),
        ({"nudge_sustain": 0}, "nudge_sustain"),
        ({"nudge_factor": 0.0}, "nudge_factor"),
        ({"suppress_threshold": math.nan}, "msf_threshold"),
    ],
)
def test_msf_rejects_bad_config(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        MsfGuard(**kwargs)  # type: ignore[arg-type]  # sustain keys take ints here
    assert info.value.field == field


# -- build_guard ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("threshold", "easgd", "expected"), [(None, False, 0.05), (None, True, 0.3), (0.2, True, 0.2)]
)
def test_build_trend_guard_thresholds(
    threshold: float | None, easgd: bool, expected: float
) -> None:
    g = build_guard(GuardKind.TREND, divergence_threshold=threshold, easgd=easgd, history=None)
    assert isinstance(g, TrendGuard)
    assert g.threshold == expected


def test_build_guard_kinds_and_history() -> None:
    none = build_guard(GuardKind.NONE, divergence_threshold=0.1, easgd=False, history=[0.1])
    assert isinstance(none, NoGuard)
    msf = build_guard(GuardKind.MSF, divergence_threshold=None, easgd=False, history=None)
    assert isinstance(msf, MsfGuard)
    trend = build_guard(GuardKind.TREND, divergence_threshold=None, easgd=False, history=[0.1, 0.2])
    assert trend.trend_history() == (0.1, 0.2)
    assert [k.value for k in GuardKind] == ["none", "trend", "msf"]
