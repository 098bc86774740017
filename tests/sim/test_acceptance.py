"""The simulator's headline figures (issue acceptance, design.md §6).

These are virtual-time results of a deterministic simulation, not wall-clock
measurements: the same inputs always give the same numbers, so asserting them
pins the balancer's behaviour without any timing flakiness.
"""

from __future__ import annotations

import pytest

from elche import FaultPlan, Mode, SimConfig, simulate
from elche.cli import draw_speeds

RIG = (1.0, 0.5, 0.25)


def run(mode: Mode, speeds: tuple[float, ...] = RIG, **kw: object) -> dict[str, object]:
    return simulate(SimConfig(speeds=speeds, mode=mode, **kw)).to_json()  # type: ignore[arg-type]  # test helper forwards SimConfig fields


@pytest.mark.slow
def test_cadence_runs_at_the_sum_of_the_ranks() -> None:
    result = run(Mode.CADENCE)
    assert result["outcome"] == "completed"
    assert result["efficiency"] >= 0.93
    assert result["lost_samples"] == 0
    assert result["duplicated_samples"] == 0
    assert result["samples_trained"] == 3 * 30_000


@pytest.mark.slow
def test_sync_is_as_slow_as_lockstep_and_cadence_beats_it_twice() -> None:
    sync = run(Mode.SYNC)
    cadence = run(Mode.CADENCE)
    assert 0.35 <= sync["efficiency"] <= 0.6  # type: ignore[operator]  # JSON values
    assert cadence["throughput"] >= 2 * sync["throughput"]  # type: ignore[operator]  # JSON values


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(Mode))
def test_every_mode_trains_every_sample_exactly_once(mode: Mode) -> None:
    result = run(mode, epochs=2, samples=5_000)
    assert result["outcome"] == "completed"
    assert result["epochs_completed"] == 2
    assert result["samples_trained"] == 10_000
    assert (result["lost_samples"], result["duplicated_samples"]) == (0, 0)


@pytest.mark.slow
def test_a_killed_rank_is_survived_with_nothing_lost() -> None:
    result = run(Mode.CADENCE, faults=FaultPlan().kill(rank=1, at_s=5.0))
    assert result["outcome"] == "completed"
    assert result["dead_ranks"] == [1]
    assert result["lost_samples"] == 0
    assert result["duplicated_samples"] == 0
    assert result["epochs_completed"] == 3


@pytest.mark.slow
def test_a_single_survivor_of_a_collective_run_saves_and_stops() -> None:
    result = simulate(SimConfig(speeds=(1.0, 0.5), faults=FaultPlan().kill(rank=1, at_s=5.0)))
    assert result.outcome == "saved_and_shutdown"
    assert result.reason == "single_survivor"
    assert result.lost_samples == 0
    assert result.saved_meta is not None
    # The bundle names exactly the samples still to train.
    todo = sum(c.uncovered_samples for c in result.saved_meta.coverage)
    started = len(result.saved_meta.coverage) * 30_000
    assert result.samples_trained - 30_000 * result.saved_meta.epoch + todo == started


@pytest.mark.slow
def test_256_ranks_stay_efficient() -> None:
    speeds = draw_speeds(256, 7)
    result = simulate(SimConfig(speeds=speeds, epochs=2, samples=1_000_000))
    assert result.outcome == "completed"
    assert result.efficiency >= 0.9
    assert (result.lost_samples, result.duplicated_samples) == (0, 0)


@pytest.mark.slow
def test_1024_ranks_waste_under_5_percent() -> None:
    # One epoch is about 30 batches a rank: the probe goes on as the first
    # window and the short last one is folded into the epoch tail, so the
    # whole epoch is one window and one average.
    speeds = draw_speeds(1024, 7)
    result = simulate(SimConfig(speeds=speeds, epochs=1, samples=1_000_000))
    assert result.outcome == "completed"
    assert result.efficiency >= 0.95
    assert result.syncs == 1
    assert (result.lost_samples, result.duplicated_samples) == (0, 0)
