"""The alert book: first at once, repeats collapsed into a count, a cap with overflow."""

from __future__ import annotations

import io

import pytest

from elche.core import timeline as tl
from elche.monitor.alerts import COLLAPSE_S, MAX_ENTRIES, AlertBook, alert_line, alerts_for
from elche.runtime.lookout import Lookout


def _counts(alerts: list[tl.Alert]) -> list[tuple[str, str, int]]:
    return [(a.name, a.path, a.count) for a in alerts]


def test_the_reference_figures() -> None:
    assert (COLLAPSE_S, MAX_ENTRIES) == (10.0, 200)


def test_the_first_is_reported_at_once_and_repeats_within_the_window_are_counted() -> None:
    book = AlertBook()
    first = book.raise_alert("rank_lost", "rank2", "heartbeat stale", 0.0)
    assert first == [
        tl.Alert(severity="critical", name="rank_lost", path="rank2", detail="heartbeat stale")
    ]
    assert book.raise_alert("rank_lost", "rank2", "heartbeat stale", 3.0) == []
    assert book.raise_alert("rank_lost", "rank2", "exited", 9.9) == []
    assert book.due(9.99) == []  # the window has not passed
    owed = book.due(10.0)
    assert _counts(owed) == [("rank_lost", "rank2", 2)] and owed[0].detail == "exited"
    # Reported at 10.0: a repeat right after is absorbed again.
    assert book.raise_alert("rank_lost", "rank2", "again", 12.0) == []
    assert _counts(book.flush()) == [("rank_lost", "rank2", 1)]
    assert len(book) == 0


def test_another_path_or_class_is_its_own_entry() -> None:
    book = AlertBook()
    out = book.raise_alert("control_drop", "rank1", "x", 0.0)
    out += book.raise_alert("control_drop", "rank2", "x", 0.0)
    out += book.raise_alert("drift", "rank1", "x", 0.0)
    assert _counts(out) == [
        ("control_drop", "rank1", 1), ("control_drop", "rank2", 1), ("drift", "rank1", 1)
    ]  # fmt: skip
    assert [a.severity for a in out] == ["critical", "critical", "warn"]


def test_a_repeat_after_the_window_is_reported_with_what_it_absorbed() -> None:
    book = AlertBook()
    book.raise_alert("drift", "root", "d", 0.0)
    book.raise_alert("drift", "root", "d", 1.0)
    # This one and the one absorbed: counts summed equal the occurrences.
    assert _counts(book.raise_alert("drift", "root", "d", 11.0)) == [("drift", "root", 2)]
    assert book.flush() == []


def test_spent_entries_are_dropped_once_their_window_passed() -> None:
    book = AlertBook()
    book.raise_alert("drift", "root", "d", 0.0)
    assert book.due(10.0) == [] and len(book) == 0
    assert _counts(book.raise_alert("drift", "root", "d", 10.5)) == [("drift", "root", 1)]


def test_the_cap_evicts_the_least_recently_active_and_reports_overflow() -> None:
    book = AlertBook(max_entries=3)
    book.raise_alert("control_drop", "rank0", "x", 0.0)
    book.raise_alert("control_drop", "rank0", "x", 0.5)  # owed 1
    book.raise_alert("control_drop", "rank1", "x", 1.0)
    book.raise_alert("control_drop", "rank0", "x", 1.5)  # rank0 most recent; owed 2
    book.raise_alert("control_drop", "rank2", "x", 2.0)
    out = book.raise_alert("control_drop", "rank3", "x", 3.0)  # evicts rank1
    # The overflow entry needed room too: rank0 went, reporting its 2 owed first.
    assert _counts(out) == [
        ("control_drop", "rank3", 1), ("control_drop", "rank0", 2), ("overflow", "root", 1)
    ]  # fmt: skip
    assert len(book) <= 3
    total = sum(a.count for a in out) + 3 + sum(a.count for a in book.flush())
    assert total == book.occurrences


def test_counts_always_sum_to_the_occurrences() -> None:
    book = AlertBook(max_entries=5)
    reported = 0
    for i in range(400):
        now = i * 0.7
        reported += sum(a.count for a in book.raise_alert("drift", f"rank{i % 9}", "d", now))
        reported += sum(a.count for a in book.due(now))
        assert len(book) <= 5
    reported += sum(a.count for a in book.flush())
    assert reported == book.occurrences


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        AlertBook(max_entries=1)
    with pytest.raises(KeyError):
        AlertBook().raise_alert("nonsense", "root", "", 0.0)


def test_the_printed_line() -> None:
    alert = tl.Alert(severity="critical", name="rank_lost", path="rank2", detail="heartbeat stale")
    assert alert_line(alert) == "elche [critical] rank_lost rank2 — heartbeat stale (x1)"


def test_which_records_raise_alerts() -> None:
    assert alerts_for(tl.RankLost(rank=2, reason="heartbeat stale")) == [
        ("rank_lost", "rank2", "heartbeat stale")
    ]
    # A round far apart is no alert by itself (early rounds are); the guard's correction is.
    apart = tl.SyncEnd(round=3, duration_ms=1.0, d_raw=0.9, k_used=3, anchor=10)
    assert alerts_for(apart) == []
    nudged = tl.GuardNudge(factor=0.5, old=20, new=10)
    assert [name for name, _, _ in alerts_for(nudged)] == ["drift"]
    stalled = tl.Stalled(silent_s=120.0, waiting_for="round 3", ranks=())
    assert [name for name, _, _ in alerts_for(stalled)] == ["stall"]
    assert alerts_for(tl.EpochStart(epoch=0)) == []


def test_the_lookout_prints_each_report_once_and_records_it() -> None:
    written: list[tl.TimelineEvent] = []
    log = io.StringIO()
    lookout = Lookout(written.append, log)
    lookout.observe(tl.RankLost(rank=1, reason="process ended"), 0.0)
    lookout.control_drop([2], "SetBudget", 0.0)
    lookout.control_drop([2], "SetBudget", 1.0)
    lookout.tick(5.0)
    assert log.getvalue().splitlines() == [
        "elche [critical] rank_lost rank1 — process ended (x1)",
        "elche [critical] control_drop rank2 — SetBudget lost (x1)",
    ]
    lookout.close()
    assert log.getvalue().splitlines()[-1] == (
        "elche [critical] control_drop rank2 — SetBudget lost (x1)"
    )
    assert [type(e).__name__ for e in written] == ["Alert"] * 3
