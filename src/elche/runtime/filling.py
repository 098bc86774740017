"""The ``FillSavePath`` fault on a real rank: fill the save path's file system.

It only ever fills a small tmpfs (at most ``MAX_FILL_BYTES`` free): the chaos
runner mounts one for a run's save path (``elche.chaos``). On any other file
system, or a bigger one, the fault is refused with the reason, so a plan
replayed by hand never fills a real disk or a RAM-backed ``/tmp``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["FILL_FILE", "MAX_FILL_BYTES", "fill_file_system"]

FILL_FILE = ".elche-fill"
MAX_FILL_BYTES = 64 << 20  # a chaos run's tmpfs is a few MiB; more is not ours to fill
_CHUNK = b"\0" * (64 << 10)


def fill_file_system(folder: Path) -> str:
    """Fill the tmpfs ``folder`` is on, up to ENOSPC; returns what was done (or why not)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fs_type = _fs_type(folder.resolve())
        stat = os.statvfs(folder)
    except OSError as exc:
        return f"not filling {folder}: {exc}"
    free = stat.f_bavail * stat.f_frsize
    if fs_type != "tmpfs" or free > MAX_FILL_BYTES:
        return (
            f"not filling {folder}: it is on {fs_type or 'an unknown file system'} with "
            f"{free >> 20} MiB free (only a tmpfs of at most {MAX_FILL_BYTES >> 20} MiB is filled)"
        )
    written = 0
    try:
        with (folder / FILL_FILE).open("ab") as f:
            while True:
                f.write(_CHUNK)
                f.flush()
                written += len(_CHUNK)
    except OSError:  # ENOSPC: full, as meant (the last partial chunk counts too)
        pass
    return f"filled {folder} ({written >> 10} KiB written until it was full)"


def _fs_type(path: Path) -> str:
    """The type of the file system ``path`` is on (``/proc/self/mountinfo``), or ''."""
    best, kind = "", ""
    for line in Path("/proc/self/mountinfo").read_text(encoding="utf-8").splitlines():
        fields, _, rest = line.partition(" - ")
        mount_point = fields.split()[4].replace("\\040", " ")
        inside = str(path) == mount_point or str(path).startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, kind = mount_point, rest.split()[0]
    return kind
