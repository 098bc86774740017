"""A run directory ``elche.train`` made itself: trimmed to its record once the run completes.

A completed run has nothing to resume, so its model states and logs go; its
report, timeline and summary (``KEPT_FILES``, a few hundred kB) stay, and so
does the last bundle ``checkpoint_every`` asked for, which the summary names.
Any other outcome keeps the directory whole, to resume or debug from.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from elche.runtime import bundle
from elche.runtime.plan import TrainResult

__all__ = ["KEPT_FILES", "tidy_run_dir"]

# What a completed run's directory keeps (``tidy_run_dir``).
KEPT_FILES = frozenset({"report.html", "timeline.jsonl", "summary.json"})


def tidy_run_dir(result: TrainResult, directory: Path) -> None:
    """Trim a completed run's directory to its record; keep any other run's whole.

    A completed run has nothing to resume, so its model states and logs go;
    its report, timeline and summary (``KEPT_FILES``, a few hundred kB) stay,
    so ``summary["report"]`` names a file that exists. So does the last
    bundle ``checkpoint_every`` asked for, which ``summary["bundle"]`` names
    (it continues the run for more epochs).
    """
    if result.summary.get("outcome") != "completed":
        print(f"elche: the run's files are kept in {directory}", file=sys.stderr, flush=True)
        return
    kept = KEPT_FILES | _bundle_files(result.summary.get("bundle"), directory)
    for path in directory.iterdir():
        if path.name in kept:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _bundle_files(stem: object, directory: Path) -> frozenset[str]:
    """The names of the files of the bundle at ``stem``, if it is in ``directory``."""
    meta = bundle.read_meta(stem) if isinstance(stem, str) else None
    if meta is None or Path(str(stem)).parent != directory:
        return frozenset()
    paths = bundle.locate(str(stem), meta, meta.world_size)
    files = [bundle.meta_path(str(stem)), paths.model, *paths.optim.values()]
    return frozenset(p.name for p in (*files, *([paths.outer] if paths.outer else [])))
