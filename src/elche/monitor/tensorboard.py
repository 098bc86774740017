"""TensorBoard scalars of a run, written from the launching process as the timeline grows.

Theory of operation. ``TensorBoardLog`` is a daemon thread that follows
``RUN_DIR/timeline.jsonl`` (as the dashboard does) every ``FOLLOW_EVERY_S``
and turns records into scalars in an event file, through tensorboardX's
``EventsWriter`` (the ``elche[tensorboard]`` extra; the event format of
``torch.utils.tensorboard``, in a package of its own, so this layer, which
imports no torch, can use it). The coordinator never waits for it: a log
that fails is reported once and the run goes on.

The thread writes the file itself. tensorboardX's ``SummaryWriter`` hands
each event to a thread of its own through a 10-event queue: on a full disk
that thread died with a traceback, the next ``add_scalar`` waited on the
full queue for ever, and the run's end waited out ``stop``'s timeout.

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
    from tensorboardX.event_file_writer import EventsWriter

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
        from tensorboardX.event_file_writer import EventsWriter

        self._reader = TimelineReader(run_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        # The file's name as SummaryWriter gives it: events.out.tfevents.<time>.<host>
        self._writer: EventsWriter = EventsWriter(str(log_dir / "events"))
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
                for scalar in scalars_for(event, self._rounds):
                    self._add(*scalar, wall_s=self._started_wall_s + event.t)
                if isinstance(event, tl.SyncEnd):
                    self._rounds = event.round
            self._writer.flush()
        except Exception as exc:  # the log must never end the run
            self._fail(exc)

    def _add(self, tag: str, value: float, step: int, *, wall_s: float) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
        self._writer.write_event(Event(wall_time=wall_s, step=step, summary=summary))

    def _fail(self, exc: Exception) -> None:
        if not self._failed:
            self._failed = True
            print(f"elche: the TensorBoard log stopped: {exc!r}", file=self._log, flush=True)

    def _follow(self) -> None:
        while not self._stop.wait(FOLLOW_EVERY_S):
            self.follow()
        self.follow()
        try:
            self._writer.close()
        except OSError as exc:  # its last flush, on a full disk
            self._fail(exc)
