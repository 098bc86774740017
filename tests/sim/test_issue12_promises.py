"""Issue 12, "keep every promise off the tested path": what the simulator shows.

Each test is named after the item it pins down and failed before its fix.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from elche import FaultPlan, Mode, SimConfig, Simulation, simulate


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


def test_issue12_item11_a_finished_runs_own_checkpoint_resumes_to_completion_at_once() -> None:
    first = Simulation(SimConfig(speeds=(1.0, 0.5), epochs=1, samples=640, checkpoint_every=1))
    first.run()
    meta = first.metas[-1]
    assert (meta.epoch, meta.epochs, meta.coverage) == (1, 1, ())  # written as epoch 0 ended
    again = simulate(
        SimConfig(speeds=(1.0, 0.5), epochs=1, samples=640, resume=meta, max_virtual_s=60.0)
    )
    assert (again.outcome, again.epochs_completed, again.samples_trained) == ("completed", 1, 0)


def test_issue12_item11_a_bundle_at_epoch_1_resumed_with_epochs_1_completes_with_1() -> None:
    # Waiting for its rounds, rank 1 dies after round 1 committed epoch 0 (training
    # through it, it would die inside that round, and the bundle hold epoch 0).
    config = SimConfig(
        speeds=(1.0, 0.5), epochs=3, samples=640, faults=FaultPlan().kill(rank=1, at_epoch=1.5),
        overlap=False,
    )  # fmt: skip
    saved = simulate(config).saved_meta
    assert saved is not None and saved.epoch == 1 and saved.coverage[0].epoch == 1
    shorter = simulate(
        dataclasses.replace(config, epochs=1, faults=FaultPlan(), resume=saved, max_virtual_s=60.0)
    )
    assert (shorter.outcome, shorter.epochs_completed, shorter.samples_trained) == (
        "completed",
        1,
        0,
    )
    assert (shorter.lost_samples, shorter.duplicated_samples) == (0, 0)
