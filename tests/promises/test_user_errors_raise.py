"""Issue 12, items 2, 14 and 15 on real processes: user errors raise, crashes are survived.

A user's mistake (a non-scalar loss, a model that cannot be built, a step
that raises on every rank) makes ``elche.train`` raise ``elche.TrainingError``
carrying the failing rank, the epoch and the user's own exception and
traceback; a rank that crashes before the run forms is survived. The user's
failing functions are in ``tests/promises/faulty.py`` (top level, so the
ranks can unpickle them).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import elche
from elche import cli
from elche.runtime import launch
from tests.promises import faulty
from tests.promises.tiny import bundle_on_disk, make_model, make_optimizer, step

DATA = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))


def train(**overrides: object) -> elche.TrainResult:
    args: dict[str, object] = {
        "model_fn": make_model, "optimizer_fn": make_optimizer, "step_fn": step,
        "dataset": DATA, "batch_size": 8, "epochs": 2, "ranks": 2, "mode": "cpu-cadence",
        "progress": False,
    }  # fmt: skip
    args.update(overrides)
    return elche.train(**args)  # type: ignore[arg-type]


def raised(**overrides: object) -> elche.TrainingError:
    with pytest.raises(elche.TrainingError) as info:
        train(**overrides)
    return info.value


@pytest.mark.integration
@pytest.mark.slow
def test_issue12_item14_a_non_scalar_loss_on_every_rank_raises_the_users_error() -> None:
    error = raised(step_fn=faulty.nonscalar_step)
    assert error.rank in (0, 1) and error.epoch == 0
    assert error.error_type == "RuntimeError"
    assert "scalar outputs" in error.message
    assert error.traceback.startswith("Traceback") and "scalar outputs" in error.traceback
    assert "elche/runtime" not in error.traceback  # the user's frames, not elche's
    assert "scalar outputs" in str(error)


@pytest.mark.integration
@pytest.mark.slow
def test_issue12_item14_a_model_fn_failing_on_one_rank_raises_at_once() -> None:
    # cadence: rank 0 waits in the group rendezvous for rank 1, which never comes.
    error = raised(model_fn=faulty.model_fails_on_rank1, mode="cadence")
    assert (error.rank, error.epoch, error.error_type) == (1, 0, "ValueError")
    assert "cannot be built" in error.message
    assert "faulty.py" in error.traceback and "model_fails_on_rank1" in error.traceback


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cadence", "cpu-cadence"])
def test_a_model_fn_that_builds_another_model_on_one_rank_is_refused_naming_it(
    mode: str,
) -> None:
    # cadence: rank 0's broadcast of its weights aborted rank 0 in gloo (a size
    # mismatch) and the run ended saved_and_shutdown; a rank with an extra tensor waited
    # in the broadcast until formation timed out. cpu-cadence: rank 1 failed its first
    # average and the run completed without it.
    error = raised(model_fn=faulty.model_wider_on_rank1, mode=mode)
    assert (error.rank, error.epoch, error.error_type) == (1, 0, "ValueError")
    assert "model_fn built another model on ranks [1] than on rank 0" in error.message
    assert "names, shapes or dtypes" in error.message


@pytest.mark.integration
@pytest.mark.slow
def test_an_eval_fn_that_changes_the_models_dtype_fails_its_rank_naming_it() -> None:
    # The eval rank failed its next step on the dtype, blamed on step_fn; with a step
    # that follows the model's dtype, its next average aborted it inside gloo (SIGABRT)
    # and the run ended saved_and_shutdown, naming nothing.
    error = raised(eval_fn=faulty.eval_halving_the_model, eval_dataset=DATA, mode="cadence")
    assert error.error_type == "ValueError"
    assert error.message.startswith("eval_fn changed the model's parameters or buffers")
    assert error.bundle is not None  # the survivor saved what was trained


@pytest.mark.integration
@pytest.mark.slow
def test_issue12_item14_the_same_error_mid_run_on_every_rank_raises() -> None:
    error = raised(step_fn=faulty.step_fails_after_a_few)
    assert error.error_type == "KeyError" and "vocabulary" in error.message
    assert "step_fails_after_a_few" in error.traceback


@pytest.mark.integration
@pytest.mark.slow
def test_an_error_that_leaves_too_few_ranks_saves_what_the_survivors_trained(
    tmp_path: Path,
) -> None:
    # Rank 1's error left rank 0 alone in a collective run: the run used to fail with
    # nothing saved, where a SIGKILL of rank 1 at the same point saved a bundle.
    stem = str(tmp_path / "run")
    error = raised(step_fn=faulty.step_fails_on_rank1_after_a_few, mode="cadence",
                   save_path=stem, epochs=4)  # fmt: skip
    assert (error.rank, error.error_type) == (1, "OSError")
    assert error.bundle == stem
    assert f"saved as the bundle {stem}: resume_from={stem!r}" in str(error)
    resumed = train(resume_from=stem, epochs=4, mode="cadence")
    assert resumed.summary["outcome"] == "completed"
    assert resumed.summary["lost_samples"] == 0


@pytest.mark.integration
@pytest.mark.slow
def test_a_rank_process_that_exits_0_mid_run_is_lost_at_once() -> None:
    # Only a non-zero exit was reported: this one was found when its heartbeats went
    # stale (heartbeat_timeout_s, 30 s here).
    result = train(step_fn=faulty.step_exits_on_rank1_after_a_few, ranks=3, epochs=3,
                   heartbeat_timeout_s=30.0)  # fmt: skip
    summary = result.summary
    assert summary["outcome"] == "completed" and summary["dead_ranks"] == [1], summary
    assert summary["lost_samples"] == 0
    reasons = [n for n in summary["notices"] if "rank 1 lost" in str(n)]
    assert reasons and "process ended (exit code 0)" in str(reasons[0]), summary["notices"]


@pytest.mark.integration
@pytest.mark.slow
def test_the_wait_for_a_rank_process_a_thread_of_the_users_keeps_alive_is_said(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The launcher waited 30 s for each such rank, saying nothing, and then killed it.
    monkeypatch.setattr(launch, "RANK_EXIT_SAY_S", 0.5)
    monkeypatch.setattr(launch, "RANK_EXIT_GRACE_S", 2.0)
    result = train(model_fn=faulty.model_with_a_thread)
    assert result.summary["outcome"] == "completed"
    err = capfd.readouterr().err
    said = (
        r"elche: rank 0's process has not exited though the run is over; waiting \d+ s more "
        r"before it is killed \(a thread of your code that does not end keeps it alive\)"
    )
    assert re.search(said, err), err[-3000:]


@pytest.mark.slow
def test_issue12_item14_one_rank_raises_the_same_training_error_in_process() -> None:
    with pytest.raises(elche.TrainingError) as info:
        train(step_fn=faulty.nonscalar_step, ranks=1)
    error = info.value
    assert (error.rank, error.epoch, error.error_type) == (0, 0, "RuntimeError")
    assert isinstance(error.__cause__, RuntimeError)  # in-process, the exception itself too


@pytest.mark.integration
@pytest.mark.slow
def test_issue12_item14_elche_run_raises_it_in_every_rank(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "elche.cli", "run", "--nproc", "2", str(script)],
        capture_output=True, text=True, timeout=240, check=False,
        cwd=Path(__file__).parents[2],
    )  # fmt: skip
    raised_on = sorted(line for line in done.stdout.splitlines() if line.startswith("RAISED"))
    assert raised_on == ["RAISED 0 ValueError", "RAISED 1 ValueError"], done.stderr[-4000:]


SCRIPT = """
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from torch.utils.data import TensorDataset
import elche
from tests.promises import faulty, tiny

if __name__ == "__main__":
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    try:
        elche.train(faulty.model_fails_on_rank1, tiny.make_optimizer, tiny.step, data,
                    batch_size=8, epochs=1, mode="cpu-cadence", progress=False)
    except elche.TrainingError as exc:
        print(f"RAISED {os.environ['RANK']} {exc.error_type}", flush=True)
"""


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cpu-cadence", "cadence"])
def test_issue12_item02_a_rank_killed_before_the_run_forms_is_survived(mode: str) -> None:
    # cadence: the others waited for it in their first group's rendezvous until their
    # collective timeout (60 s) and failed, though the coordinator said it formed without it.
    result = train(model_fn=faulty.model_killed_on_rank1, ranks=3, mode=mode)
    summary = result.summary
    assert summary["outcome"] == "completed", summary
    assert summary["dead_ranks"] == [1]
    assert summary["lost_samples"] == 0
    assert summary["epochs_completed"] == 2
    assert result.state_dict  # the final model is there


def failed_summary(**_: object) -> dict[str, object]:
    return {
        "mode": "cadence", "world_size": 2, "epochs_completed": 0, "wall_s": 0.0,
        "startup_s": None, "samples_per_s": 0.0, "final_loss": None, "eval_accuracy": None,
        "syncs": 0, "lost_samples": 0, "dead_ranks": [0, 1], "outcome": "failed",
        "reason": "rank 1 lost before the run formed (exit code 1); all_ranks_lost",
        "bundle": None, "per_rank": [],
    }  # fmt: skip


def test_issue12_item02_the_demo_prints_no_resume_command_without_a_bundle(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "_demo_summary", failed_summary)
    assert cli.main(["demo", "--json"]) == 3
    err = capsys.readouterr().err
    assert "--resume-from" not in err
    assert "the run failed" in err


def raising_summary(**_: object) -> dict[str, object]:
    raise elche.TrainingError(
        rank=1, epoch=2, error_type="KeyError", message="'label 7'",
        traceback='Traceback (most recent call last):\n  File "mine.py", line 3, in step\n'
        "KeyError: 'label 7'\n",
    )  # fmt: skip


def test_issue12_item14_the_cli_prints_the_users_error_and_exits_non_zero(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "_demo_summary", raising_summary)
    assert cli.main(["demo", "--json"]) == 1
    err = capsys.readouterr().err
    assert "rank 1 failed in epoch 2: KeyError" in err
    assert 'File "mine.py", line 3' in err
    assert "cli.py" not in err  # no traceback of elche's own frames


def all_finite(state: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values())


@pytest.mark.integration
@pytest.mark.slow
def test_issue12_item15_a_nan_loss_stops_with_a_bundle_of_the_last_finite_consensus(
    tmp_path: Path,
) -> None:
    stem = str(tmp_path / "run")
    # Rank 1 turns NaN on its second step: one that turned NaN after six of its own
    # trained fewer than that on a loaded machine (started late), in 3 epochs and
    # then in 6, and the run completed.
    error = raised(step_fn=faulty.nan_every_other, save_path=stem, epochs=6)
    assert (error.rank, error.error_type) == (1, "NonFiniteLoss")
    assert error.bundle == stem
    assert all_finite(torch.load(bundle_on_disk(stem).model))
    resumed = train(resume_from=stem, epochs=6, save_path=str(tmp_path / "again"))
    assert resumed.summary["outcome"] == "completed"
    assert resumed.summary["lost_samples"] == 0
    assert all_finite(resumed.state_dict)


@pytest.mark.integration
@pytest.mark.slow
def test_issue12_item15_skip_leaves_nan_steps_out_and_the_weights_finite() -> None:
    # Rank 1 turns NaN on its second step: one that turns NaN after six of its own
    # once trained fewer in 3 epochs (started late on a loaded machine) and skipped none.
    result = train(step_fn=faulty.nan_every_other, nonfinite="skip", mode="cadence", epochs=3)
    assert result.summary["outcome"] == "completed"
    assert all_finite(result.state_dict)
    steps, samples = result.summary["skipped_steps"], result.summary["skipped_samples"]
    assert isinstance(steps, int) and isinstance(samples, int)
    assert steps > 0 and 0 < samples <= steps * 8  # rank 1's steps, 8 samples at most each
    said = [n for n in result.summary["notices"] if "non-finite" in n]  # type: ignore[attr-defined]
    assert said[0].startswith("warning: rank 1: a non-finite loss")


@pytest.mark.slow
def test_issue12_item15_one_rank_stops_on_a_nan_loss_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ELCHE_RANK", "1")  # nan_after_a_few turns NaN on "rank 1"
    stem = str(tmp_path / "run")
    with pytest.raises(elche.TrainingError) as info:
        train(step_fn=faulty.nan_after_a_few, ranks=1, epochs=3, save_path=stem)
    assert info.value.error_type == "NonFiniteLoss"
    assert info.value.bundle == stem  # as several ranks save one (it used to save nothing)
    assert all_finite(torch.load(bundle_on_disk(stem).model))
    resumed = train(resume_from=stem, ranks=1, epochs=3)
    assert resumed.summary["outcome"] == "completed"
    result = train(step_fn=faulty.nan_after_a_few, ranks=1, epochs=3, nonfinite="skip")
    assert all_finite(result.state_dict)


def test_issue12_item15_nonfinite_is_refused_by_name() -> None:
    with pytest.raises(elche.ConfigError) as info:
        train(nonfinite="ignore")
    assert info.value.field == "nonfinite"


@pytest.mark.integration
@pytest.mark.slow
def test_issue12_item15_a_collective_run_starts_from_rank0s_weights_and_names_the_others() -> None:
    result = train(
        model_fn=faulty.model_per_rank, optimizer_fn=faulty.frozen_optimizer, mode="cadence",
        ranks=3, epochs=1,
    )  # fmt: skip
    assert result.summary["outcome"] == "completed"
    # Nothing trains (lr 0): the consensus is the start, rank 0's zeros, not the mean of 0, 1, 2.
    assert all(bool((v == 0).all()) for v in result.state_dict.values()), result.state_dict
    warnings = [n for n in result.summary["notices"] if "initial weights" in n]  # type: ignore[union-attr]
    assert len(warnings) == 1 and "[1, 2]" in warnings[0]


@pytest.mark.integration
@pytest.mark.slow
def test_issue12_item15_different_initial_weights_are_named_in_coordinator_modes() -> None:
    result = train(model_fn=faulty.model_per_rank, optimizer_fn=faulty.frozen_optimizer, ranks=2)
    warnings = [n for n in result.summary["notices"] if "initial weights" in n]  # type: ignore[union-attr]
    assert len(warnings) == 1 and "[1]" in warnings[0] and "Seed inside model_fn" in warnings[0]
