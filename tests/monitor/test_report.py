"""The report to keep: the dashboard's page with its files and the state inlined."""

from __future__ import annotations

import json
import re
from pathlib import Path

from elche.core import timeline as tl
from elche.monitor.report import REPORT_FILE, render_report, write_report
from elche.monitor.timeline import TimelineWriter

RECORDS: list[tl.TimelineEvent] = [
    tl.RankJoined(t=0.1, rank=0, host="a"),
    tl.RankJoined(t=0.1, rank=1, host="b"),
    tl.RunStart(t=0.2, world_size=2, mode="cadence"),
    tl.SyncEnd(t=0.5, round=1, duration_ms=20.0, d_raw=0.0, k_used=6, anchor=10),
    tl.EpochEnd(t=1.0, epoch=0, loss=0.4, rounds_done=1, lr=0.1),
    tl.RankLost(t=1.5, rank=1, reason="heartbeat stale"),
    tl.RunEnd(
        t=2.0, outcome="completed", reason="", epochs_completed=1, rounds_done=1,
        lost_samples=0, dead_ranks=(1,), rejected_frames=0, anchor=12, samples_per_rank=(5, 1),
    ),
]  # fmt: skip


def _inlined_state(page: str) -> dict[str, object]:
    found = re.search(r"<script>window\.ELCHE_STATE = (.*?);</script>", page, re.S)
    assert found is not None
    return json.loads(found.group(1))  # type: ignore[no-any-return]  # JSON


def test_the_report_is_one_offline_file_with_the_runs_state(tmp_path: Path) -> None:
    writer = TimelineWriter(tmp_path, started_s=0.0)
    for event in RECORDS:
        writer.write(event, event.t)
    writer.write(tl.Alert(severity="warn", name="drift", path="root", detail="</script>&"), 2.5)
    writer.close()
    path = write_report(tmp_path, 2, devices=["cpu", "cpu"])
    assert path == tmp_path / REPORT_FILE
    page = path.read_text(encoding="utf-8")
    assert not re.search(r"https?://", page)  # nothing from the network, not even a link
    assert not re.search(r"""(src|href)=["'](?!#)""", page)  # no file beside it either
    assert "uPlot" in page and "MIT" in page  # the library and its licence, inlined
    state = _inlined_state(page)
    assert state["run"]["phase"] == "done" and state["run"]["run_dir"] == str(tmp_path)  # type: ignore[index]
    assert [r["state"] for r in state["ranks"]] == ["live", "lost"]  # type: ignore[index, union-attr]
    assert state["alerts"][-1]["detail"] == "</script>&"  # type: ignore[index]
    assert page.count("</script>") == page.count("<script")  # the detail closed nothing


def test_an_empty_timeline_still_renders(tmp_path: Path) -> None:
    page = render_report({"run": {"run_dir": "<r>"}, "ranks": [], "series": {}, "alerts": []})
    assert "report of &lt;r&gt;" in page and "window.ELCHE_STATE" in page
