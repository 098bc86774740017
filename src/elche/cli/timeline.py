"""``elche timeline RUN_DIR``: a run's timeline, one record a line, or a Chrome trace.

Lines that hold no record are skipped and counted on stderr; a file with
none at all, or a ``--chrome`` path that cannot be written, is bad input
(``ConfigError`` naming ``run_dir`` or ``chrome``). The trace is written whole
or not at all (``elche.monitor.trace.write_chrome_trace``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from elche.core.errors import ConfigError

__all__ = ["run_timeline"]


def run_timeline(args: argparse.Namespace) -> int:
    from elche.core import timeline as tl
    from elche.monitor.timeline import TIMELINE_FILE, TimelineReader
    from elche.monitor.trace import write_chrome_trace

    run_dir = Path(args.run_dir)
    if not (run_dir / TIMELINE_FILE).is_file():
        raise ConfigError("run_dir", f"{run_dir} has no {TIMELINE_FILE}; give a run directory")
    chrome = None if args.chrome is None else _chrome_path(args.chrome)
    reader = TimelineReader(run_dir)
    try:
        records = reader.new_records()
    except OSError as exc:
        raise ConfigError("run_dir", f"cannot read {reader.path}: {exc}") from None
    unreadable = reader.skipped + int(reader.unfinished)  # a last line cut short is one too
    if unreadable:
        _say_unreadable(reader.path, unreadable, len(records))
    if chrome is None:
        for record in records:
            print(tl.encode(record).decode("utf-8"))
        return 0
    try:
        count = write_chrome_trace(records, chrome)
    except OSError as exc:
        raise ConfigError("chrome", f"cannot write {chrome}: {exc}") from None
    print(f"elche timeline: {count} trace events from {len(records)} records in {chrome}")
    return 0


def _chrome_path(text: str) -> Path:
    """``--chrome``'s file, checked before the timeline is read.

    Raises:
        ConfigError: (field ``chrome``) empty, a directory, or in a folder that
            does not exist.
    """
    path = Path(text)
    if not text or text.endswith(("/", os.sep)) or path.is_dir():
        raise ConfigError("chrome", f"needs a file to write, such as trace.json; got {text!r}")
    if not path.parent.is_dir():
        raise ConfigError("chrome", f"cannot write {text}: folder {path.parent} does not exist")
    return path


def _say_unreadable(path: Path, unreadable: int, records: int) -> None:
    """One line on stderr for lines that held no record; none at all is bad input.

    Raises:
        ConfigError: (field ``run_dir``) not one line of ``path`` was a record.
    """
    lines = "line" if unreadable == 1 else "lines"
    why = "damaged, cut short, not JSON, or of a kind this release does not know"
    if not records:
        raise ConfigError(
            "run_dir", f"{path} holds no timeline record: {unreadable} unreadable {lines} ({why})"
        )
    print(
        f"elche timeline: skipped {unreadable} unreadable {lines} of {path} ({why})",
        file=sys.stderr,
    )
