"""The run summary, assembled from timeline records and rank reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from elche.core import timeline as tl
from elche.monitor.summary import (
    SUMMARY_FILE,
    RunStats,
    coordinator_summary,
    rank_report_file,
    read_run,
    run_summary,
)

END = tl.RunEnd(
    outcome="completed",
    reason="",
    epochs_completed=2,
    rounds_done=9,
    lost_samples=0,
    dead_ranks=(2,),
    rejected_frames=1,
    anchor=12,
    samples_per_rank=(700, 400, 100),
)


def test_stats_follow_the_records_and_keep_the_latest_eval() -> None:
    stats = RunStats(first_dispatch_s=10.0)
    for now, event in [
        (11.0, tl.SyncEnd(round=1, duration_ms=2.0, d_raw=0.0, k_used=5, anchor=10)),
        (11.5, tl.EpochEnd(epoch=0, loss=0.7, rounds_done=1)),
        (12.0, tl.Eval(epoch=2, metric=0.9, rank=0)),
        (12.1, tl.Eval(epoch=1, metric=0.5, rank=1)),  # late, for an older epoch
        (12.5, tl.EpochEnd(epoch=1, loss=None, rounds_done=2)),  # no loss: keep the last
        (13.0, tl.SyncEnd(round=2, duration_ms=2.0, d_raw=0.0, k_used=5, anchor=10)),
        (13.1, END),
    ]:
        stats.observe(event, now)
    summary = coordinator_summary(stats, mode="cadence", world_size=3)
    assert summary == {
        "mode": "cadence",
        "world_size": 3,
        "epochs_completed": 2,
        "wall_s": 3.0,
        "first_dispatch_monotonic": 10.0,
        "samples_trained": 1200,
        "final_loss": 0.7,
        "eval_accuracy": 0.9,
        "syncs": 9,
        "lost_samples": 0,
        "skipped_steps": 0,
        "skipped_samples": 0,
        "dead_ranks": [2],
        "joined_ranks": [],
        "outcome": "completed",
        "reason": "",
        "rejected_frames": 1,
        "stale_messages": 0,
        "coordinator_restarts": 0,
        "anchor": 12,
        "samples_per_rank": [700, 400, 100],
        "notices": [],
        "user_error": None,
    }


def test_no_summary_before_the_run_ends() -> None:
    with pytest.raises(ValueError, match="RunEnd"):
        coordinator_summary(RunStats(), mode="sync", world_size=1)


def test_the_launchers_summary_joins_the_rank_reports(tmp_path: Path) -> None:
    stats = RunStats(first_dispatch_s=5.0, last_average_s=7.0)
    stats.observe(END, 7.0)
    doc = coordinator_summary(stats, mode="cadence", world_size=3)
    (tmp_path / SUMMARY_FILE).write_text(json.dumps(doc))
    wire = {"wire": "bf16", "wire_bytes": 4096, "wire_rounds": 2, "overlapped_rounds": 0}
    rank_report_file(tmp_path, 0).write_text(json.dumps({"idle_s": 0.25, **wire}))
    rank_report_file(tmp_path, 1).write_text(json.dumps({"idle_s": 0.5}))  # rank 2 died: none
    host, ranks = read_run(tmp_path, 3)
    summary = run_summary(host, ranks, speeds=[1.0, 0.5, 0.25], launched_s=4.0, save_path="s")
    assert summary["startup_s"] == 1.0
    assert summary["samples_per_s"] == 600.0
    assert summary["bundle"] is None  # completed: no bundle to name
    assert (summary["skipped_steps"], summary["skipped_samples"]) == (0, 0)
    unknown = {"wire": None, "wire_bytes": None, "wire_rounds": None, "overlapped_rounds": None}
    assert summary["per_rank"] == [
        {"rank": 0, "speed": 1.0, "samples": 700, "idle_s": 0.25, "lr": None, **wire},
        {"rank": 1, "speed": 0.5, "samples": 400, "idle_s": 0.5, "lr": None, **unknown},
        {"rank": 2, "speed": 0.25, "samples": 100, "idle_s": None, "lr": None, **unknown},
    ]


def test_a_missing_summary_names_the_run_dir(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=str(tmp_path)):
        read_run(tmp_path, 2)


def _summaries(tmp_path: Path, **end: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``summary.json`` of a run that ended as ``END`` with ``end`` changed, and the
    summary ``elche.train`` returns read back from it."""
    stats = RunStats(first_dispatch_s=5.0, last_average_s=7.0)
    stats.observe(msgspec.structs.replace(END, **end), 7.0)
    doc = coordinator_summary(stats, mode="cadence", world_size=3)
    (tmp_path / SUMMARY_FILE).write_text(json.dumps(doc))
    host, ranks = read_run(tmp_path, 3)
    summary = run_summary(host, ranks, speeds=[1.0, 0.5, 0.25], launched_s=4.0, save_path=None)
    return doc, summary


def test_the_summary_counts_the_steps_nonfinite_skip_left_out(tmp_path: Path) -> None:
    doc, summary = _summaries(tmp_path, skipped_steps=3, skipped_samples=96)
    assert (doc["skipped_steps"], doc["skipped_samples"]) == (3, 96)
    assert (summary["skipped_steps"], summary["skipped_samples"]) == (3, 96)


def test_the_summary_counts_the_stale_messages_and_the_rejected_frames(tmp_path: Path) -> None:
    doc, summary = _summaries(tmp_path, stale_messages=2)
    assert (doc["stale_messages"], doc["rejected_frames"]) == (2, 1)
    assert (summary["stale_messages"], summary["rejected_frames"]) == (2, 1)


def test_a_run_stopped_before_any_average_is_timed_to_its_last_record() -> None:
    stats = RunStats(first_dispatch_s=10.0)
    stats.observe(tl.EpochEnd(epoch=0, loss=0.7, rounds_done=0), 12.5)
    stats.observe(msgspec.structs.replace(END, rounds_done=0), 11.0)  # an earlier clock: kept
    assert coordinator_summary(stats, mode="cadence", world_size=3)["wall_s"] == 2.5
    stats = RunStats(first_dispatch_s=10.0)
    stats.observe(END, 9.0)  # a salvage's end, at the run's start
    assert coordinator_summary(stats, mode="cadence", world_size=3)["wall_s"] == 0.0
