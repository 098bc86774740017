"""The last finite consensus a rank holds, to save instead of a model gone bad.

Theory of operation. After every average a rank loads (and once before
training: the initial or resumed weights) the worker calls ``keep``, which
copies the model's state to host memory if every floating-point value in it
is finite. When the run stops for a non-finite loss or average
(``SaveReason.NONFINITE``, ``elche.core.failures``) the worker calls
``restore`` before it saves, so the bundle never holds NaN weights. The cost
is one host copy of the model per rank, refreshed once per averaging round.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Consensus"]


class Consensus:
    """A host copy of the last finite consensus model state."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] | None = None

    def keep(self, model: nn.Module) -> bool:
        """Copy ``model``'s state if it is all finite; returns whether it was kept."""
        state = model.state_dict()
        for value in state.values():
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                return False
        self.state = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        return True

    def restore(self, model: nn.Module) -> bool:
        """Load the kept state into ``model``; returns False if none was kept."""
        if self.state is None:
            return False
        model.load_state_dict(self.state)
        return True
