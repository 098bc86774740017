"""``bench.capacity``: what the machine delivers to a rig, read in the ranks' steady state."""

from __future__ import annotations

import pytest

from elche.bench.capacity import MIN_SLOW_STEPS, _steady_step_s, window_s


def test_the_window_holds_enough_of_the_slowest_ranks_steps() -> None:
    assert window_s(3.0, [1.0, 0.5, 0.25], 0.005) == 3.0  # digits-cnn: 20 ms paced steps
    slow = window_s(3.0, [1.0, 0.5, 0.25], 0.057)  # tiny-gpt: the 0.25 rank's 228 ms step
    assert slow == pytest.approx(MIN_SLOW_STEPS * 0.228)


def test_a_ranks_slow_first_steps_do_not_count() -> None:
    ends = [0.5, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4,
            2.5, 2.6, 2.7, 2.8, 2.9, 3.0]  # fmt: skip  # two slow steps, then 0.1 s each
    assert _steady_step_s(ends, 3.0) == pytest.approx(0.1)
    assert _steady_step_s([2.5, 3.2], 3.0) == pytest.approx(0.7)  # two ends: timed apart
    assert _steady_step_s([3.2], 3.0) == pytest.approx(3.2)  # one step: from the start
