"""The run summary: what the coordinator measured, joined with what the ranks did.

Two halves, one per process:

- ``RunStats`` and ``coordinator_summary`` run in the coordinator process:
  the stats follow the timeline records as they are written (the core's
  ``RunEnd`` among them), and at the end become ``RUN_DIR/summary.json``.
- ``read_run`` and ``run_summary`` run in the launcher: they read that file
  and the ranks' ``rank<R>.json`` reports and assemble the summary that
  ``elche.train`` returns and ``elche demo --json`` prints (the design's
  contract keys, plus a few more).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from elche.core import timeline as tl

__all__ = [
    "SUMMARY_FILE",
    "RunStats",
    "coordinator_summary",
    "rank_report_file",
    "rank_spans_file",
    "read_run",
    "run_summary",
]

SUMMARY_FILE = "summary.json"


def rank_report_file(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its own report at the end of the run."""
    return run_dir / f"rank{rank}.json"


def rank_spans_file(run_dir: Path, rank: int) -> Path:
    """Rank ``rank``'s own record of what each averaging round took from it.

    JSON lines, one per round the rank applied: ``{"round": N, "spans":
    [[epoch, offset, size], ...]}``, the batches this rank trained that the
    round averaged (written by the rank once the average is in its model);
    and ``{"round": "save K", ...}``: the unaveraged batches the model of a
    stop's bundle ``K`` holds, written by that model's writer.
    """
    return run_dir / f"rank{rank}.spans.jsonl"


@dataclass(slots=True)
class RunStats:
    """What the coordinator process measures for the summary, from the clock and the timeline."""

    first_dispatch_s: float | None = None  # monotonic: the first work handed out
    last_average_s: float | None = None  # monotonic: the last averaging round's end
    last_record_s: float | None = None  # monotonic: the latest record observed
    final_loss: float | None = None
    eval_metric: float | None = None
    eval_epoch: int = -1
    notices: list[str] = field(default_factory=list)
    end: tl.RunEnd | None = None  # the coordinator's account, once the run is over
    unsaved: str | None = None  # why the stop's bundle has no meta (its files may be there)

    def observe(self, event: tl.TimelineEvent, now_s: float) -> None:
        """Fold one timeline record written at ``now_s`` into the stats."""
        self.last_record_s = max(now_s, self.last_record_s or now_s)
        match event:
            case tl.SyncEnd():
                self.last_average_s = now_s
            case tl.EpochEnd(loss=loss) if loss is not None:
                self.final_loss = loss
            case tl.Eval(epoch=epoch, metric=metric) if epoch >= self.eval_epoch:
                self.eval_epoch, self.eval_metric = epoch, metric
            case tl.RunEnd():
                self.end = event
            case _:
                pass


def coordinator_summary(stats: RunStats, *, mode: str, world_size: int) -> dict[str, Any]:
    """The coordinator's half of the summary, as written to ``summary.json``.

    Raises:
        ValueError: the run is not over (no ``RunEnd`` observed).
    """
    report = stats.end
    if report is None:
        raise ValueError("the run summary needs the coordinator's RunEnd record")
    outcome, reason = report.outcome, report.reason
    if stats.unsaved is not None and outcome == "saved_and_shutdown":  # nothing resumes
        outcome, reason = "failed", f"{reason}: {stats.unsaved}"
    # Training ends at the last average; a run stopped before any ends at its last record.
    first, last = stats.first_dispatch_s, stats.last_average_s or stats.last_record_s
    wall_s = max(last - first, 0.0) if first is not None and last is not None else 0.0
    return {
        "mode": mode,
        "world_size": world_size,
        "epochs_completed": report.epochs_completed,
        "wall_s": round(wall_s, 4),
        "first_dispatch_monotonic": first,
        "samples_trained": sum(report.samples_per_rank),
        "final_loss": stats.final_loss,
        "eval_accuracy": stats.eval_metric,
        "syncs": report.rounds_done,
        "lost_samples": report.lost_samples,
        "skipped_steps": report.skipped_steps,
        "skipped_samples": report.skipped_samples,
        "dead_ranks": list(report.dead_ranks),
        "joined_ranks": list(report.joined_ranks),
        "outcome": outcome,
        "reason": reason,
        "rejected_frames": report.rejected_frames,
        "stale_messages": report.stale_messages,
        "coordinator_restarts": report.coordinator_restarts,
        "anchor": report.anchor,
        "samples_per_rank": list(report.samples_per_rank),
        "notices": stats.notices,
        "user_error": None if report.user_error is None else msgspec.to_builtins(report.user_error),
    }


def read_run(run_dir: Path, world_size: int) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """The coordinator's summary and every rank report there is.

    Raises:
        RuntimeError: the coordinator left no summary (it died), naming the run dir.
    """
    summary_file = run_dir / SUMMARY_FILE
    if not summary_file.exists():
        raise RuntimeError(f"the coordinator exited without a summary; see {run_dir}")
    host = json.loads(summary_file.read_text(encoding="utf-8"))
    ranks = {}
    for rank in [*range(world_size), *host.get("joined_ranks", [])]:
        report = rank_report_file(run_dir, rank)
        if report.exists():
            ranks[rank] = json.loads(report.read_text(encoding="utf-8"))
    return host, ranks


def run_summary(
    host: dict[str, Any],
    ranks: dict[int, dict[str, Any]],
    *,
    speeds: Sequence[float],
    launched_s: float,
    save_path: str | None,
) -> dict[str, object]:
    """The summary ``elche.train`` returns.

    Args:
        host: the coordinator's ``summary.json``.
        ranks: each rank's report, by rank (a dead rank may have none).
        speeds: each rank's testing speed.
        launched_s: the monotonic time the launcher started (``startup_s``
            runs from there to the first work handed out).
        save_path: the bundle stem, named when the run saved and shut down.
    """
    first = host.get("first_dispatch_monotonic")
    wall_s = float(host["wall_s"])
    trained = int(host["samples_trained"])
    world = int(host["world_size"])
    return {
        "mode": host["mode"],
        "world_size": world,
        "epochs_completed": host["epochs_completed"],
        "wall_s": wall_s,
        "startup_s": round(first - launched_s, 4) if first is not None else None,
        "samples_per_s": round(trained / wall_s, 2) if wall_s > 0 else 0.0,
        "final_loss": host["final_loss"],
        "eval_accuracy": host["eval_accuracy"],
        "eval": host["eval_accuracy"],  # eval_fn's metric, whatever it measures
        "syncs": host["syncs"],
        "lost_samples": host["lost_samples"],
        # steps nonfinite="skip" left out, and their samples (trained, in no model)
        "skipped_steps": host.get("skipped_steps", 0),
        "skipped_samples": host.get("skipped_samples", 0),
        "dead_ranks": host["dead_ranks"],
        "joined_ranks": host.get("joined_ranks", []),  # ranks that joined (elche join)
        "outcome": host["outcome"],
        "reason": host["reason"],
        "bundle": save_path if host["outcome"] == "saved_and_shutdown" else None,
        "user_error": host.get("user_error"),  # outcome "failed" on the user's code
        "notices": host.get("notices", []),  # the coordinator's warnings and errors
        "coordinator_restarts": host.get("coordinator_restarts", 0),
        "rejected_frames": host.get("rejected_frames", 0),  # malformed, forged or replayed
        # messages from a rank no longer live, or answers for nothing in flight
        "stale_messages": host.get("stale_messages", 0),
        "per_rank": [
            {
                "rank": rank,
                # A joined rank's speed is its own (its report; None without one).
                "speed": speeds[rank] if rank < world else ranks.get(rank, {}).get("speed"),
                "samples": host["samples_per_rank"][rank],
                "idle_s": ranks.get(rank, {}).get("idle_s"),
                "lr": ranks.get(rank, {}).get("lr"),  # the rank's learning rate at the end
                "wire": ranks.get(rank, {}).get("wire"),  # what its averaging payloads were
                "wire_bytes": ranks.get(rank, {}).get("wire_bytes"),
                "wire_rounds": ranks.get(rank, {}).get("wire_rounds"),
                # rounds it trained on through (``overlap``): landed after steps of its own
                "overlapped_rounds": ranks.get(rank, {}).get("overlapped_rounds"),
            }
            for rank in [*range(world), *host.get("joined_ranks", [])]
        ],
    }
