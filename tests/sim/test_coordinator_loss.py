"""The simulator loses the coordinator: a new one from the journal finishes the run exactly once."""

from __future__ import annotations

import pytest

from elche.core.config import Mode
from elche.core.faults import FaultPlan
from elche.sim.engine import SimConfig, Simulation


@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.CADENCE, Mode.CPU_CADENCE, Mode.CPU_ASYNC])
@pytest.mark.parametrize("at_s", [0.3, 0.9, 1.5])  # the run takes ~1.6 virtual s
def test_a_lost_coordinator_is_restored_and_nothing_is_lost_or_trained_twice(
    mode: Mode, at_s: float
) -> None:
    plan = FaultPlan().kill_coordinator(rank=1, at_s=at_s)
    config = SimConfig(speeds=(1.0, 0.5, 0.25), mode=mode, samples=3000, faults=plan, seed=4)
    sim = Simulation(config)
    result = sim.run()
    assert result.outcome == "completed", result.reason
    assert (result.lost_samples, result.duplicated_samples) == (0, 0)
    assert result.epochs_completed == 3 and result.samples_trained == 3 * 3000
    assert sim.end is not None and sim.end.coordinator_restarts == 1
    assert result.dead_ranks == []


def test_ranks_lost_while_the_coordinator_is_away_are_lost_to_its_successor() -> None:
    plan = FaultPlan().kill_coordinator(rank=0, at_s=0.5).kill(rank=2, at_s=0.52)
    config = SimConfig(speeds=(1.0, 0.5, 0.25), samples=3000, faults=plan, seed=1)
    sim = Simulation(config)
    result = sim.run()
    assert result.outcome == "completed", result.reason
    assert result.dead_ranks == [2]
    assert (result.lost_samples, result.duplicated_samples) == (0, 0)
    assert sim.end is not None and sim.end.coordinator_restarts == 1
