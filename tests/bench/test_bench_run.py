"""``elche bench`` end to end on a tiny suite: real processes, every output.

One workload, one rig, two systems (torch DDP and elche cadence, plus the
solo run every workload gets), one epoch, driven through the CLI so the
``--json`` stdout is checked too. About 15 s on the 2-core machine.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from elche.bench import suites
from elche.bench.suites import Suite, WorkloadPlan
from elche.cli import main
from elche.runtime.run_dirs import KEPT_FILES

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(120)]

ROW_KEYS = {
    "workload", "system", "speeds", "wall_s", "samples_per_s", "efficiency",
    "final_loss", "eval", "syncs", "idle_pct", "lost_samples",
    "wall_ratio_vs_ddp", "time_to_target_s", "per_rank", "per_epoch",
}  # fmt: skip
TINY = Suite(
    name="quick",
    workloads=(WorkloadPlan("digits-logreg", epochs=1),),
    rigs=((1.0, 0.5),),
    systems=("torch-ddp", "cadence"),
    capacity_s=0.5,
)


def test_tiny_bench_writes_json_report_and_charts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    monkeypatch.setitem(suites.SUITES, "quick", TINY)
    # Short: the fork server's socket goes in it, and an AF_UNIX path holds 107 bytes
    # (under tmp_path it did not fit once pytest's session number had three digits).
    # It stays to the session's end, pruned with pytest's base: the fork server and
    # multiprocessing's folder made in it serve this worker's later tests (removed
    # here, the next test to start ranks failed with FileNotFoundError).
    scratch = Path(tempfile.mkdtemp(prefix="eb-"))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "bench"

    code = main(["bench", "--suite", "quick", "--json", "--no-progress", "--out", str(out)])

    assert code == 0
    # Every run's directory went with it (torch's and multiprocessing's own may stay).
    assert [p.name for p in scratch.iterdir() if p.name.startswith("elche-")] == []
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # stdout is exactly the results JSON
    # elche's runs keep their record in the bench's folder, where stderr said; none is joinable.
    runs = out / "runs"
    solo, cadence = runs / "00-digits-logreg-solo", runs / "02-digits-logreg-cadence"
    assert set(runs.iterdir()) == {solo, cadence}  # torch DDP's run keeps none
    assert [run.get("run_dir") for run in doc["runs"]] == [str(solo), None, str(cadence)]
    for folder in (solo, cadence):
        assert {p.name for p in folder.iterdir()} == KEPT_FILES
        assert f"elche: run directory {folder}\n" in captured.err
    assert "elche: join with" not in captured.err
    assert doc == json.loads((out / "results.json").read_text())
    rows = doc["rows"]
    assert [(r["system"], r["speeds"]) for r in rows] == [
        ("solo", [1.0, 0.5]), ("torch-ddp", [1.0, 0.5]), ("cadence", [1.0, 0.5]),
    ]  # fmt: skip
    for row in rows:
        assert row.keys() >= ROW_KEYS, row["system"]
        assert row["error"] is None, row["error"]
        assert row["workload"] == "digits-logreg"
        assert row["wall_s"] > 0 and row["samples_per_s"] > 0 and row["efficiency"] > 0
        assert 0.0 <= row["eval"] <= 1.0
        assert row["lost_samples"] == 0
        assert len(row["per_epoch"]) == 1
        assert all(0.0 <= e["eval"] <= 1.0 for e in row["per_epoch"])  # evaluated after the clock
        assert row["speed_base_s"] == rows[0]["speed_base_s"] > 0  # one value, every system
        assert row["capacity_samples_per_s"] == rows[0]["capacity_samples_per_s"] > 0
        assert row["of_capacity"] > 0
        assert all(x is None or 0.0 <= x <= 100.0 for x in row["idle_pct"])
    ddp = rows[1]
    assert ddp["wall_ratio_vs_ddp"] == pytest.approx(1.0)
    assert ddp["syncs"] == len(ddp["per_epoch"]) * 23  # 1,437 samples / (2 ranks × 32)
    capacity = doc["runs"][1]["capacity"]  # the rig's, measured before its runs
    assert capacity["samples_per_s"] == rows[0]["capacity_samples_per_s"]
    assert len(capacity["step_ms"]) == 2 and capacity["fraction"] > 0
    report = (out / "report.md").read_text()
    assert "Speed injection: every system's paced ranks wait by one solo step of" in report
    assert "| **torch-ddp** |" in report and "| cadence |" in report
    assert "`runs/NN-WORKLOAD-SYSTEM/`" in report
    for kind in ("loss", "share", "idle"):
        png = out / f"digits-logreg-{kind}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size < 100_000
        assert f"({png.name})" in report
