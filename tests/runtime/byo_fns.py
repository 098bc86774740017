"""Top-level functions for the step and loader option tests (picklable, for ranks).

``Sequences`` holds variable-length items ``(id, values, label)``;
``pad_collate`` pads them; ``seq_step`` records which ids it trained (one
file per process) and whether autocast was on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

AUTOCAST_SEEN: list[bool] = []


class Sequences(torch.utils.data.Dataset[tuple[int, torch.Tensor, int]]):
    """``n`` items of lengths 1..8; the label is whether the values' mean is positive."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.items = []
        for i in range(n):
            length = int(torch.randint(1, 9, (1,), generator=g))
            values = torch.randn(length, generator=g)
            self.items.append((i, values, int(values.mean() > 0)))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, int]:
        return self.items[index]


def pad_collate(items: list[tuple[int, torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest item; ``mask`` marks the real values."""
    width = max(len(values) for _, values, _ in items)
    padded = torch.zeros(len(items), width)
    mask = torch.zeros(len(items), width)
    for row, (_, values, _) in enumerate(items):
        padded[row, : len(values)] = values
        mask[row, : len(values)] = 1.0
    return {
        "ids": torch.tensor([i for i, _, _ in items]),
        "x": padded,
        "mask": mask,
        "y": torch.tensor([label for _, _, label in items]),
    }


def by_parity(indices: list[int]) -> list[list[int]]:
    """A batch sampler: the step's even ids, then its odd ids (each a micro-batch)."""
    parts = [[i for i in indices if i % 2 == 0], [i for i in indices if i % 2 == 1]]
    return [part for part in parts if part]


def seq_model(device: torch.device | str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(1, 2).to(device)


def seq_optimizer(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def seq_step(log_dir: str, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    mean = (batch["x"] * batch["mask"]).sum(1, keepdim=True) / batch["mask"].sum(1, keepdim=True)
    autocast = torch.is_autocast_enabled("cpu")
    with (Path(log_dir) / f"{os.getpid()}.ids").open("a", encoding="utf-8") as f:
        f.write(f"{int(autocast)} " + " ".join(str(int(i)) for i in batch["ids"]) + "\n")
    return nn.functional.cross_entropy(model(mean), batch["y"])


def trained(log_dir: Path) -> list[tuple[bool, list[int]]]:
    """Each ``seq_step`` call of every process: (autocast on, ids); warm-up passes included."""
    calls = []
    for path in log_dir.glob("*.ids"):
        for line in path.read_text(encoding="utf-8").splitlines():
            flag, *ids = line.split()
            calls.append((flag == "1", [int(i) for i in ids]))
    return calls


def linear_model(device: torch.device | str) -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(4, 1).to(device)


def linear_optimizer(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def mse_step(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    AUTOCAST_SEEN.append(torch.is_autocast_enabled("cpu"))
    return nn.functional.mse_loss(model(x).float(), y)


def linear_eval(model: nn.Module, dataset: torch.utils.data.TensorDataset) -> float:
    x, y = dataset.tensors
    return float(nn.functional.mse_loss(model(x), y))
