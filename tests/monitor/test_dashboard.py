"""The dashboard server over a hand-written timeline: real sockets, port 0."""

from __future__ import annotations

import contextlib
import io
import json
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from elche.core import timeline as tl
from elche.monitor import dashboard
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
        assert status == 404
        assert json.loads(body)["endpoints"] == ["/", "/state.json", "/events", "/metrics"]
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


def test_the_page_and_its_files_come_from_elche_itself(tmp_path: Path) -> None:
    board = Dashboard(tmp_path, 1, port=0)
    url = board.start()
    try:
        _, _, page = _get(url)
        assert '<script src="/static/uPlot.iife.min.js">' in page
        assert '<script src="/static/dashboard.js">' in page
        for name, kind in [
            ("dashboard.js", "text/javascript"),
            ("dashboard.css", "text/css"),
            ("uPlot.iife.min.js", "text/javascript"),
            ("uPlot.min.css", "text/css"),
            ("LICENSE-uPlot.txt", "text/plain"),
        ]:
            status, headers, text = _get(url + "static/" + name)
            assert status == 200 and headers["Content-Type"].startswith(kind), name
            if name.startswith("dashboard"):
                assert "http://" not in text and "https://" not in text, name
            elif name == "uPlot.iife.min.js":  # only its project's address, in its header
                assert set(re.findall(r"https?://[^\s\"')]+", text)) == {
                    "https://github.com/leeoniya/uPlot"
                }
        assert "http://" not in page and "https://" not in page
        assert "MIT" in _get(url + "static/LICENSE-uPlot.txt")[2]
        assert _get(url + "static/nothing.js")[0] == 404
    finally:
        board.stop()


def test_events_push_the_state_and_say_when_the_run_is_complete(tmp_path: Path) -> None:
    board = Dashboard(tmp_path, 1, port=0)
    url = board.start()
    writer = TimelineWriter(tmp_path, started_s=0.0)
    writer.write(tl.RankJoined(rank=0, host="a"), now_s=0.1)
    writer.close()
    _state_when(url, lambda s: s["ranks"][0]["state"] == "live")
    stream = urllib.request.urlopen(url + "events", timeout=10)
    try:
        assert stream.headers["Content-Type"].startswith("text/event-stream")
        first = stream.readline().decode()
        assert first.startswith("data: ")
        assert json.loads(first.removeprefix("data: "))["ranks"][0]["host"] == "a"
        board.stop()
        rest = stream.read().decode()
    finally:
        stream.close()
        board.stop()
    assert "event: complete" in rest


def _messages(stream_text: str) -> list[tuple[str, Any]]:
    """Server-sent events as (event, data), "message" where no event is named."""
    messages = []
    for block in stream_text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line)
        if "data" in fields:
            messages.append((fields.get("event", "message"), json.loads(fields["data"])))
    return messages


def test_the_last_push_before_complete_carries_the_runs_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run writes its RunEnd just before the launcher stops the dashboard.
    The stream, woken by the stop (here before the follower: it waited
    longer), still pushes the state with the RunEnd folded in before
    `complete`, on which the page stops listening."""
    monkeypatch.setattr(dashboard, "EVENTS_EVERY_S", 3600.0)  # no push but the first and last
    board = Dashboard(tmp_path, 1, port=0)
    url = board.start()
    writer = TimelineWriter(tmp_path, started_s=0.0)
    writer.write(tl.RunStart(world_size=1, mode="cadence"), now_s=0.1)
    _state_when(url, lambda s: s["run"]["phase"] == "training")
    stream = urllib.request.urlopen(url + "events", timeout=10)
    try:
        first = stream.readline().decode()
        assert json.loads(first.removeprefix("data: "))["run"]["phase"] == "training"
        # A fold after the stream went to wait: the follower now waits on the
        # stop more recently than the stream does, so the stream wakes first.
        # It folds no more until the stop: its next wait began after this fold.
        monkeypatch.setattr(dashboard, "FOLLOW_EVERY_S", 3600.0)
        writer.write(tl.EpochEnd(epoch=0, loss=0.5, rounds_done=1, lr=0.1), now_s=0.2)
        _state_when(url, lambda s: s["run"]["epochs_completed"] == 1)
        writer.write(
            tl.RunEnd(outcome="completed", reason="", epochs_completed=1, rounds_done=1,
                      lost_samples=0, dead_ranks=(), rejected_frames=0, anchor=10,
                      samples_per_rank=(32,)),
            now_s=0.3,
        )  # fmt: skip
        writer.close()
        board.stop()
        rest = stream.read().decode()
    finally:
        stream.close()
        board.stop()
    (_, last), complete = _messages(rest)[-2:]
    assert (last["run"]["phase"], last["run"]["outcome"]) == ("done", "completed")
    assert complete == ("complete", {})


def _raw(url: str, request: bytes) -> bytes:
    """Send ``request`` as it is; the whole reply, to the server's close."""
    host, port = url.removeprefix("http://").strip("/").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def test_a_malformed_request_is_counted_and_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = io.StringIO()
    board = Dashboard(tmp_path, 1, port=0, log=log)
    url = board.start()
    try:
        too_long = b"a" * 20_000  # past aiohttp's 8190-byte line limit
        url_reply = _raw(url, b"GET /" + too_long + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        header_reply = _raw(url, b"GET / HTTP/1.1\r\nHost: x\r\nX-A: " + too_long + b"\r\n\r\n")
        for reply in (url_reply, header_reply):
            assert re.match(rb"HTTP/1\.[01] 400 ", reply), reply[:80]
        metrics = _get(url + "metrics")[2]
        assert "elche_dashboard_rejected_requests_total 2.0" in metrics
        assert _get(url + "state.json")[0] == 200  # it serves on
    finally:
        board.stop()
    assert log.getvalue().splitlines() == [
        "elche: the dashboard rejected a malformed request from 127.0.0.1 "
        "(LineTooLong, 400; 1 rejected so far)"
    ]
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out


def test_the_state_is_encoded_once_per_change_not_per_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under elche run and torchrun the dashboard shares rank 0's process: a long
    run's state is megabytes of JSON, and encoding it for every request and every
    /events client took that rank's time (0.1 CPU s a second per open page)."""
    board = Dashboard(tmp_path, 1, port=0)
    folds: list[int] = []
    state = board.view.state
    monkeypatch.setattr(board.view, "state", lambda: folds.append(1) or state())
    url = board.start()
    try:
        writer = TimelineWriter(tmp_path, started_s=0.0)
        writer.write(tl.RunStart(world_size=1, mode="cadence"), now_s=0.1)
        _state_when(url, lambda s: s["run"]["phase"] == "training")
        encoded = len(folds)
        assert len({_get(url + "state.json")[2] for _ in range(3)}) == 1
        assert len(folds) == encoded  # nothing changed: the same bytes, not encoded again
        writer.write(tl.EpochEnd(epoch=0, loss=0.5, rounds_done=1), now_s=0.2)
        writer.close()
        _state_when(url, lambda s: s["run"]["epochs_completed"] == 1)
        _get(url + "state.json")
        assert len(folds) == encoded + 1  # a change is encoded once
    finally:
        board.stop()


def _served(url: str) -> bool:
    try:
        return _get(url)[0] == 200
    except OSError:  # closed as it opened: at the cap still
        return False


def test_connections_past_the_cap_are_closed_and_the_dashboard_serves_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every connection held a file descriptor of the process that trains (rank 0's
    under elche run): a thousand opened and held left it none, and its next open of
    the timeline ended the run (EMFILE)."""
    monkeypatch.setattr(dashboard, "MAX_CONNECTIONS", 3)
    log = io.StringIO()
    board = Dashboard(tmp_path, 1, port=0, log=log)
    url = board.start()
    host, port = url.removeprefix("http://").strip("/").rsplit(":", 1)
    held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]
    try:
        for sock in held:  # each is being served: a request on it is answered
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(64).startswith(b"HTTP/1.1 200")
        with (
            socket.create_connection((host, int(port)), timeout=5) as extra,
            contextlib.suppress(ConnectionResetError),  # closed, not left open
        ):
            extra.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert extra.recv(64) == b""
    finally:
        for sock in held:
            sock.close()
    try:
        end = time.monotonic() + 10
        while not _served(url + "metrics") and time.monotonic() < end:
            time.sleep(0.02)  # polling cadence: the server sees the closes in its own time
        assert _served(url + "metrics")  # served again once they closed
    finally:
        board.stop()
    assert log.getvalue() == (
        "elche: the dashboard closed a connection past its 3 open (1 closed so far)\n"
    )
