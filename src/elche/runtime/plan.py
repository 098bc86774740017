"""What the launch paths share: a validated run, the user's hooks, the result.

``elche.train`` validates its arguments into a ``Plan`` and hands it, with
the ``Hooks`` that run in the calling process, to one of the launch paths:
``solo`` (one rank, in-process), ``launch`` (one local process per rank) or
``launched`` (this process is one rank under ``torchrun`` or ``elche run``).
Each returns a ``TrainResult``. The types live here, in the runtime, so that
the runtime never imports the public API module built on top of it (an
import-linter contract in ``pyproject.toml`` keeps it so).

This module never imports torch: ``import elche`` and the coordinator
process stay light.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elche.core.config import CoordinatorConfig
from elche.core.faults import FaultPlan

__all__ = ["Hooks", "Plan", "TrainResult"]


@dataclass(slots=True)
class TrainResult:
    """What ``train`` returns."""

    state_dict: dict[str, Any]
    epochs: list[dict[str, object]] = field(default_factory=list)
    summary: dict[str, object] = field(default_factory=dict)
    run_dir: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Hooks:
    """The user's callbacks that run in the calling process, not on a rank."""

    eval_result_fn: Callable[[int, float], None] | None
    metrics_fn: Callable[[dict[str, object]], None] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A validated run: the coordinator config plus per-rank settings."""

    config: CoordinatorConfig
    speeds: tuple[float, ...]
    speed_base_s: float | None
    devices: tuple[str, ...]
    resume_from: str | None
    faults: FaultPlan  # testing hook: what each rank does wrong, and when
