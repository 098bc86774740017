"""``digits-wide``: a wide MLP on the 8×8 digits, over a million parameters.

``64 → 1024 → 1024 → 10`` with ReLUs: 1,126,410 parameters, so one copy of
the model (or of its gradients) is 4.5 MB in float32. That makes it the
workload of the several-hosts benchmark (``elche bench --suite hosts``): on
a 100 Mbit/s link one all-reduce of it takes about half a second, while a
training step at batch 32 costs ~17 ms on one core (measured on the 2-core
development machine under load). The data,
``step_fn`` and ``eval_fn`` are the MLP's (``elche.workloads.digits``).
"""

from __future__ import annotations

import torch
from torch import nn

from elche.workloads.common import adam, seeded
from elche.workloads.digits import NUM_CLASSES, NUM_FEATURES, eval_fn, load_split, step_fn

__all__ = [
    "HIGHER_IS_BETTER",
    "METRIC",
    "eval_fn",
    "load_split",
    "make_model",
    "make_optimizer",
    "step_fn",
]

METRIC = "accuracy"
HIGHER_IS_BETTER = True
WIDTH = 1024  # two hidden layers this wide: 1,126,410 parameters
LEARNING_RATE = 1e-3


def make_model(device: torch.device | str) -> nn.Module:
    """Build the wide MLP with the same initial weights on every call.

    Args:
        device: where the parameters live.

    Returns:
        The model, taking ``float32 [batch, 64]`` to logits ``[batch, 10]``.
    """
    return seeded(
        lambda: nn.Sequential(
            nn.Linear(NUM_FEATURES, WIDTH),
            nn.ReLU(),
            nn.Linear(WIDTH, WIDTH),
            nn.ReLU(),
            nn.Linear(WIDTH, NUM_CLASSES),
        ),
        device,
    )


make_optimizer = adam(LEARNING_RATE)  # a fresh Adam over the given parameters
