"""``elche.train``'s fault hooks: ``faults=`` and the ``crash``/``stall`` shorthands.

The shorthands build the same ``FaultPlan`` a user could write, after the
given one, and each rank's spec carries only its own faults.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from elche.api import JOIN_SLOTS, _beat_every, _dashboard, _faults, _join_slots, _tensorboard_dir
from elche.core.config import CoordinatorConfig, Mode
from elche.core.errors import ConfigError
from elche.core.faults import FaultPlan, Kill, SlowDown, Stall
from elche.runtime.launch import rank_spec
from elche.runtime.plan import Plan


def test_crash_and_stall_are_shorthands_added_after_the_plan() -> None:
    given = FaultPlan().slow(rank=0, at_s=2.0, speed=0.5)
    plan = _faults(given, {1: 1.4}, {2: 1.2}, 3)
    assert plan.faults == (
        SlowDown(rank=0, at_s=2.0, speed=0.5),
        Kill(rank=1, at_epoch=1.4),
        Stall(rank=2, at_epoch=1.2),
    )
    assert _faults(None, None, None, 3) == FaultPlan()


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("plan", None, None), "faults"),
        ((FaultPlan().kill(rank=3, at_s=1.0), None, None), "faults"),
        ((None, {3: 1.0}, None), "crash"),
        ((None, None, {"1": 1.0}), "stall"),
    ],
)
def test_bad_fault_hooks_are_refused_by_name(args: tuple[object, ...], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        _faults(*args, 3)  # type: ignore[arg-type]  # bad on purpose
    assert info.value.field == field


def test_each_rank_spec_carries_its_own_faults(tmp_path: Path) -> None:
    config = CoordinatorConfig(
        mode=Mode.CADENCE, world_size=3, num_samples=100, batch_size=10, epochs=1
    )
    faults = FaultPlan().kill(rank=1, at_epoch=0.5).fail_checkpoint(rank=2).stall(rank=1, at_s=9)
    plan = Plan(
        config=config, speeds=(1.0,) * 3, speed_base_s=None, devices=("cpu",) * 3,
        resume_from=None, faults=faults,
    )  # fmt: skip
    specs = [rank_spec(plan, r, "addr", b"k", tmp_path, max_grad_norm=None) for r in range(3)]
    assert specs[0].faults == ()
    assert specs[1].faults == (faults.faults[0], faults.faults[2])
    assert specs[2].faults == (faults.faults[1],)


def test_the_dashboard_argument_beats_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELCHE_DASHBOARD", raising=False)
    assert _dashboard(None) is None
    monkeypatch.setenv("ELCHE_DASHBOARD", "0")
    assert _dashboard(None) == "0"
    assert _dashboard("127.0.0.1:9000") == "127.0.0.1:9000"
    monkeypatch.setenv("ELCHE_DASHBOARD", "")
    assert _dashboard(None) is None
    with pytest.raises(ConfigError) as info:
        _dashboard("x:y")
    assert info.value.field == "dashboard"


def test_a_tensorboard_log_needs_its_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELCHE_TENSORBOARD", raising=False)
    assert _tensorboard_dir(None) is None
    monkeypatch.setenv("ELCHE_TENSORBOARD", "/tb")
    assert _tensorboard_dir(None) == "/tb"
    assert _tensorboard_dir("/mine") == "/mine"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == "tensorboardX" else real_find_spec(name, *a),
    )  # fmt: skip
    with pytest.raises(ConfigError) as info:
        _tensorboard_dir("/mine")
    assert info.value.field == "tensorboard_dir" and "elche[tensorboard]" in str(info.value)


@pytest.mark.parametrize(
    ("timeout_s", "beat_s"), [(30.0, 1.0), (4.0, 1.0), (2.0, 0.5), (0.2, 0.05)]
)
def test_ranks_beat_and_the_timer_fires_at_least_four_times_a_timeout(
    tmp_path: Path, timeout_s: float, beat_s: float
) -> None:
    # A 2 s timeout beaten once a second is spent by one beat a loaded machine delays
    # by a second; four beats a timeout leave three to lose.
    interval = _beat_every(timeout_s)
    assert interval == beat_s
    config = CoordinatorConfig(
        mode=Mode.CADENCE, world_size=1, num_samples=10, batch_size=10, epochs=1,
        heartbeat_timeout_s=timeout_s, heartbeat_interval_s=interval,
    )  # fmt: skip
    plan = Plan(
        config=config, speeds=(1.0,), speed_base_s=None, devices=("cpu",), resume_from=None,
        faults=FaultPlan(),
    )  # fmt: skip
    spec = rank_spec(plan, 0, "addr", b"k", tmp_path, max_grad_norm=None)
    assert spec.heartbeat_interval_s == config.heartbeat_interval_s == beat_s
    with pytest.raises(ConfigError) as info:  # a bad timeout is named, not the beat
        CoordinatorConfig(
            mode=Mode.CADENCE, world_size=1, num_samples=10, batch_size=10, epochs=1,
            heartbeat_timeout_s=0.0, heartbeat_interval_s=_beat_every(0.0),
        )  # fmt: skip
    assert info.value.field == "heartbeat_timeout_s"


def test_join_slots_are_kept_on_collective_runs_of_two_ranks_unless_the_user_sets_them() -> None:
    assert _join_slots(Mode.CADENCE, 3, None) == _join_slots(Mode.SYNC, 2, None) == JOIN_SLOTS
    assert _join_slots(Mode.CPU_CADENCE, 3, None) == _join_slots(Mode.CADENCE, 1, None) == 0
    assert _join_slots(Mode.CADENCE, 3, 0) == 0  # a run no rank may join
    assert _join_slots(Mode.CADENCE, 3, 20) == 20
    assert _join_slots(Mode.CADENCE, 1, 0) == 0
