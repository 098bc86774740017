"""Imported by the fork server of local runs (``FORKSERVER_PRELOAD``), nowhere else.

SIGTERM to the process group must not end the fork server: the launcher
learns each rank's exit status from it, and reads its death as every rank's
(``multiprocessing.popen_forkserver`` reports exit code 255 for each). The
fork server ignores SIGINT itself, and exits once the launcher and every rank
have (``elche.runtime.lifetimes``).
"""

from __future__ import annotations

import signal

__all__: list[str] = []

signal.signal(signal.SIGTERM, signal.SIG_IGN)
