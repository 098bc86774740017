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

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

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
INIT_SEED = 0  # every rank must start from the same weights
CHANNELS = 16  # the first conv's; the second has twice as many
CODE = 16  # bottleneck: 64 pixels -> 16 numbers
LEARNING_RATE = 2e-3
EVAL_BATCH = 512


def make_model(device: torch.device | str) -> nn.Module:
    """Build the autoencoder with the same initial weights on every call.

    Args:
        device: where the parameters live.

    Returns:
        The model, taking ``float32 [batch, 64]`` to a reconstruction of the
        same shape with values in (0, 1).
    """
    c = CHANNELS
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        model = nn.Sequential(
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
        )
    return model.to(device)


def make_optimizer(params: Iterable[Tensor]) -> torch.optim.Optimizer:
    """Adam at ``LEARNING_RATE``.

    Args:
        params: the parameters to optimize.

    Returns:
        A fresh ``torch.optim.Adam``.
    """
    return torch.optim.Adam(params, lr=LEARNING_RATE)


def step_fn(model: nn.Module, batch: Sequence[Tensor]) -> Tensor:
    """The reconstruction loss of one batch (labels ignored).

    Args:
        model: the autoencoder, or a wrapper of it (DDP).
        batch: ``[x, y]``; ``x`` float32 ``[b, 64]`` in [0, 1].

    Returns:
        The mean squared error over every pixel of the batch, a scalar.
    """
    x = batch[0].to(_device_of(model))
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
    device = _device_of(model)
    total = 0.0
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(features), EVAL_BATCH):
                x = features[start : start + EVAL_BATCH].to(device)
                total += float(nn.functional.mse_loss(model(x), x, reduction="sum"))
    finally:
        model.train()
    return total / max(features.numel(), 1)


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
