"""Run configuration: mode names, the mode table, validation and derived values.

Every refusal is a ``ConfigError`` whose ``.field`` is the field at fault, so a
launcher can point at the offending line of a config file.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from elche.core.config import (
    Backend,
    CallbackPolicy,
    CoordinatorConfig,
    Mode,
    Policy,
    SchedulerConfig,
)
from elche.core.errors import ConfigError

BASE = CoordinatorConfig(mode=Mode.CADENCE, world_size=4, num_samples=1000, batch_size=32, epochs=3)


def coordinator(**overrides: object) -> CoordinatorConfig:
    return dataclasses.replace(BASE, **overrides)


# --- Mode.parse --------------------------------------------------------------


@pytest.mark.parametrize("mode", list(Mode))
def test_parse_accepts_every_mode_name(mode: Mode) -> None:
    assert Mode.parse(mode.value) is mode


@pytest.mark.parametrize("name", ["async", "ASYNC", "Async", "cpu-async", "CPU-Async"])
def test_parse_maps_async_to_cpu_async(name: str) -> None:
    assert Mode.parse(name) is Mode.CPU_ASYNC


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("SYNC", Mode.SYNC),
        ("Cadence", Mode.CADENCE),
        ("CPU-SYNC", Mode.CPU_SYNC),
        ("cpu-Cadence", Mode.CPU_CADENCE),
        ("  sync\n", Mode.SYNC),
    ],
)
def test_parse_ignores_case_and_surrounding_whitespace(name: str, mode: Mode) -> None:
    assert Mode.parse(name) is mode


@pytest.mark.parametrize(
    "name", ["", "bogus", "cpu_async", "cpu async", "nccl", "asynchronous", None, 3, Mode.SYNC]
)
def test_parse_refuses_a_bad_name_listing_the_accepted_values(name: object) -> None:
    with pytest.raises(ConfigError) as info:
        Mode.parse(name)
    assert info.value.field == "mode"
    text = str(info.value)
    assert repr(name) in text
    accepted = text.split("accepted: ", 1)[1]
    assert accepted.split(", ") == [m.value for m in Mode] + ["async"]


@pytest.mark.parametrize(
    ("mode", "policy", "backend"),
    [
        (Mode.SYNC, Policy.SYNC, Backend.COLLECTIVE),
        (Mode.CADENCE, Policy.CADENCE, Backend.COLLECTIVE),
        (Mode.CPU_SYNC, Policy.SYNC, Backend.COORDINATOR),
        (Mode.CPU_CADENCE, Policy.CADENCE, Backend.COORDINATOR),
        (Mode.CPU_ASYNC, Policy.ASYNC, Backend.COORDINATOR),
    ],
)
def test_each_mode_is_a_policy_backend_pair(mode: Mode, policy: Policy, backend: Backend) -> None:
    assert (mode.policy, mode.backend) == (policy, backend)
    config = coordinator(mode=mode)
    assert (config.policy, config.backend) == (policy, backend)


def test_there_is_no_collective_async_mode() -> None:
    pairs = {(m.policy, m.backend) for m in Mode}
    assert (Policy.ASYNC, Backend.COLLECTIVE) not in pairs
    assert len(pairs) == len(Mode)


# --- validation ----------------------------------------------------------------


def test_defaults_are_valid() -> None:
    SchedulerConfig()
    config = coordinator()
    assert config.seed == 42
    assert config.callback_policy is CallbackPolicy.FASTEST


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"anchor": 0}, "anchor"),
        ({"anchor": -3}, "anchor"),
        ({"anchor": 2.5}, "anchor"),
        ({"min_anchor": 0}, "min_anchor"),
        ({"max_anchor": 0}, "max_anchor"),
        ({"overhead_target": 0.9}, "overhead_target"),
        ({"overhead_target": 0.0099}, "overhead_target"),
        ({"overhead_target": math.nan}, "overhead_target"),
        ({"max_batch_diff": -1}, "max_batch_diff"),
        ({"max_overshoot": -1}, "max_overshoot"),
        ({"divergence_threshold": 0}, "divergence_threshold"),
        ({"divergence_threshold": -0.1}, "divergence_threshold"),
        ({"divergence_threshold": math.nan}, "divergence_threshold"),
        ({"gamma": math.inf}, "gamma"),
        ({"gamma": -math.inf}, "gamma"),
        ({"gamma": math.nan}, "gamma"),
        ({"fill_wait": "no"}, "fill_wait"),
        ({"fill_wait": 0}, "fill_wait"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else v,
)
def test_scheduler_config_refuses_each_bad_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(**overrides)  # type: ignore[arg-type]  # deliberately ill-typed input
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    "overrides",
    [
        {"anchor": 1, "min_anchor": 1, "max_anchor": 1},
        {"overhead_target": 0.01},
        {"overhead_target": 0.5},
        {"max_batch_diff": 0},
        {"max_overshoot": 0},
        {"divergence_threshold": 1e-9},
        {"gamma": 0.0},
    ],
    ids=repr,
)
def test_scheduler_config_accepts_the_edges(overrides: dict[str, object]) -> None:
    config = SchedulerConfig(**overrides)  # type: ignore[arg-type]  # values vary per case
    for name, value in overrides.items():
        assert getattr(config, name) == value


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"mode": "sync"}, "mode"),
        ({"world_size": 0}, "world_size"),
        ({"num_samples": 0}, "num_samples"),
        ({"batch_size": 0}, "batch_size"),
        ({"epochs": 0}, "epochs"),
        ({"seed": -1}, "seed"),
        ({"order": "sorted"}, "order"),
        ({"max_failures": 0}, "max_failures"),
        ({"eval_every": 0}, "eval_every"),
        ({"checkpoint_every": 0}, "checkpoint_every"),
        ({"callback_rank": 4}, "callback_rank"),
        ({"callback_rank": -1}, "callback_rank"),
        ({"world_size": 1, "callback_rank": 1}, "callback_rank"),
        ({"heartbeat_interval_s": 0}, "heartbeat_interval_s"),
        ({"heartbeat_timeout_s": -1.0}, "heartbeat_timeout_s"),
        ({"heartbeat_timeout_s": math.nan}, "heartbeat_timeout_s"),
        ({"formation_timeout_s": 0.0}, "formation_timeout_s"),
        ({"formation_timeout_s": "60"}, "formation_timeout_s"),
        ({"heartbeat_timeout_s": 1.0}, "heartbeat_timeout_s"),  # == interval
        ({"heartbeat_interval_s": 5.0, "heartbeat_timeout_s": 2.0}, "heartbeat_timeout_s"),
        ({"easgd_alpha": 0}, "easgd_alpha"),
        ({"easgd_alpha": 0.0}, "easgd_alpha"),
        ({"easgd_alpha": 1.5}, "easgd_alpha"),
        ({"easgd_alpha": -0.5}, "easgd_alpha"),
        ({"easgd_alpha": math.nan}, "easgd_alpha"),
        ({"scheduler": {"anchor": 2}}, "scheduler"),  # its knobs went unread
        ({"scheduler": "fast"}, "scheduler"),
        ({"scheduler": None}, "scheduler"),
    ],
    ids=repr,
)
def test_coordinator_config_refuses_each_bad_field(
    overrides: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        coordinator(**overrides)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("cls", "field"),
    [
        (CoordinatorConfig, "world_size"),
        (CoordinatorConfig, "num_samples"),
        (CoordinatorConfig, "batch_size"),
        (CoordinatorConfig, "epochs"),
        (CoordinatorConfig, "seed"),
        (CoordinatorConfig, "max_failures"),
        (CoordinatorConfig, "eval_every"),
        (CoordinatorConfig, "checkpoint_every"),
        (CoordinatorConfig, "callback_rank"),
        (SchedulerConfig, "anchor"),
        (SchedulerConfig, "min_anchor"),
        (SchedulerConfig, "max_anchor"),
        (SchedulerConfig, "max_batch_diff"),
        (SchedulerConfig, "max_overshoot"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_a_bool_given_for_an_int_is_refused(cls: type, field: str) -> None:
    # True == 1 passes every range check, so only a type check catches it.
    with pytest.raises(ConfigError) as info:
        if cls is CoordinatorConfig:
            coordinator(**{field: True})
        else:
            SchedulerConfig(**{field: True})
    assert info.value.field == field


@pytest.mark.parametrize("value", [0.5, 1.0, "0", None])
def test_a_non_int_callback_rank_is_refused(value: object) -> None:
    # Regression: callback_rank was only range-checked, so True and 0.5 passed and
    # a PINNED run broadcast SetEpochCallbackRole(rank=True), which workers refuse.
    with pytest.raises(ConfigError) as info:
        coordinator(callback_rank=value)
    assert info.value.field == "callback_rank"


@pytest.mark.parametrize(
    "overrides",
    [
        {"world_size": 1, "callback_rank": 0},
        {"callback_rank": 3},
        {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 1.001},
        {"easgd_alpha": 1.0},
        {"easgd_alpha": 1e-6},
        {"max_failures": 1, "eval_every": 1, "checkpoint_every": 1, "seed": 0},
    ],
    ids=repr,
)
def test_coordinator_config_accepts_the_edges(overrides: dict[str, object]) -> None:
    config = coordinator(**overrides)
    for name, value in overrides.items():
        assert getattr(config, name) == value


def test_configs_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        BASE.world_size = 8  # type: ignore[misc]  # asserting the refusal
    with pytest.raises(dataclasses.FrozenInstanceError):
        SchedulerConfig().anchor = 3  # type: ignore[misc]  # asserting the refusal


# --- derived values ------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "anchor"), [(Policy.SYNC, 1), (Policy.CADENCE, 10), (Policy.ASYNC, 10)]
)
def test_anchor_for_defaults_to_1_for_sync_and_10_otherwise(policy: Policy, anchor: int) -> None:
    assert SchedulerConfig().anchor_for(policy) == anchor


@pytest.mark.parametrize("policy", list(Policy))
def test_anchor_for_returns_an_explicit_anchor_for_every_policy(policy: Policy) -> None:
    assert SchedulerConfig(anchor=7).anchor_for(policy) == 7


@pytest.mark.parametrize(
    ("mode", "easgd_alpha", "expected"),
    [
        (Mode.CPU_ASYNC, None, 0.5),
        (Mode.CPU_ASYNC, 0.25, 0.25),
        (Mode.CPU_ASYNC, 1.0, 1.0),
        (Mode.SYNC, None, None),
        (Mode.CADENCE, None, None),
        (Mode.CPU_SYNC, None, None),
        (Mode.CPU_CADENCE, None, None),
        (Mode.CPU_CADENCE, 0.25, None),  # set, but only async averaging blends
        (Mode.SYNC, 0.25, None),
    ],
)
def test_blend_alpha(mode: Mode, easgd_alpha: float | None, expected: float | None) -> None:
    assert coordinator(mode=mode, easgd_alpha=easgd_alpha).blend_alpha == expected


@pytest.mark.parametrize(
    ("mode", "world_size", "expected"),
    [
        (Mode.SYNC, 4, 2),
        (Mode.CADENCE, 2, 2),
        (Mode.SYNC, 1, 1),
        (Mode.CADENCE, 1, 1),
        (Mode.CPU_SYNC, 4, 1),
        (Mode.CPU_CADENCE, 4, 1),
        (Mode.CPU_ASYNC, 4, 1),
        (Mode.CPU_ASYNC, 1, 1),
    ],
)
def test_min_live_ranks(mode: Mode, world_size: int, expected: int) -> None:
    config = coordinator(mode=mode, world_size=world_size, callback_rank=0)
    assert config.min_live_ranks == expected


def test_outer_optimizer_needs_a_coordinator_mode() -> None:
    from elche.core.config import CoordinatorConfig, Mode

    base = {"world_size": 2, "num_samples": 10, "batch_size": 2, "epochs": 1}
    assert CoordinatorConfig(mode=Mode.CPU_CADENCE, outer_lr=0.7, **base).outer_lr == 0.7
    for mode, lr, momentum, field in [
        (Mode.CADENCE, 0.7, 0.9, "outer_lr"),
        (Mode.CPU_CADENCE, 0.0, 0.9, "outer_lr"),
        (Mode.CPU_CADENCE, 0.7, 1.0, "outer_momentum"),
    ]:
        with pytest.raises(ConfigError) as info:
            CoordinatorConfig(mode=mode, outer_lr=lr, outer_momentum=momentum, **base)
        assert info.value.field == field
