"""The user's eval and checkpoint run on a rank: a failure, or an eval that returns no
number, is an answer naming it, never an exception (``elche.runtime.user_callbacks``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from elche.runtime.user_callbacks import checkpoint, evaluate, metric_of


@pytest.mark.parametrize(
    ("value", "metric"),
    [(0.5, 0.5), (1, 1.0), (torch.tensor(0.25), 0.25), (torch.tensor([0.25]), 0.25)],
)
def test_a_number_or_a_one_element_tensor_is_a_metric(value: object, metric: float) -> None:
    assert metric_of(value) == metric


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"acc": 0.5}, "eval_fn returned a dict ({'acc': 0.5}), not a number"),
        (None, "eval_fn returned None, not a number"),
        ("0.5", "eval_fn returned a str ('0.5'), not a number"),  # float() would take it
        (torch.tensor([0.5, 0.4]), "eval_fn returned a Tensor ("),
        ([0.5], "eval_fn returned a list ([0.5]), not a number"),
    ],
)
def test_anything_else_is_named_as_no_number(value: object, named: str) -> None:
    with pytest.raises(TypeError) as info:
        metric_of(value)
    assert str(info.value).startswith(named)


def test_an_eval_that_raises_is_its_error_and_the_model_trains_again() -> None:
    model = nn.Linear(2, 1)

    def eval_fn(model: nn.Module, dataset: object) -> float:
        assert not model.training and not torch.is_grad_enabled()
        raise RuntimeError("the eval set is gone")

    metric, error = evaluate(eval_fn, None, model)
    assert math.isnan(metric)
    assert error == "RuntimeError: the eval set is gone"
    assert model.training


def test_an_eval_that_returns_no_number_is_its_error() -> None:
    metric, error = evaluate(lambda model, dataset: {"acc": dataset}, 0.5, nn.Linear(2, 1))
    assert math.isnan(metric)
    assert error == "TypeError: eval_fn returned a dict ({'acc': 0.5}), not a number"


def test_an_eval_returns_its_metric() -> None:
    assert evaluate(lambda model, dataset: dataset, 0.75, nn.Linear(2, 1)) == (0.75, None)


def test_a_checkpoint_that_raises_is_its_error() -> None:
    def checkpoint_fn(version: int, model: nn.Module) -> None:
        raise OSError(f"bucket unreachable for v{version}")

    assert checkpoint(checkpoint_fn, 3, nn.Linear(2, 1)) == "OSError: bucket unreachable for v3"
    assert checkpoint(lambda version, model: None, 3, nn.Linear(2, 1)) is None
    assert checkpoint(None, 3, nn.Linear(2, 1)) is None
