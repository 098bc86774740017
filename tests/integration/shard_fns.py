"""Top-level functions for the ``elche.Shards`` run (picklable, for ranks).

Item ``(id, x, y)``: ``id = 1000 × shard + k``, ``x`` four features drawn
from the id, ``y`` whether their sum is positive. Eight shards of four
kinds: generator functions (files or URLs, in spirit), a list, a map-style
sub-dataset and an ``IterableDataset``. ``logged_step`` records the ids of
every batch it trains, one file per rank.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

import elche

Item = tuple[int, torch.Tensor, int]
LENGTHS = (80, 50, 120, 20, 70, 100, 40, 60)
STEP_S = 0.004  # what one step costs, standing in for a model's compute


def item(shard: int, k: int) -> Item:
    ident = 1000 * shard + k
    x = torch.randn(4, generator=torch.Generator().manual_seed(ident))
    return ident, x, int(x.sum() > 0)


def read_shard(shard: int, n: int) -> Iterator[Item]:
    """A streamed shard: what a reader of a file or URL would yield."""
    for k in range(n):
        yield item(shard, k)


class SubDataset(Dataset[Item]):
    def __init__(self, shard: int, n: int) -> None:
        self.shard, self.n = shard, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> Item:
        if not 0 <= k < self.n:
            raise IndexError(k)
        return item(self.shard, k)


class StreamShard(IterableDataset[Item]):
    def __init__(self, shard: int, n: int) -> None:
        self.shard, self.n = shard, n

    def __iter__(self) -> Iterator[Item]:
        return read_shard(self.shard, self.n)


def shards() -> elche.Shards:
    parts: list[Any] = [functools.partial(read_shard, s, n) for s, n in enumerate(LENGTHS)]
    parts[1] = [item(1, k) for k in range(LENGTHS[1])]
    parts[4] = SubDataset(4, LENGTHS[4])
    parts[6] = StreamShard(6, LENGTHS[6])
    return elche.Shards(parts)  # lengths: three counting passes, the rest by len()


def all_ids() -> list[int]:
    return [1000 * s + k for s, n in enumerate(LENGTHS) for k in range(n)]


def model(device: torch.device | str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2).to(device)


def optimizer(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def logged_step(log_dir: str, model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    ids, x, y = batch
    path = Path(log_dir) / f"rank{os.environ.get('ELCHE_RANK', '0')}.ids"
    with path.open("a", encoding="utf-8") as f:
        f.write(" ".join(str(int(i)) for i in ids) + "\n")
    time.sleep(STEP_S)  # a step's compute, without loading the shared cores
    return nn.functional.cross_entropy(model(x), y)


def calls(log_dir: Path, rank: int) -> list[list[int]]:
    """The ids of each ``logged_step`` call of ``rank``, in order (warm-up included)."""
    text = (log_dir / f"rank{rank}.ids").read_text(encoding="utf-8")
    return [[int(i) for i in line.split()] for line in text.splitlines()]
