"""A run's timeline as a Chrome trace (the trace-event JSON format; Perfetto and
``chrome://tracing`` open it): ``elche timeline RUN_DIR --chrome OUT.json``.

Layout: one process per rank (``rank R``, pid R + 1) with three threads,

- ``work`` (tid 0): each ``RankWindow`` as its compute time followed by its
  idle time (two slices: the window records the sum of each, not their
  order), named by epoch, with the window's figures as arguments; a
  ``throttle`` instant when the rank trained its budget and waited; ``lost``
  when it was;
- ``averaging`` (tid 1): each averaging round while the rank was live;
- ``callbacks`` (tid 2): the evals and checkpoints it ran;

and a ``coordinator`` process (pid 0): epochs, rounds, and instants for
anchor changes, nudges, alerts, bundles written and the run's end.

Times are microseconds since the coordinator started (the records' ``t``).
An argument that is a float but not a number JSON can hold (an eval's NaN)
is its text, ``"nan"``, as the timeline writes it.
Pure: records in, a JSON-able dict out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from elche._files import write_text_atomic
from elche.core import timeline as tl

__all__ = ["chrome_trace", "write_chrome_trace"]

COORDINATOR_PID = 0
WORK_TID, AVERAGING_TID, CALLBACKS_TID = 0, 1, 2
_THREADS = {WORK_TID: "work", AVERAGING_TID: "averaging", CALLBACKS_TID: "callbacks"}

Event = dict[str, Any]


def _us(seconds: float) -> float:
    return round(max(seconds, 0.0) * 1e6, 3)


def _args(args: dict[str, Any]) -> dict[str, Any]:
    return {k: repr(v) if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in args.items()}  # fmt: skip


def _slice(name: str, pid: int, tid: int, end_s: float, dur_s: float, **args: Any) -> Event:
    dur_s = max(dur_s, 0.0)
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": _us(end_s - dur_s),
            "dur": _us(dur_s), "args": _args(args)}  # fmt: skip


def _instant(name: str, pid: int, tid: int, t: float, **args: Any) -> Event:
    return {"name": name, "ph": "i", "s": "t", "pid": pid, "tid": tid, "ts": _us(t),
            "args": _args(args)}  # fmt: skip


def _meta(name: str, pid: int, value: Any, tid: int | None = None) -> Event:
    event: Event = {"name": name, "ph": "M", "pid": pid, "args": {"name": value}}
    if name.endswith("sort_index"):
        event["args"] = {"sort_index": value}
    if tid is not None:
        event["tid"] = tid
    return event


class _Tracer:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ranks: set[int] = set()
        self.live: set[int] = set()
        self.epoch_started: dict[int, float] = {}

    def rank_pid(self, rank: int) -> int:
        self.ranks.add(rank)
        return rank + 1

    def observe(self, event: tl.TimelineEvent) -> None:
        match event:
            case tl.RankJoined(rank=rank, host=host):
                self.live.add(rank)
                self.events.append(_instant("joined", self.rank_pid(rank), WORK_TID, event.t,
                                            host=host))  # fmt: skip
            case tl.RankLost(rank=rank, reason=reason):
                self.live.discard(rank)
                self.events.append(_instant("lost", self.rank_pid(rank), WORK_TID, event.t,
                                            reason=reason))  # fmt: skip
            case tl.RankWindow():
                self._window(event)
            case tl.Throttle(rank=rank, steps=steps):
                self.events.append(_instant("throttle", self.rank_pid(rank), WORK_TID, event.t,
                                            steps=steps))  # fmt: skip
            case tl.SyncEnd(round=number, duration_ms=ms, d_raw=d_raw, anchor=anchor):
                name = f"average r{number}"
                figures = {"duration_ms": ms, "divergence": d_raw, "anchor": anchor}
                self.events.append(_slice(name, COORDINATOR_PID, AVERAGING_TID, event.t,
                                          ms / 1000, **figures))  # fmt: skip
                for rank in sorted(self.live):
                    self.events.append(_slice(name, self.rank_pid(rank), AVERAGING_TID,
                                              event.t, ms / 1000, **figures))  # fmt: skip
            case tl.Eval(epoch=epoch, rank=rank, duration_ms=ms, metric=metric):
                self.events.append(_slice(f"eval e{epoch}", self.rank_pid(rank), CALLBACKS_TID,
                                          event.t, ms / 1000, metric=metric))  # fmt: skip
            case tl.EvalFailed(epoch=epoch, rank=rank, duration_ms=ms, error=error):
                pid = self.rank_pid(rank)
                self.events.append(_slice(f"eval e{epoch} failed", pid, CALLBACKS_TID, event.t,
                                          ms / 1000, error=error))  # fmt: skip
            case tl.CheckpointRan(version=version, rank=rank, duration_ms=ms, outcome=outcome):
                pid = self.rank_pid(rank)
                self.events.append(_slice(f"checkpoint v{version}", pid, CALLBACKS_TID, event.t,
                                          ms / 1000, outcome=outcome))  # fmt: skip
            case tl.EpochStart(epoch=epoch):
                self.epoch_started.setdefault(epoch, event.t)
            case tl.EpochEnd(epoch=epoch, loss=loss, lr=lr):
                begun = self.epoch_started.get(epoch, event.t)
                self.events.append(_slice(f"epoch {epoch}", COORDINATOR_PID, WORK_TID, event.t,
                                          event.t - begun, loss=loss, lr=lr))  # fmt: skip
            case (
                tl.AnchorChanged(old=old, new=new)
                | tl.MetaNudge(old=old, new=new)
                | tl.GuardNudge(old=old, new=new)
            ):
                self.events.append(_instant(type(event).__name__, COORDINATOR_PID, WORK_TID,
                                            event.t, old=old, new=new))  # fmt: skip
            case tl.Alert(severity=severity, name=name, path=path, detail=detail, count=count):
                label = f"[{severity}] {name} {path}"
                self.events.append(_instant(label, COORDINATOR_PID, WORK_TID, event.t,
                                            detail=detail, count=count))  # fmt: skip
            case tl.BundleWritten(stem=stem, seq=seq, reason=reason):
                self.events.append(_instant("bundle written", COORDINATOR_PID, WORK_TID, event.t,
                                            stem=stem, seq=seq, reason=reason))  # fmt: skip
            case tl.RunEnd(outcome=outcome, reason=reason):
                self.events.append(_instant(f"run {outcome}", COORDINATOR_PID, WORK_TID, event.t,
                                            reason=reason))  # fmt: skip
            case _:
                pass

    def _window(self, w: tl.RankWindow) -> None:
        pid = self.rank_pid(w.rank)
        idle_s = w.span_s * min(max(w.idle_pct, 0.0), 100.0) / 100
        compute_s = w.span_s - idle_s
        figures = {"batches": w.batches, "samples": w.samples, "samples_per_s": w.samples_per_s,
                   "share": w.share, "loss": w.loss, "compute_ms_per_batch": w.compute_ms_per_batch,
                   "idle_pct": w.idle_pct}  # fmt: skip
        self.events.append(_slice(f"train e{w.epoch}", pid, WORK_TID, w.t - idle_s, compute_s,
                                  **figures))  # fmt: skip
        if idle_s > 0:
            self.events.append(_slice("idle", pid, WORK_TID, w.t, idle_s, idle_pct=w.idle_pct))

    def names(self) -> list[Event]:
        out = [_meta("process_name", COORDINATOR_PID, "coordinator"),
               _meta("process_sort_index", COORDINATOR_PID, 0)]  # fmt: skip
        out += [_meta("thread_name", COORDINATOR_PID, "run", WORK_TID),
                _meta("thread_name", COORDINATOR_PID, "averaging", AVERAGING_TID)]  # fmt: skip
        for rank in sorted(self.ranks):
            pid = rank + 1
            out += [_meta("process_name", pid, f"rank {rank}"),
                    _meta("process_sort_index", pid, pid)]  # fmt: skip
            out += [_meta("thread_name", pid, name, tid) for tid, name in _THREADS.items()]
        return out


def chrome_trace(records: Iterable[tl.TimelineEvent]) -> dict[str, Any]:
    """The trace of ``records`` (in timeline order), as trace-event JSON data."""
    tracer = _Tracer()
    for record in records:
        tracer.observe(record)
    return {"traceEvents": tracer.names() + tracer.events, "displayTimeUnit": "ms",
            "otherData": {"source": "elche timeline"}}  # fmt: skip


def write_chrome_trace(records: Iterable[tl.TimelineEvent], out: Path) -> int:
    """Write the trace of ``records`` to ``out``, whole or not at all (through
    ``OUT.partial``); returns how many events it holds.

    Raises:
        OSError: ``out`` cannot be written (its folder is missing or read-only,
            or it is a directory); an earlier ``out`` is left as it was.
    """
    trace = chrome_trace(records)
    write_text_atomic(out, json.dumps(trace, allow_nan=False, default=str))
    return len(trace["traceEvents"])
