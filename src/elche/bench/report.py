"""``report.md``: the side-by-side tables of an ``elche bench`` run.

One section per workload, one table per rig: every system with its wall
time, the ratio to torch DDP's (same invocation), throughput, efficiency,
time to the workload's target eval, final loss, final eval and its
difference to DDP's, averaging rounds, per-rank idle % and lost samples;
the headline cell's spread over seeds. A closing section checks the issue's
acceptance on the ``[1, 0.5, 0.25]`` rig, issue 17's against every peer
(``bench.peers_report``), and for a suite across hosts
(``link_mbit``) the ratios per link rate and issue 14's bar
(``bench.hosts_report``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from elche.bench import metrics
from elche.bench.hosts_report import hosts_acceptance, hosts_section
from elche.bench.peers_report import peers_section
from elche.bench.suites import DDP, split_system
from elche.bench.text import num, rig_label

__all__ = ["ACCEPT_RATIO", "ACCEPT_RIG", "acceptance", "hosts_acceptance", "render"]

ACCEPT_RIG = (1.0, 0.5, 0.25)  # the rig
ACCEPT_RATIO = 0.4  # cadence wall ≤ 0.4 × DDP's ...
ACCEPT_EVAL_POINTS = 1.0  # ... with eval within 1 point (accuracy metrics)

Row = Mapping[str, Any]


def acceptance(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The issue's check, per workload that ran cadence and DDP on ``ACCEPT_RIG``.

    Args:
        rows: the bench rows.

    Returns:
        Per workload: ``workload, wall_ratio, lockstep_bound,
        eval_delta_points, ratio_ok, eval_ok, passed``. "Within 1 point" is
        defined for accuracy-like metrics only: for a lower-is-better metric
        (reconstruction MSE) ``eval_delta_points``, ``eval_ok`` and
        ``passed`` are None (not applicable).
    """
    out: list[dict[str, Any]] = []
    for row in rows:
        if row["system"] != "cadence" or tuple(row["speeds"]) != ACCEPT_RIG:
            continue
        if row.get("link_mbit") is not None:
            continue  # across hosts: ``hosts_acceptance``
        ratio = row.get("wall_ratio_vs_ddp")
        delta = row.get("eval_delta_vs_ddp")
        points = 100.0 * delta if delta is not None and row["higher_is_better"] else None
        ratio_ok = ratio is not None and ratio <= ACCEPT_RATIO
        eval_ok = (
            None
            if not row["higher_is_better"]
            else (points is not None and abs(points) <= ACCEPT_EVAL_POINTS)
        )
        out.append(
            {
                "workload": row["workload"],
                "wall_ratio": ratio,
                "lockstep_bound": metrics.lockstep_ratio(ACCEPT_RIG),
                "eval_delta_points": points,
                "ratio_ok": ratio_ok,
                "eval_ok": eval_ok,
                "passed": None if eval_ok is None else ratio_ok and eval_ok,
            }
        )
    return out


def render(doc: Mapping[str, Any]) -> str:
    """The whole ``report.md`` of a bench result document.

    Args:
        doc: the results document (``results.json``'s content).

    Returns:
        Markdown text.
    """
    rows: Sequence[Row] = doc["rows"]
    lines = [
        f"# elche bench — {doc['suite']} suite",
        "",
        f"- date: {doc['date']}",
        f"- command: `{doc['command']}`",
        f"- machine: {doc['machine']['description']}",
        f"- whole invocation: {doc['total_s']:.0f} s; repeats per cell: {doc['repeats']} "
        "(the run of median wall time is shown; systems interleaved, DDP in every repeat)",
        *_runs_line(doc),
        *_partial_line(doc),
        "",
        "Columns: *wall* is each system's training clock (first batch to the end of "
        "training, start-up excluded); *× DDP* is wall ÷ torch DDP's wall on the same "
        "rig in this invocation; *efficiency* is samples/s ÷ Σ per-rank solo throughput "
        "(solo = one rank alone at speed 1, one thread); *of cap.* is samples/s ÷ what "
        "this machine delivers to the rig's paced ranks training alone at once, measured "
        "in this invocation (the ceiling no data-parallel system passes here); "
        "*to target* is the first "
        "epoch end whose model reached the workload's target eval (— if never, or no "
        "target); *eval* is the final eval; *idle %* per rank is the share of wall time "
        "outside training steps; DDP's *syncs* are gradient all-reduces (one per step), "
        "torchft's its averaging rounds (one per 10 steps a rank).",
        "",
    ]
    for name in dict.fromkeys(row["workload"] for row in rows):
        lines += _workload_section(name, [r for r in rows if r["workload"] == name], doc)
    lines += _acceptance_section(doc.get("acceptance") or [])
    lines += peers_section(doc.get("peers_acceptance") or [])
    lines += hosts_section(rows, doc.get("hosts_acceptance") or [])
    lines += _dashboard_section(doc.get("dashboard_cost") or [])
    for note in doc.get("notes") or []:
        lines.append(f"- {note}")
    for failure in doc.get("unwritten") or []:  # a full or read-only out dir (``run_bench``)
        lines.append(f"- not written: {failure['file']}: {failure['error']}")
    return "\n".join(lines).rstrip() + "\n"


def _runs_line(doc: Mapping[str, Any]) -> list[str]:
    """Where each elche and solo run's own record is, when the bench kept them."""
    if not any(run.get("run_dir") for run in doc.get("runs") or []):
        return []
    return [
        "- each elche and solo run's own report, timeline and summary: "
        "`runs/NN-WORKLOAD-SYSTEM/` (`report.html`; `elche timeline` reads the folder)"
    ]


def _partial_line(doc: Mapping[str, Any]) -> list[str]:
    """What the suite did not run, when it was stopped (or is still running) before its end."""
    left = doc.get("not_run") or []
    if not left:
        return []
    done = f"{len(doc['runs'])} of {len(doc['runs']) + len(left)} runs"
    why = (
        f"interrupted by {doc['interrupted']} after {done}"
        if doc.get("interrupted")
        else f"{done} so far (written after each run: the bench was still running, or was killed)"
    )
    return [f"- **partial: {why}**; not run: {', '.join(cell['cell'] for cell in left)}"]


def _workload_section(name: str, rows: Sequence[Row], doc: Mapping[str, Any]) -> list[str]:
    first = rows[0]
    better = "higher is better" if first["higher_is_better"] else "lower is better"
    base = next((r["speed_base_s"] for r in rows if r.get("speed_base_s")), None)
    pacing = (
        f" Speed injection: every system's paced ranks wait by one solo step of "
        f"{1000.0 * base:.2f} ms, measured once for this workload."
        if base
        else ""
    )
    lines = [
        f"## {name}",
        "",
        f"{first['epochs']} epoch{'' if first['epochs'] == 1 else 's'}{_of_samples(first)}, "
        f"batch {first['batch_size']} per rank per step; "
        f"eval = {first['metric']} ({better}).{pacing}",
        "",
    ]
    for rig, link in dict.fromkeys((tuple(r["speeds"]), r.get("link_mbit")) for r in rows):
        cell = [r for r in rows if tuple(r["speeds"]) == rig and r.get("link_mbit") == link]
        lines += _table(rig, cell)
    for kind, chart in (doc.get("charts") or {}).get(name, {}).items():
        lines.append(f"![{name}: {kind}]({chart})")
    lines.append("")
    return lines


def _of_samples(row: Row) -> str:
    """`` of N training samples``: what each epoch trained (a plan's cut, or the whole set)."""
    samples = row.get("train_samples")
    return f" of {samples:,} training samples" if samples else ""


def _table(rig: tuple[float, ...], cell: Sequence[Row]) -> list[str]:
    target = cell[0].get("target_eval")
    bound = metrics.lockstep_ratio(rig)
    link = cell[0].get("link_mbit")
    across = "" if link is None else f", one host per rank, links {link:g} Mbit/s"
    lines = [
        f"### speeds {rig_label(rig)}{across}",
        "",
        f"Target eval {num(target, 4)}; lock-step bound on × DDP: {bound:.3f}.{_capacity(cell)}",
        "",
        "| system | wall s | × DDP | samples/s | efficiency | of cap. | to target s "
        "| final loss | eval | Δ eval vs DDP | syncs | idle % per rank | lost | wire B/round |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in cell:
        if row.get("error"):
            lines.append(f"| {row['system']} | failed: {row['error']} |||||||||||||")
            continue
        idle = " / ".join(num(x, 0) for x in row["idle_pct"])
        lines.append(
            f"| {_system(row)} | {num(row['wall_s'], 2)} | {num(row['wall_ratio_vs_ddp'], 3)} "
            f"| {num(row['samples_per_s'], 0)} | {num(row['efficiency'], 3)} "
            f"| {num(row.get('of_capacity'), 3)} | {num(row['time_to_target_s'], 2)} "
            f"| {num(row['final_loss'], 4)} "
            f"| {num(row['eval'], 4)} | {_delta(row)} | {row['syncs']} | {idle} "
            f"| {row['lost_samples']} | {num(row.get('wire_bytes_per_round'), 0)} |"
        )
    lines.append("")
    lines += _seeds_table(cell)
    return lines


def _capacity(cell: Sequence[Row]) -> str:
    """The rig's measured capacity, as a sentence for the table's heading."""
    capacity = cell[0].get("capacity_samples_per_s")
    if capacity is None:
        return ""
    return f" This machine delivers {capacity:.0f} samples/s to the rig's ranks alone at once."


def _seeds_table(cell: Sequence[Row]) -> list[str]:
    """The spread over seeds of the rows that ran on several."""
    spread = [row for row in cell if row.get("seeds")]
    if not spread:
        return []
    lines = [
        "Over seeds (each seed's own split and shuffle; min – max, mean):",
        "",
        "| system | seeds | wall s | final eval | to target s | to DDP's eval ÷ DDP wall |",
        "|---|---|---|---|---|---|",
    ]
    for row in spread:
        seeds = row["seeds"]
        cells = " | ".join(_span(seeds.get(key), 3) for key in ("wall_s", "final_eval"))
        reached = [r.get("ddp_eval_time_ratio") for r in seeds["runs"]]
        never = f"; never: {sum(r is None for r in reached)}" if None in reached else ""
        lines.append(
            f"| {_system(row)} | {', '.join(str(x) for x in seeds['seeds'])} | {cells} "
            f"| {_span(seeds.get('time_to_target_s'), 2)} "
            f"| {_span(seeds.get('ddp_eval_time_ratio'), 3)}{never} |"
        )
    lines.append("")
    return lines


def _span(spread: Mapping[str, Any] | None, digits: int) -> str:
    if not spread:
        return "—"
    return (
        f"{spread['min']:.{digits}f} – {spread['max']:.{digits}f} "
        f"({spread['mean']:.{digits}f}, n={spread['n']})"
    )


def dashboard_cost(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Each ``MODE+dashboard`` row against its ``MODE`` row on the same workload and rig.

    Returns:
        Per pair: ``workload, rig, mode, wall_s, wall_s_dashboard`` (medians),
        ``ratio`` (with ÷ without), ``spread`` (the plain runs' max ÷ min
        wall: the noise) and ``within_noise`` (``|ratio - 1| <= spread - 1``).
    """
    out: list[dict[str, Any]] = []
    for row in rows:
        mode, dashboard = split_system(row["system"])
        if not dashboard:
            continue
        base = next((r for r in rows if r["system"] == mode and r["workload"] == row["workload"]
                     and r["speeds"] == row["speeds"]), None)  # fmt: skip
        if base is None or not base.get("wall_s") or not row.get("wall_s"):
            continue
        walls = [w for w in base.get("wall_s_runs") or [base["wall_s"]] if w]
        ratio = row["wall_s"] / base["wall_s"]
        spread = max(walls) / min(walls)
        out.append({
            "workload": row["workload"], "rig": list(row["speeds"]), "mode": mode,
            "wall_s": base["wall_s"], "wall_s_dashboard": row["wall_s"], "ratio": round(ratio, 4),
            "spread": round(spread, 4), "within_noise": abs(ratio - 1) <= spread - 1,
            "wall_s_runs": base.get("wall_s_runs"),
            "wall_s_runs_dashboard": row.get("wall_s_runs"),
        })  # fmt: skip
    return out


def _dashboard_section(pairs: Sequence[Mapping[str, Any]]) -> list[str]:
    if not pairs:
        return []
    lines = [
        "## What the dashboard costs",
        "",
        "Each mode with and without its dashboard (served on 127.0.0.1 and read every "
        "second: /state.json and /metrics), interleaved in this invocation. *spread* is the "
        "plain runs' slowest ÷ fastest wall: the noise the ratio is judged against.",
        "",
        "| workload | rig | mode | wall s | with dashboard s | ratio | spread | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in pairs:
        verdict = "within noise" if p["within_noise"] else "outside noise"
        lines.append(
            f"| {p['workload']} | {rig_label(p['rig'])} | {p['mode']} | {num(p['wall_s'], 2)} "
            f"| {num(p['wall_s_dashboard'], 2)} | {num(p['ratio'], 3)} | {num(p['spread'], 3)} "
            f"| {verdict} |"
        )
    lines.append("")
    return lines


def _acceptance_section(checks: Sequence[Mapping[str, Any]]) -> list[str]:
    if not checks:
        return []
    lines = [
        "## Acceptance",
        "",
        f"The issue asks: elche `cadence` wall ≤ {ACCEPT_RATIO} × DDP's on speeds "
        f"{rig_label(ACCEPT_RIG)}, with eval within {ACCEPT_EVAL_POINTS:g} point. With no "
        f"communication cost on either side the best possible ratio is "
        f"{metrics.lockstep_ratio(ACCEPT_RIG):.3f} (lock-step bound), so ≤ "
        f"{ACCEPT_RATIO} holds only where DDP pays more per-step overhead than elche.",
        "",
        "| workload | cadence ÷ DDP wall | Δ eval (points) | verdict |",
        "|---|---|---|---|",
    ]
    for c in checks:
        if c["passed"] is None:
            verdict = f"ratio {'pass' if c['ratio_ok'] else 'miss'}; eval n/a (not an accuracy)"
        else:
            verdict = "pass" if c["passed"] else "miss"
            misses = [w for w, ok in (("ratio", c["ratio_ok"]), ("eval", c["eval_ok"])) if not ok]
            if misses:
                verdict += f" ({', '.join(misses)})"
        lines.append(
            f"| {c['workload']} | {num(c['wall_ratio'], 3)} "
            f"| {num(c['eval_delta_points'], 2)} | {verdict} |"
        )
    lines.append("")
    return lines


def _system(row: Row) -> str:
    if row["system"] == DDP:
        return "**torch-ddp**"
    if row["system"] == "solo":
        return "solo (1 rank)"
    return str(row["system"])


def _delta(row: Row) -> str:
    delta = row.get("eval_delta_vs_ddp")
    if delta is None or row["system"] == DDP:
        return "—"
    if row["higher_is_better"]:
        return f"{100.0 * delta:+.2f} pt"
    return f"{delta:+.5f}"
