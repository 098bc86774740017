"""``elche bench`` whose output is incomplete (a run failed, an ``--out`` that fills up or
turns read-only) says what it lacks and exits 1; what it measured is not lost.

The disk is a small ``tmpfs`` (root only; skipped elsewhere), filled or
remounted read-only by the test.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

import elche.bench.runner
from elche.bench import suites
from elche.bench.suites import Suite, WorkloadPlan
from elche.cli import main
from tests.bench.test_metrics import fake_run
from tests.promises.test_storage import fill, small_disk

FAULTS = {
    "full": (fill, "No space left on device"),
    "read-only": (
        lambda disk: subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True),
        "Read-only file system",
    ),
}

FAKE = Suite(
    name="quick",
    workloads=(WorkloadPlan("digits-cnn", epochs=2),),
    rigs=((1.0, 0.5),),
    systems=("torch-ddp",),
)


@pytest.mark.parametrize("fault", FAULTS)
def test_results_the_out_dir_refuses_go_to_stdout_and_each_file_is_named(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    fault: str,
) -> None:
    # results.json, report.md and the charts were written once every run was over:
    # the first chart's OSError ended the bench in a traceback (exit 1), every run's
    # numbers with it, and a partial PNG stayed.
    make_fault, reason = FAULTS[fault]
    runs = [fake_run(s, 2.0, final_loss=0.1, eval_=0.9) for s in ("solo", "torch-ddp")]

    def measured_then_faulted(suite: Suite, **kwargs: Any) -> list[dict[str, Any]]:
        make_fault(disk)
        return runs

    monkeypatch.setattr(elche.bench.runner, "run_suite", measured_then_faulted)
    monkeypatch.setitem(suites.SUITES, "quick", FAKE)
    with small_disk(tmp_path / "disk", "256k") as disk:
        out = disk / "bench"
        code = main(["bench", "--suite", "quick", "--no-progress", "--out", str(out)])
        left = sorted(p.name for p in out.iterdir())
    captured = capsys.readouterr()
    assert code == 1
    doc = json.loads(captured.out)  # the results the disk refused
    assert [r["wall_s"] for r in doc["runs"]] == [2.0, 2.0]
    assert doc["charts"] == {} and left == []  # no part of any file
    charts = [f"digits-cnn-{kind}.png" for kind in ("loss", "share", "idle")]
    files = [f"{out}/{name}" for name in (*charts, "results.json", "report.md")]
    assert doc["unwritten"] == [{"file": f, "error": reason} for f in files]
    assert captured.err.splitlines() == [
        *(f"elche bench: not written: {f}: {reason}" for f in files),
        "elche bench: output incomplete; what was measured is in stdout (the results JSON)",
    ]


def test_a_failed_run_makes_the_output_incomplete_and_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    failed = {**fake_run("torch-ddp", 1.0, final_loss=1.0, eval_=0.0), "error": "boom"}
    runs = [fake_run("solo", 2.0, final_loss=0.1, eval_=0.9), failed]
    monkeypatch.setattr(elche.bench.runner, "run_suite", lambda suite, **kwargs: runs)
    monkeypatch.setitem(suites.SUITES, "quick", FAKE)
    code = main(["bench", "--suite", "quick", "--no-progress", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 1  # it was 0: a failed cell was said only in report.md
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "elche bench: digits-cnn [1,0.5] torch-ddp failed: boom",
        f"elche bench: output incomplete; what was measured is in {tmp_path}/results.json",
    ]
    assert json.loads((tmp_path / "results.json").read_text())["runs"] == runs
