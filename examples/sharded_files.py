"""Streaming data: train on JSON-lines files through ``elche.Shards``.

Writes 8 shard files (``x``: 8 features, ``y``: whether their sum is
positive), then trains on three ranks at speeds 1, 0.5 and 0.25, each shard
a generator function that reads its file line by line. Every read line is
counted, so the run ends by saying how many lines the ranks read per item
trained: what reopening a shard and skipping to a span's offset costs.

    python examples/sharded_files.py [FOLDER]     # three ranks; the files go in FOLDER
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

import elche

LENGTHS = (300, 200, 500, 100, 400, 350, 150, 250)
BATCH, EPOCHS = 16, 3


def write_shards(folder: Path) -> list[Path]:
    g = torch.Generator().manual_seed(0)
    paths = []
    for i, n in enumerate(LENGTHS):
        path = folder / f"part-{i}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for _ in range(n):
                x = torch.randn(8, generator=g)
                f.write(json.dumps({"x": x.tolist(), "y": int(x.sum() > 0)}) + "\n")
        paths.append(path)
    return paths


def read_jsonl(path: Path) -> Iterator[tuple[torch.Tensor, int]]:
    """One shard: its file's items, in order; counts the lines it read."""
    lines = 0
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                lines += 1
                item = json.loads(line)
                yield torch.tensor(item["x"]), item["y"]
    finally:
        with (path.parent / f"reads.{os.getpid()}").open("a", encoding="utf-8") as out:
            out.write(f"{lines}\n")


def make_model(device: torch.device | str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)).to(device)


def make_optimizer(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def accuracy(model: nn.Module, dataset: torch.utils.data.TensorDataset) -> float:
    x, y = dataset.tensors
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def held_out(n: int = 1000) -> torch.utils.data.TensorDataset:
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="elche-shards-"))
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("reads.*"):
        old.unlink()
    paths = write_shards(folder)
    shards = elche.Shards([functools.partial(read_jsonl, p) for p in paths], lengths=LENGTHS)
    result = elche.train(
        make_model, make_optimizer, step, shards, batch_size=BATCH, epochs=EPOCHS, ranks=3,
        speeds=[1.0, 0.5, 0.25], eval_fn=accuracy, eval_dataset=held_out(), progress=False,
    )  # fmt: skip
    summary = result.summary
    reads = sum(int(n) for p in folder.glob("reads.*") for n in p.read_text().split())
    print(json.dumps({
        "outcome": summary["outcome"], "lost_samples": summary["lost_samples"],
        "samples": [r["samples"] for r in summary["per_rank"]],  # type: ignore[attr-defined]
        "eval": summary["eval"],
        "lines_read_per_item_trained": round(reads / (EPOCHS * len(shards)), 3),
    }))  # fmt: skip
