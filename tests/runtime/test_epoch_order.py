"""Each epoch's order: drawn by NumPy's frozen stream, and a bundle's own on resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elche
from elche.core.config import NUMPY_PERMUTATION, RANDOM_SHUFFLE, SHARD_ORDER
from elche.core.dispatch import epoch_permutation
from elche.runtime import bundle
from elche.runtime.shards import Shards, epoch_order, numpy_permutation

N = 96
TRAINED: list[int] = []  # the sample ids ``_step`` saw, in this process (``ranks=1``)


def test_the_numpy_permutation_is_one_order_per_seed_and_epoch() -> None:
    order = numpy_permutation(1000, seed=42, epoch=3)
    assert sorted(order) == list(range(1000))
    assert all(type(i) is int for i in order)  # what every dataset indexes by
    assert order == numpy_permutation(1000, seed=42, epoch=3)
    assert order != numpy_permutation(1000, seed=42, epoch=4)
    assert order != numpy_permutation(1000, seed=43, epoch=3)
    low = numpy_permutation(50, seed=2**32 - 1, epoch=0)
    assert numpy_permutation(50, seed=2**64 - 1, epoch=0) != low  # a seed's high word counts


def test_the_numpy_permutation_is_numpys_frozen_stream() -> None:
    # NumPy's legacy RandomState never changes its stream: these are the same on any NumPy.
    assert numpy_permutation(10, seed=42, epoch=0) == [1, 2, 7, 5, 0, 4, 6, 3, 9, 8]


def test_epoch_order_draws_as_the_order_says_and_shards_keep_their_own() -> None:
    data = list(range(200))
    assert epoch_order(data, seed=5, epoch=1) == numpy_permutation(200, seed=5, epoch=1)
    shuffled = epoch_order(data, seed=5, epoch=1, order=RANDOM_SHUFFLE)
    assert shuffled == epoch_permutation(200, seed=5, epoch=1)
    shards = Shards([list(range(10)), list(range(10))])
    assert list(epoch_order(shards, seed=5, epoch=1, order=RANDOM_SHUFFLE)) == list(
        epoch_order(shards, seed=5, epoch=1)
    )


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1).to(device)


def _optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)  # type: ignore[arg-type]  # an iterator of tensors


def _step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y, ids = batch
    TRAINED.extend(ids.tolist())
    return nn.functional.mse_loss(model(x).squeeze(1), y)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 4, generator=g), torch.randn(N, generator=g)
    return TensorDataset(x, y, torch.arange(N))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schema", "order", "drawn"),
    [
        (3, None, epoch_permutation),  # every bundle before schema 4: random.shuffle's order
        (4, NUMPY_PERMUTATION, numpy_permutation),
    ],
)
def test_a_resumed_epoch_trains_its_uncovered_positions_in_its_bundles_order(
    tmp_path: Path, schema: int, order: str | None, drawn: object
) -> None:
    stem = str(tmp_path / "bundle" / "run")
    data = _data()
    first = elche.train(
        _model, _optimizer, _step, data, batch_size=8, epochs=1, ranks=2, seed=7,
        checkpoint_every=1, save_path=stem, progress=False, run_dir=str(tmp_path / "a"),
    )  # fmt: skip
    assert first.summary["outcome"] == "completed"
    meta = json.loads(bundle.meta_path(stem).read_text(encoding="utf-8"))
    assert meta["order"] == NUMPY_PERMUTATION  # what a new run draws
    # The bundle as a run of ``schema`` would have left it (``ranks=1`` resumes it here).
    meta["schema_version"] = schema
    if order is None:
        del meta["order"]
    _stop_in_epoch_1(stem, meta)
    TRAINED.clear()
    second = elche.train(
        _model, _optimizer, _step, data, batch_size=8, epochs=2, ranks=1, seed=7,
        resume_from=stem, progress=False, run_dir=str(tmp_path / "b"),
    )  # fmt: skip
    assert second.summary["outcome"] == "completed"
    assert callable(drawn)
    expected = drawn(N, seed=7, epoch=1)[16:40]
    assert sorted(TRAINED[-24:]) == sorted(expected)  # warm-up steps come first, if any


def _stop_in_epoch_1(stem: str, meta: dict[str, Any]) -> None:
    """Write ``meta`` back as a bundle stopped in epoch 1 of 2, positions 16..39 still to train."""
    meta.update(epoch=1, epochs=2)
    meta["coverage"] = [{"epoch": 1, "total_samples": N, "uncovered": [[16, 24]]}]
    bundle.meta_path(stem).write_text(json.dumps(meta), encoding="utf-8")


@pytest.mark.slow
def test_a_sharded_runs_bundle_resumes_on_shards_only(tmp_path: Path) -> None:
    # Its meta said numpy-permutation: a map-style dataset of the same items
    # resumed its holes, positions of the shards' order, in another order.
    stem = str(tmp_path / "bundle" / "run")
    data = _data()
    shards = Shards([[data[i] for i in range(s, s + 24)] for s in range(0, N, 24)])
    first = elche.train(
        _model, _optimizer, _step, shards, batch_size=8, epochs=1, ranks=1, seed=7,
        checkpoint_every=1, save_path=stem, progress=False, run_dir=str(tmp_path / "a"),
    )  # fmt: skip
    assert first.summary["outcome"] == "completed"
    meta = json.loads(bundle.meta_path(stem).read_text(encoding="utf-8"))
    assert meta["order"] == SHARD_ORDER
    _stop_in_epoch_1(stem, meta)
    resume: dict[str, Any] = {
        "batch_size": 8, "epochs": 2, "ranks": 1, "seed": 7, "resume_from": stem,
        "progress": False,
    }  # fmt: skip
    refused = r"dataset: .* saved mid-epoch by a run on an elche\.Shards, this run trains a map"
    with pytest.raises(elche.ConfigError, match=refused):
        elche.train(_model, _optimizer, _step, data, **resume)
    TRAINED.clear()
    second = elche.train(_model, _optimizer, _step, shards, **resume)
    assert second.summary["outcome"] == "completed"
    assert sorted(TRAINED[-24:]) == sorted(shards.order(seed=7, epoch=1)[16:40])
