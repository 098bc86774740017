"""``elche bench --suite hosts`` end to end on a tiny suite: two namespace hosts, one rate.

One real invocation (torch DDP and cadence, each under torchrun on both
hosts, on a link shaped to 100 Mbit/s) shared by every assertion. Four
torchrun agents and their ranks start, two at a time: 98 s measured on the
2-core machine at a load of 5, 166 s at 11, hence the generous timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from elche.bench import suites
from elche.bench.suites import Suite, WorkloadPlan
from elche.cli import main
from elche.testing.hosts import RIG_PREFIX, sweep_stale

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

TINY = Suite(
    name="hosts",
    workloads=(WorkloadPlan("digits-logreg", epochs=1),),
    rigs=((1.0, 0.5),),
    systems=("torch-ddp", "cadence"),
    link_mbit=(100.0,),
    capacity_s=0.0,
)


def test_a_tiny_hosts_suite_trains_across_hosts_and_writes_rows_with_link_mbit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(suites.SUITES, "hosts", TINY)
    out = tmp_path / "bench"

    code = main(["bench", "--suite", "hosts", "--json", "--no-progress", "--out", str(out)])

    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["rows"]
    assert [(r["system"], r["link_mbit"]) for r in rows] == [
        ("solo", 100.0), ("torch-ddp", 100.0), ("cadence", 100.0),
    ]  # fmt: skip
    for row in rows:
        assert row["error"] is None, row["error"]
        assert row["wall_s"] > 0 and 0.0 <= row["eval"] <= 1.0
        assert row["lost_samples"] == 0
        assert len(row["per_epoch"]) == 1
    ddp, cadence = rows[1], rows[2]
    assert ddp["syncs"] == 23  # 1,437 samples / (2 ranks × 32): one all-reduce a step
    assert sum(r["samples"] for r in cadence["per_rank"]) == 1437  # every sample, once
    # each rank's report was read from its own host's /tmp (no shared storage)
    assert all(r["busy_s"] is not None for r in cadence["per_rank"])
    assert [r["link_mbit"] for r in doc["runs"]] == [None, 100.0, 100.0]  # solo on the machine
    assert doc["link_mbit"] == [100.0]
    report = (out / "report.md").read_text()
    assert "### speeds 1, 0.5, one host per rank, links 100 Mbit/s" in report
    assert "| digits-logreg | 1, 0.5 | cadence |" in report  # the ratios per rate
    assert (out / "digits-logreg-loss.png").stat().st_size > 0
    # the rig is gone: no namespace of this process is left
    listed = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True)
    netns = listed.stdout
    assert f"{RIG_PREFIX}-{os.getpid()}-" not in netns


def _rig_namespaces(pid: int) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in listed.stdout.splitlines()
            if line.startswith(f"{RIG_PREFIX}-{pid}-")]  # fmt: skip


def test_a_sigterm_to_a_hosts_bench_removes_its_rig(tmp_path: Path) -> None:
    # SIGTERM's default action ended the bench without its cleanup: the rig's
    # namespaces, /etc/netns entries and /tmp folders stayed until a later sweep.
    args = [sys.executable, "-m", "elche.cli", "bench", "--suite", "hosts", "--no-progress",
            "--out", str(tmp_path / "bench")]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _rig_namespaces(proc.pid):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the bench built no rig"
            time.sleep(0.1)  # polling for a condition, with a deadline
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        mine = f"{RIG_PREFIX}-{proc.pid}-*"
        left = [*_rig_namespaces(proc.pid), *Path(tempfile.gettempdir()).glob(mine)]
        left += Path("/etc/netns").glob(mine)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        sweep_stale()  # whatever it left, for the tests after this one
    assert proc.returncode == 143, err[-3000:]
    assert left == [], err[-3000:]
