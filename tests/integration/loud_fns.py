"""A step that says where its process's streams go (picklable, for ranks).

The first step of each process writes ``LOUD <mark> rank <r>`` to its
stdout and to its stderr, ``<mark>`` being ``ELCHE_LOUD_MARK`` in its
environment; then it trains as ``digits.step_fn``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from torch import Tensor, nn

from elche.workloads import digits

_SAID: list[bool] = []


def loud_step(model: nn.Module, batch: Sequence[Tensor]) -> Tensor:
    if not _SAID:
        _SAID.append(True)
        line = f"LOUD {os.environ.get('ELCHE_LOUD_MARK')} rank {os.environ.get('ELCHE_RANK')}"
        print(line, flush=True)
        print(line, file=sys.stderr, flush=True)
    return digits.step_fn(model, batch)


def no_checkpoint(version: int, model: object) -> None:
    """A ``checkpoint_fn`` that writes nothing (the fault plan fails it first)."""
