"""The bench arithmetic, rows and report on fake numbers (no training)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from elche.bench import metrics
from elche.bench.peers_report import peers_acceptance, peers_section
from elche.bench.report import acceptance, dashboard_cost, render
from elche.bench.rows import build_rows
from elche.bench.suites import (
    EVAL_TARGETS,
    QUICK,
    SUITES,
    Suite,
    WorkloadPlan,
    split_system,
    with_dashboard,
)

CONTRACT_KEYS = {
    "workload", "system", "speeds", "wall_s", "samples_per_s", "efficiency",
    "final_loss", "eval", "syncs", "idle_pct", "lost_samples",
    "final_eval", "target_eval", "time_to_target_s", "seeds",
}  # fmt: skip


# --- metrics -------------------------------------------------------------------------


def test_ideal_throughput_is_the_sum_of_solo_throughputs() -> None:
    assert metrics.ideal_throughput([1.0, 0.5, 0.25], 1000.0) == pytest.approx(1750.0)


def test_efficiency_is_throughput_over_the_ideal() -> None:
    assert metrics.efficiency(875.0, [1.0, 0.5, 0.25], 1000.0) == pytest.approx(0.5)
    assert metrics.efficiency(1000.0, [1.0], 1000.0) == pytest.approx(1.0)


@pytest.mark.parametrize(("sps", "solo"), [(None, 1000.0), (875.0, None), (875.0, 0.0)])
def test_efficiency_is_none_when_a_number_is_missing(sps: float | None, solo: float | None) -> None:
    assert metrics.efficiency(sps, [1.0, 0.5], solo) is None


def test_ratio() -> None:
    assert metrics.ratio(3.0, 7.5) == pytest.approx(0.4)
    assert metrics.ratio(None, 7.5) is None
    assert metrics.ratio(3.0, None) is None
    assert metrics.ratio(3.0, 0.0) is None
    assert metrics.ratio(float("nan"), 1.0) is None


def test_lockstep_bound() -> None:
    assert metrics.lockstep_ratio([1.0, 0.5, 0.25]) == pytest.approx(0.75 / 1.75)
    assert metrics.lockstep_ratio([1.0, 1.0]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="empty"):
        metrics.lockstep_ratio([])


def test_target_is_the_highest_finite_final_loss() -> None:
    assert metrics.target_loss([0.3, None, 0.5, float("nan"), 0.1]) == 0.5
    assert metrics.target_loss([None, float("inf")]) is None


def test_time_to_target_is_the_first_epoch_at_or_below_it() -> None:
    epochs = [(1.0, 2.0), (2.0, None), (3.0, 0.5), (4.0, 0.4)]
    assert metrics.time_to_target(epochs, 0.5) == 3.0
    assert metrics.time_to_target(epochs, 0.1) is None
    assert metrics.time_to_target(epochs, None) is None


def test_time_to_target_eval_is_the_first_epoch_reaching_it_either_way() -> None:
    evals = [(1.0, 0.5), (2.0, None), (3.0, 0.96), (4.0, 0.99)]
    assert metrics.time_to_target_eval(evals, 0.95, higher_is_better=True) == 3.0
    assert metrics.time_to_target_eval(evals, 0.995, higher_is_better=True) is None
    assert metrics.time_to_target_eval(evals, None, higher_is_better=True) is None
    errors = [(1.0, 0.09), (2.0, float("nan")), (3.0, 0.02)]
    assert metrics.time_to_target_eval(errors, 0.03, higher_is_better=False) == 3.0
    assert metrics.time_to_target_eval(errors, 0.1, higher_is_better=False) == 1.0


def test_spread_over_seeds() -> None:
    got = metrics.spread([0.97, None, 0.95, float("inf"), 0.99])
    assert got == pytest.approx(
        {"n": 3, "min": 0.95, "max": 0.99, "mean": 0.97, "median": 0.97, "range": 0.04}
    )
    assert metrics.spread([None]) is None


def test_idle_pct() -> None:
    assert metrics.idle_pct(10.0, 7.5) == pytest.approx(25.0)
    assert metrics.idle_pct(10.0, 11.0) == 0.0  # never negative
    assert metrics.idle_pct(0.0, 1.0) is None
    assert metrics.idle_pct(None, 1.0) is None


def test_median_index_picks_the_lower_median_and_skips_failures() -> None:
    assert metrics.median_index([3.0, 1.0, 2.0]) == 2
    assert metrics.median_index([4.0, None, 1.0]) == 2
    assert metrics.median_index([None, None]) is None


# --- suites ------------------------------------------------------------------------


def test_quick_runs_ddp_and_cadence_on_the_issue_rig() -> None:
    assert SUITES["quick"] is QUICK
    assert (1.0, 0.5, 0.25) in QUICK.rigs
    assert {"torch-ddp", "cadence"} <= set(QUICK.systems)
    assert {"torchft-localsgd", "torchft-diloco"} <= set(QUICK.systems)
    assert [p.name for p in QUICK.workloads] == ["digits-cnn", "digits-mlp", "tiny-gpt"]
    # per repeat and workload: solo + every system on every rig; then the headline
    # cells (cadence and DDP on digits-cnn and tiny-gpt) once on each extra seed
    jobs = QUICK.seed_jobs()
    assert [(seed, p.name, system) for seed, p, system, _ in jobs] == [
        (1, "digits-cnn", "torch-ddp"), (1, "digits-cnn", "cadence"),
        (1, "tiny-gpt", "torch-ddp"), (1, "tiny-gpt", "cadence"),
        (2, "digits-cnn", "torch-ddp"), (2, "digits-cnn", "cadence"),
        (2, "tiny-gpt", "torch-ddp"), (2, "tiny-gpt", "cadence"),
    ]  # fmt: skip
    per_repeat = len(QUICK.workloads) * (1 + len(QUICK.systems))
    assert QUICK.num_runs() == QUICK.repeats * per_repeat + len(jobs)


def test_every_quick_workload_has_a_target_eval() -> None:
    for plan in QUICK.workloads:
        assert plan.target_eval is not None
        if plan.name.startswith("digits"):  # accuracy
            assert 0.0 < plan.target_eval == EVAL_TARGETS[plan.name] < 1.0
    gpt = next(p for p in QUICK.workloads if p.name == "tiny-gpt")
    assert gpt.target_eval == gpt.target != EVAL_TARGETS["tiny-gpt"]  # its cut's own target


# --- rows and report -----------------------------------------------------------------

SUITE = Suite(
    name="fake",
    workloads=(WorkloadPlan("digits-cnn", epochs=2),),
    rigs=((1.0, 0.5),),
    systems=("torch-ddp", "cadence"),
    repeats=3,
    extra_seeds=(1, 2),
    headline_workloads=("digits-cnn",),
)


def fake_run(
    system: str, wall_s: float, *, final_loss: float, eval_: float, seed: int = 0
) -> dict[str, Any]:
    speeds = [1.0] if system == "solo" else [1.0, 0.5]
    samples = [200, 100][: len(speeds)]
    return {
        "workload": "digits-cnn", "system": system, "speeds": speeds, "ranks": len(speeds),
        "epochs": 2, "batch_size": 32, "metric": "accuracy", "higher_is_better": True,
        "error": None, "wall_s": wall_s, "startup_s": 1.0, "total_s": wall_s + 2,
        "samples": sum(samples), "samples_per_s": sum(samples) / wall_s,
        "final_loss": final_loss, "eval": eval_, "syncs": 3, "lost_samples": 0,
        "seed": seed,
        "capacity": None if system == "solo" else {"samples_per_s": 240.0, "fraction": 0.8},
        "per_epoch": [
            {"epoch": 0, "t": wall_s / 2, "loss": 1.0, "eval": eval_ - 0.02},
            {"epoch": 1, "t": wall_s, "loss": final_loss, "eval": eval_},
        ],
        "per_rank": [
            {"rank": r, "speed": s, "samples": n, "busy_s": wall_s * 0.75}
            for r, (s, n) in enumerate(zip(speeds, samples, strict=True))
        ],
    }  # fmt: skip


@pytest.fixture
def rows() -> list[dict[str, Any]]:
    runs = []
    for wall in (3.0, 1.0, 2.0):  # three repeats; medians: solo 2, DDP 4, cadence 2.5
        runs += [
            fake_run("solo", wall, final_loss=0.1, eval_=0.97),
            fake_run("torch-ddp", 2 * wall, final_loss=0.2, eval_=0.96),
            fake_run("cadence", 1.25 * wall, final_loss=0.3, eval_=0.955),
        ]
    failed = fake_run("cadence", 1.0, final_loss=1.0, eval_=0.0)
    keep = ("workload", "system", "speeds", "ranks", "epochs", "batch_size", "metric")
    runs.append({**{k: failed[k] for k in keep}, "higher_is_better": True, "error": "boom"})
    for seed, eval_ in ((1, 0.93), (2, 0.99)):  # the headline cell on the extra seeds
        runs += [
            fake_run("torch-ddp", 10.0, final_loss=0.2, eval_=eval_, seed=seed),
            fake_run("cadence", 5.0, final_loss=0.3, eval_=eval_ - 0.01, seed=seed),
        ]
    return build_rows(SUITE, runs)


def test_one_row_per_system_with_every_contract_key(rows: list[dict[str, Any]]) -> None:
    assert [r["system"] for r in rows] == ["solo", "torch-ddp", "cadence"]
    for row in rows:
        assert row.keys() >= CONTRACT_KEYS
        assert row["speeds"] == [1.0, 0.5]
        assert len(row["idle_pct"]) == row["ranks"]


def test_rows_report_the_median_run_and_ratios_against_ddp(rows: list[dict[str, Any]]) -> None:
    solo, ddp, cadence = rows
    assert ddp["wall_s"] == 4.0 and ddp["wall_s_runs"] == [6.0, 2.0, 4.0]
    assert cadence["wall_s"] == 2.5 and cadence["repeats"] == 4  # the failed run is counted
    assert cadence["wall_s_runs"] == [3.75, 1.25, 2.5, None]
    assert cadence["wall_ratio_vs_ddp"] == pytest.approx(2.5 / 4.0)
    assert cadence["eval_delta_vs_ddp"] == pytest.approx(-0.005)
    # solo: 200 samples in 2 s -> 100/s; the rig's ideal is 1.5 × 100/s
    assert solo["efficiency"] == pytest.approx(1 / 1.5)
    assert cadence["efficiency"] == pytest.approx((300 / 2.5) / 150.0)
    assert cadence["idle_pct"] == pytest.approx([25.0, 25.0])
    # Every row of the rig, solo's too, is measured against the rig's capacity.
    assert [r["capacity_samples_per_s"] for r in rows] == [240.0] * 3
    assert cadence["of_capacity"] == pytest.approx((300 / 2.5) / 240.0)
    assert solo["of_capacity"] == pytest.approx(100 / 240.0)
    assert cadence["per_rank"][0]["share"] == pytest.approx(2 / 3)


def test_time_to_target_loss_uses_the_highest_final_loss(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        assert row["target_loss"] == 0.3
    solo, ddp, cadence = rows
    assert (solo["time_to_target_loss_s"], ddp["time_to_target_loss_s"]) == (2.0, 4.0)
    assert cadence["time_to_target_loss_s"] == 2.5


def test_every_row_carries_final_eval_and_time_to_the_workloads_target(
    rows: list[dict[str, Any]],
) -> None:
    solo, ddp, cadence = rows
    assert [r["target_eval"] for r in rows] == [EVAL_TARGETS["digits-cnn"]] * 3 == [0.95] * 3
    assert (solo["final_eval"], ddp["final_eval"], cadence["final_eval"]) == (0.97, 0.96, 0.955)
    # solo reaches 0.95 at its first epoch end (eval 0.95), DDP and cadence only at the last
    assert (solo["time_to_target_s"], ddp["time_to_target_s"]) == (1.0, 4.0)
    assert cadence["time_to_target_s"] == 2.5


def test_headline_rows_report_the_spread_over_seeds(rows: list[dict[str, Any]]) -> None:
    solo, ddp, cadence = rows
    assert solo["seeds"] is None  # not a headline system
    assert ddp["seeds"]["seeds"] == [0, 1, 2]
    assert [r["final_eval"] for r in ddp["seeds"]["runs"]] == [0.96, 0.93, 0.99]
    assert ddp["seeds"]["final_eval"] == pytest.approx(
        {"n": 3, "min": 0.93, "max": 0.99, "mean": 0.96, "median": 0.96, "range": 0.06}
    )
    # seed 1's cadence (final 0.92) never reaches 0.95; seed 2's does at its first epoch
    assert [r["time_to_target_s"] for r in cadence["seeds"]["runs"]] == [2.5, None, 2.5]
    assert cadence["seeds"]["wall_s"]["max"] == 5.0
    text = render(
        {
            "suite": "fake", "date": "d", "command": "c", "total_s": 1.0, "repeats": 3,
            "machine": {"description": "m"}, "rows": rows,
        }
    )  # fmt: skip
    assert "| cadence | 0, 1, 2 | 2.500 – 5.000 (4.167, n=3) |" in text


def test_acceptance_and_report_render(rows: list[dict[str, Any]]) -> None:
    moved = [{**r, "speeds": [1.0, 0.5, 0.25]} for r in rows]
    (check,) = acceptance(moved)
    assert check["wall_ratio"] == pytest.approx(0.625)
    assert check["eval_delta_points"] == pytest.approx(-0.5)
    assert (check["ratio_ok"], check["eval_ok"], check["passed"]) == (False, True, False)
    doc = {
        "suite": "fake", "date": "today", "command": "elche bench", "total_s": 1.0,
        "repeats": 3, "machine": {"description": "2 CPU cores"}, "rows": rows,
        "acceptance": [check], "charts": {"digits-cnn": {"loss": "digits-cnn-loss.png"}},
        "notes": ["a note"],
    }  # fmt: skip
    text = render(doc)
    assert "| cadence | 2.50 | 0.625 |" in text
    assert "-0.50 pt" in text
    assert "miss (ratio)" in text
    assert "![digits-cnn: loss](digits-cnn-loss.png)" in text
    assert text.endswith("- a note\n")


def test_acceptance_does_not_judge_eval_of_a_lower_is_better_metric(
    rows: list[dict[str, Any]],
) -> None:
    moved = [{**r, "speeds": [1.0, 0.5, 0.25], "higher_is_better": False} for r in rows]
    (check,) = acceptance(moved)
    assert (check["eval_delta_points"], check["eval_ok"], check["passed"]) == (None, None, None)
    doc = {
        "suite": "fake", "date": "today", "command": "c", "total_s": 1.0, "repeats": 1,
        "machine": {"description": "m"}, "rows": moved, "acceptance": [check],
    }  # fmt: skip
    assert "ratio miss; eval n/a (not an accuracy)" in render(doc)


# --- the dashboard's cost ------------------------------------------------------------


def test_with_dashboard_twins_each_elche_mode_right_after_it() -> None:
    suite = with_dashboard(Suite(name="t", workloads=SUITE.workloads, rigs=SUITE.rigs,
                                 systems=("torch-ddp", "cadence", "cpu-sync")))  # fmt: skip
    assert suite.systems == (
        "torch-ddp", "cadence", "cadence+dashboard", "cpu-sync", "cpu-sync+dashboard"
    )  # fmt: skip
    assert split_system("cpu-sync+dashboard") == ("cpu-sync", True)
    assert split_system("torch-ddp") == ("torch-ddp", False)
    assert any("+dashboard" in note for note in suite.notes)


def test_the_dashboard_cost_is_judged_against_the_plain_runs_spread() -> None:
    suite = Suite(name="t", workloads=SUITE.workloads, rigs=SUITE.rigs,
                  systems=("cadence", "cadence+dashboard"), repeats=3)  # fmt: skip
    runs = []
    for plain, watched in ((2.0, 2.1), (2.4, 2.3), (2.2, 2.25)):
        runs += [fake_run("cadence", plain, final_loss=0.3, eval_=0.9),
                 fake_run("cadence+dashboard", watched, final_loss=0.3, eval_=0.9)]  # fmt: skip
    (pair,) = dashboard_cost(build_rows(suite, runs))
    assert pair["mode"] == "cadence" and pair["wall_s"] == 2.2 and pair["wall_s_dashboard"] == 2.25
    assert pair["ratio"] == pytest.approx(2.25 / 2.2, abs=1e-4)
    assert pair["spread"] == pytest.approx(1.2) and pair["within_noise"] is True
    slow = [fake_run("cadence+dashboard", 3.0, final_loss=0.3, eval_=0.9)] * 3
    (pair,) = dashboard_cost(
        build_rows(suite, [r for r in runs if r["system"] == "cadence"] + slow)
    )
    assert pair["within_noise"] is False
    doc = {"suite": "t", "date": "d", "command": "c", "machine": {"description": "m"},
           "total_s": 1.0, "repeats": 3, "rows": [], "dashboard_cost": [pair]}  # fmt: skip
    assert "| cadence | 2.20 | 3.00 | 1.364 | 1.200 | outside noise |" in render(doc)


def test_time_to_ddps_final_eval_is_against_ddp_on_the_same_seed() -> None:
    runs = [
        fake_run("solo", 2.0, final_loss=0.1, eval_=0.97),
        fake_run("torch-ddp", 4.0, final_loss=0.2, eval_=0.96),
        fake_run("cadence", 2.0, final_loss=0.3, eval_=0.97),  # 0.95 at 1 s, 0.97 at 2 s
        fake_run("torch-ddp", 10.0, final_loss=0.2, eval_=0.93, seed=1),
        fake_run("cadence", 5.0, final_loss=0.3, eval_=0.96, seed=1),  # 0.94 at 2.5 s
        fake_run("torch-ddp", 10.0, final_loss=0.2, eval_=0.99, seed=2),
        fake_run("cadence", 5.0, final_loss=0.3, eval_=0.98, seed=2),  # never 0.99
    ]
    solo, ddp, cadence = build_rows(dataclasses.replace(SUITE, repeats=1), runs)
    assert ddp["ddp_eval_time_ratio"] == 1.0  # DDP reaches its own final eval at its end
    assert (cadence["time_to_ddp_eval_s"], cadence["ddp_eval_time_ratio"]) == (2.0, 0.5)
    assert (solo["time_to_ddp_eval_s"], solo["ddp_eval_time_ratio"]) == (2.0, 0.5)
    seeds = cadence["seeds"]["runs"]
    assert [r["time_to_ddp_eval_s"] for r in seeds] == [2.0, 2.5, None]
    assert [r["ddp_eval_time_ratio"] for r in seeds] == [0.5, 0.25, None]
    assert cadence["seeds"]["ddp_eval_time_ratio"]["median"] == pytest.approx(0.375)


def _check_row(system: str, wall_s: float, **extra: Any) -> dict[str, Any]:
    row = {
        "workload": "tiny-gpt", "system": system, "speeds": [1.0, 0.5, 0.25], "link_mbit": None,
        "wall_s": wall_s, "metric": "bits per char", "higher_is_better": False,
        "eval_delta_vs_ddp": 0.0, "of_capacity": 0.9, "ddp_eval_time_ratio": None, "seeds": None,
    }  # fmt: skip
    return row | extra


def test_the_peers_bar_judges_speed_eval_capacity_and_time_to_ddps_eval() -> None:
    seeds = {"runs": [{"ddp_eval_time_ratio": r} for r in (0.45, None, 0.48)]}
    rows = [
        _check_row("torch-ddp", 10.0),
        _check_row("torchft-diloco", 11.0),
        _check_row("cpu-cadence", 4.0),
        _check_row("cadence", 4.5, eval_delta_vs_ddp=-0.05, of_capacity=0.96, seeds=seeds),
    ]
    (check,) = peers_acceptance(rows)
    assert check["slower_or_level"] == ["cpu-cadence"] and not check["fastest"]
    assert check["eval_ok"]  # 0.05 bits per character better than DDP is no miss
    assert check["capacity_ok"]
    assert check["ddp_eval_time_ratio"] == 0.48  # median of 0.45, 0.48 and never
    assert check["ddp_eval_time_ok"] and not check["passed"]
    text = "\n".join(peers_section([check]))
    assert "| tiny-gpt | cpu-cadence | -0.0500 | 0.960 | 0.480 | miss (speed) |" in text

    worse = peers_acceptance([*rows[:2], {**rows[3], "eval_delta_vs_ddp": 0.03}])
    assert worse[0]["eval_ok"] is False and worse[0]["fastest"]
    mlp = _check_row(
        "cadence", 1.0, workload="digits-mlp", metric="accuracy", higher_is_better=True,
        eval_delta_vs_ddp=-0.008, of_capacity=0.3,
    )  # fmt: skip
    (judged,) = peers_acceptance([mlp])
    assert judged["capacity_ok"] is None and judged["ddp_eval_time_ok"] is None  # not judged
    assert judged["eval_ok"] and judged["passed"]
