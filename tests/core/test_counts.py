"""The balancer's batch-count arithmetic, one pure function at a time."""

from __future__ import annotations

import math

from elche.core.counts import (
    cap_window,
    non_negative,
    round_half_away,
    slack_batches,
    speed_target,
    step_toward,
)


def test_speed_target_scales_the_anchor_by_relative_speed() -> None:
    assert speed_target(10, 50.0, 100.0) == 20  # twice as fast
    assert speed_target(10, 0.0, 100.0) == 10  # no pace yet: the anchor's count
    assert speed_target(10, 100.0, 100.0) == 10
    assert speed_target(10, 0.001, 100.0) == 640  # at most 64 times the anchor


def test_step_toward_clamps_each_move() -> None:
    assert step_toward(5, 20, 3) == 8
    assert step_toward(20, 5, 3) == 17
    assert step_toward(2, 1, 5) == 1
    assert step_toward(5, 20, None) == 20


def test_cap_window_scales_the_live_counts_under_the_cap() -> None:
    counts = [10, 10, 10]
    assert cap_window(counts, [0, 1, 2], 15)
    assert counts == [5, 5, 5]
    assert not cap_window(counts, [0, 1, 2], None)
    assert not cap_window(counts, [0, 1, 2], 15)
    assert counts == [5, 5, 5]


def test_cap_window_takes_back_what_floors_of_one_overshoot() -> None:
    counts = [100, 1, 1]  # scaled: 2, 1, 1 = 4 > 3
    assert cap_window(counts, [0, 1, 2], 3)
    assert counts == [1, 1, 1]


def test_cap_window_gives_the_remainder_to_the_largest_count() -> None:
    counts = [7, 7, 50]  # dead rank 2 is not capped
    assert cap_window(counts, [0, 1], 9)
    assert counts == [4, 5, 50]  # floors 4, 4; +1 to the highest index of the tie


def test_rounding_and_floors() -> None:
    assert (round_half_away(2.5), round_half_away(2.4)) == (3, 2)
    assert non_negative(-1.0) == 0.0
    assert non_negative(math.nan) == 0.0
    assert slack_batches(150.0, 100.0) == 2
    assert slack_batches(0.0, 100.0) == 0
    assert slack_batches(math.inf, 1.0) == 2**63 - 1
