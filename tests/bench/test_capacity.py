"""``bench.capacity``: what the machine delivers to a rig, read in the ranks' steady state."""

from __future__ import annotations

import os
import signal
from typing import Any, cast

import pytest

from elche.bench.capacity import MIN_SLOW_STEPS, _steady_step_s, measure_capacity, window_s


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


class _Started:
    """A process whose start, the first of ``ctx``'s, is followed by a stop signal."""

    def __init__(self, process: Any, ctx: _StopAfterTheFirstStart) -> None:
        self.process, self.ctx = process, ctx

    def __getattr__(self, name: str) -> Any:
        return getattr(self.process, name)

    def start(self) -> None:
        self.process.start()
        self.ctx.started.append(self.process)
        if len(self.ctx.started) == 1:
            os.kill(os.getpid(), signal.SIGHUP)  # a closed terminal, as the probe starts


class _StopAfterTheFirstStart:
    """A rank context whose first started process is followed by a stop signal."""

    def __init__(self, ctx: Any) -> None:
        self.ctx, self.started = ctx, cast(list[Any], [])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ctx, name)

    def Process(self, *args: Any, **kwargs: Any) -> _Started:  # multiprocessing's name
        return _Started(self.ctx.Process(*args, **kwargs), self)


@pytest.mark.integration
@pytest.mark.slow
def test_a_stop_while_the_probes_ranks_start_ends_every_one_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Raised between two starts, the stop left the first rank waiting at the barrier
    # for the others for ever.
    from elche.cli.endings import Terminated, stop_signals_raise
    from elche.runtime import launch

    ctx = _StopAfterTheFirstStart(launch.rank_context())
    monkeypatch.setattr(launch, "rank_context", lambda: ctx)
    try:
        with stop_signals_raise(), pytest.raises(Terminated):
            measure_capacity("digits", [1.0, 1.0], speed_base_s=0.001, batch_size=8, seconds=60)
        assert ctx.started and not any(rank.is_alive() for rank in ctx.started)
    finally:
        for rank in ctx.started:
            rank.kill()
            rank.join()
