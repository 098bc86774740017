"""The hosts suite's rows, ratios, bar and report on fake numbers (no processes)."""

from __future__ import annotations

from typing import Any

import pytest

from elche.bench.hosts_report import hosts_acceptance
from elche.bench.report import acceptance, render
from elche.bench.rows import build_rows
from elche.bench.suites import HOSTS, SUITES, Suite, WorkloadPlan
from tests.bench.test_metrics import fake_run

RIG = (1.0, 0.5)
SUITE = Suite(
    name="fake-hosts",
    workloads=(WorkloadPlan("digits-cnn", epochs=2),),
    rigs=(RIG,),
    systems=("torch-ddp", "cadence", "cpu-async"),
    link_mbit=(1000.0, 100.0),
)
# wall s per (system, link): DDP is bound by the slow link, elche is not
WALLS = {
    ("torch-ddp", 1000.0): 4.0, ("cadence", 1000.0): 2.0, ("cpu-async", 1000.0): 5.0,
    ("torch-ddp", 100.0): 20.0, ("cadence", 100.0): 4.0, ("cpu-async", 100.0): 6.0,
}  # fmt: skip
EVALS = {"torch-ddp": 0.96, "cadence": 0.955, "cpu-async": 0.94}


def hosts_runs() -> list[dict[str, Any]]:
    runs = [{**fake_run("solo", 2.0, final_loss=0.1, eval_=0.97), "link_mbit": None}]
    for (system, link), wall in WALLS.items():
        runs.append(
            {**fake_run(system, wall, final_loss=0.2, eval_=EVALS[system]), "link_mbit": link}
        )
    return runs


@pytest.fixture
def rows() -> list[dict[str, Any]]:
    return build_rows(SUITE, hosts_runs())


def test_the_hosts_suite_is_registered_as_the_issue_asks() -> None:
    assert SUITES["hosts"] is HOSTS
    assert HOSTS.rigs == ((1.0, 0.5, 0.25),)
    assert set(HOSTS.link_mbit) == {1000.0, 100.0}
    assert HOSTS.systems == ("torch-ddp", "cadence", "cpu-cadence", "cpu-async")
    assert HOSTS.links() == HOSTS.link_mbit
    assert Suite("one-host", (), ()).links() == (None,)
    # solo once, then every system on every rig at every rate
    assert HOSTS.num_runs() == 1 + 2 * 4


def test_one_cell_per_link_rate_each_row_carrying_its_rate(rows: list[dict[str, Any]]) -> None:
    cells = [(r["link_mbit"], r["system"]) for r in rows]
    assert cells == [
        (1000.0, "solo"), (1000.0, "torch-ddp"), (1000.0, "cadence"), (1000.0, "cpu-async"),
        (100.0, "solo"), (100.0, "torch-ddp"), (100.0, "cadence"), (100.0, "cpu-async"),
    ]  # fmt: skip
    by = {(r["link_mbit"], r["system"]): r for r in rows}
    # ratios pair each row with DDP at the same rate, never across rates
    assert by[100.0, "cadence"]["wall_ratio_vs_ddp"] == pytest.approx(4.0 / 20.0)
    assert by[1000.0, "cadence"]["wall_ratio_vs_ddp"] == pytest.approx(2.0 / 4.0)
    assert by[1000.0, "cpu-async"]["wall_ratio_vs_ddp"] == pytest.approx(5.0 / 4.0)
    # solo (on the machine itself) is every cell's efficiency denominator
    assert by[100.0, "solo"]["wall_s"] == by[1000.0, "solo"]["wall_s"] == 2.0


def test_the_bar_is_checked_per_rate(rows: list[dict[str, Any]]) -> None:
    checks = {(c["link_mbit"], c["system"]): c for c in hosts_acceptance(rows)}
    # 100 Mbit/s judges cadence only: 0.2 × DDP and -0.5 points: met
    assert set(checks) == {(100.0, "cadence"), (1000.0, "cadence"), (1000.0, "cpu-async")}
    slow = checks[100.0, "cadence"]
    assert slow["wall_ratio"] == pytest.approx(0.2)
    assert slow["eval_delta_points"] == pytest.approx(-0.5)
    assert slow["passed"] is True
    # 1000 Mbit/s: every elche row must be ahead; cpu-async at 1.25 × DDP is not
    assert checks[1000.0, "cadence"]["passed"] is True
    assert checks[1000.0, "cpu-async"]["passed"] is False
    # the one-host acceptance does not judge rows across hosts
    assert acceptance([{**r, "speeds": [1.0, 0.5, 0.25]} for r in rows]) == []


def test_a_slow_cadence_or_a_worse_eval_misses_the_bar() -> None:
    runs = hosts_runs()
    for run in runs:
        if run["system"] == "cadence" and run["link_mbit"] == 100.0:
            run.update(fake_run("cadence", 6.0, final_loss=0.2, eval_=0.96))
            run["link_mbit"] = 100.0  # 0.3 × DDP, eval equal
        if run["system"] == "torch-ddp" and run["link_mbit"] == 100.0:
            run["eval"] = 0.98  # cadence now 2.5 points behind as well
    (slow,) = [c for c in hosts_acceptance(build_rows(SUITE, runs)) if c["link_mbit"] == 100.0]
    assert slow["wall_ratio"] == pytest.approx(0.3)
    assert slow["eval_delta_points"] == pytest.approx(-2.0)
    assert slow["passed"] is False


def test_the_report_prints_a_table_per_rate_the_ratios_and_the_bar(
    rows: list[dict[str, Any]],
) -> None:
    doc = {
        "suite": "fake-hosts", "date": "today", "command": "elche bench --suite hosts",
        "total_s": 1.0, "repeats": 1, "machine": {"description": "2 CPU cores"}, "rows": rows,
        "hosts_acceptance": hosts_acceptance(rows),
    }  # fmt: skip
    text = render(doc)
    assert "### speeds 1, 0.5, one host per rank, links 1000 Mbit/s" in text
    assert "### speeds 1, 0.5, one host per rank, links 100 Mbit/s" in text
    assert "| workload | speeds | system | × DDP at 1000 Mbit/s | × DDP at 100 Mbit/s |" in text
    assert "| digits-cnn | 1, 0.5 | cadence | 0.500 | 0.200 |" in text
    assert "| digits-cnn | 1, 0.5 | cpu-async | 1.250 | 0.300 |" in text
    assert "| digits-cnn | 100 Mbit/s | cadence | 0.200 | -0.50 |" in text
    assert (
        "| digits-cnn | 1000 Mbit/s | cpu-async | 1.250 | -2.00 | wall < DDP's | missed |" in text
    )


def test_without_a_host_rig_the_hosts_suite_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    import elche.testing.hosts
    from elche.cli import main

    monkeypatch.setattr(elche.testing.hosts, "missing", lambda: "needs root (network namespaces)")
    code = main(["bench", "--suite", "hosts", "--no-progress", "--out", str(tmp_path)])
    assert code == 2
    assert "--suite hosts refused: needs root (network namespaces)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing written


def test_a_system_the_hosts_cannot_run_is_refused_by_name() -> None:
    from elche.bench.hosts import run_on_hosts

    with pytest.raises(ValueError, match=r"torch-ddp, sync, cadence.*not 'cadence\+dashboard'"):
        run_on_hosts(
            "cadence+dashboard", WorkloadPlan("digits-mlp", epochs=1), (1.0, 0.5), seed=0,
            speed_base_s=0.001, rig=None,  # type: ignore[arg-type]  # refused before any rig use
        )  # fmt: skip
