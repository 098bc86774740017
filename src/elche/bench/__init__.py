"""``elche bench``: elche's modes, torch DDP, torchft and solo side by side, with ratios.

Every speed claim elche makes comes from here (design §1.4): the competitor
runs in the same invocation, on the same workload, split, seed, epochs,
per-rank batch size and speed injection, interleaved when repeated.

Modules:

- ``suites`` — the ``quick``, ``full`` and ``hosts`` suites (workloads, rigs,
  systems, link rates);
- ``runner`` — runs one training per workload × rig × system × repeat;
- ``hosts``, ``on_host`` — runs across namespace hosts at limited bandwidth
  (the ``hosts`` suite); ``hosts_report`` — its ratios and bar;
- ``metrics`` — efficiency, ratios, time to target, idle % (pure functions);
- ``rows`` — the JSON rows of design §6 from the run records;
- ``report`` — ``report.md``; ``charts`` — the PNG charts.

``run_bench`` ties them together and writes ``results.json``, ``report.md``
and the charts into one directory.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from elche._files import check_writable
from elche.bench.suites import SUITES, Suite
from elche.runtime.bundle import write_whole

__all__ = ["SUITES", "Suite", "default_out_dir", "incomplete", "machine", "run_bench"]


def default_out_dir(now: dt.datetime | None = None) -> Path:
    """``results/bench-<UTC timestamp>`` under the working directory."""
    stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%d-%H%M%S")
    return Path("results") / f"bench-{stamp}"


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    cpus = os.cpu_count() or 0
    cuda = torch.cuda.is_available()
    return {
        "cpus": cpus,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": cuda,
        "description": (
            f"{cpus} CPU cores, {'CUDA available (unused)' if cuda else 'CPU only'}, "
            f"{platform.system()} {platform.machine()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}"
        ),
    }


def run_bench(
    suite: Suite,
    out_dir: Path,
    *,
    command: str,
    progress: bool = True,
) -> dict[str, Any]:
    """Run ``suite`` and write ``results.json``, ``report.md`` and PNG charts.

    ``results.json`` and ``report.md`` are also written after each run, with
    the runs so far and the cells not run yet (``not_run``): a bench killed
    outright (SIGKILL, a lost machine) leaves what it measured. A write that
    fails then is left for the last one to say.

    Args:
        suite: what to run.
        out_dir: created if missing (before anything runs); existing files of
            the same names are overwritten.
        command: the command line, recorded in the results.
        progress: show a live display on stderr.

    Returns:
        The results document (``results.json``'s content). Its ``unwritten``
        lists, ``{file, error}`` each (``error``: the reason), the outputs
        that a full or read-only ``out_dir`` refused once the suite had run
        (``results.json`` too: the document is then only what this returns);
        none is left in part, and the others are still written. Ctrl-C,
        SIGTERM or SIGHUP stops the run in progress as it stops any
        (``run_suite``; one that has trained is kept), and the outputs are
        written for the runs before it: ``interrupted`` names
        the signal (``"SIGINT"``; None when the suite ran to its end) and
        ``not_run`` lists the cells left, the stopped one first
        (``Cell.to_json``). A second signal while they are written stops the
        writes; each file is then whole, the last after-each-run one or this one.

    Raises:
        ConfigError: (field ``out_dir``) ``out_dir`` cannot be made or written;
            nothing has run.
    """
    from elche.bench.charts import write_charts
    from elche.bench.runner import Run, available_suite, run_suite

    check_writable(out_dir, "out_dir")  # before the suite's minutes, not after
    started = time.perf_counter()
    suite = available_suite(suite, say=lambda text: print(text, file=sys.stderr))
    about = _about(suite, command, out_dir)
    measured: list[Run] = []

    def measured_one(run: Run) -> None:
        measured.append(run)
        _write_outputs(out_dir, _document(suite, about, measured, started), [])  # see above

    interrupted = None
    try:
        runs = run_suite(suite, progress=progress, on_run=measured_one, runs_dir=out_dir / "runs")
    except KeyboardInterrupt as stop:
        from elche.cli.endings import stop_signal

        runs, interrupted = measured, stop_signal(stop).name
    doc = _document(suite, about, runs, started, interrupted=interrupted)
    unwritten: list[OSError] = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)  # (made above; gone since, made again)
    except OSError as exc:  # each file below says so
        unwritten.append(exc)
    doc["charts"], failed = write_charts(doc["rows"], out_dir)
    doc["total_s"] = round(time.perf_counter() - started, 1)
    doc["unwritten"] = [_unwritten(exc) for exc in unwritten + failed]
    _write_outputs(out_dir, doc, doc["unwritten"])
    return doc


def _about(suite: Suite, command: str, out_dir: Path) -> dict[str, Any]:
    """What every write of the results says of the suite, whatever has run."""
    return {
        "suite": suite.name,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "machine": machine(),
        "repeats": suite.repeats,
        "seed": suite.seed,
        "workloads": [
            {
                "name": p.name,
                "epochs": p.epochs,
                "batch_size": p.batch_size,
                "train_samples": p.train_samples,
                "target_eval": p.target_eval,
            }
            for p in suite.workloads
        ],
        "extra_seeds": list(suite.extra_seeds),
        "headline_workloads": list(suite.headline_workloads),
        "rigs": [list(rig) for rig in suite.rigs],
        "systems": ["solo", *suite.systems],
        "link_mbit": list(suite.link_mbit),
        "notes": list(suite.notes),
        "out_dir": str(out_dir),
    }


def _document(
    suite: Suite,
    about: dict[str, Any],
    runs: list[dict[str, Any]],
    started: float,
    *,
    interrupted: str | None = None,
) -> dict[str, Any]:
    """The results document of ``runs``, the first ``len(runs)`` of ``suite.cells()``,
    without charts (``charts``) or failed writes (``unwritten``) yet."""
    from elche.bench.peers_report import peers_acceptance
    from elche.bench.report import acceptance, dashboard_cost, hosts_acceptance
    from elche.bench.rows import build_rows

    rows = build_rows(suite, runs)
    return {
        **about,
        "rows": rows,
        "acceptance": acceptance(rows),
        "peers_acceptance": peers_acceptance(rows),
        "hosts_acceptance": hosts_acceptance(rows),
        "dashboard_cost": dashboard_cost(rows),
        "charts": {},
        "runs": runs,
        "interrupted": interrupted,
        "not_run": [cell.to_json() for cell in suite.cells()[len(runs) :]],
        "total_s": round(time.perf_counter() - started, 1),
        "unwritten": [],
    }


def _write_outputs(out_dir: Path, doc: dict[str, Any], unwritten: list[dict[str, str]]) -> None:
    """Write ``results.json`` and ``report.md`` of ``doc``; each that cannot be goes to
    ``unwritten``."""
    from elche.bench.report import render

    _write(out_dir / "results.json", json.dumps(doc, indent=1) + "\n", unwritten)
    _write(out_dir / "report.md", render(doc), unwritten)  # (it names what failed before)


def incomplete(doc: dict[str, Any]) -> list[str]:
    """What ``run_bench``'s output lacks, a line each: every failed run, every file not written."""
    lines = [
        f"{run['workload']} [{','.join(f'{s:g}' for s in run['speeds'])}] {run['system']} "
        f"failed: {run['error']}"
        for run in doc["runs"]
        if run.get("error")
    ]
    return lines + [f"not written: {u['file']}: {u['error']}" for u in doc["unwritten"]]


def _write(path: Path, text: str, unwritten: list[dict[str, str]]) -> None:
    """Write ``path`` whole; if it cannot be, no part of it, and its error goes to ``unwritten``."""
    try:
        write_whole(path, lambda f: f.write(text.encode("utf-8")), sync=False)
    except OSError as exc:
        unwritten.append(_unwritten(exc))


def _unwritten(exc: OSError) -> dict[str, str]:
    """An output's error as results.json lists it: its file, and why (``strerror``)."""
    return {"file": str(exc.filename), "error": exc.strerror or str(exc)}
