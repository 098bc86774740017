"""Speed injection: the wait rule, its validation, and the solo-step probe.

No real sleeps: ``Pacer`` takes a recording fake for ``sleep``, and the
minimum rule of ``measure_base_step_s`` runs against a scripted clock. The
probe's promise — the real model, its optimizer state and the global RNG come
out bitwise unchanged — is checked on a real model with Adam state.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence

import pytest
import torch
from torch import Tensor, nn

from elche.core.errors import ConfigError
from elche.runtime.pacing import (
    Pacer,
    check_speed,
    check_speed_base_s,
    measure_base_step_s,
    pacer_for,
    warm_up,
)


class RecordingSleep:
    """A fake ``time.sleep`` that only writes down what it was asked."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


class ScriptedClock:
    """A fake ``perf_counter`` whose successive steps last the given seconds."""

    def __init__(self, durations_s: Sequence[float]) -> None:
        self._readings = iter(self._cumulate(durations_s))

    @staticmethod
    def _cumulate(durations_s: Sequence[float]) -> Iterator[float]:
        now_s = 100.0
        for duration_s in durations_s:
            yield now_s  # step starts
            now_s += duration_s
            yield now_s  # step ends

    def __call__(self) -> float:
        return next(self._readings)


def tiny_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def mse_step(model: nn.Module, batch: Sequence[Tensor]) -> Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


BATCH = (torch.randn(5, 4, generator=torch.Generator().manual_seed(2)), torch.zeros(5, 3))


# --- Pacer ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("speed", "wait_s"),
    [(1.0, 0.0), (0.5, 0.010), (0.25, 0.030), (0.1, 0.090), (1, 0.0)],
)
def test_wait_is_base_times_inverse_speed_minus_one(speed: float, wait_s: float) -> None:
    pacer = Pacer(speed, 0.010, sleep=RecordingSleep())
    assert pacer.wait_s == pytest.approx(wait_s)
    assert isinstance(pacer.speed, float)


def test_after_step_sleeps_the_wait_and_accumulates_it() -> None:
    sleep = RecordingSleep()
    pacer = Pacer(0.25, 0.002, sleep=sleep)
    returned = [pacer.after_step() for _ in range(4)]
    assert sleep.calls == pytest.approx([0.006] * 4)
    assert returned == pytest.approx([0.006] * 4)
    assert pacer.injected_s == pytest.approx(0.024)


def test_full_speed_never_calls_sleep() -> None:
    sleep = RecordingSleep()
    pacer = Pacer(1.0, 0.5, sleep=sleep)
    assert [pacer.after_step() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert sleep.calls == []
    assert pacer.injected_s == 0.0


def test_zero_base_means_no_wait_at_any_speed() -> None:
    sleep = RecordingSleep()
    pacer = Pacer(0.1, 0.0, sleep=sleep)
    pacer.after_step()
    assert sleep.calls == []


@pytest.mark.parametrize("speed", [0, 0.0, -0.5, 1.0001, 2, math.nan, math.inf, True, "0.5", None])
def test_speed_outside_zero_one_is_a_config_error(speed: object) -> None:
    with pytest.raises(ConfigError) as info:
        Pacer(speed, 0.01)  # type: ignore[arg-type]  # deliberately wrong types
    assert info.value.field == "speeds"
    with pytest.raises(ConfigError):
        check_speed(speed)  # type: ignore[arg-type]  # deliberately wrong types


@pytest.mark.parametrize("base_s", [-0.001, math.nan, math.inf, False, "1"])
def test_bad_base_is_a_config_error(base_s: object) -> None:
    with pytest.raises(ConfigError) as info:
        Pacer(0.5, base_s)  # type: ignore[arg-type]  # deliberately wrong types
    assert info.value.field == "base_s"


def test_check_speed_returns_a_float() -> None:
    assert check_speed(1) == 1.0
    assert isinstance(check_speed(1), float)


# --- measure_base_step_s -------------------------------------------------------------


def test_fastest_of_the_timed_repeats_after_warmup() -> None:
    # warmup 2 (0.5 s, 0.5 s: ignored), then repeats 4, 5, 3, 100, 6: the fastest is 3.
    clock = ScriptedClock([0.5, 0.5, 4.0, 5.0, 3.0, 100.0, 6.0])
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    got = measure_base_step_s(model, optimizer, mse_step, BATCH, clock=clock)
    assert got == pytest.approx(3.0)


def test_real_clock_gives_a_small_positive_time() -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    got = measure_base_step_s(model, optimizer, mse_step, BATCH, warmup=0, repeats=1)
    assert 0.0 < got < 5.0


def test_steps_run_on_copies_that_do_train() -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[nn.Module] = []
    losses: list[float] = []

    def spy_step(m: nn.Module, batch: Sequence[Tensor]) -> Tensor:
        seen.append(m)
        loss = mse_step(m, batch)
        losses.append(loss.item())
        return loss

    measure_base_step_s(model, optimizer, spy_step, BATCH, warmup=1, repeats=3)
    assert len(seen) == 4
    assert all(m is seen[0] and m is not model for m in seen)  # one copy, reused
    assert losses[-1] < losses[0]  # the copied optimizer drives the copied parameters


def test_the_real_model_optimizer_and_rng_are_bitwise_unchanged() -> None:
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    optimizer.zero_grad()
    mse_step(model, BATCH).backward()  # type: ignore[no-untyped-call]  # torch stub
    optimizer.step()  # Adam now holds step, exp_avg and exp_avg_sq
    params_before = copy.deepcopy(model.state_dict())
    grads_before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    optim_before = copy.deepcopy(optimizer.state_dict())
    rng_before = torch.get_rng_state()

    measure_base_step_s(model, optimizer, mse_step, BATCH)

    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, params_before[name]), name
    grads_after = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads_after) == len(grads_before)
    assert all(torch.equal(a, b) for a, b in zip(grads_after, grads_before, strict=True))
    optim_after = optimizer.state_dict()
    assert optim_after["param_groups"] == optim_before["param_groups"]
    for index, state in optim_before["state"].items():
        for key, value in state.items():
            assert torch.equal(optim_after["state"][index][key], value), (index, key)
    assert torch.equal(torch.get_rng_state(), rng_before)


@pytest.mark.parametrize(("warmup", "repeats"), [(-1, 5), (0, 0)])
def test_bad_counts_are_refused_before_anything_runs(warmup: int, repeats: int) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="warmup"):
        measure_base_step_s(model, optimizer, mse_step, BATCH, warmup=warmup, repeats=repeats)


# --- warm_up -------------------------------------------------------------------------


class WithStats(nn.Module):
    """A model with a buffer that every training-mode forward moves."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.norm(self.linear(x)))  # type: ignore[no-any-return]


def test_warm_up_runs_the_steps_and_leaves_no_trace() -> None:
    model = WithStats()
    grad_step = [p.grad for p in model.parameters()]
    mse_step(model, BATCH).backward()  # type: ignore[no-untyped-call]  # torch stub
    grads_before = [p.grad for p in model.parameters()]
    grad_values = [g.clone() for g in grads_before if g is not None]
    state_before = copy.deepcopy(model.state_dict())
    rng_before = torch.get_rng_state()
    calls: list[int] = []

    def counting_step(m: nn.Module, batch: Sequence[Tensor]) -> Tensor:
        calls.append(1)
        return mse_step(m, batch)

    warm_up(model, counting_step, BATCH, steps=3)

    assert len(calls) == 3
    assert grad_step != grads_before  # the setup did make gradients to keep
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state_before[name]), name  # weights and BN statistics
    grads_after = [p.grad for p in model.parameters()]
    assert all(a is b for a, b in zip(grads_after, grads_before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads_after, grad_values, strict=True))
    assert torch.equal(torch.get_rng_state(), rng_before)


# --- check_speed_base_s ----------------------------------------------------------------


@pytest.mark.parametrize("base_s", [0, 0.0, -1.0, math.nan, math.inf, True, "0.01"])
def test_a_given_base_must_be_a_positive_finite_number(base_s: object) -> None:
    with pytest.raises(ConfigError) as info:
        check_speed_base_s(base_s)  # type: ignore[arg-type]  # deliberately wrong values
    assert info.value.field == "speed_base_s"


def test_a_given_base_passes_as_a_float_and_none_passes() -> None:
    assert check_speed_base_s(None) is None
    assert check_speed_base_s(1) == 1.0 and isinstance(check_speed_base_s(1), float)


# --- pacer_for ---------------------------------------------------------------------------


def test_a_full_speed_rank_only_warms_up() -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    assert pacer_for(model, optimizer, mse_step, BATCH, speed=1.0, base_s=0.01) is None
    assert all(torch.equal(t, before[k]) for k, t in model.state_dict().items())


def test_a_paced_rank_paces_by_the_given_base_without_timing() -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pacer = pacer_for(model, optimizer, mse_step, BATCH, speed=0.25, base_s=0.004)
    assert pacer is not None
    assert (pacer.base_s, pacer.wait_s) == (0.004, pytest.approx(0.012))


def test_a_paced_rank_without_a_base_measures_its_own() -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pacer = pacer_for(model, optimizer, mse_step, BATCH, speed=0.5)
    assert pacer is not None and 0.0 < pacer.base_s < 5.0


# --- a SlowDown fault: set_speed and slows_later -----------------------------------------


def test_set_speed_paces_later_steps_at_the_new_speed() -> None:
    sleep = RecordingSleep()
    pacer = Pacer(1.0, 0.01, sleep=sleep)
    assert pacer.after_step() == 0.0
    pacer.set_speed(0.5)
    assert pacer.after_step() == pytest.approx(0.01)
    assert sleep.calls == [pytest.approx(0.01)]
    assert (pacer.speed, pacer.injected_s) == (0.5, pytest.approx(0.01))


def test_set_speed_refuses_a_bad_speed_and_keeps_the_old_one() -> None:
    pacer = Pacer(0.5, 0.01, sleep=RecordingSleep())
    with pytest.raises(ConfigError) as info:
        pacer.set_speed(0.0)
    assert info.value.field == "speeds"
    assert (pacer.speed, pacer.wait_s) == (0.5, pytest.approx(0.01))


def test_a_full_speed_rank_that_slows_later_gets_a_pacer_that_waits_nothing() -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    given = pacer_for(model, optimizer, mse_step, BATCH, speed=1.0, base_s=0.01, slows_later=True)
    assert given is not None and (given.base_s, given.wait_s) == (0.01, 0.0)
    measured = pacer_for(model, optimizer, mse_step, BATCH, speed=1.0, slows_later=True)
    assert measured is not None and measured.wait_s == 0.0 and 0.0 < measured.base_s < 5.0
