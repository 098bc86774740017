"""Real processes, real SIGKILLs: each failure ends as specified, nothing lost.

Every test trains scikit-learn's digits on real rank processes (gloo, CPU)
and breaks something on purpose: a rank SIGKILLs itself mid-window, a rank
hangs, a rank dies inside ``checkpoint_fn``, the only peer of a collective run
dies (the survivor saves; the bundle resumes), the coordinator is killed. One
``FaultPlan`` drives a simulation and a real run alike; a slow-down and
failing checkpoints act on real ranks.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

import elche
from elche import FaultPlan, Mode, SimConfig, simulate
from elche.core.checkpoint import CheckpointMeta, SaveReason
from elche.workloads import digits
from tests.promises.tiny import bundle_on_disk

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def data() -> tuple[object, object]:
    return digits.load_digits_split(seed=0)


def train(data: tuple[object, object], tmp_path: Path, **kw: object) -> elche.TrainResult:
    train_set, test_set = data
    options: dict[str, object] = {
        "batch_size": 32,
        "epochs": 3,
        "speeds": [1.0, 0.5, 0.25],
        "eval_fn": digits.eval_fn,
        "eval_dataset": test_set,
        "progress": False,
        "heartbeat_timeout_s": 3.0,
        "run_dir": str(tmp_path / "run"),
    }
    options.update(kw)
    return elche.train(
        digits.make_model, digits.make_optimizer, digits.step_fn, train_set, **options
    )  # type: ignore[arg-type]  # test helper forwards keywords


def assert_survived(result: elche.TrainResult, dead: list[int], epochs: int = 3) -> None:
    summary = result.summary
    assert summary["outcome"] == "completed"
    assert summary["dead_ranks"] == dead
    assert summary["epochs_completed"] == epochs
    assert summary["lost_samples"] == 0
    # A clean run reaches ~0.9 and chance is 0.1; which samples a survivor
    # trains after the loss depends on timing, so the bar leaves room for it.
    assert summary["eval_accuracy"] >= 0.8  # type: ignore[operator]  # JSON value
    assert result.state_dict


@pytest.mark.parametrize("mode", ["cadence", "sync", "cpu-cadence", "cpu-async"])
def test_sigkill_mid_window_is_survived(
    mode: str, data: tuple[object, object], tmp_path: Path
) -> None:
    result = train(data, tmp_path, mode=mode, crash={1: 1.4})
    assert_survived(result, dead=[1])


def test_one_plan_drives_a_simulation_and_a_real_run_alike(
    data: tuple[object, object], tmp_path: Path
) -> None:
    plan = FaultPlan().kill(rank=1, at_epoch=0.5)
    replayed = FaultPlan.from_json(plan.to_json())  # as a printed schedule is replayed
    sim = simulate(
        SimConfig(speeds=(1.0, 0.5, 0.25), mode=Mode.CADENCE, epochs=3,
                  samples=len(data[0]), batch_size=32, heartbeat_timeout_s=3.0,
                  faults=replayed)  # type: ignore[arg-type]  # Dataset
    ).to_json()  # fmt: skip
    real = train(data, tmp_path, mode="cadence", faults=plan)
    for summary in (sim, real.summary):
        assert summary["outcome"] == "completed"
        assert summary["dead_ranks"] == [1]
        assert summary["lost_samples"] == 0
    assert_survived(real, dead=[1])


def no_op_checkpoint(version: int, model: object) -> None:
    """A checkpoint_fn that succeeds (unless a FailCheckpoint fault says otherwise)."""


def test_a_slow_down_paces_a_full_speed_rank_and_checkpoints_fail_on_cue(
    data: tuple[object, object], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    plan = FaultPlan().slow(rank=0, at_epoch=1.0, speed=0.5)
    plan = plan.fail_checkpoint(rank=0, at_s=0.0).fail_checkpoint(rank=1, at_s=0.0)
    result = train(data, tmp_path, speeds=[1.0, 1.0], faults=plan,
                   checkpoint_fn=no_op_checkpoint, checkpoint_every=1)  # fmt: skip
    assert_survived(result, dead=[])
    injected = [
        json.loads((tmp_path / "run" / f"rank{r}.json").read_text())["injected_s"] for r in (0, 1)
    ]
    assert injected[0] > 0.0 and injected[1] == 0.0
    assert "FailCheckpoint fault" in capfd.readouterr().err


def test_a_hung_rank_is_declared_dead_and_survived(
    data: tuple[object, object], tmp_path: Path
) -> None:
    result = train(data, tmp_path, mode="cpu-cadence", stall={2: 1.2})
    assert_survived(result, dead=[2])


def dying_checkpoint(version: int, model: object) -> None:
    """Kills its process the first time it runs; succeeds after that."""
    marker = Path(os.environ["ELCHE_TEST_MARKER"])
    if not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def test_sigkill_inside_checkpoint_fn_moves_the_role(
    data: tuple[object, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELCHE_TEST_MARKER", str(tmp_path / "died-once"))
    result = train(data, tmp_path, mode="cadence", checkpoint_fn=dying_checkpoint,
                   checkpoint_every=1)  # fmt: skip
    # The elected rank held the role and died in it; the others finish the run.
    dead = result.summary["dead_ranks"]
    assert isinstance(dead, list) and len(dead) == 1
    assert_survived(result, dead=dead)


def test_lone_survivor_saves_and_the_bundle_resumes(
    data: tuple[object, object], tmp_path: Path
) -> None:
    stem = str(tmp_path / "bundle" / "run")
    saved = train(data, tmp_path / "a", speeds=[1.0, 0.5], epochs=4, crash={1: 1.5},
                  save_path=stem)  # fmt: skip
    assert saved.summary["outcome"] == "saved_and_shutdown"
    assert saved.summary["reason"] == "single_survivor"
    assert saved.summary["lost_samples"] == 0
    files = bundle_on_disk(stem)
    assert files.model.exists() and sorted(files.optim) == [0]  # rank 1 died before the save
    assert files.optim[0].exists()
    resumed = train(data, tmp_path / "b", speeds=[1.0, 0.5], epochs=4, resume_from=stem)
    assert_survived(resumed, dead=[], epochs=4)
    trained = sum(r["samples"] for r in resumed.summary["per_rank"])  # type: ignore[attr-defined]
    done_before = saved.summary["epochs_completed"]
    # Exactly the rest: the unfinished epoch's holes plus the untouched epochs.
    assert trained < (4 - done_before) * len(data[0])  # type: ignore[arg-type]  # Dataset


def test_a_coordinator_that_may_not_be_restarted_leaves_a_bundle_that_resumes(
    data: tuple[object, object], tmp_path: Path
) -> None:
    stem = str(tmp_path / "bundle" / "run")
    # Rank 0's share of an epoch starts at its front (``ChunkPool``), so it never
    # fires on its first batch of an epoch: at 1.4 inside its share, or later on a
    # batch it takes from a peer (1.40-1.94 seen), long after epoch 0's round.
    # Rank 1's share starts past 0.4: it fired on its first batch of epoch 1,
    # which on a loaded machine raced that round's journal record (a bundle of
    # round 0, epoch 0: honest, but not what this test is about).
    plan = FaultPlan().kill_coordinator(rank=0, at_epoch=1.4)
    saved = train(data, tmp_path / "a", faults=plan, max_coordinator_restarts=0, save_path=stem)
    summary = saved.summary
    assert (summary["outcome"], summary["reason"]) == ("saved_and_shutdown", "coordinator_lost")
    assert summary["bundle"] == stem and summary["coordinator_restarts"] == 0
    meta = CheckpointMeta.from_json(Path(f"{stem}.meta.json").read_text(encoding="utf-8"))
    assert meta.reason is SaveReason.COORDINATOR_LOST and 1 <= meta.epoch < 3
    assert meta.rounds_done == summary["syncs"] and meta.rounds_done > 0
    # Listed with every bundle of the run, as a coordinator's own saves are.
    assert summary["bundles"][-1] == {  # type: ignore[index]  # JSON value
        "stem": stem, "seq": meta.save_seq, "reason": "coordinator_lost",
    }  # fmt: skip
    files = bundle_on_disk(stem)
    assert files.model.exists() and sorted(files.optim) == [0, 1, 2]
    assert not list((tmp_path / "bundle").glob("*.local.*"))  # moved into the bundle
    resumed = train(data, tmp_path / "b", resume_from=stem)
    assert_survived(resumed, dead=[])
    n = len(data[0])  # type: ignore[arg-type]  # a Dataset
    open_epochs = {c.epoch for c in meta.coverage}
    untouched = [e for e in range(meta.epoch, 3) if e not in open_epochs]
    owed = sum(c.uncovered_samples for c in meta.coverage) + len(untouched) * n
    trained = sum(r["samples"] for r in resumed.summary["per_rank"])  # type: ignore[attr-defined]
    assert trained == owed  # exactly what the bundle's model lacks: nothing lost, nothing twice


def test_a_resumed_run_whose_coordinator_is_lost_commits_a_bundle_of_its_own_progress(
    data: tuple[object, object], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    first, stem = str(tmp_path / "first" / "run"), str(tmp_path / "bundle" / "run")
    two: dict[str, object] = {"speeds": None, "ranks": 2, "eval_fn": None}
    saved = train(data, tmp_path / "a", **two, epochs=1, save_path=first, checkpoint_every=1)
    assert saved.summary["outcome"] == "completed"
    before = CheckpointMeta.from_json(Path(f"{first}.meta.json").read_text(encoding="utf-8"))
    assert (before.epoch, before.coverage) == (1, ()) and before.rounds_done > 0
    # at_epoch is the run's progress, its epochs numbered on from the bundle's: the
    # resumed run trains epochs 1 and 2, and 2.3 is in its second (a whole epoch
    # after its start, so that its first rounds closed: progress to commit).
    plan = FaultPlan().kill_coordinator(rank=0, at_epoch=2.3)
    capfd.readouterr()
    lost = train(data, tmp_path / "b", **two, resume_from=first, save_path=stem, faults=plan,
                 max_coordinator_restarts=0)  # fmt: skip
    err = capfd.readouterr().err
    (at,) = re.findall(r"elche rank 0: killed the coordinator on purpose at ([\d.]+)", err)
    assert 2.3 <= float(at) < 3
    summary = lost.summary
    assert (summary["outcome"], summary["reason"]) == ("saved_and_shutdown", "coordinator_lost")
    assert summary["bundle"] == stem and summary["coordinator_restarts"] == 0
    said = f"the run could not continue (coordinator_lost); its state is saved as the bundle {stem}"
    assert said in err and f"Resume it with resume_from={stem!r}" in err
    meta = CheckpointMeta.from_json(Path(f"{stem}.meta.json").read_text(encoding="utf-8"))
    assert meta.reason is SaveReason.COORDINATOR_LOST and meta.epochs == 3
    # The resumed run's progress: its rounds on from the bundle's, its epochs too.
    assert meta.rounds_done == summary["syncs"] and meta.rounds_done > before.rounds_done
    assert meta.epoch == summary["epochs_completed"] and 1 <= meta.epoch <= 2
    n = len(data[0])  # type: ignore[arg-type]  # a Dataset
    open_epochs = {c.epoch for c in meta.coverage}
    untouched = [e for e in range(meta.epoch, 3) if e not in open_epochs]
    owed = sum(c.uncovered_samples for c in meta.coverage) + len(untouched) * n
    assert 0 < owed < 2 * n
    trained = sum(r["samples"] for r in summary["per_rank"])  # type: ignore[attr-defined]
    assert trained == 2 * n - owed  # this run's samples: none of epoch 0's
    files = bundle_on_disk(stem)
    assert files.model.exists() and sorted(files.optim) == [0, 1]
    again = train(data, tmp_path / "c", **two, resume_from=stem)
    assert again.summary["outcome"] == "completed" and again.summary["lost_samples"] == 0
    assert again.summary["epochs_completed"] == 3
    trained = sum(r["samples"] for r in again.summary["per_rank"])  # type: ignore[attr-defined]
    assert trained == owed  # exactly what the bundle's model lacks: nothing lost, nothing twice
