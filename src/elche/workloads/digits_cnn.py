"""``digits-cnn``: a small convolutional classifier on the 8×8 digits.

Two 3×3 convolutions (1→32→64 channels, same padding), a 2×2 max-pool and a
two-layer head (1,024→128→10): 151,306 parameters. A training step at batch
32 costs about 5 ms on one core of the 2-core development machine — heavy
enough that compute, not messaging, dominates a step, while a whole
benchmark run stays in seconds. The data, ``step_fn`` and ``eval_fn`` are
the MLP's (``elche.workloads.digits``): the model reshapes the flat
``[batch, 64]`` features to ``[batch, 1, 8, 8]`` itself.
"""

from __future__ import annotations

import torch
from torch import nn

from elche.workloads.common import adam, seeded
from elche.workloads.digits import NUM_CLASSES, eval_fn, load_split, step_fn

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
CHANNELS = (32, 64)  # ~5 ms a step at batch 32 on one core; (16, 32) is ~3 ms
HIDDEN = 128
LEARNING_RATE = 1e-3  # Adam's default; reaches ~0.98 test accuracy in 15 epochs


def make_model(device: torch.device | str) -> nn.Module:
    """Build the CNN with the same initial weights on every call.

    Args:
        device: where the parameters live.

    Returns:
        The model, taking ``float32 [batch, 64]`` (flattened 8×8 images) to
        logits ``[batch, 10]``.
    """
    c1, c2 = CHANNELS
    return seeded(
        lambda: nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),  # [b, 64] -> [b, 1, 8, 8]
            nn.Conv2d(1, c1, 3, padding=1),  # [b, 32, 8, 8]
            nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1),  # [b, 64, 8, 8]
            nn.ReLU(),
            nn.MaxPool2d(2),  # [b, 64, 4, 4]
            nn.Flatten(),  # [b, 1024]
            nn.Linear(c2 * 16, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, NUM_CLASSES),
        ),
        device,
    )


make_optimizer = adam(LEARNING_RATE)  # a fresh Adam over the given parameters
