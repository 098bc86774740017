"""``elche bench --suite hosts`` end to end on a tiny suite: two namespace hosts, one rate.

One real invocation (torch DDP and cadence, each under torchrun on both
hosts, on a link shaped to 100 Mbit/s) shared by every assertion. Four
torchrun agents and their ranks start, two at a time: 98 s measured on the
2-core machine at a load of 5, 166 s at 11, hence the generous timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from elche.bench import suites
from elche.bench.suites import Suite, WorkloadPlan
from elche.cli import main
from elche.testing.hosts import RIG_PREFIX

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
