"""Fast ranks fill the wait for a late window, in virtual time.

With step times that vary (``SimConfig.jitter``), budgets sized by the
smoothed paces end apart; ``SchedulerConfig.fill_wait`` (the default) lets a
rank out of budget train on while a peer is expected to finish its own. The
same seeded runs with and without it: the same samples, nothing lost or
trained twice, and the filled runs end sooner.
"""

from __future__ import annotations

import dataclasses

import pytest

from elche import SimConfig, simulate
from elche.core.config import SchedulerConfig


@pytest.mark.parametrize("speeds", [(1.0, 0.5, 0.25), (1.0, 0.9, 0.3, 0.3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_filling_the_wait_ends_a_jittery_run_sooner_with_every_sample_once(
    speeds: tuple[float, ...], seed: int
) -> None:
    filled = SimConfig(speeds=speeds, epochs=2, samples=12_000, jitter=0.2, seed=seed)
    holding = dataclasses.replace(filled, scheduler=SchedulerConfig(fill_wait=False))
    on, off = simulate(filled), simulate(holding)
    for result in (on, off):
        assert result.outcome == "completed"
        assert (result.lost_samples, result.duplicated_samples) == (0, 0)
        assert result.samples_trained == 2 * 12_000
    assert on.virtual_wall_s < off.virtual_wall_s
