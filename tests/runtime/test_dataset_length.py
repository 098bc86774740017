"""A dataset must keep its length, the same on every rank, while training.

Each rank draws each epoch's order from its own ``len(dataset)``. A dataset
that grew during the run, or whose length depends on the process (it lists
files still being written), made that rank read other samples at the
positions it was handed: the run completed with ``lost_samples`` 0 and the
ranks' own span records clean, while some samples were trained twice,
others never, and items past the run's length trained. Now the rank fails
with a ``ConfigError`` naming the dataset as it draws the epoch's order.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import elche
from tests.runtime import byo_fns as fx

N = 16


class Listed(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Items listed when asked: ``extra`` more on rank ``on_rank`` (``ELCHE_RANK``)."""

    def __init__(self, extra: int = 0, on_rank: str = "") -> None:
        self.num_items, self.extra, self.on_rank = N, extra, on_rank

    def __len__(self) -> int:
        here = os.environ.get("ELCHE_RANK") == self.on_rank
        return self.num_items + (self.extra if here else 0)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((4,), float(index)), torch.zeros(1)


GROWING = Listed()


def _grow(epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if epoch == 1:
        GROWING.num_items += 10  # files written while the run trains


def test_a_dataset_that_grows_between_epochs_fails_the_run_naming_it(tmp_path: Path) -> None:
    with pytest.raises(elche.TrainingError, match=r"dataset: has 26 items as epoch 1 starts"):
        elche.train(
            fx.linear_model, fx.linear_optimizer, fx.mse_step, GROWING, batch_size=4, epochs=2,
            ranks=1, epoch_fn=_grow, progress=False, run_dir=str(tmp_path),
        )  # fmt: skip


@pytest.mark.integration
@pytest.mark.slow
def test_a_rank_whose_dataset_has_another_length_fails_the_run_naming_it(tmp_path: Path) -> None:
    with pytest.raises(elche.TrainingError, match="planned 16") as info:
        elche.train(
            fx.linear_model, fx.linear_optimizer, fx.mse_step, Listed(extra=10, on_rank="1"),
            batch_size=4, epochs=2, ranks=2, progress=False, run_dir=str(tmp_path),
        )  # fmt: skip
    assert info.value.rank == 1
    assert "dataset: has 26 items as epoch 0 starts on this rank" in str(info.value)
