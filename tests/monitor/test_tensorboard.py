"""TensorBoard scalars from a hand-written timeline, read back by TensorBoard's own reader."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path

import pytest

from elche.core import timeline as tl
from elche.monitor.tensorboard import TensorBoardLog, scalars_for
from elche.monitor.timeline import TimelineWriter

pytest.importorskip("tensorboardX", reason="the elche[tensorboard] extra is not installed")
event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="the tensorboard package (TensorBoard's reader) is not installed",
)


def _window(rank: int, t: float, share: float, sps: float) -> tl.RankWindow:
    return tl.RankWindow(
        t=t, rank=rank, epoch=0, span_s=1.0, batches=4, samples=128, loss=0.5,
        samples_per_s=sps, share=share, compute_ms_per_batch=10.0, idle_pct=20.0,
    )  # fmt: skip


RECORDS: list[tl.TimelineEvent] = [
    tl.RunStart(t=0.2, world_size=2, mode="cadence"),
    tl.SyncEnd(t=0.5, round=1, duration_ms=20.0, d_raw=0.0, k_used=6, anchor=10),
    _window(0, 0.5, 0.75, 300.0),
    _window(1, 0.5, 0.25, 100.0),
    tl.EpochEnd(t=1.0, epoch=0, loss=0.4, rounds_done=1, lr=0.1),
    tl.SyncEnd(t=1.5, round=2, duration_ms=30.0, d_raw=0.0, k_used=6, anchor=12),
    _window(0, 1.5, 0.7, 310.0),
    tl.Eval(t=1.6, epoch=1, metric=0.9, rank=0),
    tl.EpochEnd(t=2.0, epoch=1, loss=0.3, rounds_done=2, lr=None),
]


def test_each_record_gives_its_scalars_at_an_ordering_step() -> None:
    assert scalars_for(RECORDS[2], 1) == [
        ("rank0/samples_per_s", 300.0, 1), ("rank0/share", 0.75, 1), ("rank0/idle_pct", 20.0, 1)
    ]  # fmt: skip
    assert scalars_for(RECORDS[4], 1) == [("loss", 0.4, 0), ("lr", 0.1, 0)]
    assert scalars_for(RECORDS[-1], 2) == [("loss", 0.3, 1)]  # no lr reported
    assert scalars_for(RECORDS[0], 0) == []


def test_the_log_follows_the_timeline_into_event_files_tensorboard_reads(tmp_path: Path) -> None:
    run_dir, log_dir = tmp_path / "run", tmp_path / "tb"
    run_dir.mkdir()
    writer = TimelineWriter(run_dir, started_s=0.0)
    log = TensorBoardLog(run_dir, log_dir)
    log.start()
    for event in RECORDS:
        writer.write(event, event.t)
    writer.close()
    log.stop()  # reads what is left, flushes and closes
    reader = event_accumulator.EventAccumulator(str(log_dir))
    reader.Reload()
    tags = set(reader.Tags()["scalars"])
    assert {"loss", "lr", "eval/metric", "rounds/duration_ms", "rounds/anchor"} <= tags
    assert {"rank0/samples_per_s", "rank1/share", "rank1/idle_pct"} <= tags
    assert [(s.step, s.value) for s in reader.Scalars("loss")] == [
        (0, pytest.approx(0.4)), (1, pytest.approx(0.3))
    ]  # fmt: skip
    speeds = [(s.step, s.value) for s in reader.Scalars("rank0/samples_per_s")]
    assert speeds == [(1, 300.0), (2, 310.0)]
    assert [s.value for s in reader.Scalars("rounds/anchor")] == [10.0, 12.0]


def test_a_disk_that_fills_up_stops_the_log_in_one_line_and_stop_returns(tmp_path: Path) -> None:
    # tensorboardX's SummaryWriter wrote on a thread of its own: a full disk killed it
    # with a traceback, the log's next add_scalar waited on its full queue for ever (no
    # line of elche's), and stop() waited out its timeout with the thread still alive.
    run_dir, disk = tmp_path / "run", tmp_path / "disk"
    run_dir.mkdir()
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=True)
    try:
        said = io.StringIO()
        log = TensorBoardLog(run_dir, disk / "tb", log=said)
        log.start()
        writer = TimelineWriter(run_dir, started_s=0.0)
        with (disk / "ballast").open("wb", buffering=0) as fh, contextlib.suppress(OSError):
            while True:  # until the disk is full
                fh.write(b"\0" * 4096)
        for i in range(400):  # more than a write buffer's worth of scalars
            writer.write(_window(0, i * 0.01, 1.0, 300.0), i * 0.01)
        writer.close()
        log.stop()
        assert not log._thread.is_alive()
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)
    assert said.getvalue() == (
        "elche: the TensorBoard log stopped: OSError(28, 'No space left on device')\n"
    )
