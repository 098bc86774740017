"""A rank's testing hooks: the faults of its ``RankSpec`` (``elche.core.faults``), fired.

Rules:

- Faults are checked before each batch, by progress (``at_epoch``) and by
  wall seconds since the training loop began (``at_s``); each fires once, in
  order. ``Kill`` SIGKILLs the process, ``Stall`` freezes the heartbeats and
  hangs, ``SlowDown`` re-paces every later step, ``FailCheckpoint`` makes
  every later checkpoint report an error (from the start when it has no
  time), ``KillCoordinator`` SIGKILLs the coordinator the run dir names,
  ``StopLauncher`` sends the launcher SIGTERM, ``FillSavePath`` fills the
  file system of the save path.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, assert_never

from torch import nn

from elche.core import rank as r
from elche.core.faults import (
    FailCheckpoint,
    Fault,
    FillSavePath,
    Join,
    Kill,
    KillCoordinator,
    SlowDown,
    Stall,
    StopLauncher,
    position,
)
from elche.runtime.filling import fill_file_system

if TYPE_CHECKING:
    from elche.runtime.worker import Worker

__all__ = ["RankFaults"]

CheckpointFn = Callable[[int, nn.Module], None]


class RankFaults:
    """The faults of one rank not fired yet, and whether its checkpoints fail."""

    def __init__(self, faults: Sequence[Fault]) -> None:
        self._pending = [f for f in faults if not f.from_start]  # not fired yet
        self._fail_checkpoint = any(f.from_start for f in faults)
        self._started_s = time.monotonic()  # reset when the loop begins (at_s counts from it)

    def start(self) -> None:
        """The training loop begins: ``at_s`` counts from now."""
        self._started_s = time.monotonic()

    def checkpoint_fn(self, users: CheckpointFn | None) -> CheckpointFn | None:
        """The ``checkpoint_fn`` to run: the user's, or one that fails (``FailCheckpoint``)."""
        return _failing_checkpoint if self._fail_checkpoint else users

    def before(self, worker: Worker, batch: r.Train) -> None:
        """Testing hooks: before ``batch``, fire this rank's faults that are due, in order."""
        if not self._pending:
            return
        at = position(epoch=batch.epoch, offset=batch.offset, num_samples=len(worker.fns.dataset))
        elapsed_s = time.monotonic() - self._started_s
        pending, self._pending = self._pending, []
        for fault in pending:
            if fault.due(epoch=at, elapsed_s=elapsed_s):
                self._fire(worker, fault, at)
            else:
                self._pending.append(fault)

    def _fire(self, worker: Worker, fault: Fault, at: float) -> None:
        rank = worker.spec.rank
        match fault:
            case Kill():
                print(f"elche rank {rank}: crashing on purpose at {at:.2f}", file=sys.stderr)
                os.kill(os.getpid(), signal.SIGKILL)
            case Stall():
                print(f"elche rank {rank}: stalling on purpose at {at:.2f}", file=sys.stderr)
                assert worker.bridge is not None
                worker.bridge.freeze()
                threading.Event().wait()  # hangs until the launcher kills the process
            case SlowDown(speed=speed):
                print(f"elche rank {rank}: slowing to {speed:g} at {at:.2f}", file=sys.stderr)
                assert worker.pacer is not None  # warm_up built one (slows_later)
                worker.pacer.set_speed(speed)
            case FailCheckpoint():
                self._fail_checkpoint = True
            case KillCoordinator():
                _kill_coordinator(worker, at)
            case Join():  # no rank's fault in a real run (FaultPlan.check): elche join
                pass
            case StopLauncher():
                print(f"elche rank {rank}: SIGTERM to the launcher at {at:.2f}", file=sys.stderr)
                if worker.spec.launcher_pid is not None:
                    os.kill(worker.spec.launcher_pid, signal.SIGTERM)
            case FillSavePath():
                folder = Path(worker.spec.save_path or worker.spec.run_dir).parent
                print(f"elche rank {rank}: {fill_file_system(folder)} at {at:.2f}", file=sys.stderr)
            case _:
                assert_never(fault)


def _kill_coordinator(worker: Worker, at: float) -> None:
    """The ``KillCoordinator`` fault: SIGKILL the coordinator named in the run dir."""
    rank = worker.spec.rank
    try:
        pid = int((Path(worker.spec.run_dir) / "coordinator.pid").read_text(encoding="utf-8"))
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError) as exc:
        print(f"elche rank {rank}: cannot kill the coordinator: {exc}", file=sys.stderr)
        return
    print(f"elche rank {rank}: killed the coordinator on purpose at {at:.2f}", file=sys.stderr)


def _failing_checkpoint(version: int, model: nn.Module) -> None:
    """The ``checkpoint_fn`` of a rank under a ``FailCheckpoint`` fault."""
    del version, model
    raise OSError("disk full (FailCheckpoint fault)")
