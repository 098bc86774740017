"""``digits-logreg``: multinomial logistic regression on the 8×8 digits.

The smallest workload: one ``Linear(64, 10)`` (650 parameters) under
cross-entropy, on the same stratified split as ``digits`` (1,437 training,
360 test samples). A step costs about 0.25 ms on one core (batch 32,
measured on the 2-core development machine), so messaging, Python overhead
and sleep granularity weigh as much as compute: this workload shows the
communication-bound end of the range, and the benchmark reports it as such.

Data, ``step_fn`` and ``eval_fn`` are the MLP's (``elche.workloads.digits``):
only the model and the optimizer differ.
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
# Adam at 1e-2: a convex problem with 650 weights tolerates a large step; on one
# process at batch 32 it reaches ~0.95 test accuracy within 10 epochs.
LEARNING_RATE = 1e-2


def make_model(device: torch.device | str) -> nn.Module:
    """``Linear(64, 10)`` with the same initial weights on every call.

    Args:
        device: where the parameters live.

    Returns:
        The model, taking ``float32 [batch, 64]`` to logits ``[batch, 10]``.
    """
    return seeded(lambda: nn.Linear(NUM_FEATURES, NUM_CLASSES), device)


make_optimizer = adam(LEARNING_RATE)  # a fresh Adam over the given parameters
