"""User code that fails on purpose, for the user-error promise tests (top level, so ranks
can unpickle it). Each rank process imports this module afresh, so the counters are per rank.
"""

from __future__ import annotations

import os
import signal
import threading

import torch
from torch import nn

from tests.promises.tiny import make_model, step

_calls = [0]  # this rank's calls of the counting step functions


def rank() -> int:
    return int(os.environ.get("ELCHE_RANK") or os.environ.get("RANK") or 0)


def nonscalar_step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """A new user's mistake: the loss is the model's output, not a scalar."""
    return model(batch[0])


def model_fails_on_rank1(device: torch.device) -> nn.Module:
    if rank() == 1:
        raise ValueError("this rank's model cannot be built")
    return make_model(device)


def model_wider_on_rank1(device: torch.device) -> nn.Module:
    """A model_fn that builds by rank: rank 1's hidden layer is wider than the others'."""
    torch.manual_seed(0)
    hidden = 5 if rank() == 1 else 3
    return nn.Sequential(nn.Linear(4, hidden), nn.Linear(hidden, 2)).to(device)


def eval_halving_the_model(model: nn.Module, dataset: object) -> float:
    """An eval_fn that evaluates in half precision by converting the rank's model itself."""
    model.half()
    return 0.5


def model_killed_on_rank1(device: torch.device) -> nn.Module:
    """A real crash before the run forms: rank 1 dies while building its model."""
    if rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return make_model(device)


def step_fails_after_a_few(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's step raises the same error once it has trained a few batches."""
    _calls[0] += 1
    if _calls[0] > 6:  # past the warm-up's two passes and a few real steps
        raise KeyError("label 7 is not in the vocabulary")
    return step(model, batch)


def step_fails_on_rank1_after_a_few(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """Rank 1's step raises (its data shard went away) at its second step past the warm-up's
    two passes: the last of the probe's two (``PROBE_STEPS``), which every rank takes however
    slow a busy machine makes it, where a later step may never come to a rank the balancer
    gives little. One step was trained first: the error is no first step's. Rank 0's never."""
    _calls[0] += 1
    if rank() == 1 and _calls[0] > 3:
        raise OSError("its data shard could not be read")
    return step(model, batch)


def step_exits_on_rank1_after_a_few(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """Rank 1's process ends with status 0 mid-run (the user's code called os._exit(0)),
    at its first step past the warm-up's two passes: every rank has one in its first
    window, however few batches a busy machine lets it take after."""
    _calls[0] += 1
    if rank() == 1 and _calls[0] > 2:
        os._exit(0)
    return step(model, batch)


def nan_after_a_few(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """The loss turns NaN on rank 1 after a few steps (a diverging run)."""
    _calls[0] += 1
    loss = step(model, batch)
    if rank() == 1 and _calls[0] > 6:
        return loss * float("nan")
    return loss


def nan_every_other(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """The loss is NaN on every second step of rank 1 (a flaky one): a rank 1 given
    as few as two steps (started late on a loaded machine) has one to skip."""
    _calls[0] += 1
    loss = step(model, batch)
    if rank() == 1 and _calls[0] % 2 == 0:
        return loss * float("nan")
    return loss


def model_with_a_thread(device: torch.device) -> nn.Module:
    """A model_fn that starts a thread of the user's own that never ends (a logger)."""
    threading.Thread(target=threading.Event().wait, name="users-logger").start()
    return make_model(device)


def model_per_rank(device: torch.device) -> nn.Module:
    """A model_fn that forgets to seed, exaggerated: rank r's weights are all r."""
    model = nn.Linear(4, 2).to(device)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float(rank()))
    return model


def frozen_optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.0)  # type: ignore[arg-type]
