"""A watched dashboard for the bench: what the dashboard costs a run, measured.

``watched_dashboard`` picks a free local port for a run's dashboard and
watches it as a person and a Prometheus server would: a thread in the bench
process reads ``/state.json`` and ``/metrics`` every ``WATCH_EVERY_S`` until
the run is over. ``Watch.polls`` counts the reads that succeeded, so a
result shows that the dashboard was served and read, not only asked for.
"""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["WATCH_EVERY_S", "Watch", "watched_dashboard"]

# The page's push interval and a common Prometheus scrape interval are 1 s or longer.
WATCH_EVERY_S = 1.0
_PATHS = ("state.json", "metrics")


@dataclass
class Watch:
    """The address to serve the dashboard on, and how often it was read."""

    address: str
    polls: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def watch(self) -> None:
        url = f"http://{self.address}/"
        while not self._stop.wait(WATCH_EVERY_S):
            for path in _PATHS:
                try:
                    with urllib.request.urlopen(url + path, timeout=2) as response:
                        response.read()
                    self.polls += 1
                except (urllib.error.URLError, OSError):
                    pass  # not up yet, or already gone


@contextmanager
def watched_dashboard() -> Iterator[Watch]:
    """A free local address for the dashboard, read every second while the block runs."""
    with socket.socket() as probe:  # a free port; the dashboard binds it right after
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    watch = Watch(f"127.0.0.1:{port}")
    thread = threading.Thread(target=watch.watch, name="elche-bench-watch", daemon=True)
    thread.start()
    try:
        yield watch
    finally:
        watch._stop.set()
        thread.join(timeout=5)
