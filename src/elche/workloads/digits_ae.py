"""``digits-ae``: a small convolutional autoencoder on the 8×8 digits.

The encoder (3×3 conv 1→16, stride-2 conv 16→32, linear to a 16-number
code) and the decoder (linear, transposed conv 32→16, conv 16→1, sigmoid)
rebuild each image from its code; 30,065 parameters, about 3 ms a step at
batch 32 on one core of the 2-core development machine. The loss and the
metric are the mean squared error of the reconstruction in pixel units
scaled to [0, 1] — **lower is better** (``HIGHER_IS_BETTER = False``). The
labels of the digits split are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from elche.workloads.common import adam, device_of, seeded, summed_over_batches
from elche.workloads.digits import load_split

__all__ = [
    "HIGHER_IS_BETTER",
    "METRIC",
    "eval_fn",
    "load_split",
    "make_model",
    "make_optimizer",
    "step_fn",
]

METRIC = "reconstruction MSE"
HIGHER_IS_BETTER = False
CHANNELS = 16  # the first conv's; the second has twice as many
CODE = 16  # bottleneck: 64 pixels -> 16 numbers
LEARNING_RATE = 2e-3


def make_model(device: torch.device | str) -> nn.Module:
    """Build the autoencoder with the same initial weights on every call.

    Args:
        device: where the parameters live.

    Returns:
        The model, taking ``float32 [batch, 64]`` to a reconstruction of the
        same shape with values in (0, 1).
    """
    c = CHANNELS
    return seeded(
        lambda: nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),  # [b, 1, 8, 8]
            nn.Conv2d(1, c, 3, padding=1),  # [b, 16, 8, 8]
            nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1),  # [b, 32, 4, 4]
            nn.ReLU(),
            nn.Flatten(),  # [b, 512]
            nn.Linear(2 * c * 16, CODE),  # the code, [b, 16]
            nn.Linear(CODE, 2 * c * 16),
            nn.ReLU(),
            nn.Unflatten(1, (2 * c, 4, 4)),  # [b, 32, 4, 4]
            nn.ConvTranspose2d(2 * c, c, 4, stride=2, padding=1),  # [b, 16, 8, 8]
            nn.ReLU(),
            nn.Conv2d(c, 1, 3, padding=1),  # [b, 1, 8, 8]
            nn.Sigmoid(),
            nn.Flatten(),  # [b, 64]
        ),
        device,
    )


make_optimizer = adam(LEARNING_RATE)  # a fresh Adam over the given parameters


def step_fn(model: nn.Module, batch: Sequence[Tensor]) -> Tensor:
    """The reconstruction loss of one batch (labels ignored).

    Args:
        model: the autoencoder, or a wrapper of it (DDP).
        batch: ``[x, y]``; ``x`` float32 ``[b, 64]`` in [0, 1].

    Returns:
        The mean squared error over every pixel of the batch, a scalar.
    """
    x = batch[0].to(device_of(model))
    return nn.functional.mse_loss(model(x), x)


def eval_fn(model: nn.Module, dataset: TensorDataset) -> float:
    """Mean squared reconstruction error on ``dataset`` (lower is better).

    Args:
        model: the autoencoder.
        dataset: features and labels as ``load_split`` returns them.

    Returns:
        The per-pixel MSE over the whole dataset, ≥ 0.
    """
    features = dataset.tensors[0]
    return summed_over_batches(model, (features,), _squared_error) / max(features.numel(), 1)


def _squared_error(model: nn.Module, batch: Sequence[Tensor]) -> float:
    (x,) = batch
    return float(nn.functional.mse_loss(model(x), x, reduction="sum"))
