"""Batch fetching: every fast path gives exactly what default_collate gives."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from elche.runtime.data import fetch


class Plain(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self) -> None:
        self.x = torch.arange(40.0).reshape(10, 4)

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], i


class Batched(Plain):
    calls = 0

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        Batched.calls += 1
        return [self[i] for i in indices]


def reference(dataset: Dataset[object], indices: list[int]) -> object:
    return default_collate([dataset[i] for i in indices])


def test_tensor_dataset_fast_path_matches_default_collate() -> None:
    data = TensorDataset(torch.randn(10, 3), torch.arange(10))
    got = fetch(data, [7, 2, 2, 9])
    want = reference(data, [7, 2, 2, 9])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_plain_dataset_goes_item_by_item() -> None:
    got = fetch(Plain(), [3, 1])
    want = reference(Plain(), [3, 1])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_getitems_is_used_when_present() -> None:
    before = Batched.calls
    got = fetch(Batched(), [0, 5])
    assert Batched.calls == before + 1
    assert torch.equal(got[1], torch.tensor([0, 5]))


def test_a_custom_collate_is_honoured() -> None:
    data = TensorDataset(torch.arange(5))
    assert fetch(data, [4, 0], collate=lambda items: [int(x[0]) for x in items]) == [4, 0]
