"""From run records to the rows of ``elche bench``'s JSON (design §6).

One row per workload × rig × system, from the runs on the suite's seed.
With several repeats, the row reports
the run with the median wall time (the lower median of an even count) and
lists every repeat's wall time in ``wall_s_runs``; ratios against torch DDP
pair the two medians of the same workload and rig, measured in the same
invocation. ``solo`` runs once per workload and repeat; its row is repeated
under every rig (``speeds`` is the rig's vector, ``ranks`` is 1), because it
is each rig's efficiency denominator.

Row keys: ``workload, system, speeds, wall_s, samples_per_s, efficiency,
final_loss, eval, syncs, idle_pct, lost_samples`` (the contract) plus
``link_mbit, metric, higher_is_better, ranks, epochs, batch_size, train_samples, samples,
startup_s, capacity_samples_per_s, of_capacity, total_s, repeats, wall_s_runs,
speed_base_s, wire, overlap, wire_bytes_per_round, final_eval, target_eval,
time_to_target_s, target_loss, time_to_target_loss_s, time_to_ddp_eval_s,
ddp_eval_time_ratio, wall_ratio_vs_ddp,
eval_delta_vs_ddp, per_rank[{rank, speed, samples, share, busy_s, idle_s,
idle_pct}], per_epoch[{epoch, t, loss, eval}], seeds, error``.
``idle_pct`` is the per-rank list, in rank order.

Links: in a suite with ``link_mbit`` rates (``--suite hosts``) a cell is a
workload × rig × link rate, ``link_mbit`` the rate of the rig's shaped links
(the solo row, trained on the machine itself, is repeated in every cell with
the cell's rate); elsewhere ``link_mbit`` is None (one host, loopback).

Capacity: ``capacity_samples_per_s`` is what the machine delivers to the
rig's paced ranks training alone at once (``bench.capacity``, measured in
the same invocation); ``of_capacity`` is the row's samples/s over it, the
share of the machine's own ceiling the system reaches (None when the suite
skipped the measurement).

Quality: ``final_eval`` is the eval after the last epoch (``eval``, under
the name the quality columns use); ``time_to_target_s`` is the first epoch
end whose model reached the plan's ``target_eval``
(``WorkloadPlan.target_eval``; None when the workload has no target or the run
never reached it); ``time_to_target_loss_s`` is the same for the cell's
``target_loss`` (the highest final training loss among its systems).
``time_to_ddp_eval_s`` is the first epoch end whose model reached torch
DDP's final eval in the cell, ``ddp_eval_time_ratio`` that over DDP's wall
(None where the run never reached it, or the cell has no DDP row).

Seeds: the headline cells' rows (``Suite.headline_workloads`` ×
``HEADLINE_SYSTEMS``) carry ``seeds = {"seeds", "runs": [{seed, wall_s,
final_eval, time_to_target_s, time_to_ddp_eval_s, ddp_eval_time_ratio}],
"wall_s", "final_eval", "time_to_target_s", "ddp_eval_time_ratio"}``, the
last four ``metrics.spread`` over the seeds (the suite's seed counted by its
reported median run; each seed's DDP eval and wall are DDP's on that seed);
every other row has ``seeds = None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from elche.bench import metrics
from elche.bench.runner import Run
from elche.bench.suites import DDP, SOLO, Suite

__all__ = ["build_rows"]

Row = dict[str, Any]


def build_rows(suite: Suite, runs: Sequence[Run]) -> list[Row]:
    """The JSON rows of a finished suite.

    Args:
        suite: the suite that produced ``runs`` (gives the order of rows).
        runs: every run record, as ``run_suite`` returned them.

    Returns:
        Rows ordered by workload, rig, then system (solo first, DDP next).
    """
    extra = [r for r in runs if r.get("seed", suite.seed) != suite.seed]
    runs = [r for r in runs if r.get("seed", suite.seed) == suite.seed]
    rows: list[Row] = []
    for plan in suite.workloads:
        solo = _median_run([r for r in runs if r["workload"] == plan.name and r["system"] == SOLO])
        solo_sps = _num(solo.get("samples_per_s")) if solo else None
        for rig, link in ((rig, link) for rig in suite.rigs for link in suite.links()):
            capacity = _capacity(runs, plan.name, rig)
            cell: list[Row] = []
            for system in (SOLO, *suite.systems):
                chosen = (
                    solo
                    if system == SOLO
                    else _median_run(
                        [
                            r
                            for r in runs
                            if r["workload"] == plan.name
                            and r["system"] == system
                            and tuple(r["speeds"]) == rig
                            and r.get("link_mbit") == link
                        ]
                    )
                )
                if chosen is not None:
                    row = _row(chosen, rig, solo_sps, capacity, plan.target_eval)
                    cell.append(row | {"link_mbit": link})
            _compare_in_cell(cell)
            for row in cell:
                row["seeds"] = _seed_spread(row, extra, suite.seed)
            rows.extend(cell)
    return rows


def _seed_spread(row: Row, extra: Sequence[Run], seed: int) -> dict[str, Any] | None:
    """The row's spread over seeds, when other seeds ran its cell; else None."""
    others = [
        r
        for r in extra
        if r["workload"] == row["workload"]
        and r["system"] == row["system"]
        and list(r["speeds"]) == row["speeds"]
    ]
    if not others:
        return None
    entries = [
        {
            "seed": seed,
            "wall_s": row["wall_s"],
            "final_eval": row["final_eval"],
            "time_to_target_s": row["time_to_target_s"],
            "time_to_ddp_eval_s": row["time_to_ddp_eval_s"],
            "ddp_eval_time_ratio": row["ddp_eval_time_ratio"],
        }
    ]
    target = row["target_eval"]
    for run in others:
        ddp = next(
            (
                r
                for r in extra
                if r["workload"] == row["workload"]
                and r["system"] == DDP
                and list(r["speeds"]) == row["speeds"]
                and r.get("seed") == run.get("seed")
            ),
            None,
        )
        entries.append(
            {
                "seed": run.get("seed"),
                "wall_s": _num(run.get("wall_s")),
                "final_eval": _num(run.get("eval")),
                "time_to_target_s": _time_to_eval(run, target),
                **_to_ddp_eval(run, ddp),
                "error": run.get("error"),
            }
        )
    return {
        "seeds": [e["seed"] for e in entries],
        "runs": entries,
        **{key: metrics.spread(e[key] for e in entries) for key in _SPREAD_KEYS},
    }


_SPREAD_KEYS = ("wall_s", "final_eval", "time_to_target_s", "ddp_eval_time_ratio")


def _to_ddp_eval(run: Run | Row, ddp: Run | Row | None) -> dict[str, float | None]:
    """When ``run`` first reached DDP's final eval, in seconds and as a share of DDP's wall."""
    ddp_eval = _num(ddp.get("eval")) if ddp is not None else None
    ddp_wall = _num(ddp.get("wall_s")) if ddp is not None else None
    seconds = _time_to_eval(run, ddp_eval)
    return {"time_to_ddp_eval_s": seconds, "ddp_eval_time_ratio": metrics.ratio(seconds, ddp_wall)}


def _time_to_eval(run: Run, target: float | None) -> float | None:
    """A run's time to ``target`` eval, from its per-epoch evals."""
    points = [(float(e["t"]), _num(e.get("eval"))) for e in run.get("per_epoch") or []]
    return metrics.time_to_target_eval(
        points, target, higher_is_better=bool(run.get("higher_is_better", True))
    )


def _median_run(candidates: Sequence[Run]) -> Run | None:
    """The run of median wall time (failed runs only if nothing succeeded)."""
    if not candidates:
        return None
    index = metrics.median_index([_num(r.get("wall_s")) for r in candidates])
    chosen = dict(candidates[0 if index is None else index])
    chosen["wall_s_runs"] = [r.get("wall_s") for r in candidates]
    chosen["repeats"] = len(candidates)
    return chosen


def _capacity(runs: Sequence[Run], workload: str, rig: tuple[float, ...]) -> float | None:
    """The rig's measured capacity in samples/s (``bench.capacity``), if measured."""
    for run in runs:
        record = run.get("capacity")
        if run["workload"] == workload and tuple(run["speeds"]) == rig and record:
            return _num(record.get("samples_per_s"))
    return None


def _row(
    run: Run,
    rig: tuple[float, ...],
    solo_sps: float | None,
    capacity: float | None,
    target_eval: float | None,
) -> Row:
    wall_s = _num(run.get("wall_s"))
    sps = _num(run.get("samples_per_s"))
    per_rank = []
    total = sum(int(r["samples"]) for r in run.get("per_rank") or [])
    for r in run.get("per_rank") or []:
        busy_s = _num(r.get("busy_s"))
        idle = metrics.idle_pct(wall_s, busy_s)
        per_rank.append(
            {
                "rank": r["rank"],
                "speed": r["speed"],
                "samples": r["samples"],
                "share": int(r["samples"]) / total if total else None,
                "busy_s": busy_s,
                "idle_s": None if idle is None or wall_s is None else idle * wall_s / 100.0,
                "idle_pct": idle,
            }
        )
    return {
        "workload": run["workload"],
        "system": run["system"],
        "speeds": list(rig),
        "wall_s": wall_s,
        "samples_per_s": sps,
        "efficiency": metrics.efficiency(sps, rig, solo_sps),
        "capacity_samples_per_s": capacity,
        "of_capacity": metrics.ratio(sps, capacity),
        "final_loss": _num(run.get("final_loss")),
        "eval": _num(run.get("eval")),
        "final_eval": _num(run.get("eval")),
        "target_eval": target_eval,
        "syncs": run.get("syncs"),
        "idle_pct": [r["idle_pct"] for r in per_rank],
        "lost_samples": run.get("lost_samples"),
        "metric": run["metric"],
        "higher_is_better": run["higher_is_better"],
        "ranks": run["ranks"],
        "epochs": run["epochs"],
        "batch_size": run["batch_size"],
        "train_samples": run.get("train_samples"),
        "samples": run.get("samples"),
        "startup_s": run.get("startup_s"),
        "total_s": run.get("total_s"),
        "repeats": run.get("repeats", 1),
        "wall_s_runs": run.get("wall_s_runs", [wall_s]),
        "speed_base_s": run.get("speed_base_s"),
        "wire": run.get("wire"),
        "overlap": run.get("overlap"),
        "wire_bytes_per_round": run.get("wire_bytes_per_round"),
        "per_rank": per_rank,
        "per_epoch": run.get("per_epoch") or [],
        "error": run.get("error"),
    }


def _compare_in_cell(cell: list[Row]) -> None:
    """Target loss, the times to target and the ratios against DDP, in place."""
    target = metrics.target_loss(row["final_loss"] for row in cell)
    ddp = next((row for row in cell if row["system"] == DDP), None)
    for row in cell:
        points = [(float(e["t"]), _num(e.get("loss"))) for e in row["per_epoch"]]
        row["target_loss"] = target
        row["time_to_target_loss_s"] = metrics.time_to_target(points, target)
        row["time_to_target_s"] = _time_to_eval(row, row["target_eval"])
        row.update(_to_ddp_eval(row, ddp))
        row["wall_ratio_vs_ddp"] = metrics.ratio(row["wall_s"], ddp["wall_s"] if ddp else None)
        row["eval_delta_vs_ddp"] = (
            row["eval"] - ddp["eval"]
            if ddp is not None and row["eval"] is not None and ddp["eval"] is not None
            else None
        )


def _num(value: object) -> float | None:
    """A JSON number as a float; None for None, bools and anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
