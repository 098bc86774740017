"""``elche.Session`` in-process (one rank, no launcher): the script's loop drives elche.train."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elche
from elche import ConfigError, TrainingError

NUM_SAMPLES = 48
BATCH = 8


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 4, generator=g)
    return TensorDataset(torch.arange(NUM_SAMPLES), x, (x.sum(1) > 0).long())


def make_model(device: Any = "cpu") -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(4, 2).to(device)


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def step_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    _, x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def run_session(**options: Any) -> tuple[elche.Session, list[Any], nn.Module]:
    """A Session over ``data()``; what the loop saw (ids, progress, loss dtype) per batch."""
    model = make_model()
    seen: list[Any] = []
    with elche.Session(
        model, make_optimizer(model.parameters()), data(), batch_size=BATCH, epochs=2,
        progress=False, **options,
    ) as session:  # fmt: skip
        for batch in session:
            loss = step_fn(model, batch)
            seen.append((batch[0].tolist(), elche.progress().fraction, model(batch[1]).dtype))
            session.step(loss)
    return session, seen, model


def test_a_session_trains_what_elche_train_trains_and_holds_its_result() -> None:
    session, seen, model = run_session(accumulate=2)
    plain = elche.train(
        make_model, make_optimizer, step_fn, data(), batch_size=BATCH, epochs=2,
        progress=False, accumulate=2,
    )  # fmt: skip
    result = session.result
    assert result.summary["outcome"] == "completed"
    assert sum(r["samples"] for r in result.summary["per_rank"]) == 2 * NUM_SAMPLES  # type: ignore[attr-defined]  # JSON value
    # One implementation: the same order, accumulation and steps give the same weights.
    for name, value in plain.state_dict.items():
        torch.testing.assert_close(result.state_dict[name], value)
        torch.testing.assert_close(model.state_dict()[name], value)  # the loop's own model
    # Past the warm-up batches, each epoch's micro-batches cover the dataset once.
    trained = [ids for ids, _, _ in seen[-2 * NUM_SAMPLES // BATCH :]]
    for epoch in (trained[: NUM_SAMPLES // BATCH], trained[NUM_SAMPLES // BATCH :]):
        assert sorted(i for ids in epoch for i in ids) == list(range(NUM_SAMPLES))
    fractions = [f for _, f, _ in seen]
    assert fractions == sorted(fractions)  # elche.progress() in the loop: the run's progress
    assert fractions[-1] == pytest.approx(5 / 6)  # the last of 6 optimizer steps starts


def test_bf16_autocasts_the_loops_forward() -> None:
    _, seen, _ = run_session(precision="bf16")
    assert {dtype for _, _, dtype in seen} == {torch.bfloat16}


def fail_at(n: int, error: BaseException | None) -> elche.Session:
    """A loop that raises ``error`` (None: breaks) at its ``n``-th batch."""
    model = make_model()
    session = elche.Session(
        model, make_optimizer(model.parameters()), data(), batch_size=BATCH, epochs=2,
        progress=False,
    )  # fmt: skip
    with session:
        for i, batch in enumerate(session):
            if i == n:
                if error is None:
                    break
                raise error
            session.step(step_fn(model, batch))
    return session


def test_an_error_in_the_loop_ends_the_run_with_a_training_error_naming_the_rank() -> None:
    with pytest.raises(TrainingError) as caught:
        fail_at(5, ValueError("bad batch"))
    assert caught.value.rank == 0 and caught.value.error_type == "ValueError"
    assert "bad batch" in str(caught.value)
    assert isinstance(caught.value.__cause__, ValueError)


def test_leaving_the_loop_early_ends_the_run_as_a_failure() -> None:
    with pytest.raises(TrainingError, match="left the session"):
        fail_at(3, None)


def test_a_loss_given_as_a_number_is_named_as_session_steps() -> None:
    # It failed as "'float' object has no attribute 'backward'", naming nothing.
    model = make_model()
    session = elche.Session(
        model, make_optimizer(model.parameters()), data(), batch_size=BATCH, epochs=1,
        progress=False,
    )  # fmt: skip
    with pytest.raises(TrainingError) as caught, session:
        for batch in session:
            session.step(step_fn(model, batch).item())
    assert caught.value.error_type == "TypeError"
    assert caught.value.message.startswith("session.step was given a float (")


def test_bad_keywords_and_several_ranks_without_a_launcher_are_config_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    model = make_model()
    opt = make_optimizer(model.parameters())
    with pytest.raises(ConfigError, match="step_fn"):
        elche.Session(model, opt, data(), batch_size=BATCH, epochs=1, step_fn=step_fn)
    with pytest.raises(ConfigError, match=r"speeds.*elche run --nproc N"):
        elche.Session(model, opt, data(), batch_size=BATCH, epochs=1, speeds=[1.0, 0.5])
    session = elche.Session(model, opt, data(), batch_size=BATCH, epochs=1)
    with pytest.raises(RuntimeError, match="inside `with"):
        iter(session)
    with pytest.raises(RuntimeError, match="once the run completed"):
        _ = session.result
