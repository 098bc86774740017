"""The alert book: what a person should look at, collapsed and capped.

Rules (the reference's alert lane, restated):

- An alert has a *name* (its class), a *path* (what it is about: ``rank2``,
  ``root``) and a severity fixed by its name (``SEVERITY``).
- The first occurrence of a (name, path) is reported at once, ``count`` 1.
  Repeats within ``COLLAPSE_S`` of the last report of that (name, path) are
  absorbed; the report after the window carries their count (``due`` makes
  it once the window has passed, ``flush`` at the end), so the counts summed
  over all reports equal the occurrences.
- At most ``MAX_ENTRIES`` (name, path) entries are live. A new one evicts
  the least recently active entry, reporting what it still owed first; an
  eviction is itself an ``overflow`` alert at ``root``, collapsed like any
  other. An entry with nothing owed whose window has passed is dropped.

The book is pure: times come in as ``now_s`` and reports go out as
``elche.core.timeline.Alert`` records; printing them is the caller's job
(``alert_line``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from elche.core import timeline as tl

__all__ = [
    "COLLAPSE_S",
    "MAX_ENTRIES",
    "SEVERITY",
    "AlertBook",
    "alert_line",
    "alerts_for",
]

# The reference's figures: 10 000 ms collapse window, 200 live entries.
COLLAPSE_S = 10.0
MAX_ENTRIES = 200
SEVERITY = {
    "rank_lost": "critical",  # a rank died or was evicted
    "control_drop": "critical",  # a control message did not reach a live rank
    "coordinator_lost": "critical",  # the coordinator process died; a successor took over
    "drift": "warn",  # a round found a replica far from the consensus
    "overflow": "warn",  # the alert book evicted entries
    "stall": "warn",  # no progress for the stall watchdog's interval
}
OVERFLOW = "overflow"
ROOT = "root"


@dataclass(slots=True)
class _Entry:
    reported_s: float  # when this (name, path) was last reported: its window's start
    detail: str  # the latest occurrence's detail
    owed: int = 0  # occurrences absorbed since that report


class AlertBook:
    """Collapses and caps alerts; see the module's rules.

    Args:
        collapse_s: repeats within this many seconds are absorbed.
        max_entries: live (name, path) entries at most.

    Raises:
        ValueError: ``collapse_s`` < 0 or ``max_entries`` < 2 (an eviction
            needs room for its own ``overflow`` entry).
    """

    def __init__(self, collapse_s: float = COLLAPSE_S, max_entries: int = MAX_ENTRIES) -> None:
        if collapse_s < 0 or max_entries < 2:
            raise ValueError(f"need collapse_s >= 0 and max_entries >= 2, got {collapse_s}, "
                             f"{max_entries}")  # fmt: skip
        self.collapse_s = collapse_s
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self.occurrences = 0  # every occurrence ever raised, overflow included

    def __len__(self) -> int:
        return len(self._entries)

    def raise_alert(self, name: str, path: str, detail: str, now_s: float) -> list[tl.Alert]:
        """One occurrence at ``now_s``; returns the reports to make now (maybe none).

        Raises:
            KeyError: ``name`` is not an alert class (``SEVERITY``).
        """
        SEVERITY[name]  # an unknown class is a bug at the call site
        self.occurrences += 1
        key = (name, path)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            entry.detail = detail
            if now_s - entry.reported_s < self.collapse_s:
                entry.owed += 1
                return []
            count, entry.owed, entry.reported_s = entry.owed + 1, 0, now_s
            return [_alert(name, path, detail, count)]  # with the repeats it absorbed
        out: list[tl.Alert] = []
        evicted = self._make_room(out)
        self._entries[key] = _Entry(reported_s=now_s, detail=detail)
        out.append(_alert(name, path, detail, 1))
        if evicted and name != OVERFLOW:
            text = f"{evicted} alert entries evicted (cap {self.max_entries})"
            out += self.raise_alert(OVERFLOW, ROOT, text, now_s)
        return out

    def due(self, now_s: float) -> list[tl.Alert]:
        """Reports owed by entries whose collapse window has passed; drops spent entries."""
        out: list[tl.Alert] = []
        for key, entry in list(self._entries.items()):
            if now_s - entry.reported_s < self.collapse_s:
                continue
            if entry.owed:
                out.append(_alert(*key, entry.detail, entry.owed))
                entry.owed, entry.reported_s = 0, now_s
            else:
                del self._entries[key]
        return out

    def flush(self) -> list[tl.Alert]:
        """Every report still owed (at the end of the run); the book is empty after."""
        out = [_alert(*key, e.detail, e.owed) for key, e in self._entries.items() if e.owed]
        self._entries.clear()
        return out

    def _make_room(self, out: list[tl.Alert]) -> int:
        evicted = 0
        while len(self._entries) >= self.max_entries:
            key, entry = self._entries.popitem(last=False)
            if entry.owed:
                out.append(_alert(*key, entry.detail, entry.owed))
            evicted += 1
        return evicted


def _alert(name: str, path: str, detail: str, count: int) -> tl.Alert:
    return tl.Alert(severity=SEVERITY[name], name=name, path=path, detail=detail, count=count)


def alert_line(alert: tl.Alert) -> str:
    """How an alert is printed: ``elche [critical] rank_lost rank2 — heartbeat stale (x1)``."""
    return f"elche [{alert.severity}] {alert.name} {alert.path} — {alert.detail} (x{alert.count})"


def alerts_for(event: tl.TimelineEvent) -> list[tuple[str, str, str]]:
    """The (name, path, detail) occurrences a timeline record raises."""
    match event:
        case tl.RankLost(rank=rank, reason=reason):
            return [("rank_lost", f"rank{rank}", reason)]
        case tl.GuardNudge(factor=factor, new=new):
            detail = f"divergence rising: the guard nudged the anchor down (x{factor:.2f}) to {new}"
            return [("drift", ROOT, detail)]
        case tl.Stalled(silent_s=silent_s, waiting_for=waiting_for):
            return [("stall", ROOT, f"no progress for {silent_s:.0f} s; waiting for {waiting_for}")]
        case _:
            return []
