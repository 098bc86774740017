"""The arithmetic of ``elche bench``: pure functions over measured numbers.

Definitions (the report and ``docs/benchmarks.md`` use exactly these):

- **solo throughput** of a rank at speed s: ``s × solo``, where ``solo`` is
  samples/s of the workload trained by ``elche.train(ranks=1)`` at speed 1
  on one thread, alone on the machine;
- **ideal throughput** of a rig: Σ over its ranks of their solo throughput;
- **efficiency**: measured samples/s ÷ ideal throughput (1.0 = the rig
  trains at the speed of its sum);
- **ratio vs DDP**: a system's value ÷ torch DDP's on the same workload and
  rig, measured in the same invocation; its **lock-step bound**
  ``n × min(speeds) / Σ speeds`` is the best wall ratio possible when neither
  system pays for communication;
- **target loss** of a workload × rig: the highest final training loss among
  its systems, so every system reaches it; **time to target**: the first
  epoch-end time (from the first batch) whose epoch loss is at or below it;
- **target eval** of a workload: a fixed value of its eval metric
  (``suites.EVAL_TARGETS``); **time to target eval**: the first epoch-end time
  whose model's eval reaches it (≥ when higher is better, ≤ otherwise);
- **spread** over seeds: min, max, mean and max − min of a value;
- **idle %** of a rank: 100 × (wall − the rank's training-step time) ÷ wall.

Nothing here reads a clock or runs a model, so the unit tests feed fake
numbers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

__all__ = [
    "efficiency",
    "ideal_throughput",
    "idle_pct",
    "lockstep_ratio",
    "median_index",
    "ratio",
    "spread",
    "target_loss",
    "time_to_target",
    "time_to_target_eval",
]


def ideal_throughput(speeds: Sequence[float], solo_samples_per_s: float) -> float:
    """Σ per-rank solo throughput: ``sum(speeds) × solo_samples_per_s``.

    Args:
        speeds: the rig's speed vector, each in (0, 1].
        solo_samples_per_s: samples/s of one speed-1 rank alone.

    Returns:
        The samples/s the rig would reach at the speed of its sum.
    """
    return float(sum(speeds)) * solo_samples_per_s


def lockstep_ratio(speeds: Sequence[float]) -> float:
    """The best wall-time ratio against a lock-step system, with no overheads.

    Lock-step data parallelism (DDP) steps every rank at the slowest one's
    pace: ``n × min(speeds)`` rank-steps per unit of time, against
    ``sum(speeds)`` at the speed of the sum. The same work therefore takes at
    best ``n × min(speeds) / sum(speeds)`` of DDP's wall time when neither
    system pays anything for communication; a measured ratio below it means
    DDP paid more overhead than elche.

    Args:
        speeds: the rig's speed vector, not empty.

    Returns:
        The bound, in (0, 1]; e.g. 0.75 / 1.75 ≈ 0.429 for ``[1, 0.5, 0.25]``.

    Raises:
        ValueError: ``speeds`` is empty.
    """
    if not speeds:
        raise ValueError("speeds must not be empty")
    return len(speeds) * min(speeds) / float(sum(speeds))


def efficiency(
    samples_per_s: float | None, speeds: Sequence[float], solo_samples_per_s: float | None
) -> float | None:
    """Measured throughput over the rig's ideal throughput.

    Args:
        samples_per_s: what the system measured, or None if it failed.
        speeds: the rig's speed vector.
        solo_samples_per_s: the solo run's samples/s, or None if it failed.

    Returns:
        The efficiency (1.0 = the speed of the sum), or None when a number is
        missing or the ideal is not positive.
    """
    if samples_per_s is None or solo_samples_per_s is None:
        return None
    ideal = ideal_throughput(speeds, solo_samples_per_s)
    return samples_per_s / ideal if ideal > 0 else None


def ratio(value: float | None, baseline: float | None) -> float | None:
    """``value / baseline``, or None when either is missing or baseline is 0.

    Args:
        value: e.g. a system's wall time.
        baseline: e.g. torch DDP's wall time on the same cell.

    Returns:
        The ratio, or None.
    """
    if value is None or baseline is None or baseline == 0:
        return None
    if not (math.isfinite(value) and math.isfinite(baseline)):
        return None
    return value / baseline


def target_loss(final_losses: Iterable[float | None]) -> float | None:
    """The loss every system reached: the highest finite final loss.

    Args:
        final_losses: each system's last-epoch training loss (None: failed).

    Returns:
        The target, or None if no system has a finite final loss.
    """
    finite = [x for x in final_losses if x is not None and math.isfinite(x)]
    return max(finite) if finite else None


def time_to_target(
    epochs: Iterable[tuple[float, float | None]], target: float | None
) -> float | None:
    """The first epoch-end time whose loss is at or below ``target``.

    Args:
        epochs: ``(t_s, loss)`` per epoch in order, ``t_s`` from the first
            batch; a loss of None (no batch reported) never qualifies.
        target: the loss to reach, or None.

    Returns:
        Seconds from the first batch, or None if never reached (or no target).
    """
    if target is None:
        return None
    for t_s, loss in epochs:
        if loss is not None and math.isfinite(loss) and loss <= target:
            return t_s
    return None


def time_to_target_eval(
    epochs: Iterable[tuple[float, float | None]], target: float | None, *, higher_is_better: bool
) -> float | None:
    """The first epoch-end time whose eval reaches ``target``.

    Args:
        epochs: ``(t_s, eval)`` per epoch in order, ``t_s`` from the first
            batch; an eval of None (not evaluated) never qualifies.
        target: the eval to reach, or None (no target for the workload).
        higher_is_better: reach means ``eval >= target`` if True, else ``<=``.

    Returns:
        Seconds from the first batch, or None if never reached (or no target).
    """
    if target is None:
        return None
    for t_s, value in epochs:
        if value is None or not math.isfinite(value):
            continue
        if (value >= target) if higher_is_better else (value <= target):
            return t_s
    return None


def spread(values: Iterable[float | None]) -> dict[str, float | int] | None:
    """``{n, min, max, mean, median, range}`` of the finite values; None if there are none.

    Args:
        values: e.g. one cell's final eval on each seed.
    """
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None
    low, high = min(finite), max(finite)
    return {
        "n": len(finite),
        "min": low,
        "max": high,
        "mean": statistics.fmean(finite),
        "median": statistics.median(finite),
        "range": high - low,
    }


def idle_pct(wall_s: float | None, busy_s: float | None) -> float | None:
    """Share of the wall time a rank spent outside its training steps, in %.

    Args:
        wall_s: the run's training wall time.
        busy_s: the rank's time in training steps (compute + injected wait).

    Returns:
        ``100 × max(wall − busy, 0) / wall``, or None if a number is missing
        or the wall time is not positive.
    """
    if wall_s is None or busy_s is None or wall_s <= 0:
        return None
    return 100.0 * max(wall_s - busy_s, 0.0) / wall_s


def median_index(values: Sequence[float | None]) -> int | None:
    """The index of the median of ``values`` (the lower median; None skipped).

    Args:
        values: e.g. the wall times of a cell's repeats.

    Returns:
        The index of the run to report, or None if every value is None.
    """
    present = [(v, i) for i, v in enumerate(values) if v is not None]
    if not present:
        return None
    middle = statistics.median_low(v for v, _ in present)
    return next(i for v, i in present if v == middle)
