"""Step and loader options on one rank: accumulate, precision, the DataLoader options.

In-process runs (``ranks=1``) on tiny data; the same ``Stepper`` and
``Loader`` serve every rank of a cluster (``tests/integration/test_byo_options.py``).
"""

from __future__ import annotations

import collections
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import elche
from elche.core.dispatch import epoch_permutation
from elche.core.progress import Progress
from elche.runtime.loading import Loader
from elche.runtime.options import TrainOptions
from elche.runtime.shards import epoch_order
from elche.runtime.stepping import Stepper, optimizer_for, schedule_factor
from tests.runtime import byo_fns as fx

N = 100


def _linear_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))


def test_accumulate_makes_the_step_of_one_big_batch() -> None:
    data = _linear_data()
    result = elche.train(
        fx.linear_model, fx.linear_optimizer, fx.mse_step, data, batch_size=8, accumulate=2,
        epochs=2, ranks=1, progress=False,
    )  # fmt: skip
    model = fx.linear_model("cpu")
    optimizer = fx.linear_optimizer(model.parameters())
    x, y = data.tensors
    for epoch in range(2):  # the plain loop: batches of 16 in elche's epoch order
        perm = epoch_order(data, seed=42, epoch=epoch)
        for start in range(0, N, 16):
            index = torch.tensor(perm[start : start + 16])
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[index]), y[index]).backward()
            optimizer.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(result.state_dict[name], value, rtol=1e-5, atol=1e-6)
    assert result.summary["per_rank"][0]["samples"] == 2 * N  # type: ignore[index]


@pytest.mark.parametrize(("precision", "autocast"), [("bf16", True), ("fp32", False)])
def test_precision_runs_the_forward_under_autocast(precision: str, autocast: bool) -> None:
    fx.AUTOCAST_SEEN.clear()
    result = elche.train(
        fx.linear_model, fx.linear_optimizer, fx.mse_step, _linear_data(), batch_size=16,
        epochs=1, ranks=1, progress=False, precision=precision,
    )  # fmt: skip
    assert fx.AUTOCAST_SEEN and set(fx.AUTOCAST_SEEN) == {autocast}
    assert all(v.dtype == torch.float32 for v in result.state_dict.values())
    assert isinstance(result.epochs[-1]["loss"], float)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("precision", "fp8"),
        ("precision", "fp16"),  # CPU devices
        ("accumulate", 0),
        ("accumulate", 1.5),
        ("num_workers", -1),
        ("drop_last", "yes"),
        ("pin_memory", 1),
        ("lr_schedule", 0.5),
        ("collate_fn", "pad"),
        ("batch_sampler", [1, 2]),
    ],
)
def test_a_bad_option_names_its_field(field: str, value: object) -> None:
    with pytest.raises(elche.ConfigError) as caught:
        elche.train(
            fx.linear_model, fx.linear_optimizer, fx.mse_step, _linear_data(), batch_size=8,
            epochs=1, ranks=1, progress=False, **{field: value},  # type: ignore[arg-type]
        )  # fmt: skip
    assert caught.value.field == field


def test_variable_length_items_train_through_a_padding_collate_with_workers(
    tmp_path: Path,
) -> None:
    data = fx.Sequences(60)
    result = elche.train(
        fx.seq_model, fx.seq_optimizer, functools.partial(fx.seq_step, str(tmp_path)), data,
        batch_size=8, epochs=2, ranks=1, progress=False, collate_fn=fx.pad_collate,
        num_workers=2, accumulate=2, batch_sampler=fx.by_parity,
    )  # fmt: skip
    assert result.summary["outcome"] == "completed"
    calls = fx.trained(tmp_path)
    real = calls[-(2 * 4 * 2) :]  # 2 epochs x 4 steps (16, 16, 16, 12) x 2 micro-batches
    assert collections.Counter(i for _, ids in real for i in ids) == {i: 2 for i in range(60)}
    assert all(len({i % 2 for i in ids}) == 1 for _, ids in real)  # by_parity's micro-batches


def _loader(workers: int, **kw: object) -> Loader:
    options = TrainOptions(collate_fn=fx.pad_collate, num_workers=workers, **kw)  # type: ignore[arg-type]
    return Loader(
        fx.Sequences(40), options, micro_size=4, step_size=8,
        perm=lambda e: epoch_permutation(40, seed=1, epoch=e), device=torch.device("cpu"),
    )  # fmt: skip


def test_the_prefetching_stream_gives_the_batches_of_a_direct_fetch() -> None:
    streamed, direct = _loader(2), _loader(0)
    plan = [(0, 0, 8), (0, 8, 8), (0, 16, 4), (1, 0, 8)]
    try:
        for i, (epoch, offset, size) in enumerate(plan):
            if i == 2:  # a step the stream did not plan: it restarts from there
                got = streamed.step(1, 8, 8, lambda: [(1, 8, 8)])
                want = direct.step(1, 8, 8, list)
            else:
                got = streamed.step(epoch, offset, size, functools.partial(list, plan[i:]))
                want = direct.step(epoch, offset, size, list)
            assert [mb.size for mb in got] == [mb.size for mb in want]
            for a, b in zip(got, want, strict=True):
                assert a.batch.keys() == b.batch.keys()
                for key in a.batch:
                    assert torch.equal(a.batch[key], b.batch[key])
    finally:
        streamed.close()


def test_drop_last_leaves_a_short_step_out_and_counts_it() -> None:
    loader = _loader(0, drop_last=True)
    assert loader.step(0, 32, 6, list) == []
    assert loader.num_dropped == 6
    assert [mb.size for mb in loader.step(0, 0, 8, list)] == [4, 4]


def test_a_batch_sampler_that_loses_an_index_is_refused() -> None:
    loader = _loader(0, batch_sampler=lambda ids: [ids[:-1]])
    with pytest.raises(ValueError, match="exactly once"):
        loader.step(0, 0, 8, list)


def test_a_schedule_that_cannot_reach_the_ranks_is_refused_before_they_start() -> None:
    with pytest.raises(elche.ConfigError) as caught:
        elche.train(
            fx.linear_model, fx.linear_optimizer, fx.mse_step, _linear_data(), batch_size=8,
            epochs=1, ranks=2, progress=False, lr_schedule=lambda p: 1.0 - p.fraction,
        )  # fmt: skip
    assert caught.value.field == "lr_schedule"


START = Progress(samples=0, step=0, fraction=0.0, planned_samples=N, exact_samples=0)


def _scheduled(factor: object) -> Stepper:
    model = fx.linear_model("cpu")
    return Stepper(
        model, fx.linear_optimizer(model.parameters()), fx.mse_step, device=torch.device("cpu"),
        max_grad_norm=None, options=TrainOptions(lr_schedule=lambda p: factor),  # type: ignore[arg-type, return-value]
        progress=lambda: START,
    )  # fmt: skip


@pytest.mark.parametrize(
    "factor", [-1.0, float("nan"), float("inf"), None, "0.5", torch.tensor([0.5, 1.0])], ids=repr
)
def test_a_schedule_factor_that_is_no_finite_number_at_least_0_is_refused_naming_it(
    factor: object,
) -> None:
    # -1 turned every step around (the model ascended); NaN was blamed on the loss.
    stepper = _scheduled(factor)
    with pytest.raises(ValueError, match=r"^lr_schedule returned .*finite number >= 0") as caught:
        stepper.apply_schedule()
    assert repr(factor) in str(caught.value)
    assert [g["lr"] for g in stepper.optimizer.param_groups] == [0.05]  # left as it was


@pytest.mark.parametrize(
    ("factor", "lr"), [(0, 0.0), (0.5, 0.025), (torch.tensor(2.0), 0.1)], ids=repr
)
def test_a_schedule_factor_scales_the_base_lr(factor: object, lr: float) -> None:
    stepper = _scheduled(factor)
    stepper.apply_schedule()
    assert stepper.optimizer.param_groups[0]["lr"] == pytest.approx(lr)
    assert schedule_factor(factor) == pytest.approx(lr / 0.05)


@pytest.mark.slow
def test_a_negative_schedule_fails_the_run_naming_lr_schedule_and_its_value() -> None:
    with pytest.raises(elche.TrainingError) as caught:
        elche.train(
            fx.linear_model, fx.linear_optimizer, fx.mse_step, _linear_data(), batch_size=8,
            epochs=1, ranks=1, progress=False, lr_schedule=lambda p: -1.0,
        )  # fmt: skip
    assert caught.value.error_type == "ValueError"
    assert caught.value.message.startswith("lr_schedule returned -1.0; it must return a finite")


def _train_linear(**fns: object) -> elche.TrainResult:
    args: dict[str, object] = {
        "model_fn": fx.linear_model, "optimizer_fn": fx.linear_optimizer, "step_fn": fx.mse_step,
    }  # fmt: skip
    args.update(fns)
    return elche.train(  # type: ignore[arg-type]
        dataset=_linear_data(), batch_size=8, epochs=1, ranks=1, progress=False, **args
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("returned", "named"),
    [(lambda loss: loss.item(), "a float ("), (lambda loss: (loss, {}), "a tuple ("),
     (lambda loss: None, "None;")],
    ids=["item", "tuple", "none"],
)  # fmt: skip
def test_a_step_fn_that_returns_no_tensor_is_named(returned: Any, named: str) -> None:
    # It failed as "AttributeError: 'float' object has no attribute 'backward'" with a
    # traceback of no frames (elche's, left out of the report): nothing named step_fn.
    with pytest.raises(elche.TrainingError) as caught:
        _train_linear(step_fn=lambda model, batch: returned(fx.mse_step(model, batch)))
    assert caught.value.error_type == "TypeError"
    assert caught.value.message.startswith(f"step_fn returned {named}")
    assert "the loss as a tensor" in caught.value.message


@pytest.mark.slow
def test_an_optimizer_over_another_models_parameters_is_refused() -> None:
    # It trained nothing and the run completed: the model came back as it was built.
    other = fx.linear_model("cpu")
    with pytest.raises(elche.TrainingError) as caught:
        _train_linear(optimizer_fn=lambda params: fx.linear_optimizer(other.parameters()))
    assert caught.value.error_type == "ValueError"
    assert "none of them the model's parameters" in caught.value.message
    with pytest.raises(elche.TrainingError) as caught:
        _train_linear(optimizer_fn=lambda params: None)
    assert caught.value.error_type == "TypeError"
    assert caught.value.message.startswith("optimizer_fn returned None, not a torch.optim")
    # Its sibling: a model_fn that returns no model failed in elche's own code with
    # "AttributeError: 'tuple' object has no attribute 'parameters'".
    with pytest.raises(elche.TrainingError) as caught:
        _train_linear(model_fn=lambda device: (fx.linear_model(device),))
    assert caught.value.error_type == "TypeError"
    assert caught.value.message.startswith("model_fn returned (Linear(")
    assert caught.value.message.endswith(", not a torch.nn.Module (model_fn(device) -> the "
                                         "model, on that device)")  # fmt: skip


class _Wrapped:
    """An optimizer of a library's own class, with ``torch.optim.Optimizer``'s interface."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self.param_groups = inner.param_groups

    def step(self, closure: Any = None) -> None:
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def test_an_optimizer_with_the_optimizer_interface_is_taken() -> None:
    model = fx.linear_model("cpu")
    wrapped = _Wrapped(torch.optim.SGD(model.parameters(), lr=0.1))
    assert optimizer_for(lambda params: wrapped, model) is wrapped


@pytest.mark.slow
def test_an_optimizer_over_some_of_the_models_parameters_trains_them() -> None:
    def bias_only(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in params if p.ndim == 1], lr=0.05)

    built = fx.linear_model("cpu").state_dict()
    state = _train_linear(optimizer_fn=bias_only).state_dict
    assert torch.equal(state["weight"], built["weight"])
    assert not torch.equal(state["bias"], built["bias"])
