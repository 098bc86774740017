"""Imported by the fork server of local runs (``FORKSERVER_PRELOAD``), nowhere else.

SIGINT, SIGTERM or SIGHUP to the process group (Ctrl-C, a closed terminal)
must not end the fork server: the launcher learns each rank's exit status
from it, and reads its death as every rank's (``multiprocessing.popen_forkserver``
reports exit code 255 for each). The fork server ignores SIGINT itself, but only once its other
preloads (torch: seconds) are imported; this module comes first. Ranks fork
with the three ignored (``lifetimes.STOP_SIGNALS``), from their first
instruction. The fork server exits once the launcher and every rank have
(``elche.runtime.lifetimes``).
"""

from __future__ import annotations

import signal

__all__: list[str] = []

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
