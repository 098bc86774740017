"""One rank keeps the callback and ``nonfinite="skip"`` promises several ranks keep.

``elche.train(ranks=1)`` trains in the caller's process. An ``eval_fn``,
``checkpoint_fn``, ``metrics_fn`` or ``eval_result_fn`` that raised (or an
``eval_fn`` that returned no number) used to end it with the raw exception,
no result and no bundle, where a run of several ranks logs the failure and
goes on (``docs/failure-modes.md``, "A callback fails"). Under
``nonfinite="skip"`` it skipped steps without a word and without a count.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elche
from elche.core import timeline as tl
from elche.monitor.timeline import read_timeline
from tests.promises.tiny import make_model, make_optimizer, step

DATA = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
BATCH = 16  # four steps an epoch


def train(tmp_path: Path, **overrides: object) -> elche.TrainResult:
    args: dict[str, object] = {
        "model_fn": make_model, "optimizer_fn": make_optimizer, "step_fn": step,
        "dataset": DATA, "batch_size": BATCH, "epochs": 2, "ranks": 1, "progress": False,
        "run_dir": str(tmp_path / "run"),
    }  # fmt: skip
    args.update(overrides)
    return elche.train(**args)  # type: ignore[arg-type]


def eval_raises(model: nn.Module, dataset: object) -> float:
    raise RuntimeError("the eval set is gone")


def eval_gives_a_dict(model: nn.Module, dataset: object) -> dict[str, float]:
    return {"acc": 0.5, "f1": 0.4}


def checkpoint_raises(version: int, model: nn.Module) -> None:
    raise OSError("bucket unreachable")


def hook_raises(*args: object) -> None:
    raise RuntimeError("my logger is down")


def nan_step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    return step(model, batch) * float("nan")


def completed(result: elche.TrainResult) -> bool:
    return result.summary["outcome"] == "completed" and len(result.epochs) == 2


@pytest.mark.slow
def test_an_eval_fn_that_raises_is_logged_and_training_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = train(tmp_path, eval_fn=eval_raises, eval_dataset=DATA)
    assert completed(result)
    assert result.summary["eval"] is None
    said = "eval_fn failed on rank 0 after epoch 1: RuntimeError: the eval set is gone"
    assert said in capsys.readouterr().err
    assert f"error: {said}" in result.summary["notices"]  # type: ignore[operator]  # a list
    failed = [e for e in read_timeline(tmp_path / "run") if isinstance(e, tl.EvalFailed)]
    assert [(e.epoch, e.rank) for e in failed] == [(1, 0), (2, 0)]


@pytest.mark.slow
def test_an_eval_fn_that_returns_no_number_is_named_and_training_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    eval_result_fn_calls: list[object] = []
    result = train(
        tmp_path, eval_fn=eval_gives_a_dict, eval_dataset=DATA,
        eval_result_fn=lambda *args: eval_result_fn_calls.append(args),
    )  # fmt: skip
    assert completed(result)
    assert "eval_fn returned a dict ({'acc': 0.5, 'f1': 0.4}), not a number" in (
        capsys.readouterr().err
    )
    assert eval_result_fn_calls == []  # no metric to hand on
    assert all("eval" not in epoch for epoch in result.epochs)


@pytest.mark.slow
def test_a_checkpoint_fn_that_raises_is_logged_and_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stem = str(tmp_path / "ckpt")
    result = train(tmp_path, checkpoint_fn=checkpoint_raises, checkpoint_every=1, save_path=stem)
    assert completed(result)
    err = capsys.readouterr().err
    assert "checkpoint v1 failed on rank 0: OSError: bucket unreachable" in err
    assert "checkpoint v1 failed on every live rank; giving up on this version" in err
    assert [b["reason"] for b in result.summary["bundles"]] == ["checkpoint"] * 2  # type: ignore[attr-defined]
    ran = [e for e in read_timeline(tmp_path / "run") if isinstance(e, tl.CheckpointRan)]
    assert [(e.version, e.outcome) for e in ran] == [(1, "failed"), (2, "failed")]


@pytest.mark.slow
def test_metrics_fn_and_eval_result_fn_that_raise_are_logged_and_training_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = train(
        tmp_path, metrics_fn=hook_raises, eval_result_fn=hook_raises,
        eval_fn=lambda model, dataset: 0.5, eval_dataset=DATA,
    )  # fmt: skip
    assert completed(result)
    assert result.summary["eval"] == 0.5
    err = capsys.readouterr().err
    assert err.count("elche: metrics_fn raised; training goes on") == 2
    assert err.count("elche: eval_result_fn raised; training goes on") == 2


@pytest.mark.slow
def test_skipped_steps_are_warned_of_and_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = train(tmp_path, step_fn=nan_step, nonfinite="skip")
    assert completed(result)
    assert (result.summary["skipped_steps"], result.summary["skipped_samples"]) == (8, 128)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "non-finite" in line]
    assert warnings == [  # the first and every hundredth, as on several ranks
        "elche [warning] rank 0: a non-finite loss in epoch 0; that step was skipped "
        "(1 so far, nonfinite='skip')"
    ]
    (end,) = [e for e in read_timeline(tmp_path / "run") if isinstance(e, tl.RunEnd)]
    assert (end.skipped_steps, end.skipped_samples) == (8, 128)


@pytest.mark.slow
def test_a_run_that_skips_nothing_counts_nothing(tmp_path: Path) -> None:
    result = train(tmp_path, nonfinite="skip", epochs=1)
    assert (result.summary["skipped_steps"], result.summary["skipped_samples"]) == (0, 0)


def test_a_run_in_an_earlier_runs_directory_has_a_timeline_of_its_own(tmp_path: Path) -> None:
    # One rank's timeline went on from the earlier run's: its report and its
    # dashboard showed both runs' epochs, from two starts.
    train(tmp_path, epochs=2)
    train(tmp_path, epochs=1)
    records = read_timeline(tmp_path / "run")
    assert sum(isinstance(e, tl.RunStart) for e in records) == 1
    assert [e.epoch for e in records if isinstance(e, tl.EpochEnd)] == [0]
