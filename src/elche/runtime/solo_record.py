"""A single rank's timeline: the dashboard, TensorBoard and the report for one rank too.

One rank trains in-process with no coordinator, so nothing writes a
timeline for it. When the run has a run directory (``run_dir=``, or a
temporary one because a dashboard or a TensorBoard log was asked for),
``SoloRecord`` writes the records a cluster's coordinator would for one rank
(``RankJoined``, ``RunStart``, ``RolesMoved``, per epoch ``EpochStart``, a
``RankWindow`` and ``EpochEnd``, ``Eval`` or ``EvalFailed``, ``CheckpointRan``,
``RunEnd``), and the same watchers follow it (``launch.start_watching``); at
the end it writes the report. Everything it writes is for watching: a write that fails is
reported once and training goes on.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

from elche.core import timeline as tl
from elche.monitor.timeline import TimelineWriter
from elche.runtime.launch import Watchers, keep_report, start_watching
from elche.runtime.plan import Plan
from elche.runtime.salvage import forget_earlier_run

__all__ = ["SoloRecord"]


class SoloRecord:
    """Writes one rank's timeline in ``run_dir`` and serves it as asked.

    Args:
        plan: the run's plan.
        run_dir: the run directory (made if missing).
        dashboard: the dashboard address, or None.
        tensorboard_dir: the TensorBoard log directory, or None.
    """

    def __init__(
        self, plan: Plan, run_dir: Path, *, dashboard: str | None, tensorboard_dir: str | None
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        forget_earlier_run(run_dir)  # its timeline would open this one's
        self.plan, self.run_dir = plan, run_dir
        self._writer = TimelineWriter(run_dir, started_s=time.monotonic())
        self._failed = False
        self._epoch_started_s = time.monotonic()
        self._watchers: Watchers = start_watching(plan, run_dir, dashboard, tensorboard_dir)
        self._write(tl.RankJoined(rank=0, host=socket.gethostname()))
        self._write(tl.RunStart(world_size=1, mode=plan.config.mode.value))
        self._write(tl.RolesMoved(epoch_rank=0, eval_rank=0, checkpoint_rank=0))

    def epoch_started(self, epoch: int) -> None:
        self._epoch_started_s = time.monotonic()
        self._write(tl.EpochStart(epoch=epoch))

    def epoch_ended(
        self, epoch: int, *, loss: float | None, lr: float | None, batches: int, samples: int,
        compute_s: float,
    ) -> None:  # fmt: skip
        """The epoch's window (the whole epoch: one rank has no rounds) and its end."""
        span_s = max(time.monotonic() - self._epoch_started_s, 1e-9)
        self._write(tl.RankWindow(
            rank=0, epoch=epoch, span_s=round(span_s, 6), batches=batches, samples=samples,
            loss=loss, samples_per_s=round(samples / span_s, 3), share=1.0,
            compute_ms_per_batch=round(1000 * compute_s / batches, 4) if batches else None,
            idle_pct=round(max(0.0, 100 * (1 - compute_s / span_s)), 3),
        ))  # fmt: skip
        self._write(tl.EpochEnd(epoch=epoch, loss=loss, rounds_done=0, lr=lr))

    def evaluated(self, epochs_done: int, metric: float, duration_ms: float) -> None:
        self._write(tl.Eval(epoch=epochs_done, metric=metric, rank=0,
                            duration_ms=round(duration_ms, 3)))  # fmt: skip

    def eval_failed(self, epochs_done: int, error: str, duration_ms: float) -> None:
        self._write(tl.EvalFailed(epoch=epochs_done, rank=0, duration_ms=round(duration_ms, 3),
                                  error=error))  # fmt: skip

    def checkpoint_ran(self, version: int, error: str | None, duration_ms: float) -> None:
        self._write(tl.CheckpointRan(
            version=version, rank=0, duration_ms=round(duration_ms, 3),
            outcome="ok" if error is None else "failed", error=error,
        ))  # fmt: skip

    def saved(self, stem: str, seq: int, reason: str) -> None:
        self._write(tl.BundleWritten(stem=stem, seq=seq, reason=reason))

    def ended(
        self,
        *,
        outcome: str,
        reason: str,
        epochs: int,
        samples: int,
        skipped: tuple[int, int] = (0, 0),
    ) -> str | None:
        """Write ``RunEnd``, stop the watchers, write the report; the report's path.

        ``skipped``: the steps ``nonfinite="skip"`` left out, and their samples.
        """
        self._write(tl.RunEnd(
            outcome=outcome, reason=reason, epochs_completed=epochs, rounds_done=0,
            lost_samples=0, dead_ranks=(), rejected_frames=0, anchor=0,
            samples_per_rank=(samples,), skipped_steps=skipped[0], skipped_samples=skipped[1],
        ))  # fmt: skip
        self._writer.close()
        self._watchers.stop()
        return keep_report(self.plan, self.run_dir)

    def _write(self, event: tl.TimelineEvent) -> None:
        if self._failed:
            return
        try:
            self._writer.write(event, time.monotonic())
        except OSError as exc:  # the timeline is for watching; training goes on
            self._failed = True
            print(f"elche: could not write the timeline: {exc}", file=sys.stderr, flush=True)
