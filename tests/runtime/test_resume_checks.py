"""A bundle's optimizer state is checked against ``optimizer_fn`` before a resume starts.

A bundle saved with SGD resumed with Adam used to fail in every rank's first
step, inside torch (``KeyError: 'betas'``); it is refused up front, as a model
of other keys or shapes is (``elche.runtime.resume``). A batch size mismatch
under ``accumulate`` names both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elche
from elche.core.errors import ConfigError
from elche.runtime.resume import _check_optimizer, _kept
from tests.promises.tiny import make_model, make_optimizer, step


def adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)  # type: ignore[arg-type]


def momentum_sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)  # type: ignore[arg-type]


def two_groups(params: Any) -> torch.optim.Optimizer:
    weight, bias = list(params)  # the tiny model's two
    groups: list[dict[str, Any]] = [{"params": [weight]}, {"params": [bias], "lr": 0.01}]
    return torch.optim.SGD(groups, lr=0.1)


def saved_by(optimizer_fn: object, path: Path) -> Path:
    """The state of ``optimizer_fn``'s optimizer after one step, saved at ``path``."""
    model = make_model(torch.device("cpu"))
    optimizer = optimizer_fn(model.parameters())  # type: ignore[operator]
    optimizer.param_groups[0].setdefault("initial_lr", 0.1)  # as the rank's Stepper adds it
    nn.functional.cross_entropy(model(torch.randn(3, 4)), torch.tensor([0, 1, 0])).backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), path)
    return path


def misfit(saved_with: object, resumed_with: object, tmp_path: Path) -> ConfigError:
    path = saved_by(saved_with, tmp_path / "optim.pt")
    with pytest.raises(ConfigError) as info:
        _check_optimizer(path, make_model(torch.device("cpu")), resumed_with)  # type: ignore[arg-type]
    assert info.value.field == "resume_from"
    return info.value


def test_an_sgd_state_does_not_resume_adam_naming_the_keys_it_lacks(tmp_path: Path) -> None:
    text = str(misfit(make_optimizer, adam, tmp_path))
    assert "does not fit the Adam optimizer_fn makes" in text
    assert "param group 0 has no betas, eps (it has dampening, momentum, nesterov instead)" in text


def test_an_adam_state_does_not_resume_sgd(tmp_path: Path) -> None:
    text = str(misfit(adam, momentum_sgd, tmp_path))
    assert "the SGD optimizer_fn makes: its param group 0 has no dampening, momentum" in text


def test_other_param_groups_are_refused_in_torchs_words(tmp_path: Path) -> None:
    assert "parameter groups" in str(misfit(make_optimizer, two_groups, tmp_path))


def test_the_same_optimizer_with_other_hyperparameters_resumes_saying_which_it_keeps(
    tmp_path: Path,
) -> None:
    # The saved values win (torch's load_state_dict restores each group's): a resume
    # with another lr trained on at the old one, and nothing said so.
    path = saved_by(make_optimizer, tmp_path / "optim.pt")
    kept = _check_optimizer(path, make_model(torch.device("cpu")), momentum_sgd)
    assert kept == ["lr=0.1 (optimizer_fn makes 0.5)", "momentum=0 (optimizer_fn makes 0.9)"]
    assert _check_optimizer(path, make_model(torch.device("cpu")), make_optimizer) == []


def test_a_key_a_newer_torch_added_is_filled_in_not_refused(tmp_path: Path) -> None:
    path = saved_by(adam, tmp_path / "optim.pt")
    state = torch.load(path, weights_only=True)
    for group in state["param_groups"]:
        del group["foreach"], group["differentiable"]  # Adam's __setstate__ defaults them
    torch.save(state, path)
    _check_optimizer(path, make_model(torch.device("cpu")), adam)


def test_an_optimizer_handed_out_again_keeps_its_own_state(tmp_path: Path) -> None:
    # elche.Session's optimizer_fn returns the script's own optimizer each time.
    path = saved_by(momentum_sgd, tmp_path / "optim.pt")
    model = make_model(torch.device("cpu"))
    mine = adam(model.parameters())
    nn.functional.cross_entropy(model(torch.randn(3, 4)), torch.tensor([0, 1, 0])).backward()
    mine.step()
    weight = next(model.parameters())
    before = {k: v.clone() for k, v in mine.state[weight].items()}
    with pytest.raises(ConfigError):
        _check_optimizer(path, model, lambda params: mine)
    assert mine.param_groups[0]["betas"] == (0.9, 0.999)
    assert mine.state[weight].keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(mine.state[weight][key], value)


DATA = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The bundle of a one-rank run with SGD, batch_size 16, after its two epochs."""
    stem = str(tmp_path_factory.mktemp("bundle") / "run")
    result = elche.train(
        make_model, make_optimizer, step, DATA, batch_size=16, epochs=2, ranks=1, progress=False,
        save_path=stem, checkpoint_every=1,
    )  # fmt: skip
    assert result.summary["outcome"] == "completed"
    return stem


def resume_args(stem: str) -> dict[str, object]:
    """``elche.train``'s arguments for a resume of ``stem`` (each test changes one)."""
    return {
        "model_fn": make_model, "optimizer_fn": make_optimizer, "step_fn": step, "dataset": DATA,
        "batch_size": 16, "epochs": 3, "ranks": 1, "progress": False, "resume_from": stem,
    }  # fmt: skip


def resume(stem: str, **kw: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        elche.train(**(resume_args(stem) | kw))
    return info.value


def resumed(stem: str, run_dir: Path, **kw: object) -> dict[str, object]:
    """The summary of a resume of ``stem`` that completed."""
    result = elche.train(**(resume_args(stem) | {"run_dir": str(run_dir)} | kw))
    assert result.summary["outcome"] == "completed"
    return result.summary


@pytest.mark.slow
def test_resuming_with_another_optimizer_is_refused_before_training(bundle: str) -> None:
    error = resume(bundle, optimizer_fn=adam)
    assert error.field == "resume_from"
    assert "does not fit the Adam optimizer_fn makes" in str(error)


@pytest.mark.slow
def test_resuming_with_accumulate_names_it_beside_batch_size(bundle: str) -> None:
    error = resume(bundle, accumulate=2)
    assert str(error) == (
        "batch_size: the checkpoint was saved with batch_size × accumulate = 16 samples per "
        "optimizer step, this run has batch_size=16 × accumulate=2 = 32"
    )


@pytest.mark.slow
def test_resuming_with_another_lr_says_the_bundles_is_kept(
    bundle: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    resumed(bundle, tmp_path / "run", optimizer_fn=momentum_sgd)
    assert (
        "elche: resuming: the bundle's optimizer state keeps its own lr=0.1 (optimizer_fn "
        "makes 0.5); momentum=0 (optimizer_fn makes 0.9): loading it restores them"
    ) in capfd.readouterr().err


def test_hyperparameters_kept_as_tensors_of_several_elements_are_passed_by() -> None:
    # Comparing them made a tensor whose truth is ambiguous: the resume raised.
    made = [{"params": [0], "lr": 0.5, "weights": torch.tensor([1.0, 2.0])}]
    saved = [{"params": [0], "lr": 0.1, "weights": torch.tensor([1.0, 3.0])}]
    assert _kept(made, saved) == ["lr=0.1 (optimizer_fn makes 0.5)"]


@pytest.mark.slow
def test_resuming_a_bundle_past_the_runs_epochs_says_nothing_is_left_to_train(
    bundle: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # Allowed (docs/failure-modes.md), and the run completed at once with nothing
    # trained, unsaid: a resume with the finished run's own epochs looked like a run.
    summary = resumed(bundle, tmp_path / "run", epochs=2)
    assert summary["epochs_completed"] == 2
    assert (
        "elche: resuming: the bundle has 2 epoch(s) trained and this run has epochs=2: "
        "nothing is left to train, so the run completes at once (epochs=3 or more trains on)"
    ) in capfd.readouterr().err
