"""Issue 17's bar in ``report.md``: cadence against every peer, its capacity, its quality.

Per workload on the ``[1, 0.5, 0.25]`` rig (one host), ``cadence``:

- **fastest**: a shorter wall than every other row of its cell (torch DDP,
  both torchft systems, every other elche mode, and solo);
- **eval**: within 1 point of DDP's final eval (accuracy) or 0.02 bits per
  character (tiny-gpt): not worse than DDP's by more (better is no miss);
  other metrics are not judged (None);
- **capacity**: ``of_capacity`` ≥ 0.95 (the bar holds on ``digits-cnn``
  and ``tiny-gpt``; the other workloads report theirs unjudged);
- **to DDP's eval**: on ``tiny-gpt``, the median over seeds of the time it
  took to reach DDP's final eval ≤ 0.5 × DDP's wall (a seed that never
  reached it counts as a miss).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from elche.bench.text import num, rig_label

__all__ = ["CAPACITY_BAR", "DDP_EVAL_TIME_BAR", "peers_acceptance", "peers_section"]

RIG = (1.0, 0.5, 0.25)
EVAL_BARS = {"accuracy": 0.01, "bits per char": 0.02}  # cadence worse than DDP by at most
CAPACITY_BAR = 0.95
CAPACITY_JUDGED = ("digits-cnn", "tiny-gpt")
DDP_EVAL_TIME_BAR = 0.5
DDP_EVAL_TIME_JUDGED = ("tiny-gpt",)

Row = Mapping[str, Any]


def peers_acceptance(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Issue 17's check per workload whose cell ran cadence on ``RIG`` on one host.

    Returns:
        Per workload: ``workload, slower_or_level`` (the systems whose wall is
        not longer than cadence's), ``fastest, eval_delta, eval_ok,
        of_capacity, capacity_ok, ddp_eval_time_ratio`` (the median over
        seeds, or the one run's), ``ddp_eval_time_ok, passed``. An ``_ok`` is
        None where the bar does not judge that workload; ``passed`` is every
        judged bar met.
    """
    out: list[dict[str, Any]] = []
    for row in rows:
        if row["system"] != "cadence" or tuple(row["speeds"]) != RIG:
            continue
        if row.get("link_mbit") is not None or row.get("wall_s") is None:
            continue
        cell = [
            r
            for r in rows
            if r["workload"] == row["workload"]
            and tuple(r["speeds"]) == RIG
            and r.get("link_mbit") is None
            and r["system"] != "cadence"
            and r.get("wall_s") is not None
        ]
        level = [str(r["system"]) for r in cell if r["wall_s"] <= row["wall_s"]]
        delta = row.get("eval_delta_vs_ddp")
        bar = EVAL_BARS.get(str(row.get("metric")))
        worse = None if delta is None else (-delta if row["higher_is_better"] else delta)
        eval_ok = None if bar is None or worse is None else worse <= bar
        capacity = row.get("of_capacity")
        capacity_ok = (
            (capacity is not None and capacity >= CAPACITY_BAR)
            if row["workload"] in CAPACITY_JUDGED
            else None
        )
        ratio = _median_ddp_eval_time(row)
        time_ok = (
            (ratio is not None and ratio <= DDP_EVAL_TIME_BAR)
            if row["workload"] in DDP_EVAL_TIME_JUDGED
            else None
        )
        judged = [ok for ok in (not level, eval_ok, capacity_ok, time_ok) if ok is not None]
        out.append({
            "workload": row["workload"], "slower_or_level": level, "fastest": not level,
            "eval_delta": delta, "eval_ok": eval_ok, "of_capacity": capacity,
            "capacity_ok": capacity_ok, "ddp_eval_time_ratio": ratio,
            "ddp_eval_time_ok": time_ok, "passed": all(judged),
        })  # fmt: skip
    return out


def _median_ddp_eval_time(row: Row) -> float | None:
    """The median over seeds of the row's ``ddp_eval_time_ratio`` (never reached: infinite)."""
    seeds = row.get("seeds")
    runs = seeds["runs"] if seeds else [row]
    ratios = [r.get("ddp_eval_time_ratio") for r in runs]
    median = statistics.median(math.inf if r is None else float(r) for r in ratios)
    return None if math.isinf(median) else median


def peers_section(checks: Sequence[Mapping[str, Any]]) -> list[str]:
    """The report's section for ``peers_acceptance``'s checks (none: nothing)."""
    if not checks:
        return []
    lines = [
        "## Against every peer (issue 17)",
        "",
        f"`cadence` on speeds {rig_label(RIG)}: a shorter wall than every "
        f"other system of its cell, eval within 1 point (accuracy) or 0.02 bits per "
        f"character of DDP's, ≥ {CAPACITY_BAR:g} of the measured capacity on "
        f"{' and '.join(CAPACITY_JUDGED)}, and on {' and '.join(DDP_EVAL_TIME_JUDGED)} DDP's "
        f"final eval reached in ≤ {DDP_EVAL_TIME_BAR:g} × DDP's wall (median over seeds).",
        "",
        "| workload | not slower than cadence | Δ eval vs DDP | of capacity "
        "| to DDP's eval ÷ DDP wall | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        misses = [
            name
            for name, ok in (
                ("speed", c["fastest"]),
                ("eval", c["eval_ok"]),
                ("capacity", c["capacity_ok"]),
                ("to DDP's eval", c["ddp_eval_time_ok"]),
            )
            if ok is False
        ]
        verdict = "pass" if c["passed"] else f"miss ({', '.join(misses)})"
        lines.append(
            f"| {c['workload']} | {', '.join(c['slower_or_level']) or '—'} "
            f"| {num(c['eval_delta'], 4)} | {num(c['of_capacity'], 3)}{_judged(c['capacity_ok'])} "
            f"| {num(c['ddp_eval_time_ratio'], 3)}{_judged(c['ddp_eval_time_ok'])} | {verdict} |"
        )
    lines.append("")
    return lines


def _judged(ok: bool | None) -> str:
    return " (not judged)" if ok is None else ""
