"""What every workload module shares: seeded builds, Adam, batched evaluation.

- ``seeded(build, device)`` builds a model with the global RNG forked and
  seeded with ``INIT_SEED``: identical initial weights on every rank, and
  nobody's random stream shifted.
- ``adam(lr)`` is a picklable ``make_optimizer``.
- ``summed_over_batches`` runs a per-batch score in eval mode without
  gradients and puts the model back in train mode; ``accuracy`` is the
  classification score built on it (labels ``[b]`` or per-position ``[b, T]``).
- ``char_codes(text)`` maps bytes to the text workloads' ``VOCAB`` symbols.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

__all__ = [
    "EVAL_BATCH",
    "INIT_SEED",
    "VOCAB",
    "accuracy",
    "adam",
    "char_codes",
    "device_of",
    "seeded",
    "summed_over_batches",
]

INIT_SEED = 0  # every rank must start from the same weights
EVAL_BATCH = 512  # evaluation batch (the digits test split is 360 samples)
VOCAB = 97  # text workloads: 0 other, 1 newline, 2..96 printable ASCII 32..126


def seeded(build: Callable[[], nn.Module], device: torch.device | str) -> nn.Module:
    """``build()`` under a forked global RNG seeded with ``INIT_SEED``, moved to ``device``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        model = build()
    return model.to(device)


def adam(lr: float) -> Callable[[Iterable[Tensor]], torch.optim.Optimizer]:
    """A ``make_optimizer``: ``params`` → a fresh ``torch.optim.Adam`` at ``lr``."""
    return functools.partial(torch.optim.Adam, lr=lr)


def device_of(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter."""
    return next(model.parameters()).device


def summed_over_batches(
    model: nn.Module,
    tensors: Sequence[Tensor],
    score: Callable[[nn.Module, Sequence[Tensor]], float],
) -> float:
    """Σ ``score(model, batch)`` over ``EVAL_BATCH`` slices of ``tensors``.

    Each slice is moved to the model's device; the model runs in eval mode
    without gradients and is put back in train mode, even on error.
    """
    device = device_of(model)
    total = 0.0
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(tensors[0]), EVAL_BATCH):
                batch = [t[start : start + EVAL_BATCH].to(device) for t in tensors]
                total += score(model, batch)
    finally:
        model.train()
    return total


def _correct(model: nn.Module, batch: Sequence[Tensor]) -> float:
    x, y = batch
    return float((model(x).argmax(dim=-1) == y).sum().item())


def accuracy(model: nn.Module, dataset: TensorDataset) -> float:
    """The share of targets predicted (argmax of the last logit dimension), in [0, 1].

    Args:
        model: a classifier mapping inputs to logits ``[..., classes]``.
        dataset: ``(inputs, targets)``; targets ``[b]`` or ``[b, T]``.
    """
    inputs, targets = dataset.tensors
    return summed_over_batches(model, (inputs, targets), _correct) / max(targets.numel(), 1)


def char_codes(text: bytes) -> Tensor:
    """Bytes to ``VOCAB`` indices, int64: newline 1, printable ASCII 2..96, all else 0."""
    raw = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
    codes = torch.zeros_like(raw)  # 0: anything else
    printable = (raw >= 32) & (raw <= 126)
    codes[printable] = raw[printable] - 30  # 32..126 -> 2..96
    codes[raw == 10] = 1  # newline
    return codes
