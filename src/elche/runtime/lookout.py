"""The coordinator process's alert desk: the alert book, fed and printed.

``Host`` hands every timeline record it writes to ``Lookout.observe`` (a
rank lost, a drifting round, a stall raise alerts), and every control
message that did not reach a live rank to ``control_drop``. The book
(``elche.monitor.alerts``) collapses and caps them; each report it makes is
printed once on stderr (``elche [critical] rank_lost rank2 — heartbeat stale
(x1)``) and written to the timeline as an ``Alert`` record, where the
dashboard's state and metrics find it. ``tick`` runs on every loop turn to
report repeats whose collapse window has passed; ``close`` flushes the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TextIO

from elche.core import timeline as tl
from elche.monitor.alerts import AlertBook, alert_line, alerts_for

__all__ = ["Lookout"]


class Lookout:
    """Feeds the alert book and reports what it says.

    Args:
        write: appends a record to the timeline (``Host``'s writer).
        log: where alert lines are printed.
    """

    def __init__(self, write: Callable[[tl.TimelineEvent], None], log: TextIO) -> None:
        self.book = AlertBook()
        self._write = write
        self._log = log

    def observe(self, event: tl.TimelineEvent, now_s: float) -> None:
        """A record was written at ``now_s``: raise the alerts it stands for."""
        for name, path, detail in alerts_for(event):
            self._report(self.book.raise_alert(name, path, detail, now_s))

    def control_drop(self, ranks: Iterable[int], what: str, now_s: float) -> None:
        """``what`` did not reach ``ranks``."""
        for rank in ranks:
            alerts = self.book.raise_alert("control_drop", f"rank{rank}", f"{what} lost", now_s)
            self._report(alerts)

    def coordinator_restored(self, restarts: int, now_s: float) -> None:
        """This coordinator took over from a lost one (the ``restarts``-th successor)."""
        detail = f"the coordinator process was lost; restart {restarts} goes on from its journal"
        self._report(self.book.raise_alert("coordinator_lost", "coordinator", detail, now_s))

    def tick(self, now_s: float) -> None:
        """Report the repeats whose collapse window has passed."""
        if len(self.book):
            self._report(self.book.due(now_s))

    def close(self) -> None:
        """Report everything still owed (the run is over)."""
        self._report(self.book.flush())

    def _report(self, alerts: list[tl.Alert]) -> None:
        for alert in alerts:
            print(alert_line(alert), file=self._log, flush=True)
            self._write(alert)
