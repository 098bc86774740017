"""Fault plans: the builders' validation, triggers, and the JSON round trip.

Every refusal is a ``ConfigError`` naming the field at fault; a plan printed
with ``to_json`` reads back equal, so a failing schedule can be replayed.
"""

from __future__ import annotations

import json
import math
import random

import pytest

import elche.sim.faults
from elche.core.errors import ConfigError
from elche.core.faults import FailCheckpoint, FaultPlan, Kill, SlowDown, Stall, position

EVERY_KIND = (
    FaultPlan()
    .kill(rank=1, at_epoch=0.5)
    .stall(rank=2, at_s=3.0)
    .slow(rank=0, at_s=1.5, at_epoch=1.25, speed=0.5)
    .fail_checkpoint(rank=0)
    .fail_checkpoint(rank=1, at_epoch=2.0)
)


def test_builders_append_in_order_and_normalise_numbers() -> None:
    plan = FaultPlan().kill(rank=1, at_s=5).slow(rank=0, at_epoch=1, speed=1)
    assert plan.faults == (Kill(rank=1, at_s=5.0), SlowDown(rank=0, at_epoch=1.0, speed=1.0))
    assert all(isinstance(f.at_s or f.at_epoch, float) for f in plan.faults)
    assert FaultPlan().faults == ()  # each builder call returned a new plan


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: Kill(rank=1), "at_s"),  # no trigger
        (lambda: Stall(rank=-1, at_s=1.0), "rank"),
        (lambda: Kill(rank=True, at_s=1.0), "rank"),
        (lambda: Kill(rank=1, at_s=-0.1), "at_s"),
        (lambda: Kill(rank=1, at_s=math.inf), "at_s"),
        (lambda: Kill(rank=1, at_s=math.nan), "at_s"),
        (lambda: Stall(rank=1, at_epoch=-1.0), "at_epoch"),
        (lambda: Stall(rank=1, at_epoch="1"), "at_epoch"),
        (lambda: SlowDown(rank=0, at_s=1.0, speed=0.0), "speed"),
        (lambda: SlowDown(rank=0, at_s=1.0, speed=1.5), "speed"),
        (lambda: FaultPlan().slow(rank=0, at_s=1.0, speed=True), "speed"),
        (lambda: FailCheckpoint(rank=0, at_s=-1.0), "at_s"),
    ],
)
def test_bad_fields_are_refused_by_name(build: object, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        build()  # type: ignore[operator]  # a parametrized callable
    assert info.value.field == field


def test_a_failing_checkpoint_needs_no_trigger() -> None:
    assert FailCheckpoint(rank=0) == FaultPlan().fail_checkpoint(rank=0).faults[0]
    assert FailCheckpoint(rank=0).from_start
    assert not FailCheckpoint(rank=0, at_epoch=1.0).from_start


def test_check_refuses_a_rank_outside_the_world() -> None:
    EVERY_KIND.check(3)
    with pytest.raises(ConfigError) as info:
        EVERY_KIND.check(2)
    assert info.value.field == "faults"


def test_position_is_epoch_dot_fraction() -> None:
    assert position(epoch=1, offset=250, num_samples=1000) == 1.25
    assert position(epoch=0, offset=0, num_samples=0) == 0.0


def test_a_fault_is_due_at_the_first_trigger_reached() -> None:
    both = SlowDown(rank=0, at_s=10.0, at_epoch=1.5, speed=0.5)
    assert not both.due(epoch=1.4, elapsed_s=9.9)
    assert both.due(epoch=1.5, elapsed_s=0.0)
    assert both.due(epoch=0.0, elapsed_s=10.0)
    assert not both.due(epoch=0.0)  # the simulator fires at_s itself
    assert not Kill(rank=0, at_s=1.0).due(epoch=99.0)


def test_for_rank_keeps_plan_order() -> None:
    assert EVERY_KIND.for_rank(0) == (EVERY_KIND.faults[2], EVERY_KIND.faults[3])
    assert EVERY_KIND.for_rank(7) == ()


def test_json_round_trip_is_equal() -> None:
    text = EVERY_KIND.to_json()
    assert FaultPlan.from_json(text) == EVERY_KIND
    assert json.loads(text)["faults"][0] == {"kind": "kill", "rank": 1, "at_epoch": 0.5}
    assert FaultPlan.from_json(FaultPlan().to_json()) == FaultPlan()


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_round_trip_exactly(seed: int) -> None:
    plan = FaultPlan.random(random.Random(seed), world_size=4, horizon_s=3.0)
    assert FaultPlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("not json", "faults"),
        ("[]", "faults"),
        ('{"faults": {}}', "faults"),
        ('{"faults": [], "extra": 1}', "faults"),
        ('{"faults": [{"rank": 1, "at_s": 1}]}', "faults"),  # no kind
        ('{"faults": [{"kind": "explode", "rank": 1}]}', "faults"),
        ('{"faults": [{"kind": "kill", "rank": 1, "at_s": 1, "when": 2}]}', "faults"),
        ('{"faults": [{"kind": "slow", "rank": 1, "at_s": 1}]}', "faults"),  # no speed
        ('{"faults": [{"kind": "kill", "at_s": 1}]}', "faults"),  # no rank
        ('{"faults": ["kill"]}', "faults"),
        ('{"faults": [{"kind": "kill", "rank": 1, "at_s": -1}]}', "at_s"),
        ('{"faults": [{"kind": "slow", "rank": 1, "at_s": 1, "speed": 2}]}', "speed"),
    ],
)
def test_from_json_refuses_bad_documents(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        FaultPlan.from_json(text)
    assert info.value.field == field


def test_the_simulator_path_re_exports_the_core_types() -> None:
    assert elche.sim.faults.FaultPlan is FaultPlan
    assert elche.sim.faults.Kill is Kill
