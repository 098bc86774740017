"""Issue 12, "keep every promise off the tested path": what the simulator shows.

Each test is named after the item it pins down and failed before its fix.
"""

from __future__ import annotations

import pickle

import pytest

from elche import Mode, SimConfig, Simulation


def finished_core_size(mode: Mode, epochs: int) -> tuple[int, int]:
    sim = Simulation(SimConfig(speeds=(1.0, 0.5), mode=mode, epochs=epochs, samples=320))
    result = sim.run()
    assert (result.outcome, result.epochs_completed) == ("completed", epochs)
    assert result.samples_trained == epochs * 320
    return len(sim.core.work.pools), len(pickle.dumps(sim.core))


@pytest.mark.parametrize("mode", [Mode.CADENCE, Mode.CPU_ASYNC])
def test_issue12_item17_the_coordinators_state_does_not_grow_with_the_epochs(mode: Mode) -> None:
    pools_20, bytes_20 = finished_core_size(mode, 20)
    pools_200, bytes_200 = finished_core_size(mode, 200)
    assert pools_200 == pools_20 == 0  # a finished epoch's pool goes
    # Only the counters' widths may differ (a pickled int takes 1, 2 or 4 bytes).
    assert abs(bytes_200 - bytes_20) <= 32
