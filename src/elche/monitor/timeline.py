"""The timeline file: one writer, one reader, records visible as they happen.

``RUN_DIR/timeline.jsonl`` holds one JSON record a line (the catalog is
``elche.core.timeline``). The coordinator process is its only writer; the
launcher follows it while the run goes on (progress, ``metrics_fn``) and
the benchmarks read it afterwards.

Every record reaches the file (the OS, not a buffer in the writer) before
``write`` returns, so ``tail -f RUN_DIR/timeline.jsonl`` and a following
reader see each one as it happens. No fsync: the timeline is for watching a
run, and a record lost to a machine crash costs nothing that a bundle needs.

A disk that fills up can take part of a record (the OS writes what fits):
``write`` raises for that record, and the next record the disk takes starts
on a line of its own, so a reader loses the torn record only, not the one
glued to it (the run's end, say, once space came back).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from elche.core import timeline as tl

__all__ = ["TIMELINE_FILE", "TimelineReader", "TimelineWriter", "read_timeline"]

TIMELINE_FILE = "timeline.jsonl"


class TimelineWriter:
    """Appends records to ``RUN_DIR/timeline.jsonl``, each stamped and flushed.

    Args:
        run_dir: the run directory (must exist).
        started_s: the clock reading that ``t = 0`` stands for.

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, run_dir: Path, *, started_s: float) -> None:
        self.path = run_dir / TIMELINE_FILE
        self._started_s = started_s
        self._file = self.path.open("ab", buffering=0)  # unbuffered: every write is visible
        self._torn = False  # the file ends in part of a record, with no newline

    def write(self, event: tl.TimelineEvent, now_s: float) -> tl.TimelineEvent:
        """Stamp ``event`` with ``t`` for ``now_s`` and append it; returns the stamped record.

        Raises:
            OSError: the write failed, maybe after part of the record (a full
                disk, say); the file stays usable: the next record starts a line.
        """
        stamped = msgspec.structs.replace(event, t=round(now_s - self._started_s, 6))
        line = tl.encode(stamped) + b"\n"
        if self._torn:
            line = b"\n" + line
        left = memoryview(line)
        try:
            while left:  # an unbuffered write may take part of it: the OS raises for the rest
                left = left[self._file.write(left) :]
        finally:
            if len(left) < len(line):  # some of it reached the file
                self._torn = bool(left)
        return stamped

    def close(self) -> None:
        self._file.close()


class TimelineReader:
    """Follows a timeline as its writer appends: each call returns the new records.

    A line still being written is kept until its newline arrives; a line of
    a kind this release does not know, or one that is not a record (damaged,
    not JSON), is skipped and counted in ``skipped``. A timeline written anew
    in the folder (the next run of a script that trains twice there) is
    followed from its start.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / TIMELINE_FILE
        self.skipped = 0  # lines read so far that held no record this release knows
        self._offset = 0
        self._partial = b""
        self._file: tuple[int, int] | None = None  # (device, inode) of the file followed

    @property
    def unfinished(self) -> bool:
        """Whether the file ends in a line with no newline yet (being written, or cut short)."""
        return bool(self._partial.strip())

    def new_records(self) -> list[tl.TimelineEvent]:
        """The records appended since the last call (all of them, the first time)."""
        try:
            with self.path.open("rb") as fh:
                stat = os.fstat(fh.fileno())
                new = self._file != (stat.st_dev, stat.st_ino) or stat.st_size < self._offset
                if new:  # (the first; or another, though it may reuse the inode number)
                    self._file, self._offset, self._partial = (stat.st_dev, stat.st_ino), 0, b""
                fh.seek(self._offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        events = [tl.decode(line) for line in lines if line.strip()]
        records = [event for event in events if event is not None]
        self.skipped += len(events) - len(records)
        return records


def read_timeline(run_dir: Path) -> list[tl.TimelineEvent]:
    """Every record of a (finished) run's timeline."""
    return TimelineReader(run_dir).new_records()
