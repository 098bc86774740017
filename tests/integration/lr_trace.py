"""Top-level functions (picklable, for rank processes) that trace each step's lr and progress.

``traced_optimizer`` keeps the process's optimizer; ``traced_step`` appends
one JSON line per call to ``<log_dir>/<pid>.jsonl``: the monotonic time (one
clock for every process on the machine), the optimizer's lr and
``elche.progress()``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import elche
from elche.workloads import digits

WARMUP = 0.1  # fraction of the run spent warming up
FLOOR = 0.1  # the schedule's final factor
BASE_LR = 0.1

_OPTIMIZERS: list[torch.optim.Optimizer] = []


def warmup_cosine(progress: elche.Progress) -> float:
    """Linear warm-up to 1 over ``WARMUP``, then cosine down to ``FLOOR`` at the end."""
    f = progress.fraction
    if f < WARMUP:
        return f / WARMUP
    return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * (f - WARMUP) / (1 - WARMUP)))


def schedule_at(fraction: float) -> float:
    return warmup_cosine(
        elche.Progress(samples=0, step=0, fraction=fraction, planned_samples=1, exact_samples=0)
    )


# The schedule's steepest slope, per unit of fraction (warm-up: 1 / WARMUP).
MAX_SLOPE = max(1 / WARMUP, (1 - FLOOR) * math.pi / 2 / (1 - WARMUP))


def traced_optimizer(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    optimizer = torch.optim.SGD(params, lr=BASE_LR)
    _OPTIMIZERS.append(optimizer)
    return optimizer


def traced_step(log_dir: str, model: nn.Module, batch: Any) -> torch.Tensor:
    progress = elche.progress()
    record = {
        "t": _now(),
        "lr": _OPTIMIZERS[-1].param_groups[0]["lr"],
        "fraction": progress.fraction,
        "samples": progress.samples,
        "exact": progress.exact_samples,
        "size": int(batch[0].shape[0]),
    }
    with (Path(log_dir) / f"{os.getpid()}.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return digits.step_fn(model, batch)


def _now() -> float:
    import time

    return time.monotonic()


def read_traces(log_dir: Path) -> list[list[dict[str, float]]]:
    """Each process's records, in the order it wrote them."""
    return [
        [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        for path in sorted(log_dir.glob("*.jsonl"))
    ]
