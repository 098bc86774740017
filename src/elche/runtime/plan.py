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

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elche.core.config import CoordinatorConfig
from elche.core.errors import ConfigError
from elche.core.faults import FaultPlan

__all__ = ["Hooks", "Plan", "TrainResult", "hold_save_path"]


@dataclass(slots=True)
class TrainResult:
    """What ``train`` returns."""

    state_dict: dict[str, Any]
    epochs: list[dict[str, object]] = field(default_factory=list)
    summary: dict[str, object] = field(default_factory=dict)
    run_dir: str | None = None


@contextmanager
def hold_save_path(save_path: str | None) -> Iterator[None]:
    """Hold ``save_path`` for this run: a second run at the same stem is refused.

    An advisory lock on ``STEM.lock`` (``fcntl.flock``, the holder's pid in
    the file), released when the run returns or its process dies, so a
    killed run never blocks the next one.

    Raises:
        ConfigError: another live run holds ``save_path`` (its pid is named).
    """
    if save_path is None:
        yield
        return
    lock = Path(f"{save_path}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            raise ConfigError(
                "save_path",
                f"another run (pid {holder}) is writing bundles at {save_path}; "
                "give this run its own save_path",
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        yield  # the file stays: removing it would let two runs lock two inodes


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
    # The save number of the bundle ``resume_from`` named when it was checked: the
    # coordinator and every rank start from that save, or refuse to start.
    resume_seq: int | None = None
