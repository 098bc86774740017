"""ElChe: the behaviour pinned by floDl 0.7.0's ElChe tests, plus elche's own.

Where a reference test only bounds a number, the exact value is derived by
hand from spec §3 in a comment beside the assertion.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elche.core.elche_state import ElCheState, Phase
from elche.core.errors import ConfigError
from elche.core.ledger import WindowReport
from elche.core.scheduler import ElChe
from elche.core.verdicts import NudgeDown, Stable, SuppressGrowth, Verdict


def pinned(world_size: int, rank: int, anchor: int = 10, overhead_target: float = 0.05) -> ElChe:
    """An ElChe whose anchor rank is pinned without data (a resumed pin)."""
    c = ElChe(world_size, anchor, overhead_target=overhead_target)
    state = ElCheState(
        anchor=anchor,
        anchor_rank=rank,
        smoothed_ms_per_batch=(0.0,) * world_size,
        phase=Phase.PROBE,
        calibration_count=0,
    )
    c.restore_from_state(state)
    return c


def staged_grow(anchor: int = 10) -> ElChe:
    """An ElChe with a real Grow(2*anchor) proposal staged (two sync-swamped reports)."""
    c = ElChe(2, anchor)
    for _ in range(2):
        c.report_timing([100.0 * anchor] * 2, c.batch_counts, 5000.0)
    assert c.proposed_anchor == 2 * anchor
    return c


def report(
    wall: tuple[float, ...],
    steps: tuple[int, ...],
    dms: tuple[float, ...],
    dbatches: tuple[int, ...],
    *,
    coherent: bool,
) -> WindowReport:
    return WindowReport(
        wall_ms=wall,
        steps=steps,
        delivered_ms=dms,
        delivered_batches=dbatches,
        fill_ms=(0.0,) * len(wall),
        delivered_coherent=coherent,
        sync_ms=1.0,
    )


# -- construction --------------------------------------------------------------


def test_initial_equal() -> None:
    c = ElChe(2, 10)
    assert c.batch_counts == (10, 10)
    assert sum(c.batch_counts) == 20
    assert c.anchor == 10
    assert not c.is_calibrated
    assert c.anchor_rank is None
    assert c.phase is Phase.PROBE


def test_initial_three_devices() -> None:
    assert ElChe(3, 15).batch_counts == (15, 15, 15)


@pytest.mark.parametrize(
    ("world_size", "anchor", "field"), [(0, 10, "world_size"), (2, 0, "anchor")]
)
def test_rejects_empty_world_or_zero_anchor(world_size: int, anchor: int, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        ElChe(world_size, anchor)
    assert info.value.field == field


def test_rejects_bad_knobs() -> None:
    with pytest.raises(ConfigError, match="overhead_target"):
        ElChe(2, 10, overhead_target=math.nan)
    with pytest.raises(ConfigError, match="max_batch_diff"):
        ElChe(2, 10, max_batch_diff=-1)


def test_single_survivor_balances_naturally() -> None:
    # elche allows world_size 1 (the reference demands 2): the lone rank is the anchor.
    c = ElChe(1, 10)
    c.report_timing([1000.0], [10], 5.0)
    assert c.anchor_rank == 0
    assert c.batch_counts == (10,)
    assert c.recent_batch_share() == (1.0,)


def test_builders_clamp_and_order() -> None:
    assert ElChe(2, 5, overhead_target=0.001).overhead_target == 0.01
    assert ElChe(2, 5, overhead_target=0.9).overhead_target == 0.5
    c = ElChe(2, 10, max_anchor=5)  # min_anchor (= 10) falls to max, anchor clamped
    assert (c.anchor, c.min_anchor, c.max_anchor) == (5, 5, 5)
    c = ElChe(2, 10, min_anchor=20)  # anchor lifted to the floor
    assert (c.anchor, c.min_anchor) == (20, 20)
    c = ElChe(2, 10, max_anchor=15, min_anchor=30)  # floor capped at max
    assert (c.anchor, c.min_anchor) == (15, 15)
    assert ElChe(2, 1, max_anchor=0).max_anchor == 1


def test_max_batch_diff_accessor() -> None:
    assert ElChe(2, 10, max_batch_diff=5).max_batch_diff == 5
    assert ElChe(2, 10).max_batch_diff is None


# -- ratio discovery -----------------------------------------------------------


def test_ratio_discovery_2x() -> None:
    c = ElChe(2, 10, overhead_target=0.50)
    c.report_timing([500.0, 1000.0], c.batch_counts, 10.0)
    assert c.is_calibrated
    assert c.batch_counts == (20, 10)


def test_ratio_discovery_fbrl_like() -> None:
    c = ElChe(2, 10, overhead_target=0.50)
    c.report_timing([730.0, 1640.0], c.batch_counts, 50.0)
    # Reference bound 22..23; exactly round(10 * 164 / 73) = round(22.47) = 22.
    assert c.batch_counts == (22, 10)


def test_three_devices_mixed_speed() -> None:
    c = ElChe(3, 10, overhead_target=0.50)
    c.report_timing([333.0, 500.0, 1000.0], c.batch_counts, 10.0)
    assert c.batch_counts == (30, 20, 10)


def test_successive_reports_refine() -> None:
    c = ElChe(2, 10, overhead_target=0.50)
    c.report_timing([500.0, 1000.0], c.batch_counts, 10.0)
    assert c.batch_counts == (20, 10)
    c.report_timing([1000.0, 1000.0], c.batch_counts, 10.0)
    assert c.batch_counts == (20, 10)


def test_speed_ratio_clamped_against_degenerate_sample() -> None:
    c = ElChe(2, 10)
    for _ in range(6):
        c.report_timing([0.1, 1000.0], [10, 10], 1.0)
    # Reference bound <= 640; exactly anchor * 64 since 10_000x is capped at 64x.
    assert c.batch_counts == (640, 10)


def test_uncalibrated_rank_keeps_anchor() -> None:
    c = ElChe(3, 10, overhead_target=0.50)
    c.report_timing([500.0, 1000.0, 0.0], [10, 10, 0], 10.0)
    assert c.batch_counts == (20, 10, 10)
    assert c.smoothed_ms_per_batch(2) is None


def test_dead_zone_ignores_small_changes() -> None:
    c = ElChe(2, 10, overhead_target=0.50)
    c.report_timing([500.0, 1000.0], [10, 10], 10.0)
    # Rank 0's mean becomes (50 + 55) / 2 = 52.5 -> target round(1000 / 52.5) = 19;
    # |19 - 20| = 1 is not > 5 % of 20, so the count holds.
    c.report_timing([550.0, 1000.0], [10, 10], 10.0)
    assert c.batch_counts == (20, 10)


def test_batch_count_clamped_to_max_diff() -> None:
    c = ElChe(2, 10, max_batch_diff=3)
    c.report_timing([100.0, 20.0], c.batch_counts, 0.0)
    assert c.batch_counts == (10, 50)  # first calibration is never clamped
    c.report_timing([100.0, 450.0], c.batch_counts, 0.0)
    # Reference bound >= 47; rank 1's mean is (2 + 9) / 2 = 5.5 -> target 18, step -3 -> 47.
    assert c.batch_counts == (10, 47)


def test_max_batch_diff_zero_freezes_counts_after_calibration() -> None:
    c = ElChe(2, 10, max_batch_diff=0, overhead_target=0.50)
    c.report_timing([500.0, 1000.0], [10, 10], 10.0)
    assert c.batch_counts == (20, 10)
    for _ in range(3):
        c.report_timing([250.0, 1000.0], [10, 10], 10.0)
    assert c.batch_counts == (20, 10)


def test_zero_reports_clear_trust_window_after_five() -> None:
    c = ElChe(2, 10, overhead_target=0.50)
    c.report_timing([500.0, 1000.0], [10, 10], 10.0)
    for _ in range(4):
        c.report_timing([0.0, 1000.0], [0, 10], 10.0)
    assert c.smoothed_ms_per_batch(0) == 50.0
    c.report_timing([math.nan, 1000.0], [10, 10], 10.0)  # invalid reading: 5th miss
    assert c.smoothed_ms_per_batch(0) is None


def test_fully_idle_window_reports_nothing() -> None:
    c = ElChe(2, 10)
    c.report_timing([0.0, 0.0], [0, 0], 10.0)
    assert not c.is_calibrated
    assert c.calibration_count == 0


# -- window-pressure growth ----------------------------------------------------


def test_anchor_auto_tune() -> None:
    c = ElChe(2, 10, overhead_target=0.10)
    for _ in range(5):
        c.report_timing([1000.0, 1000.0], c.batch_counts, 5.0)
    c.report_timing([1000.0, 1000.0], c.batch_counts, 500.0)
    c.commit_proposed_anchor()
    assert c.anchor == 20
    assert c.batch_counts == (20, 20)


def test_auto_tune_with_speed_ratio() -> None:
    c = ElChe(2, 10, overhead_target=0.10)
    for _ in range(5):
        c.report_timing([500.0, 1000.0], [10, 10], 5.0)
    c.report_timing([500.0, 1000.0], [10, 10], 400.0)
    c.commit_proposed_anchor()
    assert c.anchor == 20
    assert c.batch_counts == (40, 20)


def test_stable_when_overhead_low() -> None:
    c = ElChe(2, 10, overhead_target=0.10)
    c.report_timing([1000.0, 1000.0], c.batch_counts, 5.0)
    assert c.anchor == 10
    assert c.proposed_anchor is None


def test_anchor_capped_at_max() -> None:
    c = ElChe(2, 10, overhead_target=0.01, max_anchor=15)
    for _ in range(5):
        c.report_timing([100.0, 100.0], c.batch_counts, 0.5)
    c.report_timing([100.0, 100.0], c.batch_counts, 500.0)
    c.commit_proposed_anchor()
    assert c.anchor == 15
    assert c.batch_counts == (15, 15)


def test_max_anchor_one_never_grows() -> None:
    c = ElChe(2, 1, max_anchor=1)
    for _ in range(6):
        c.report_timing([100.0, 200.0], [1, 1], 500.0)
        c.commit_proposed_anchor()
    assert c.anchor == 1
    assert c.batch_counts == (2, 1)


def test_proposal_committed_on_stable() -> None:
    c = ElChe(2, 10, overhead_target=0.10)
    for _ in range(5):
        c.report_timing([1000.0, 1000.0], [10, 10], 5.0)
    c.report_timing([1000.0, 1000.0], [10, 10], 500.0)
    assert c.anchor == 10, "a report must not move the anchor"
    assert c.proposed_anchor == 20
    c.commit_proposed_anchor()
    assert c.anchor == 20
    assert c.proposed_anchor is None


def test_grow_vetoed_on_suppress() -> None:
    c = ElChe(2, 10, overhead_target=0.10)
    for _ in range(5):
        c.report_timing([1000.0, 1000.0], [10, 10], 5.0)
    c.report_timing([1000.0, 1000.0], [10, 10], 500.0)
    c.veto_proposed_growth()
    assert c.anchor == 10
    assert c.proposed_anchor is None


def test_growth_latched_off_after_suppress() -> None:
    c = ElChe(2, 10, overhead_target=0.10)
    for _ in range(5):
        c.report_timing([1000.0, 1000.0], [10, 10], 5.0)
    c.report_timing([1000.0, 1000.0], [10, 10], 500.0)
    c.veto_proposed_growth()
    assert not c.growth_enabled
    for i in range(5):
        c.report_timing([1000.0, 1000.0], [10, 10], 500.0)
        assert c.proposed_anchor is None
        c.commit_proposed_anchor()
        assert c.anchor == 10
        assert c.growth_enabled is (i == 4), "re-arms on the 5th consecutive Stable"
    c.report_timing([1000.0, 1000.0], [10, 10], 500.0)
    c.commit_proposed_anchor()
    assert c.anchor == 20


def test_proposal_discarded_on_nudge() -> None:
    c = ElChe(2, 20, overhead_target=0.10)
    for _ in range(5):
        c.report_timing([1000.0, 1000.0], [20, 20], 5.0)
    c.report_timing([1000.0, 1000.0], [20, 20], 500.0)
    assert c.proposed_anchor == 40
    c.discard_proposed_anchor()
    c.nudge_anchor_down(0.5)
    assert c.anchor == 10


def test_warmup_proposes_from_second_calibration() -> None:
    c = ElChe(2, 10)
    c.report_timing([1000.0, 1000.0], c.batch_counts, 5000.0)
    assert c.phase is Phase.WARMUP
    assert c.proposed_anchor is None, "the first report never proposes"
    c.report_timing([1000.0, 1000.0], c.batch_counts, 5000.0)
    assert c.phase is Phase.WARMUP
    assert c.proposed_anchor == 20
    c.commit_proposed_anchor()
    assert c.anchor == 20


def test_warmup_growth_dies_on_veto() -> None:
    c = staged_grow()
    c.veto_proposed_growth()
    assert c.anchor == 10


def test_borderline_warmup_pressure_waits_for_stable() -> None:
    c = ElChe(2, 10, overhead_target=0.10)
    # overhead = 150 / (10 * 100 + 150) = 0.130: above 0.10, below the 0.20 warmup bar.
    for i in range(5):
        c.report_timing([1000.0, 1000.0], c.batch_counts, 150.0)
        assert c.proposed_anchor is None, f"proposed during warmup (report {i + 1})"
    assert c.phase is Phase.STABLE
    c.report_timing([1000.0, 1000.0], c.batch_counts, 150.0)
    # Derived: ceil(10 * min(0.1304 / 0.10, 2.0)) = ceil(13.04) = 14.
    assert c.proposed_anchor == 14


def test_fill_counts_toward_overhead_and_is_consumed() -> None:
    c = ElChe(2, 10, overhead_target=0.10)
    c.report_timing([1000.0, 1000.0], [10, 10], 0.0)
    c.set_window_fill_ms([5000.0, 0.0])  # anchor rank 0's fill alone is 0.83 overhead
    c.report_timing([1000.0, 1000.0], [10, 10], 0.0)
    assert c.proposed_anchor == 20
    c.report_timing([1000.0, 1000.0], [10, 10], 0.0)
    assert c.proposed_anchor is None, "the fill is one-shot"


def test_sync_policy_exempt_from_growth() -> None:
    windowed, sync = ElChe(2, 10), ElChe(2, 10, window_growth_applicable=False)
    for c in (windowed, sync):
        for _ in range(2):
            c.report_timing([1000.0, 1000.0], c.batch_counts, 5000.0)
    assert windowed.proposed_anchor == 20
    assert sync.proposed_anchor is None


def test_non_finite_inputs_are_contained() -> None:
    c = ElChe(2, 10)
    c.report_timing([1000.0, 1000.0], [10, 10], 1.0)
    c.report_timing([1000.0, 1000.0], [10, 10], math.inf)
    assert c.proposed_anchor == 20  # NaN overhead passes the bar, grows by the cap (reference)
    c.report_timing([1000.0, 1000.0], [10, 10], math.nan)
    assert c.proposed_anchor is None  # a NaN sync reads as no fixed cost
    c.apply_callback_slack([math.inf, math.nan])
    c.report_timing([1000.0, 1000.0], [10, 10], 1.0)
    assert c.batch_counts == (1, 10)  # infinite slack saturates, NaN slack is none


# -- window cap ----------------------------------------------------------------


def test_window_capped_to_max_total() -> None:
    c = ElChe(2, 10, overhead_target=0.10)
    c.set_max_total_batches(40)
    for _ in range(5):
        c.report_timing([500.0, 1000.0], [10, 10], 5.0)
    c.report_timing([500.0, 1000.0], [10, 10], 400.0)
    c.commit_proposed_anchor()
    # Derived: [40, 20] * 40/60 floors to [26, 13]; the remainder 1 goes to rank 0.
    assert c.batch_counts == (27, 13)
    assert c.window_cap_binding


def test_cap_binding_suppresses_anchor_growth() -> None:
    c = ElChe(2, 10, overhead_target=0.10)
    c.set_max_total_batches(30)
    for _ in range(5):
        c.report_timing([500.0, 1000.0], [10, 10], 5.0)
    c.report_timing([500.0, 1000.0], [10, 10], 400.0)
    c.commit_proposed_anchor()
    assert c.anchor == 20  # [20, 10] sums to exactly 30: not binding before this grow
    for _ in range(10):
        c.report_timing([500.0, 1000.0], [10, 10], 400.0)
        assert c.proposed_anchor is None
        c.commit_proposed_anchor()
    assert c.anchor == 20
    assert sum(c.batch_counts) <= 30


def test_cap_remainder_ties_go_to_highest_index() -> None:
    c = ElChe(3, 10)
    c.set_max_total_batches(20)
    c.report_timing([1000.0, 1000.0, 1000.0], [10, 10, 10], 1.0)
    # Derived: 30 -> 20 scales each 10 to floor(6.67) = 6; the 2 left go to rank 2.
    assert c.batch_counts == (6, 6, 8)


def test_cap_floor_of_one_cannot_break_cap() -> None:
    # elche deviation: the reference would leave [2, 1, 1] (sum 4 > cap 3) here.
    c = ElChe(3, 10)
    c.set_max_total_batches(3)
    c.report_timing([0.1, 1000.0, 1000.0], [10, 10, 10], 1.0)  # uncapped: [640, 10, 10]
    assert c.batch_counts == (1, 1, 1)


def test_more_ranks_than_cap_keeps_floor_of_one() -> None:
    c = ElChe(3, 10)
    c.set_max_total_batches(2)
    c.report_timing([1000.0, 1000.0, 1000.0], [10, 10, 10], 1.0)
    assert c.batch_counts == (1, 1, 1)


def test_set_max_total_batches_rejects_negative() -> None:
    with pytest.raises(ConfigError, match="max_total_batches"):
        ElChe(2, 10).set_max_total_batches(-1)


# -- callback slack ------------------------------------------------------------


def test_callback_slack_reduces_firing_rank_count() -> None:
    c = ElChe(2, 10, overhead_target=0.50)
    c.report_timing([500.0, 1000.0], [10, 10], 10.0)
    assert c.batch_counts == (20, 10)
    c.apply_callback_slack([200.0, 0.0])  # 4 batches at 50 ms
    c.report_timing([1000.0, 1000.0], [20, 10], 10.0)
    assert c.batch_counts == (16, 10)
    c.report_timing([800.0, 1000.0], [16, 10], 10.0)
    assert c.batch_counts == (20, 10), "slack is consumed exactly once"


def test_callback_slack_clamps_at_one() -> None:
    c = ElChe(2, 10, overhead_target=0.50)
    c.report_timing([500.0, 1000.0], c.batch_counts, 10.0)
    c.apply_callback_slack([10_000.0, 0.0])
    c.report_timing([500.0, 1000.0], c.batch_counts, 10.0)
    assert c.batch_counts == (1, 10)


def test_callback_slack_size_mismatch_is_noop() -> None:
    c = ElChe(2, 10, overhead_target=0.50)
    c.report_timing([500.0, 1000.0], [10, 10], 10.0)
    c.apply_callback_slack([200.0, 0.0, 0.0])
    c.apply_callback_slack([])
    assert c.pending_callback_slack_ms == (0.0, 0.0)
    c.report_timing([1000.0, 1000.0], [20, 10], 10.0)
    assert c.batch_counts == (20, 10)


def test_callback_slack_multi_rank() -> None:
    c = ElChe(3, 10, overhead_target=0.50)
    c.report_timing([333.0, 500.0, 1000.0], [10, 10, 10], 10.0)
    assert c.batch_counts == (30, 20, 10)
    c.apply_callback_slack([100.0, 100.0, 0.0])
    c.report_timing([30 * 33.3, 20 * 50.0, 1000.0], [30, 20, 10], 10.0)
    # Derived: ceil(100 / 33.3) = 4 off rank 0 (reference: 3 or 4), ceil(100 / 50) = 2 off rank 1.
    assert c.batch_counts == (26, 18, 10)


# -- nudge and relax -----------------------------------------------------------


def test_nudge_anchor_down() -> None:
    c = ElChe(2, 20, overhead_target=0.50)
    c.report_timing([50.0, 100.0], c.batch_counts, 0.0)
    assert c.batch_counts == (40, 20)
    c.nudge_anchor_down(0.5)
    assert c.anchor == 10
    assert c.batch_counts == (20, 10)


def test_nudge_clamped_to_one() -> None:
    c = ElChe(2, 5)
    c.nudge_anchor_down(0.1)  # ceil(5 * 0.1) = 1, below min_anchor 5
    assert c.anchor == 1


def test_nudge_never_increases() -> None:
    c = ElChe(2, 10)
    c.nudge_anchor_down(2.0)
    assert c.anchor == 10


def test_nudge_ignores_nan_factor() -> None:
    c = ElChe(2, 10)
    for _ in range(6):
        c.report_timing([100.0, 100.0], [10, 10], 1.0)
    c.nudge_anchor_down(math.nan)
    assert c.anchor == 10
    c.nudge_anchor_down(0.5)
    assert c.anchor == 5


def test_relax_anchor_up_grows_anchor() -> None:
    c = ElChe(2, 10, overhead_target=0.50)
    c.report_timing([500.0, 1000.0], c.batch_counts, 5.0)
    c.relax_anchor_up()
    assert c.anchor == 11
    assert c.batch_counts == (22, 11)


def test_relax_anchor_up_capped_by_max_batch_diff() -> None:
    c = ElChe(2, 10, overhead_target=0.50, max_batch_diff=20)
    c.report_timing([300.0, 900.0], c.batch_counts, 5.0)  # ratio 3: [30, 10]
    c.relax_anchor_up()  # would project [33, 11]: a lead of 22 > 20
    assert c.anchor == 10


def test_relax_anchor_up_capped_by_max_anchor() -> None:
    c = ElChe(2, 10, overhead_target=0.50, max_anchor=11)
    c.report_timing([500.0, 1000.0], c.batch_counts, 5.0)
    c.relax_anchor_up()
    assert c.anchor == 11
    c.relax_anchor_up()
    assert c.anchor == 11


# -- phases and election -------------------------------------------------------


def test_phase_advances_on_first_calibration() -> None:
    c = ElChe(3, 10, overhead_target=0.50)
    c.report_timing([100.0, 380.0, 395.0], c.batch_counts, 10.0)
    assert c.phase is Phase.WARMUP
    assert c.anchor_rank is not None


@pytest.mark.parametrize(
    ("reports", "phase"),
    [(4, Phase.WARMUP), (5, Phase.STABLE), (19, Phase.STABLE), (20, Phase.MATURE)],
)
def test_phase_thresholds(reports: int, phase: Phase) -> None:
    c = ElChe(2, 10, overhead_target=0.50)
    for _ in range(reports):
        c.report_timing([500.0, 1000.0], c.batch_counts, 10.0)
    assert c.calibration_count == reports
    assert c.phase is phase


def test_election_lowest_rank_tiebreak() -> None:
    c = ElChe(3, 10, overhead_target=0.50)
    c.report_timing([100.0, 100.0, 100.0], c.batch_counts, 10.0)
    assert c.anchor_rank == 0


@pytest.mark.parametrize(("fast_wall", "anchor_rank"), [(840.0, 1), (860.0, 0)])
def test_cohort_band_is_15_percent(fast_wall: float, anchor_rank: int) -> None:
    # 84 ms is outside 0.85 x 100 ms (only rank 1 is eligible); 86 ms is inside,
    # and with no sitting anchor the lowest-index cohort member wins.
    c = ElChe(2, 10, overhead_target=0.50)
    c.report_timing([fast_wall, 1000.0], [10, 10], 1.0)
    assert c.anchor_rank == anchor_rank


@pytest.mark.parametrize(("challenger_wall", "anchor_rank"), [(1090.0, 0), (1120.0, 1)])
def test_dominance_margin_is_10_percent(challenger_wall: float, anchor_rank: int) -> None:
    c = ElChe(2, 10, overhead_target=0.50)
    c.report_timing([1000.0, 1000.0], [10, 10], 1.0)  # tie: rank 0 elected
    for _ in range(5):  # the 6th report re-elects on five challenger samples
        c.report_timing([1000.0, challenger_wall], [10, 10], 1.0)
    assert c.anchor_rank == anchor_rank  # 109 ms is not > 110 ms; 112 ms is


def test_tied_challengers_go_to_highest_index() -> None:
    # Derived from the reference's max_by: ranks 1 and 2 tie at 115 ms (> 110 % of the
    # sitting anchor's 100 ms, all inside the 15 % band); the later index wins.
    c = ElChe(3, 10, overhead_target=0.50)
    c.report_timing([1000.0, 1000.0, 1000.0], [10, 10, 10], 1.0)
    for _ in range(5):
        c.report_timing([1000.0, 1150.0, 1150.0], [10, 10, 10], 1.0)
    assert c.anchor_rank == 2


def test_anchor_stable_under_tied_slow_ranks() -> None:
    c = ElChe(3, 10, overhead_target=0.50)
    c.report_timing([100.0, 380.0, 395.0], [10, 10, 10], 10.0)
    assert c.anchor_rank == 1  # cohort {1, 2}, no sitting anchor: lowest index
    for a, b in [(390.0, 380.0), (385.0, 388.0), (392.0, 386.0)] * 3:  # into Stable
        c.report_timing([100.0, a, b], [10, 10, 10], 10.0)
        assert c.anchor_rank == 1


def test_anchor_switches_when_clear_winner_emerges() -> None:
    c = ElChe(3, 10, overhead_target=0.50)
    c.report_timing([100.0, 400.0, 200.0], [10, 10, 10], 10.0)
    assert c.anchor_rank == 1
    for _ in range(4):
        c.report_timing([100.0, 200.0, 600.0], [10, 10, 10], 10.0)
        assert c.anchor_rank == 1, "no re-election before Stable"
    c.report_timing([100.0, 200.0, 600.0], [10, 10, 10], 10.0)
    assert c.anchor_rank == 2


def test_pinned_wrong_anchor_self_corrects() -> None:
    c = pinned(2, 0, overhead_target=0.50)  # wrong: rank 0 is the fast one
    for _ in range(5):
        c.report_timing([500.0, 2000.0], [10, 20], 10.0)
        assert c.anchor_rank == 0
    assert c.batch_counts == (10, 5)  # rank 1 runs slower than the pinned anchor
    c.report_timing([500.0, 2000.0], [10, 20], 10.0)  # the 6th sees Stable on entry
    assert c.anchor_rank == 1
    assert c.batch_counts == (20, 10)


def test_warmup_unsticks_when_pinned_anchor_never_reports() -> None:
    c = pinned(2, 1)
    for _ in range(4):
        c.report_timing([100.0, 0.0], [10, 0], 1.0)
        assert not c.is_calibrated
    c.report_timing([100.0, 0.0], [10, 0], 1.0)  # 5th miss: elect from ranks with data
    assert c.is_calibrated
    assert c.anchor_rank == 0


# -- the verdict seam ----------------------------------------------------------


def test_nudge_then_discard_survives_a_later_commit() -> None:
    c = staged_grow()
    c.nudge_anchor_down(0.5)
    assert c.anchor == 5
    c.discard_proposed_anchor()
    c.commit_proposed_anchor()
    assert c.anchor == 5


def test_nudge_without_discard_is_clobbered_by_commit() -> None:
    # Documents why the seam discards: the pre-nudge grow would win.
    c = staged_grow()
    c.nudge_anchor_down(0.5)
    c.commit_proposed_anchor()
    assert c.anchor == 20


def test_verdict_nudge_down_discards_and_nudges() -> None:
    c = staged_grow()
    c.apply_verdict(NudgeDown(factor=0.5))
    assert c.anchor == 5
    c.apply_verdict(Stable())
    assert c.anchor == 5
    assert not c.growth_enabled


def test_verdict_stable_commits_pending_grow() -> None:
    c = staged_grow()
    c.apply_verdict(Stable(relax_up=False))
    assert c.anchor == 20
    assert c.batch_counts == (20, 20)


def test_verdict_stable_relax_up_drifts() -> None:
    c = ElChe(2, 10)
    c.apply_verdict(Stable(relax_up=True))
    assert c.anchor == 11
    c = ElChe(2, 10)
    c.apply_verdict(Stable(relax_up=False))
    assert c.anchor == 10


def test_verdict_suppress_growth_drops_and_latches() -> None:
    c = staged_grow()
    c.apply_verdict(SuppressGrowth())
    assert c.anchor == 10
    assert not c.growth_enabled
    c.apply_verdict(Stable())
    assert c.anchor == 10


# -- report_window -------------------------------------------------------------


def test_coherent_report_feeds_delivered_scale() -> None:
    c = ElChe(2, 4)
    c.report_window(report((40.0, 100.0), (4, 4), (80.0, 220.0), (4, 4), coherent=True))
    assert c.is_calibrated
    assert c.smoothed_ms_per_batch(0) == pytest.approx(20.0)
    assert c.smoothed_ms_per_batch(1) == pytest.approx(55.0)


def test_incoherent_report_feeds_compute_scale() -> None:
    c = ElChe(2, 4)
    c.report_window(report((40.0, 100.0), (4, 4), (80.0, 0.0), (4, 0), coherent=False))
    assert c.smoothed_ms_per_batch(0) == pytest.approx(10.0)
    assert c.smoothed_ms_per_batch(1) == pytest.approx(25.0)


def test_all_zero_window_reports_nothing() -> None:
    c = ElChe(2, 4)
    c.report_window(report((0.0, 0.0), (0, 0), (0.0, 0.0), (0, 0), coherent=True))
    assert not c.is_calibrated


def test_shape_errors_leave_state_unchanged() -> None:
    c = ElChe(2, 10)
    with pytest.raises(ValueError, match="entries"):
        c.report_timing([100.0], [10, 10], 1.0)
    with pytest.raises(ValueError, match="entries"):
        c.report_window(report((1.0,), (1,), (1.0,), (1,), coherent=True))
    assert not c.is_calibrated
    assert c.ms_per_batch() == (0.0, 0.0)


# -- helpers and reporting -----------------------------------------------------


def test_clamp_total() -> None:
    c = ElChe(2, 10, overhead_target=0.50)
    c.report_timing([500.0, 1000.0], c.batch_counts, 10.0)
    assert c.clamp_total(15) == (10, 5)
    assert c.clamp_total(17) == (12, 5)  # floors [11, 5], +1 to rank 0 first
    assert ElChe(2, 10).clamp_total(30) == (10, 10)


def test_recent_batch_share_and_wall_target() -> None:
    c = ElChe(2, 10, overhead_target=0.50)
    assert c.recent_batch_share() == (0.5, 0.5)
    assert c.anchor_wall_ms() == 0.0
    c.report_timing([500.0, 1000.0], [10, 10], 10.0)
    c.report_timing([1000.0, 1000.0], [20, 10], 10.0)
    assert c.recent_batch_share() == pytest.approx((40 / 60, 20 / 60))
    assert c.anchor_wall_ms() == pytest.approx(1000.0)  # 10 batches x 100 ms
    assert c.ms_per_batch() == pytest.approx((50.0, 100.0))
    assert c.smoothed_ms_per_batch(7) is None


# -- retire (elche) ------------------------------------------------------------


def test_retired_anchor_is_replaced_at_next_report() -> None:
    c = ElChe(3, 10, overhead_target=0.50)
    for _ in range(2):
        c.report_timing([250.0, 500.0, 1000.0], [10, 10, 10], 1.0)
    assert c.anchor_rank == 2
    c.retire(2)
    assert c.anchor_rank is None
    assert c.smoothed_ms_per_batch(2) is None
    calibrations = c.calibration_count
    c.report_timing([250.0, 500.0, 1000.0], [10, 10, 10], 1.0)  # its late timing is ignored
    assert c.anchor_rank == 1
    assert c.calibration_count == calibrations + 1
    assert c.batch_counts[:2] == (20, 10)
    assert c.retired == frozenset({2})


def test_retired_rank_is_outside_the_window_cap() -> None:
    c = ElChe(3, 10)
    c.set_max_total_batches(20)
    c.retire(2)
    c.report_timing([500.0, 1000.0, 0.0], [10, 10, 0], 1.0)
    # Derived: live [20, 10] scale by 20/30 to [13, 6], the remainder 1 to rank 0;
    # the retired rank keeps the anchor's 10 and is not counted.
    assert c.batch_counts == (14, 6, 10)
    assert c.window_cap_binding


def test_retire_rejects_unknown_rank() -> None:
    with pytest.raises(ValueError, match="rank"):
        ElChe(2, 10).retire(2)


# -- persistence ---------------------------------------------------------------


def test_state_round_trip_seeds_one_sample() -> None:
    c = ElChe(2, 10, overhead_target=0.50)
    for walls in ([500.0, 1000.0], [700.0, 1000.0]):
        c.report_timing(walls, [10, 10], 10.0)
    state = c.to_state()
    assert state.smoothed_ms_per_batch == (60.0, 100.0)
    assert state.trend_history is None
    resumed = ElChe(2, 10, max_anchor=50)
    resumed.restore_from_state(state)
    assert resumed.to_state() == state
    assert resumed.is_calibrated
    assert resumed.max_anchor == 50, "knobs are not restored"
    resumed.report_timing([400.0, 1000.0], [10, 10], 10.0)
    assert resumed.smoothed_ms_per_batch(0) == 50.0  # mean(60, 40): one seeded sample


def test_a_saved_anchor_above_a_resumed_runs_max_anchor_is_brought_down_to_it() -> None:
    # It was kept: a run resumed with max_anchor=20 averaged every 200 batches until
    # some shrink brought the anchor down (a growth is a no-op past the cap).
    saved = ElChe(2, 200).to_state()
    resumed = ElChe(2, 10, max_anchor=20)
    resumed.restore_from_state(saved)
    assert resumed.anchor == 20
    kept = ElChe(2, 10, max_anchor=500)
    kept.restore_from_state(saved)
    assert kept.anchor == 200  # within the cap: the saved trajectory as it was


def test_restore_rejects_other_world_size() -> None:
    c = ElChe(3, 10)
    with pytest.raises(ConfigError, match="smoothed_ms_per_batch"):
        c.restore_from_state(ElChe(2, 20).to_state())
    assert c.anchor == 10


# -- properties ----------------------------------------------------------------

_MS = st.sampled_from([0.0, 0.05, 37.5, 100.0, 420.0, 1000.0, 5000.0, math.inf, math.nan])
_VERDICTS: st.SearchStrategy[Verdict] = st.one_of(
    st.builds(Stable, relax_up=st.booleans()),
    st.just(SuppressGrowth()),
    st.builds(NudgeDown, factor=st.sampled_from([0.0, 0.1, 0.5, 0.9, 2.0, math.nan])),
)


@st.composite
def _scenarios(draw: st.DrawFn) -> tuple[ElChe, int, list[tuple[str, object]]]:
    ws = draw(st.integers(1, 4))
    c = ElChe(
        ws,
        draw(st.integers(1, 40)),
        overhead_target=draw(st.sampled_from([0.01, 0.05, 0.1, 0.5])),
        max_anchor=draw(st.integers(1, 120)),
        min_anchor=draw(st.none() | st.integers(1, 60)),
        max_batch_diff=draw(st.none() | st.integers(0, 8)),
        window_growth_applicable=draw(st.booleans()),
    )
    cap = draw(st.sampled_from([0, 1, 3, 7, 30, 200]))
    c.set_max_total_batches(cap)
    per_rank = st.lists(_MS, min_size=ws, max_size=ws)
    op = st.one_of(
        st.tuples(
            st.just("report"),
            st.tuples(per_rank, st.lists(st.integers(0, 40), min_size=ws, max_size=ws), _MS),
        ),
        st.tuples(st.just("verdict"), _VERDICTS),
        st.tuples(st.just("slack"), per_rank),
        st.tuples(st.just("fill"), per_rank),
        st.tuples(st.just("retire"), st.integers(0, ws - 1)),
    )
    return c, cap, draw(st.lists(op, max_size=30))


def _apply(c: ElChe, name: str, arg: object) -> None:
    match name, arg:
        case "report", (list() as walls, list() as batches, float() as sync_ms):
            c.report_timing(walls, batches, sync_ms)
        case "verdict", (Stable() | SuppressGrowth() | NudgeDown()) as verdict:
            c.apply_verdict(verdict)
        case "slack", list() as ms:
            c.apply_callback_slack(ms)
        case "fill", list() as ms:
            c.set_window_fill_ms(ms)
        case "retire", int() as rank:
            c.retire(rank)
        case _:
            raise AssertionError(f"unknown op {name}")


@pytest.mark.slow  # ~0.5 s: 150 random streams of up to 30 operations
@settings(max_examples=150, deadline=None)
@given(_scenarios())
def test_random_streams_keep_invariants(
    scenario: tuple[ElChe, int, list[tuple[str, object]]],
) -> None:
    c, cap, ops = scenario
    for name, arg in ops:
        before = (c.batch_counts, c.calibration_count)
        _apply(c, name, arg)
        assert all(n >= 1 for n in c.batch_counts)
        assert 1 <= c.anchor <= c.max_anchor
        live = [n for r, n in enumerate(c.batch_counts) if r not in c.retired]
        recomputed = (c.batch_counts, c.calibration_count) != before
        if recomputed and cap > 0 and len(live) <= cap:  # cap 0 means no cap
            assert sum(live) <= cap
        state = c.to_state()
        twin = ElChe(c.world_size, 1)
        twin.restore_from_state(state)
        assert twin.to_state() == state
        assert ElCheState.from_json(state.to_json()) == state
