"""What this machine delivers to a rig's paced ranks at once: the bench's capacity.

Every rank trains its own copy of the workload's model, fetching each
step's batch from the training set as every system's ranks do, paced by
elche's speed injection with the suite's shared solo step, with no
communication and no coordinator, all started together and stopped after
the same seconds. Their summed samples per second is the *capacity*: the
most any data-parallel system (elche or a peer) could train on this machine
with this rig, since every system's ranks compete for the same cores. Each
row of ``elche bench`` divides its samples/s by it (``of_capacity``); the
nominal rig (Σ speed × batch ÷ solo step) is what the capacity would be on
cores that did not slow each other.

``elche bench`` measures it once per workload and rig, before the rig's
runs, in the same invocation; ``scripts/concurrent_capacity.py`` prints it
on its own.

A rank's rate is taken in its steady state: over the steps that end in the
last ``1 - SETTLE`` of the window (the first steps of a fresh process, and
of ranks that start together, run slower), and the window is at least
``MIN_SLOW_STEPS`` of the slowest rank's paced steps long. On tiny-gpt
(57 ms a step; the 0.25 rank's paced step 229 ms) a 3-second window over
every step read 166 samples/s, below what cadence then trained (184):
the rig's slowest rank made 10 steps in it, its first ones slow.

The batches are fetched, not one fixed batch reused: no system can skip
that work, so a ceiling without it is one none can reach. On digits-cnn
(five alternating pairs, 2026-12-03) the probe with fetching read 2.8 %
less than the fixed batch's (paired differences −7 % to +3 %: the same size
as this machine's drift between two probes).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.synchronize import Barrier
from typing import Any

__all__ = ["Capacity", "measure_capacity", "window_s"]

SETTLE = 1 / 3  # the first third of the window: not counted
MIN_SLOW_STEPS = 30  # the window holds at least this many of the slowest rank's steps


@dataclass(frozen=True, slots=True)
class Capacity:
    """One rig's measured capacity on this machine.

    Attributes:
        samples_per_s: the ranks' summed samples per second, all at once.
        nominal_samples_per_s: Σ speed × batch ÷ solo step (cores that never
            slow each other).
        fraction: ``samples_per_s / nominal_samples_per_s``.
        step_ms: each rank's measured step (its injected wait included), in
            rig order.
        seconds: how long every rank trained.
    """

    samples_per_s: float
    nominal_samples_per_s: float
    fraction: float
    step_ms: tuple[float, ...]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        """The JSON-ready record."""
        record = asdict(self)
        record["step_ms"] = list(self.step_ms)
        return record


def measure_capacity(
    workload: str,
    speeds: Sequence[float],
    *,
    speed_base_s: float,
    batch_size: int,
    seconds: float = 3.0,
) -> Capacity:
    """Train ``speeds``' paced ranks at once for ``seconds``; see the module docstring.

    Args:
        workload: the workload's name (``elche.workloads``).
        speeds: the rig.
        speed_base_s: the solo step every paced rank waits by.
        batch_size: samples per step.
        seconds: how long every rank trains, after its warm-up.
    """
    from elche.runtime.launch import rank_context
    from elche.runtime.lifetimes import held_stop_signals

    seconds = window_s(seconds, speeds, speed_base_s)
    ctx = rank_context()  # elche's fork server, torch loaded, as every system's ranks
    start, out = ctx.Barrier(len(speeds)), ctx.Queue()
    jobs = [
        (workload, index, s, speed_base_s, batch_size, seconds) for index, s in enumerate(speeds)
    ]
    ranks = [ctx.Process(target=_rank, args=(job, start, out, os.getpid())) for job in jobs]
    try:
        # A stop while they start waits until all have: the ranks started by then
        # would wait at the barrier for the others for ever.
        with held_stop_signals():
            for rank in ranks:
                rank.start()
        results = sorted(out.get(timeout=120 + 4 * seconds) for _ in ranks)
    except BaseException:  # they ignore stop signals (forked from the fork server)
        for rank in ranks:
            if rank.pid is not None:
                rank.kill()
        raise
    finally:
        for rank in ranks:
            if rank.pid is not None:
                rank.join(timeout=10)
                if rank.is_alive():
                    rank.kill()
    per_step_s = [_steady_step_s(ends, seconds) for _, ends in results]
    delivered = sum(batch_size / s for s in per_step_s)
    nominal = sum(speeds) * batch_size / speed_base_s
    return Capacity(
        samples_per_s=round(delivered, 2),
        nominal_samples_per_s=round(nominal, 2),
        fraction=round(delivered / nominal, 4),
        step_ms=tuple(round(1000 * s, 3) for s in per_step_s),
        seconds=seconds,
    )


def window_s(seconds: float, speeds: Sequence[float], speed_base_s: float) -> float:
    """How long the ranks train: ``seconds``, or ``MIN_SLOW_STEPS`` of the slowest rank's steps."""
    return max(seconds, MIN_SLOW_STEPS * speed_base_s / min(speeds))


def _steady_step_s(ends: Sequence[float], seconds: float) -> float:
    """A rank's seconds per step over the steps that end after the window's first part.

    ``ends``: each step's end, in seconds since the window began.
    """
    settled = [t for t in ends if t >= SETTLE * seconds]
    if len(settled) < 2:  # too few steps to time apart: every step from the start
        return ends[-1] / len(ends)
    return (settled[-1] - settled[0]) / (len(settled) - 1)


def _rank(
    job: tuple[str, int, float, float, int, float], start: Barrier, out: Any, launcher: int
) -> None:
    """One paced rank training alone, in a process of its own, ended once its
    ``launcher`` process is gone (a killed bench)."""
    import torch

    from elche.runtime.data import fetch
    from elche.runtime.lifetimes import watch_launcher
    from elche.runtime.pacing import Pacer, warm_up
    from elche.workloads import get as get_workload

    watch_launcher(launcher, grace_s=0.0)

    name, index, speed, base_s, batch_size, seconds = job
    torch.set_num_threads(1)  # as every rank process runs
    workload = get_workload(name)
    train_set, _ = workload.load_split(0)
    model = workload.make_model("cpu")
    optimizer = workload.make_optimizer(model.parameters())
    size = min(batch_size, len(train_set))
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(index)).tolist()
    batch = fetch(train_set, order[:size])
    warm_up(model, workload.step_fn, batch)
    pacer = Pacer(speed, base_s)
    start.wait()
    began = time.perf_counter()
    ends: list[float] = []
    while not ends or ends[-1] < seconds:
        at = len(ends) * size % (len(order) - size + 1)  # through the order, as an epoch goes
        batch = fetch(train_set, order[at : at + size])
        optimizer.zero_grad(set_to_none=True)
        workload.step_fn(model, batch).backward()  # type: ignore[no-untyped-call]  # torch stub
        optimizer.step()
        pacer.after_step()
        ends.append(time.perf_counter() - began)
    out.put((index, ends))
