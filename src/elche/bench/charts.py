"""PNG charts of an ``elche bench`` run (matplotlib, headless ``Agg`` backend).

Per workload, three figures with one panel per rig (per rig and link rate
in a suite across hosts):

- ``<workload>-loss.png`` — training loss per epoch against wall time since
  the first batch, one line per system (DDP dashed);
- ``<workload>-share.png`` — each rank's share of the samples trained, per
  system, beside the share its speed deserves (``s / Σ speeds``);
- ``<workload>-idle.png`` — each rank's idle % (wall time outside training
  steps), per system.

Figures are small (≈ 60–90 KB at 80 dpi) so they can live in the repository.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elche.runtime.bundle import write_whole

__all__ = ["DPI", "write_charts"]

DPI = 80  # keeps each PNG under ~100 KB
PANEL_IN = (4.6, 3.2)  # width, height of one rig's panel, inches

Row = Mapping[str, Any]


def write_charts(
    rows: Sequence[Row], out_dir: Path
) -> tuple[dict[str, dict[str, str]], list[OSError]]:
    """Draw every chart of ``rows`` into ``out_dir``.

    Args:
        rows: the bench rows (``per_epoch`` and ``per_rank`` are read).
        out_dir: an existing directory.

    Returns:
        ``{workload: {"loss" | "share" | "idle": file name}}``, file names
        relative to ``out_dir``, of the charts written; and the error of each
        chart that could not be (a full or read-only disk), naming its file:
        it is left out, no part of it on disk.
    """
    import matplotlib

    matplotlib.use("Agg")  # headless: no display, no GUI toolkit
    written: dict[str, dict[str, str]] = {}
    failed: list[OSError] = []
    for name in dict.fromkeys(row["workload"] for row in rows):
        mine = [r for r in rows if r["workload"] == name and not r.get("error")]
        rigs = list(dict.fromkeys((tuple(r["speeds"]), r.get("link_mbit")) for r in mine))
        if not rigs:
            continue
        files = {}
        for kind, draw in (("loss", _loss), ("share", _share), ("idle", _idle)):
            file = f"{name}-{kind}.png"
            try:
                _figure(name, kind=kind, rigs=rigs, rows=mine, draw=draw, path=out_dir / file)
            except OSError as exc:
                failed.append(exc)
                continue
            files[kind] = file
        if files:
            written[name] = files
    return written, failed


def _figure(
    name: str,
    *,
    kind: str,
    rigs: Sequence[tuple[tuple[float, ...], float | None]],
    rows: Sequence[Row],
    draw: Any,
    path: Path,
) -> None:
    import matplotlib.pyplot as plt

    width, height = PANEL_IN
    fig, axes = plt.subplots(
        1, len(rigs), figsize=(width * len(rigs), height), squeeze=False, layout="constrained"
    )
    titles = {"loss": "training loss vs wall time", "share": "share of samples per rank"}
    fig.suptitle(f"{name}: {titles.get(kind, 'idle % per rank')}", fontsize=10)
    for ax, (rig, link) in zip(axes[0], rigs, strict=True):
        cell = [r for r in rows if tuple(r["speeds"]) == rig and r.get("link_mbit") == link]
        draw(ax, rig, cell)
        across = "" if link is None else f", links {link:g} Mbit/s"
        ax.set_title("speeds " + ", ".join(f"{s:g}" for s in rig) + across, fontsize=9)
        ax.tick_params(labelsize=7)
    try:
        write_whole(path, functools.partial(fig.savefig, dpi=DPI, format="png"), sync=False)
    finally:
        plt.close(fig)


def _loss(ax: Any, rig: tuple[float, ...], cell: Sequence[Row]) -> None:
    for row in cell:
        points = [(e["t"], e["loss"]) for e in row["per_epoch"] if e.get("loss") is not None]
        if not points:
            continue
        ts, losses = zip(*points, strict=True)
        style = "--" if row["system"] == "torch-ddp" else "-"
        ax.plot(ts, losses, style, marker=".", markersize=3, linewidth=1, label=row["system"])
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the first batch", fontsize=8)
    ax.set_ylabel("epoch training loss", fontsize=8)
    ax.legend(fontsize=6)


def _share(ax: Any, rig: tuple[float, ...], cell: Sequence[Row]) -> None:
    systems = [r for r in cell if r["system"] != "solo"]
    labels = ["deserved", *(r["system"] for r in systems)]
    total = sum(rig)
    stacks = [[s / total for s in rig]] + [
        [p["share"] or 0.0 for p in r["per_rank"]] for r in systems
    ]
    for rank in range(len(rig)):
        left = [sum(stack[:rank]) for stack in stacks]
        widths = [stack[rank] if rank < len(stack) else 0.0 for stack in stacks]
        ax.barh(labels, widths, left=left, label=f"rank {rank} ({rig[rank]:g})")
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of samples", fontsize=8)
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(rig))


def _idle(ax: Any, rig: tuple[float, ...], cell: Sequence[Row]) -> None:
    systems = [r for r in cell if r["system"] != "solo"]
    width = 0.8 / max(len(rig), 1)
    for rank in range(len(rig)):
        xs = [i + rank * width for i in range(len(systems))]
        values = [
            (r["idle_pct"][rank] or 0.0) if rank < len(r["idle_pct"]) else 0.0 for r in systems
        ]
        ax.bar(xs, values, width=width, label=f"rank {rank} ({rig[rank]:g})")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(systems))])
    ax.set_xticklabels([r["system"] for r in systems], rotation=30, ha="right", fontsize=7)
    ax.set_ylim(0, 100)
    ax.set_ylabel("idle % of wall", fontsize=8)
    ax.legend(fontsize=6)
