"""Joins in simulated runs: seeded random schedules with ranks that join, and shares.

The random schedules are those of ``test_faults`` with ``Join`` among the
kinds, in the collective modes (the ones ranks join). Whatever happens, every
sample is in a consensus model exactly once (or listed as still to do in the
saved bundle), by the simulator's own ground truth.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from elche import FaultPlan, Mode, SimConfig, simulate
from elche.core.errors import ConfigError

from .test_faults import CheckedSimulation


def join_scenario(seed: int) -> SimConfig:
    rng = random.Random(seed)
    world_size = rng.randint(1, 4)
    plan = FaultPlan.random(rng, world_size=world_size, horizon_s=3.0, joins=True)
    if not plan.join_slots(world_size):  # every schedule has a join
        plan = plan.join(rank=world_size, at_s=rng.uniform(0.0, 3.0))
    return SimConfig(
        speeds=tuple(round(rng.uniform(0.2, 1.0), 2) for _ in range(world_size)),
        mode=rng.choice([Mode.SYNC, Mode.CADENCE]),
        epochs=2,
        samples=rng.randint(50, 1000),
        batch_size=rng.choice([7, 32]),
        seed=seed,
        faults=plan,
        heartbeat_timeout_s=2.0,
        jitter=rng.choice([0.0, 0.1]),
        max_failures=rng.choice([None, None, 2]),
        eval_every=rng.choice([None, 1]),
        checkpoint_every=rng.choice([None, 1]),
    )


@pytest.mark.parametrize("seed", range(120))
def test_random_schedules_with_joins_lose_and_duplicate_nothing(seed: int) -> None:
    config = join_scenario(seed)
    result = CheckedSimulation(config).run()
    assert result.duplicated_samples == 0
    if result.outcome == "failed":
        # Nothing to save: every rank was lost, or a restarted coordinator lost
        # a rank of the run before it re-formed (a failure without joins too).
        assert "no rank was left" in result.reason or "restarted" in result.reason, result.reason
        return
    assert result.outcome in ("completed", "saved_and_shutdown")
    assert result.lost_samples == 0
    if result.outcome == "completed":
        assert result.samples_trained == config.epochs * config.samples


def test_random_plans_draw_joins_only_when_asked() -> None:
    for seed in range(50):
        plain = FaultPlan.random(random.Random(seed), world_size=3, horizon_s=3.0)
        assert plain.join_slots(3) == 0
    drawn = [
        FaultPlan.random(random.Random(seed), world_size=3, horizon_s=3.0, joins=True)
        for seed in range(50)
    ]
    assert sum(plan.join_slots(3) > 0 for plan in drawn) >= 10


def test_a_joiner_trains_in_proportion_to_its_speed() -> None:
    speeds = (1.0, 0.5, 0.25)
    plan = FaultPlan().join(rank=3, at_s=1.0, speed=0.5)
    result = simulate(SimConfig(speeds=speeds, samples=20_000, epochs=3, seed=3, faults=plan))
    assert result.outcome == "completed" and result.joined_ranks == [3]
    assert (result.lost_samples, result.duplicated_samples) == (0, 0)
    rate = {r.rank: r.samples / (r.busy_s + r.idle_s) for r in result.per_rank}
    assert result.per_rank[3].speed == 0.5
    # Rank 3 (speed 0.5, from its join on) keeps pace with rank 1 (speed 0.5, from the start).
    assert 0.8 < rate[3] / rate[1] < 1.2, rate
    assert rate[3] > 1.5 * rate[2]


def test_a_join_shortens_the_run() -> None:
    base = SimConfig(speeds=(1.0, 0.25), samples=20_000, epochs=2, seed=1)
    alone = simulate(base)
    plan = FaultPlan().join(rank=2, at_s=0.5)
    joined = simulate(dataclasses.replace(base, faults=plan))
    assert joined.virtual_wall_s < 0.8 * alone.virtual_wall_s


def test_a_join_names_a_slot_past_the_world() -> None:
    with pytest.raises(ConfigError, match="past"):
        SimConfig(speeds=(1.0, 1.0), faults=FaultPlan().join(rank=1, at_s=1.0))


def test_joins_need_a_collective_mode() -> None:
    with pytest.raises(ConfigError) as info:
        plan = FaultPlan().join(rank=1, at_s=0.1)
        simulate(SimConfig(speeds=(1.0,), mode=Mode.CPU_SYNC, faults=plan))
    assert info.value.field == "join_slots"


def test_a_join_round_trips_through_json_and_is_no_real_rank_fault() -> None:
    plan = FaultPlan().kill(rank=0, at_s=1.0).join(rank=2, at_s=0.5, speed=0.25)
    assert FaultPlan.from_json(plan.to_json()) == plan
    assert plan.join_slots(2) == 1
    plan.check(2, joins=True)
    with pytest.raises(ConfigError, match="elche join"):
        plan.check(2)  # a real run's plan: ranks join with elche join
    with pytest.raises(ConfigError, match="at_s"):
        FaultPlan.from_json('{"faults": [{"kind": "join", "rank": 2, "at_epoch": 0.5}]}')
