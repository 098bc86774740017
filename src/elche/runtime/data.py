"""Fetching a batch: dataset positions to a collated batch, fast where it can be.

``default_collate`` over ``dataset[i]`` item by item is the general path. Two
faster paths give the same batch: a ``TensorDataset`` under the default
collate is indexed once per tensor, and a dataset with ``__getitems__`` (the
batched-fetch protocol ``DataLoader`` uses) is asked for all items at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import TensorDataset, default_collate

__all__ = ["fetch", "to_device"]


def fetch(
    dataset: Any,
    indices: Sequence[int],
    collate: Callable[[list[Any]], Any] | None = None,
) -> Any:
    """The collated batch of ``dataset`` at ``indices``.

    Args:
        dataset: a map-style dataset.
        indices: dataset indices, in batch order.
        collate: the collate function (None: ``default_collate``).
    """
    if collate is None or collate is default_collate:
        if isinstance(dataset, TensorDataset):
            index = torch.as_tensor(indices, dtype=torch.long)
            return [tensor[index] for tensor in dataset.tensors]
        collate = default_collate
    getitems = getattr(dataset, "__getitems__", None)
    items = getitems(list(indices)) if getitems is not None else [dataset[i] for i in indices]
    return collate(items)


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
