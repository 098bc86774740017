"""Small file helpers shared by the API, the monitor, the benchmarks and the CLI.

- ``check_writable``: a folder exists (or is made) and takes a byte, checked
  before the work whose output goes there starts (``elche.train``'s
  ``save_path`` and ``run_dir``, ``elche bench --out``).
- ``write_text_atomic``: a text file appears whole or not at all (a
  temporary name beside it, then ``os.replace``); no fsync: these are
  reports and traces, not bundles (``elche.runtime.bundle`` writes those).

Imported by ``elche.monitor``, so it imports nothing of elche's but the
core's errors.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from elche.core.errors import ConfigError

__all__ = ["check_writable", "write_text_atomic"]


def check_writable(folder: Path, field: str) -> None:
    """``folder`` exists (or can be made) and takes a byte.

    The folders it made stay, as the work that follows writes there; the
    probe file does not.

    Raises:
        ConfigError: (field ``field``) it cannot be made or written (a file
            in its path, a read-only or full file system, ``/proc``).
    """
    probe = folder / f".elche-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"x")  # a full disk takes an empty file, not a byte
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as exc:
        raise ConfigError(field, f"cannot write in {folder}: {exc}") from None


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through ``PATH.PID.partial`` and ``os.replace``: a
    reader never sees half a file, a failed write leaves ``path`` as it was, and
    two processes writing it at once (the survivors of a lost rank 0 each write
    the run's report) each replace it whole.

    Raises:
        OSError: ``path``'s folder is missing, read-only or full, or ``path``
            is a directory (the temporary file is removed).
    """
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # (several may write it)
    try:
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise
