"""The timeline file: typed records, visible as written, followed incrementally."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
from pathlib import Path

import pytest

from elche.core import timeline as tl
from elche.monitor.timeline import TIMELINE_FILE, TimelineReader, TimelineWriter, read_timeline


def test_a_record_is_on_disk_as_soon_as_it_is_written(tmp_path: Path) -> None:
    writer = TimelineWriter(tmp_path, started_s=100.0)
    stamped = writer.write(tl.EpochEnd(epoch=2, loss=0.25, rounds_done=7), now_s=101.5)
    assert stamped == tl.EpochEnd(t=1.5, epoch=2, loss=0.25, rounds_done=7)
    # Not closed, not flushed by hand: another process reading now sees it.
    line = (tmp_path / TIMELINE_FILE).read_bytes()
    assert line == b'{"kind":"EpochEnd","epoch":2,"loss":0.25,"rounds_done":7,"lr":null,"t":1.5}\n'
    writer.close()


def test_a_reader_follows_the_writer_and_keeps_a_partial_line(tmp_path: Path) -> None:
    reader = TimelineReader(tmp_path)
    assert reader.new_records() == []  # no file yet
    writer = TimelineWriter(tmp_path, started_s=0.0)
    writer.write(tl.RunStart(world_size=3, mode="cadence"), now_s=0.0)
    writer.write(tl.RankLost(rank=2, reason="process ended"), now_s=2.0)
    assert reader.new_records() == [
        tl.RunStart(world_size=3, mode="cadence"),
        tl.RankLost(t=2.0, rank=2, reason="process ended"),
    ]
    writer.close()
    with (tmp_path / TIMELINE_FILE).open("ab") as fh:
        fh.write(b'{"kind":"SyncStart","t":3.0,"rou')  # a record half written
    assert reader.new_records() == []
    with (tmp_path / TIMELINE_FILE).open("ab") as fh:
        fh.write(b'nd":4}\n')
    assert reader.new_records() == [tl.SyncStart(t=3.0, round=4)]


def test_a_reader_follows_the_next_run_in_the_folder_from_its_start(tmp_path: Path) -> None:
    # A script that trains twice in one run dir (under elche run): the second run
    # writes its timeline anew, shorter than the first, and a reader that kept its
    # offset read none of it (elche run follows it for ranks declared lost).
    reader = TimelineReader(tmp_path)
    writer = TimelineWriter(tmp_path, started_s=0.0)
    writer.write(tl.RunStart(world_size=3, mode="cadence"), now_s=0.0)
    writer.write(tl.EpochEnd(epoch=0, loss=0.5, rounds_done=3), now_s=1.0)
    writer.close()
    assert len(reader.new_records()) == 2
    (tmp_path / TIMELINE_FILE).unlink()  # the next run forgets the earlier one's files
    writer = TimelineWriter(tmp_path, started_s=0.0)
    writer.write(tl.RankLost(rank=1, reason="heartbeat stale"), now_s=0.5)
    writer.close()
    assert reader.new_records() == [tl.RankLost(t=0.5, rank=1, reason="heartbeat stale")]


def test_unknown_kinds_and_damaged_lines_are_skipped(tmp_path: Path) -> None:
    (tmp_path / TIMELINE_FILE).write_bytes(
        b'{"kind":"FromTheFuture","t":0.1}\n'
        b"not json\n"
        b'{"kind":"Eval","t":0.2,"epoch":1,"metric":0.9,"rank":0,"new_field":1}\n'
    )
    assert read_timeline(tmp_path) == [tl.Eval(t=0.2, epoch=1, metric=0.9, rank=0)]


def test_every_kind_round_trips() -> None:
    events = [
        tl.RunStart(world_size=2, mode="sync"),
        tl.EpochStart(epoch=0),
        tl.EpochEnd(epoch=0, loss=None, rounds_done=1),
        tl.SyncStart(round=1),
        tl.SyncEnd(round=1, duration_ms=3.5, d_raw=0.01, k_used=9, anchor=10),
        tl.AnchorChanged(old=10, new=12),
        tl.MetaNudge(factor=0.5, old=12, new=6),
        tl.GuardNudge(factor=0.5, old=6, new=3),
        tl.Eval(epoch=1, metric=0.5, rank=1),
        tl.RankLost(rank=1, reason="heartbeat stale"),
        tl.OuterMomentumRestored(file="x.outer.npz"),
        tl.EvalFailed(epoch=1, rank=0, duration_ms=2.0, error="boom"),
        tl.CheckpointRan(version=1, rank=2, duration_ms=4.0, outcome="ok"),
        tl.BundleWritten(stem="/tmp/run/checkpoint", seq=3, reason="checkpoint"),
        tl.RankJoined(rank=0, host="node-a"),
        tl.Throttle(rank=0, steps=12),
        tl.RolesMoved(epoch_rank=1, eval_rank=1, checkpoint_rank=1),
        tl.RankWindow(
            rank=1,
            epoch=0,
            span_s=0.5,
            batches=8,
            samples=256,
            loss=0.7,
            samples_per_s=512.0,
            share=0.33,
            compute_ms_per_batch=40.0,
            idle_pct=36.0,
        ),
        tl.Alert(severity="critical", name="rank_lost", path="rank2", detail="heartbeat stale"),
        tl.Stalled(silent_s=120.0, waiting_for="round 3", ranks=("rank 0: live",)),
        tl.RunEnd(
            outcome="completed",
            reason="",
            epochs_completed=3,
            rounds_done=12,
            lost_samples=0,
            dead_ranks=(1,),
            rejected_frames=0,
            anchor=10,
            samples_per_rank=(600, 300, 100),
        ),
    ]
    assert len(events) == len(tl.TimelineEvent.__args__)  # every kind is covered
    assert [tl.decode(tl.encode(event)) for event in events] == events


def test_a_run_end_written_before_stale_messages_were_kept_reads_none() -> None:
    line = (
        b'{"kind":"RunEnd","t":1.0,"outcome":"completed","reason":"","epochs_completed":1,'
        b'"rounds_done":2,"lost_samples":0,"dead_ranks":[],"rejected_frames":0,"anchor":10,'
        b'"samples_per_rank":[64,32]}'
    )
    end = tl.decode(line)
    assert isinstance(end, tl.RunEnd) and end.stale_messages == 0


def test_a_nan_or_infinite_float_reaches_the_reader(tmp_path: Path) -> None:
    # An eval_fn that returned NaN was written as "metric": null, which the float field
    # refused: every reader skipped the record (eval_result_fn was never called, the
    # TensorBoard log and the trace had no eval for that epoch).
    writer = TimelineWriter(tmp_path, started_s=0.0)
    writer.write(tl.Eval(epoch=1, metric=float("nan"), rank=0), now_s=1.0)
    writer.write(tl.EpochEnd(epoch=1, loss=float("inf"), rounds_done=2), now_s=2.0)
    writer.write(tl.GuardNudge(factor=float("-inf"), old=4, new=2), now_s=3.0)
    writer.close()
    reader = TimelineReader(tmp_path)
    nan_eval, inf_end, nudge = reader.new_records()
    assert reader.skipped == 0
    assert isinstance(nan_eval, tl.Eval) and math.isnan(nan_eval.metric)
    assert inf_end == tl.EpochEnd(t=2.0, epoch=1, loss=float("inf"), rounds_done=2)
    assert nudge == tl.GuardNudge(t=3.0, factor=float("-inf"), old=4, new=2)


def test_a_record_torn_by_a_full_disk_costs_no_record_after_it(tmp_path: Path) -> None:
    # The OS wrote the part of a record that fitted and the writer said nothing; once
    # space came back, the next record went on the torn line and no reader saw it.
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=True)
    try:
        writer = TimelineWriter(disk, started_s=0.0)
        writer.write(tl.SyncStart(round=0), now_s=0.0)  # the file's first page: room for more
        with (disk / "ballast").open("wb", buffering=0) as fh, contextlib.suppress(OSError):
            while True:  # until the disk is full
                fh.write(b"\0" * 1024)
        written = 0
        with pytest.raises(OSError):
            for number in range(1, 1000):  # until the page is full: the last one torn
                writer.write(tl.SyncStart(round=number), now_s=1.0)
                written = number
        (disk / "ballast").unlink()  # space again
        writer.write(tl.SyncStart(round=1000), now_s=2.0)
        writer.close()
        reader = TimelineReader(disk)
        records = reader.new_records()
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)
    assert [r.round for r in records] == [*range(written + 1), 1000]  # type: ignore[union-attr]
    assert reader.skipped == 1  # the torn one
