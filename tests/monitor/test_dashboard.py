"""The dashboard server over a hand-written timeline: real sockets, port 0."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from elche.core import timeline as tl
from elche.monitor.dashboard import Dashboard
from elche.monitor.timeline import TimelineWriter

pytestmark = pytest.mark.slow


def _get(url: str) -> tuple[int, dict[str, str], str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def _state_when(url: str, condition: object, deadline_s: float = 10.0) -> dict[str, object]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        state = json.loads(_get(url + "state.json")[2])
        if condition(state):  # type: ignore[operator]  # a predicate
            return state  # type: ignore[no-any-return]  # JSON
        time.sleep(0.02)  # polling cadence; the condition is what synchronises
    raise AssertionError("the dashboard never showed the record")


def test_it_follows_the_timeline_and_serves_every_endpoint(tmp_path: Path) -> None:
    board = Dashboard(tmp_path, 2, port=0)
    url = board.start()
    try:
        assert url.startswith("http://127.0.0.1:")
        status, headers, page = _get(url)
        assert (
            status == 200
            and "/state.json" in page
            and headers["Content-Type"].startswith("text/html")
        )
        writer = TimelineWriter(tmp_path, started_s=0.0)
        writer.write(tl.RankJoined(rank=1, host="b"), now_s=0.5)
        state = _state_when(url, lambda s: s["ranks"][1]["state"] == "live")
        assert state["ranks"][0]["state"] == "joining"  # type: ignore[index]  # JSON
        status, headers, _ = _get(url + "state.json")
        assert headers["Access-Control-Allow-Origin"] == "*"
        assert headers["Cache-Control"] == "no-cache"
        status, headers, text = _get(url + "metrics")
        assert status == 200 and "elche_live_ranks 1.0" in text
        status, _, body = _get(url + "nowhere")
        assert status == 404 and json.loads(body)["endpoints"] == ["/", "/state.json", "/metrics"]
        writer.write(tl.RankLost(rank=1, reason="gone"), now_s=1.0)
        writer.close()
    finally:
        board.stop()
    # stop() read the timeline one last time.
    assert board.view.state()["ranks"][1]["state"] == "lost"
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


def test_a_taken_port_is_an_os_error(tmp_path: Path) -> None:
    first = Dashboard(tmp_path, 1, port=0)
    url = first.start()
    try:
        port = int(url.rsplit(":", 1)[1].strip("/"))
        with pytest.raises(OSError, match="could not serve"):
            Dashboard(tmp_path, 1, port=port).start()
    finally:
        first.stop()


def test_a_broken_record_does_not_stop_the_server(tmp_path: Path) -> None:
    board = Dashboard(tmp_path, 1, port=0)
    url = board.start()
    try:
        (tmp_path / "timeline.jsonl").write_bytes(b"not json\n")
        writer = TimelineWriter(tmp_path, started_s=0.0)
        writer.write(tl.RankJoined(rank=0, host="a"), now_s=0.1)
        writer.close()
        _state_when(url, lambda s: s["ranks"][0]["state"] == "live")
    finally:
        board.stop()
