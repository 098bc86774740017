"""The Chrome trace of a timeline: valid trace-event JSON, one track per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elche.cli import main
from elche.core import timeline as tl
from elche.monitor.timeline import TimelineWriter
from elche.monitor.trace import chrome_trace, write_chrome_trace

RECORDS: list[tl.TimelineEvent] = [
    tl.RankJoined(t=0.1, rank=0, host="a"),
    tl.RankJoined(t=0.1, rank=1, host="b"),
    tl.RankJoined(t=0.1, rank=2, host="c"),
    tl.RunStart(t=0.2, world_size=3, mode="cadence"),
    tl.EpochStart(t=0.2, epoch=0),
    tl.SyncStart(t=0.45, round=1),
    tl.SyncEnd(t=0.5, round=1, duration_ms=50.0, d_raw=0.01, k_used=6, anchor=10),
    *(
        tl.RankWindow(
            t=0.5,
            rank=r,
            epoch=0,
            span_s=0.3,
            batches=4,
            samples=128,
            loss=0.5,
            samples_per_s=400.0,
            share=0.3,
            compute_ms_per_batch=60.0,
            idle_pct=20.0,
        )
        for r in range(3)
    ),
    tl.Throttle(t=0.4, rank=0, steps=4),
    tl.Eval(t=0.9, epoch=1, metric=0.8, rank=0, duration_ms=100.0),
    tl.CheckpointRan(t=0.95, version=1, rank=1, duration_ms=30.0, outcome="ok"),
    tl.RankLost(t=0.96, rank=2, reason="heartbeat stale"),
    tl.SyncEnd(t=1.0, round=2, duration_ms=40.0, d_raw=0.01, k_used=6, anchor=10),
    tl.Alert(t=0.96, severity="critical", name="rank_lost", path="rank2", detail="stale"),
    tl.EpochEnd(t=1.0, epoch=0, loss=0.4, rounds_done=2, lr=0.1),
    tl.RunEnd(
        t=1.1,
        outcome="completed",
        reason="",
        epochs_completed=1,
        rounds_done=2,
        lost_samples=0,
        dead_ranks=(2,),
        rejected_frames=0,
        anchor=10,
        samples_per_rank=(1, 1, 1),
    ),
]


def _valid(trace: dict[str, object]) -> list[dict[str, object]]:
    """The trace-event format's rules for the phases used: X, i, M."""
    events = trace["traceEvents"]
    assert isinstance(events, list)
    for e in events:
        assert {"name", "ph", "pid"} <= e.keys() and isinstance(e["pid"], int)
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["tid"], int)
        elif e["ph"] == "i":
            assert e["ts"] >= 0 and e["s"] in ("t", "p", "g")
        else:
            assert e["ph"] == "M" and e["name"] in (
                "process_name", "process_sort_index", "thread_name"
            )  # fmt: skip
    return events


def test_each_rank_gets_a_track_with_its_work_idle_averages_and_callbacks() -> None:
    events = _valid(json.loads(json.dumps(chrome_trace(RECORDS), allow_nan=False)))
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "coordinator", 1: "rank 0", 2: "rank 1", 3: "rank 2"}

    def on(pid: int, tid: int) -> list[str]:
        return [
            e["name"] for e in events if e["ph"] != "M" and (e["pid"], e.get("tid")) == (pid, tid)
        ]

    assert on(1, 0) == ["joined", "train e0", "idle", "throttle"]
    train = next(e for e in events if e["pid"] == 1 and e["name"] == "train e0")
    idle = next(e for e in events if e["pid"] == 1 and e["name"] == "idle")
    assert train["ts"] == 200_000 and train["dur"] == 240_000  # 80 % of the 0.3 s window
    assert idle["ts"] == 440_000 and idle["dur"] == 60_000 and idle["ts"] + idle["dur"] == 500_000
    assert on(1, 1) == ["average r1", "average r2"] and on(3, 1) == ["average r1"]  # rank 2 died
    assert on(1, 2) == ["eval e1"] and on(2, 2) == ["checkpoint v1"]
    assert "lost" in on(3, 0)
    assert "epoch 0" in on(0, 0) and "[critical] rank_lost rank2" in on(0, 0)


def test_the_cli_writes_the_trace_of_a_run_directory(tmp_path: Path, capsys: object) -> None:
    writer = TimelineWriter(tmp_path, started_s=0.0)
    for event in RECORDS:
        writer.write(event, event.t)
    writer.close()
    out = tmp_path / "trace.json"
    assert main(["timeline", str(tmp_path), "--chrome", str(out)]) == 0
    trace = json.loads(out.read_text(encoding="utf-8"))
    assert len([e for e in _valid(trace) if e["name"] == "process_name"]) == 4
    assert main(["timeline", str(tmp_path / "missing")]) == 2  # ConfigError: no timeline there


def _run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    writer = TimelineWriter(run_dir, started_s=0.0)
    for event in RECORDS:
        writer.write(event, event.t)
    writer.close()
    return run_dir


@pytest.mark.parametrize("where", ["{tmp}/missing/trace.json", "{tmp}", "", "{tmp}/new/"])
def test_a_chrome_path_that_cannot_be_written_is_one_line_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    # Each ended in a raw traceback (FileNotFoundError, IsADirectoryError).
    run_dir = _run_dir(tmp_path)
    assert main(["timeline", str(run_dir), "--chrome", where.format(tmp=tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elche timeline: error: chrome: ") and err.count("\n") == 1


def test_the_trace_is_written_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "trace.json"
    out.write_text("the earlier trace")

    def crash(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("elche._files.os.replace", crash)
    with pytest.raises(OSError):
        write_chrome_trace(RECORDS, out)
    assert out.read_text() == "the earlier trace"  # not half of the new one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]  # no partial left
    monkeypatch.undo()
    assert write_chrome_trace(RECORDS, out) > 0
    assert json.loads(out.read_text())["traceEvents"]


def test_an_eval_that_gave_nan_is_in_the_trace_as_valid_json(tmp_path: Path) -> None:
    # The record used to be unreadable (skipped); read, its NaN broke json.dumps.
    run_dir = _run_dir(tmp_path)
    writer = TimelineWriter(run_dir, started_s=0.0)
    writer.write(tl.Eval(epoch=2, metric=float("nan"), rank=1, duration_ms=5.0), now_s=1.5)
    writer.close()
    out = tmp_path / "trace.json"
    assert main(["timeline", str(run_dir), "--chrome", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    (nan_eval,) = [e for e in _valid(json.loads(text)) if e["name"] == "eval e2"]
    assert nan_eval["pid"] == 2 and nan_eval["args"] == {"metric": "nan"}
