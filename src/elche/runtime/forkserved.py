"""Imported by the fork server of local runs (``FORKSERVER_PRELOAD``), nowhere else.

SIGINT, SIGTERM or SIGHUP to the process group (Ctrl-C, a closed terminal)
must not end the fork server: the launcher learns each rank's exit status
from it, and reads its death as every rank's (``multiprocessing.popen_forkserver``
reports exit code 255 for each). The fork server ignores SIGINT itself, but only once its other
preloads (torch: seconds) are imported; this module comes first, and the
launcher starts the server with the three blocked (``launch.rank_context``)
until this module has ignored them, so none ends it even while it imports
this. Ranks fork with the three ignored (``lifetimes.STOP_SIGNALS``), from
their first instruction. The fork server exits once the launcher and every rank have
(``elche.runtime.lifetimes``).
"""

from __future__ import annotations

import signal

__all__: list[str] = []

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
# The launcher started the server with the three blocked (``launch.rank_context``),
# so none ended its imports before this one; ignored now, they can come.
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
