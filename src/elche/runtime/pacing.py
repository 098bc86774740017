"""Speed injection: make one rank run at a fraction of its real speed.

Tests and benchmarks need unequal workers on a machine whose cores are all
alike, so a rank told to run at ``speed`` s ∈ (0, 1] is slowed down on
purpose (design §4). Every system under test — elche's own worker and every
baseline (torch DDP) — uses exactly this module, so a comparison can never be
won by pacing one side differently.

Theory of operation
-------------------
1. Before training, ``measure_base_step_s`` times the rank's *solo* step —
   forward, backward and optimizer step, no communication — on deep copies
   of the model and optimizer, and keeps the fastest (``base``): another
   process can only ever add time to a step, so the minimum is the solo cost.
2. After every optimizer step, ``Pacer.after_step`` waits
   ``base × (1/s − 1)``, so one step costs about ``base / s``: a rank at
   s = 0.25 is four times slower than it could be.
3. A ``SlowDown`` fault (``elche.core.faults``) changes ``s`` mid-run
   (``Pacer.set_speed``). A full-speed rank has no pacer, unless such a
   fault is planned for it: then it measures ``base`` too and paces at
   s = 1 (no wait) until the fault fires.

Rules
-----
- ``base`` is measured **once**. The wait is never derived from a step time
  that includes collective or coordinator waits: a slow peer would lengthen
  this rank's step, which would lengthen its wait, which slows the peer's
  collectives — a feedback loop that explodes.
- The measurement trains copies only: the real model and optimizer come out
  bitwise unchanged, so no sample is trained outside the epoch plan.
- The sleep is injectable, so unit tests never sleep for real (trio's
  testing rules).

Every rank also runs ``warm_up`` before its first timed step, paced or not:
a framework's first iterations pay one-off costs (kernel selection, the
allocator growing, lazy state), and the balancer's first reading must be the
rank's speed, not those costs.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from elche.core.errors import ConfigError

__all__ = [
    "Pacer",
    "check_speed",
    "check_speed_base_s",
    "measure_base_step_s",
    "pacer_for",
    "warm_up",
]

BatchT = TypeVar("BatchT")


def measure_base_step_s(
    model: nn.Module,
    optimizer: Optimizer,
    step_fn: Callable[[nn.Module, BatchT], Tensor],
    batch: BatchT,
    *,
    warmup: int = 2,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Time one solo training step (forward + backward + optimizer step).

    The step runs on deep copies of ``model`` and ``optimizer`` (copied
    together, so the copied optimizer drives the copied parameters), inside a
    forked RNG state: the real model, its optimizer state and the global RNG
    streams are left exactly as they were. The copies cost one extra model
    and optimizer state in memory for the duration of the call.

    Args:
        model: the rank's model, not wrapped in DDP (no communication).
        optimizer: the optimizer over ``model``'s parameters.
        step_fn: ``step_fn(model, batch)`` returns the loss to backpropagate.
        batch: one batch, e.g. the rank's first.
        warmup: untimed steps first (allocator, lazy state, caches).
        repeats: timed steps; the fastest is returned.
        clock: monotonic seconds, ``time.perf_counter`` by default; tests
            pass a scripted fake.

    Returns:
        The fastest wall time of one step, in seconds (CUDA is synchronized
        before each clock reading).

    Raises:
        ValueError: ``warmup`` < 0 or ``repeats`` < 1. Nothing was run.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    devices = _cuda_devices(model)
    # One deepcopy call shares the memo: the optimizer's param_groups and state
    # keys map to the copied model's parameters, not to fresh orphans.
    model_copy, optimizer_copy = copy.deepcopy((model, optimizer))
    timings_s: list[float] = []
    with torch.random.fork_rng(devices=devices):
        for i in range(warmup + repeats):
            _synchronize(devices)
            start_s = clock()
            optimizer_copy.zero_grad(set_to_none=True)
            step_fn(model_copy, batch).backward()  # type: ignore[no-untyped-call]  # torch stub
            optimizer_copy.step()
            _synchronize(devices)
            elapsed_s = clock() - start_s
            if i >= warmup:
                timings_s.append(elapsed_s)
    return min(timings_s)


def warm_up(
    model: nn.Module,
    step_fn: Callable[[nn.Module, BatchT], Tensor],
    batch: BatchT,
    *,
    steps: int = 2,
) -> None:
    """Run ``steps`` forward and backward passes that leave no trace.

    Unlike ``measure_base_step_s`` this needs no copy of the model (a rank
    may hold a model that fits its device only once): there is no optimizer
    step, the buffers (e.g. batch-norm statistics) are put back, the
    gradients are those from before, and the RNG streams are forked.

    Args:
        model: the rank's model.
        step_fn: ``step_fn(model, batch)`` returns the loss to backpropagate.
        batch: one batch, e.g. the rank's first.
        steps: how many passes (0 runs nothing).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = [b.detach().clone() for b in model.buffers()]
    with torch.random.fork_rng(devices=_cuda_devices(model)):
        for _ in range(steps):
            for p in params:
                p.grad = None
            step_fn(model, batch).backward()  # type: ignore[no-untyped-call]  # torch stub
    with torch.no_grad():
        for live, saved in zip(model.buffers(), buffers, strict=True):
            live.copy_(saved)
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad


def pacer_for(
    model: nn.Module,
    optimizer: Optimizer,
    step_fn: Callable[[nn.Module, BatchT], Tensor],
    batch: BatchT,
    *,
    speed: float,
    base_s: float | None = None,
    slows_later: bool = False,
) -> Pacer | None:
    """Make a rank ready to train at ``speed``: warm its steps up, build its pacer.

    A rank at full speed only warms up and gets no pacer, unless it
    ``slows_later``. A paced rank paces by ``base_s`` when one is given (and
    warms up), otherwise by its own ``measure_base_step_s``, whose untimed
    steps warm the same kernels up.

    Args:
        model: the rank's model (left as it was).
        optimizer: the optimizer over ``model``'s parameters (left as it was).
        step_fn: ``step_fn(model, batch)`` returns the loss to backpropagate.
        batch: one batch, e.g. the rank's first.
        speed: the rank's speed, in (0, 1].
        base_s: the solo step time to pace by; None: measure it.
        slows_later: a ``SlowDown`` fault is planned for this rank: build a
            pacer even at full speed (it waits nothing until ``set_speed``).

    Returns:
        The rank's pacer, or None at full speed when it never slows down.
    """
    if speed >= 1.0 and not slows_later:
        warm_up(model, step_fn, batch)
        return None
    if base_s is None:
        base_s = measure_base_step_s(model, optimizer, step_fn, batch)
    else:
        warm_up(model, step_fn, batch)
    return Pacer(speed, base_s)


class Pacer:
    """Slows a rank to ``speed`` of its solo pace by waiting after each step.

    Args:
        speed: the fraction of full speed to run at, in (0, 1]; 1.0 never waits.
        base_s: the solo step time from ``measure_base_step_s``, in seconds.
        sleep: the blocking wait, ``time.sleep`` by default; tests pass a fake.

    Raises:
        ConfigError: ``speed`` outside (0, 1] or not a number (field
            ``"speeds"``), or ``base_s`` negative or not finite (field
            ``"base_s"``). No pacer is built.
    """

    def __init__(
        self,
        speed: float,
        base_s: float,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        check_speed(speed)  # the speed first, then the base (the documented order)
        if isinstance(base_s, bool) or not isinstance(base_s, int | float):
            raise ConfigError("base_s", f"must be a number of seconds, got {base_s!r}")
        if not math.isfinite(base_s) or base_s < 0:
            raise ConfigError("base_s", f"must be finite and >= 0, got {base_s!r}")
        self.base_s = float(base_s)
        self.set_speed(speed)
        self.injected_s = 0.0  # total wait injected so far (nominal, not measured)
        self._sleep = sleep

    def set_speed(self, speed: float) -> None:
        """Pace every later step at ``speed`` (a ``SlowDown`` fault).

        Raises:
            ConfigError: (field ``"speeds"``) ``speed`` outside (0, 1] or not
                a number; the pacer is unchanged.
        """
        self.speed = check_speed(speed)
        # One step should cost base / speed; the step itself already took base.
        self.wait_s = self.base_s * (1.0 / self.speed - 1.0)

    def after_step(self) -> float:
        """Wait the per-step penalty; call once after every optimizer step.

        Returns:
            The seconds asked of ``sleep`` (0.0 at speed 1, where it is not
            called at all). ``injected_s`` grows by the same amount.
        """
        if self.wait_s <= 0.0:
            return 0.0
        self._sleep(self.wait_s)
        self.injected_s += self.wait_s
        return self.wait_s

    def __repr__(self) -> str:
        return f"Pacer(speed={self.speed}, base_s={self.base_s:.6f}, wait_s={self.wait_s:.6f})"


def check_speed(speed: float) -> float:
    """Validate one entry of a ``speeds`` vector.

    Args:
        speed: the fraction of full speed a rank runs at.

    Returns:
        ``speed`` as a float.

    Raises:
        ConfigError: (field ``"speeds"``) ``speed`` is a bool, not a number,
            NaN, or outside (0, 1].
    """
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not 0 < speed <= 1:
        raise ConfigError("speeds", f"a speed must be a number in (0, 1], got {speed!r}")
    return float(speed)


def check_speed_base_s(base_s: float | None) -> float | None:
    """Validate a solo step time given instead of measured (``None`` passes).

    A benchmark that compares systems measures the solo step once and hands
    it to every system, so their paced ranks wait exactly alike.

    Raises:
        ConfigError: (field ``"speed_base_s"``) not a number, or not finite
            and > 0 seconds.
    """
    if base_s is None:
        return None
    if isinstance(base_s, bool) or not isinstance(base_s, int | float):
        raise ConfigError("speed_base_s", f"must be a number of seconds, got {base_s!r}")
    if not 0 < base_s < math.inf:
        raise ConfigError("speed_base_s", f"must be finite and > 0 seconds, got {base_s!r}")
    return float(base_s)


def _cuda_devices(model: nn.Module) -> list[int]:
    """The CUDA device indices holding ``model``'s parameters or buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def _synchronize(devices: list[int]) -> None:
    """Wait for queued CUDA kernels, so a clock reading covers the work."""
    for index in devices:
        torch.cuda.synchronize(index)
