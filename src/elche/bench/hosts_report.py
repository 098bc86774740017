"""The across-hosts part of ``report.md``: ratios per link rate and issue 14's bar.

The bar (issue 14, item 6): at 100 Mbit/s, ``cadence``'s wall ≤ 0.25 ×
torch DDP's with its eval within 1 point; at 1000 Mbit/s every elche mode's
wall below DDP's. Rows with ``link_mbit`` None (one host) are not judged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from elche.bench.suites import DDP, ELCHE_MODES
from elche.bench.text import num, rig_label

__all__ = ["HOSTS_FAST_MBIT", "HOSTS_RATIO", "HOSTS_SLOW_MBIT", "hosts_acceptance", "hosts_section"]

HOSTS_SLOW_MBIT = 100.0  # at this rate: cadence wall ≤ HOSTS_RATIO × DDP's, eval within 1 point
HOSTS_RATIO = 0.25
HOSTS_FAST_MBIT = 1000.0  # at this rate: every elche row ahead of DDP (× DDP < 1)
EVAL_POINTS = 1.0

Row = Mapping[str, Any]


def hosts_acceptance(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Issue 14's check for every elche row across hosts at a rate it names.

    Returns:
        Per row: ``workload, speeds, link_mbit, system, wall_ratio,
        eval_delta_points, bar`` (what it must meet, in words) and
        ``passed`` (None where the row failed to run).
    """
    out: list[dict[str, Any]] = []
    for row in rows:
        link = row.get("link_mbit")
        if row["system"] not in ELCHE_MODES or link not in (HOSTS_SLOW_MBIT, HOSTS_FAST_MBIT):
            continue
        if link == HOSTS_SLOW_MBIT and row["system"] != "cadence":
            continue
        ratio = row.get("wall_ratio_vs_ddp")
        delta = row.get("eval_delta_vs_ddp")
        points = 100.0 * delta if delta is not None and row["higher_is_better"] else None
        if link == HOSTS_SLOW_MBIT:
            bar = f"wall <= {HOSTS_RATIO:g} x DDP, eval within {EVAL_POINTS:g} point"
            passed = (
                None
                if ratio is None or points is None
                else ratio <= HOSTS_RATIO and abs(points) <= EVAL_POINTS
            )
        else:
            bar = "wall < DDP's"
            passed = None if ratio is None else ratio < 1.0
        out.append({
            "workload": row["workload"], "speeds": list(row["speeds"]), "link_mbit": link,
            "system": row["system"], "wall_ratio": ratio, "eval_delta_points": points,
            "bar": bar, "passed": passed,
        })  # fmt: skip
    return out


def hosts_section(rows: Sequence[Row], checks: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ratios of every system to DDP per link rate, then the bar, as Markdown lines."""
    links = list(dict.fromkeys(r["link_mbit"] for r in rows if r.get("link_mbit") is not None))
    if not links:
        return []
    header = " | ".join(f"× DDP at {link:g} Mbit/s" for link in links)
    lines = [
        "## Across hosts: wall ÷ torch DDP's per link rate",
        "",
        f"| workload | speeds | system | {header} |",
        "|---|---|---|" + "---|" * len(links),
    ]
    cells = dict.fromkeys((r["workload"], tuple(r["speeds"]), r["system"]) for r in rows
                          if r.get("link_mbit") is not None and r["system"] != DDP)  # fmt: skip
    for workload, speeds, system in cells:
        ratios = [
            _ratio(rows, workload, speeds, system, link) for link in links
        ]  # one per link, in the header's order
        lines.append(f"| {workload} | {rig_label(speeds)} | {system} | {' | '.join(ratios)} |")
    lines.append("")
    if checks:
        lines += [
            "Issue 14's bar:",
            "",
            "| workload | link | system | × DDP | Δ eval (points) | bar | verdict |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in checks:
            verdict = {True: "met", False: "missed", None: "not measured"}[c["passed"]]
            lines.append(
                f"| {c['workload']} | {c['link_mbit']:g} Mbit/s | {c['system']} "
                f"| {num(c['wall_ratio'], 3)} | {num(c['eval_delta_points'], 2)} | {c['bar']} "
                f"| {verdict} |"
            )
        lines.append("")
    return lines


def _ratio(rows: Sequence[Row], workload: str, speeds: tuple[float, ...], system: str,
           link: float) -> str:  # fmt: skip
    for row in rows:
        if (row["workload"], tuple(row["speeds"]), row["system"], row.get("link_mbit")) == (
            workload, speeds, system, link,
        ):  # fmt: skip
            return num(row.get("wall_ratio_vs_ddp"), 3)
    return "—"
