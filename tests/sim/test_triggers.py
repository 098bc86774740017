"""Progress triggers in the simulator: a fault fires at a batch boundary.

A fault with ``at_epoch`` fires when its rank is about to train the batch at
that epoch.fraction, before the batch, as on a real rank; one with both
triggers fires once, at the first reached.
"""

from __future__ import annotations

from elche import FaultPlan, Mode, SimConfig, SimResult, Simulation
from elche.core import timeline as tl
from elche.core.rank import Train
from elche.sim.engine import _Rank

SAMPLES = 960  # 30 batches of 32 per epoch


class RecordingSimulation(Simulation):
    """Writes down every batch a rank starts: (rank, epoch.fraction, speed)."""

    def __init__(self, config: SimConfig) -> None:
        super().__init__(config)
        self.started: list[tuple[int, float, float]] = []

    def _train(self, r: _Rank, action: Train) -> None:
        self.started.append((r.rank, action.epoch + action.offset / SAMPLES, r.speed))
        super()._train(r, action)


def simulate(faults: FaultPlan, **kw: object) -> tuple[RecordingSimulation, SimResult]:
    config = SimConfig(
        speeds=(1.0, 0.5, 0.25), mode=Mode.CADENCE, epochs=3, samples=SAMPLES, faults=faults, **kw
    )  # type: ignore[arg-type]  # test helper forwards SimConfig fields
    sim = RecordingSimulation(config)
    return sim, sim.run()


def test_a_progress_kill_fires_before_the_batch_at_that_point() -> None:
    sim, result = simulate(FaultPlan().kill(rank=1, at_epoch=0.5))
    assert (result.outcome, result.dead_ranks, result.lost_samples) == ("completed", [1], 0)
    rank1 = [at for rank, at, _ in sim.started if rank == 1]
    assert rank1 and max(rank1) < 0.5  # never started a batch at or past 0.5
    assert result.samples_trained == 3 * SAMPLES


def test_a_progress_slow_down_paces_the_rank_from_that_batch_on() -> None:
    sim, result = simulate(FaultPlan().slow(rank=0, at_epoch=1.0, speed=0.2))
    speeds = {(at >= 1.0, speed) for rank, at, speed in sim.started if rank == 0}
    assert speeds == {(False, 1.0), (True, 0.2)}
    assert result.outcome == "completed"


def test_a_fault_with_two_triggers_fires_once() -> None:
    # The first slow-down fires by progress; its at_s later must not undo the second.
    plan = FaultPlan().slow(rank=0, at_epoch=0.2, at_s=0.2, speed=0.5)
    plan = plan.slow(rank=0, at_epoch=0.3, speed=0.9)
    sim, _ = simulate(plan)
    late = {speed for rank, at, speed in sim.started if rank == 0 and at >= 0.3}
    assert late == {0.9}


def checkpoint_failures(sim: Simulation) -> list[float]:
    return [when for when, _, text in sim.notices if "checkpoint" in text and "failed" in text]


def test_failing_checkpoints_start_at_their_trigger() -> None:
    plain, _ = simulate(FaultPlan(), checkpoint_every=1)
    assert checkpoint_failures(plain) == []
    every = FaultPlan().fail_checkpoint(rank=0).fail_checkpoint(rank=1).fail_checkpoint(rank=2)
    assert checkpoint_failures(simulate(every, checkpoint_every=1)[0])
    late = FaultPlan()
    for rank in range(3):
        late = late.fail_checkpoint(rank=rank, at_epoch=1.5).fail_checkpoint(rank=rank, at_s=1e6)
    failures = checkpoint_failures(simulate(late, checkpoint_every=1)[0])
    first_epoch_end = min(e.t for e in plain.timeline if isinstance(e, tl.EpochEnd))
    assert failures and min(failures) > first_epoch_end


def test_a_timed_failing_checkpoint_fires_in_virtual_time() -> None:
    plan = FaultPlan()
    for rank in range(3):
        plan = plan.fail_checkpoint(rank=rank, at_s=0.0)
    assert checkpoint_failures(simulate(plan, checkpoint_every=1)[0])
