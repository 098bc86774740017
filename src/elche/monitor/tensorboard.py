"""TensorBoard scalars of a run, written from the launching process as the timeline grows.

Theory of operation. ``TensorBoardLog`` is a daemon thread that follows
``RUN_DIR/timeline.jsonl`` (as the dashboard does) every ``FOLLOW_EVERY_S``
and turns records into scalars through tensorboardX's ``SummaryWriter``
(the ``elche[tensorboard]`` extra; the same writer API as
``torch.utils.tensorboard``, in a package of its own, so this layer, which
imports no torch, can use it). The coordinator never waits for it: a log
that fails is reported once and the run goes on.

Scalars (``scalars_for``), each at a step that orders them:

- ``loss``, ``lr``: at the epoch's end, step = epoch;
- ``eval/metric``: an eval's result, step = the epochs it saw;
- ``rounds/duration_ms``, ``rounds/anchor``: each averaging round, step =
  the round;
- ``rank<R>/samples_per_s``, ``rank<R>/share``, ``rank<R>/idle_pct``: each
  window record, step = the rounds done when it was taken.

Wall times are the run's: the log's start plus the record's ``t``.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from elche.core import timeline as tl
from elche.monitor.timeline import TimelineReader

if TYPE_CHECKING:
    from tensorboardX import SummaryWriter

__all__ = ["TensorBoardLog", "scalars_for"]

# A TensorBoard reader polls its files every few seconds: once a second is live enough.
FOLLOW_EVERY_S = 1.0

Scalar = tuple[str, float, int]  # tag, value, step


def scalars_for(event: tl.TimelineEvent, rounds_done: int) -> list[Scalar]:
    """The scalars one record gives (``rounds_done``: the latest round completed before it)."""
    match event:
        case tl.EpochEnd(epoch=epoch, loss=loss, lr=lr):
            out = [] if loss is None else [("loss", loss, epoch)]
            return out + ([] if lr is None else [("lr", lr, epoch)])
        case tl.Eval(epoch=epoch, metric=metric):
            return [("eval/metric", metric, epoch)]
        case tl.SyncEnd(round=number, duration_ms=duration_ms, anchor=anchor):
            return [("rounds/duration_ms", duration_ms, number),
                    ("rounds/anchor", float(anchor), number)]  # fmt: skip
        case tl.RankWindow(rank=rank, samples_per_s=sps, share=share, idle_pct=idle):
            return [(f"rank{rank}/samples_per_s", sps, rounds_done),
                    (f"rank{rank}/share", share, rounds_done),
                    (f"rank{rank}/idle_pct", idle, rounds_done)]  # fmt: skip
        case _:
            return []


class TensorBoardLog:
    """Writes a run's scalars under ``log_dir`` while it goes on.

    Args:
        run_dir: the run directory whose timeline is followed.
        log_dir: where the event files go (made if missing).
        log: where a failure is reported.
    """

    def __init__(self, run_dir: Path, log_dir: Path, *, log: TextIO = sys.stderr) -> None:
        from tensorboardX import SummaryWriter

        self._reader = TimelineReader(run_dir)
        self._writer: SummaryWriter = SummaryWriter(log_dir=str(log_dir))
        self._started_wall_s = time.time()
        self._rounds = 0
        self._log = log
        self._failed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="elche-tensorboard", daemon=True)
        self.log_dir = log_dir

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Write what the timeline still holds, flush and close the files."""
        self._stop.set()
        self._thread.join(timeout_s)

    def follow(self) -> None:
        """Write the scalars of the records appended since the last call."""
        if self._failed:
            return
        try:
            for event in self._reader.new_records():
                for tag, value, step in scalars_for(event, self._rounds):
                    wall_s = self._started_wall_s + event.t
                    self._writer.add_scalar(tag, value, step, walltime=wall_s)
                if isinstance(event, tl.SyncEnd):
                    self._rounds = event.round
            self._writer.flush()
        except Exception as exc:  # the log must never end the run
            self._failed = True
            print(f"elche: the TensorBoard log stopped: {exc!r}", file=self._log, flush=True)

    def _follow(self) -> None:
        while not self._stop.wait(FOLLOW_EVERY_S):
            self.follow()
        self.follow()
        self._writer.close()
