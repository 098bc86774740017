"""A tiny model and its functions for the promise tests (top level, so ranks can unpickle them)."""

from __future__ import annotations

import itertools
import os

import torch
from torch import nn

from elche.core.checkpoint import CheckpointMeta
from elche.runtime.bundle import BundlePaths, locate, meta_path


def make_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2).to(device)


def make_optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # type: ignore[arg-type]


def step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


_STEPS = itertools.count(1)  # this process's steps


def step_then_exit(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """``step``, but rank ``EXIT_RANK``'s process ends with status ``EXIT_CODE`` on its
    ``EXIT_STEP``-th step, as a user's ``os._exit`` would end it."""
    steps = next(_STEPS)
    if os.environ.get("ELCHE_RANK") == os.environ["EXIT_RANK"] and steps == int(
        os.environ["EXIT_STEP"]
    ):
        os._exit(int(os.environ["EXIT_CODE"]))
    return step(model, batch)


def log_checkpoint(version: int, model: nn.Module) -> None:
    """A ``checkpoint_fn`` that appends its version to the file ``CHECKPOINT_LOG`` names."""
    with open(os.environ["CHECKPOINT_LOG"], "a", encoding="utf-8") as log:
        log.write(f"{version}\n")


def score(model: nn.Module, dataset: object) -> float:
    return 0.5


def bundle_on_disk(stem: str) -> BundlePaths:
    """Where the files of the bundle committed at ``stem`` are (its meta names them)."""
    meta = CheckpointMeta.from_json(meta_path(stem).read_text(encoding="utf-8"))
    return locate(stem, meta, meta.world_size)
