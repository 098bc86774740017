"""The chaos runner's SIGTERM to the launcher and full save path, replayed in the
simulator (one fault vocabulary: ``StopLauncher``, ``FillSavePath``)."""

from __future__ import annotations

import pytest

from elche import FaultPlan, Mode, SimConfig, simulate
from elche.sim.engine import SimResult


def run(plan: FaultPlan, mode: Mode = Mode.CADENCE, **kw: object) -> SimResult:
    options: dict[str, object] = {
        "speeds": (1.0, 0.6, 0.3), "mode": mode, "epochs": 2, "samples": 1437,
        "batch_size": 32, "seed": 1, "faults": plan, "heartbeat_timeout_s": 2.0,
        "checkpoint_every": 1,
    }  # fmt: skip
    options.update(kw)
    return simulate(SimConfig(**options))  # type: ignore[arg-type]  # test factory


@pytest.mark.parametrize("mode", [Mode.CADENCE, Mode.CPU_ASYNC])
def test_a_sigterm_mid_run_saves_a_bundle_that_resumes_to_the_end(mode: Mode) -> None:
    stopped = run(FaultPlan().stop_launcher(rank=1, at_epoch=0.6), mode)
    assert (stopped.outcome, stopped.reason) == ("saved_and_shutdown", "graceful_shutdown")
    assert stopped.saved_meta is not None and stopped.duplicated_samples == 0
    resumed = run(FaultPlan(), mode, resume=stopped.saved_meta)
    assert resumed.outcome == "completed" and resumed.epochs_completed == 2
    assert (resumed.lost_samples, resumed.duplicated_samples) == (0, 0)


def test_a_full_save_path_costs_the_bundles_not_the_run() -> None:
    full = run(FaultPlan().fill_save_path(rank=0, at_epoch=0.3))
    assert full.outcome == "completed" and full.lost_samples == 0
    assert full.epochs_completed == 2


def test_a_stop_on_a_full_save_path_says_its_bundle_could_not_be_written() -> None:
    plan = FaultPlan().fill_save_path(rank=2, at_epoch=0.1).stop_launcher(rank=0, at_epoch=1.2)
    stopped = run(plan)
    assert stopped.outcome == "failed"
    assert "the bundle could not be written" in stopped.reason
    assert "No space left on device" in stopped.reason
    assert stopped.saved_meta is None
