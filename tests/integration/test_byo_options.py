"""The step and loader options on three real ranks, in one run.

Variable-length items through a padding ``collate_fn``, ``num_workers=2``
(each rank prefetches with its own persistent loader processes),
``accumulate=2``, ``precision="bf16"`` and a ``batch_sampler``, at speeds 1,
0.5 and 0.25: the run completes, every sample is trained once per epoch, the
forward ran under autocast, and the fast rank trained the most.
"""

from __future__ import annotations

import collections
import functools
from pathlib import Path

import pytest

import elche
from elche.runtime.shards import epoch_order
from tests.runtime import byo_fns as fx

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_three_ranks_train_variable_length_items_with_every_option(tmp_path: Path) -> None:
    data, epochs = fx.Sequences(600), 2
    result = elche.train(
        fx.seq_model, fx.seq_optimizer, functools.partial(fx.seq_step, str(tmp_path)), data,
        batch_size=8, epochs=epochs, speeds=[1.0, 0.5, 0.25], speed_base_s=0.02, progress=False,
        collate_fn=fx.pad_collate, num_workers=2, accumulate=2, precision="bf16",
        batch_sampler=fx.by_parity,
    )  # fmt: skip
    summary = result.summary
    assert summary["outcome"] == "completed"
    assert summary["lost_samples"] == 0
    samples = [r["samples"] for r in summary["per_rank"]]  # type: ignore[attr-defined]
    assert sum(samples) == epochs * len(data)
    assert samples[0] > samples[2]
    calls = fx.trained(tmp_path)
    assert all(autocast for autocast, _ in calls)
    assert all(len({i % 2 for i in ids}) == 1 for _, ids in calls)  # by_parity's micro-batches
    counts = collections.Counter(i for _, ids in calls for i in ids)
    # Warm-up passes (before training) go over the first step's items again.
    first_step = set(epoch_order(data, seed=42, epoch=0)[:16])
    assert {i for i in range(len(data)) if counts[i] != epochs} <= first_step
    assert all(counts[i] >= epochs for i in first_step)
