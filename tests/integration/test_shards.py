"""A sharded stream on real ranks: a SIGKILLed rank loses no item.

One run, audited item by item: 8 shards, 3 ranks at speeds 1, 0.5, 0.25,
rank 1 kills itself in the middle of its span of the second epoch. The run
completes, and every item of every shard is in the consensus exactly once
per epoch: the survivors' trained items plus the dead rank's averaged ones
(its first ``samples`` trained, committed in training order); what it
trained after its last average (typically a few batches) was trained again
by the survivors.
"""

from __future__ import annotations

import collections
import functools
from pathlib import Path

import pytest

import elche
from tests.integration import shard_fns as fx

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EPOCHS = 3
BATCH = 8
WARM_UP_CALLS = 2  # a rank given its solo step warms up with two passes of its first batch


def test_a_sigkilled_rank_of_a_sharded_stream_loses_no_item(tmp_path: Path) -> None:
    dataset = fx.shards()
    result = elche.train(
        fx.model, fx.optimizer, functools.partial(fx.logged_step, str(tmp_path)), dataset,
        batch_size=BATCH, epochs=EPOCHS, speeds=[1.0, 0.5, 0.25], speed_base_s=fx.STEP_S,
        crash={1: 1.7}, heartbeat_timeout_s=3.0, progress=False, run_dir=str(tmp_path / "run"),
    )  # fmt: skip
    summary = result.summary
    assert summary["outcome"] == "completed"
    assert summary["dead_ranks"] == [1]
    assert summary["lost_samples"] == 0
    samples = [r["samples"] for r in summary["per_rank"]]  # type: ignore[attr-defined]
    assert sum(samples) == EPOCHS * len(dataset)
    assert samples[0] > samples[2]  # shares follow speed

    first = dataset.order(seed=42, epoch=0)[:BATCH]
    averaged: collections.Counter[int] = collections.Counter()
    for rank in range(3):
        calls = fx.calls(tmp_path, rank)
        warm = [dataset[i][0] for i in first]
        assert calls[:WARM_UP_CALLS] == [warm] * WARM_UP_CALLS
        trained = [i for ids in calls[WARM_UP_CALLS:] for i in ids]
        if rank == 1:  # what it trained after its last average died with it
            assert len(trained) >= samples[1]
            trained = trained[: samples[1]]
        averaged.update(trained)
    assert averaged == {i: EPOCHS for i in fx.all_ids()}
