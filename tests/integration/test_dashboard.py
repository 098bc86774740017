"""A real 3-rank run with its dashboard: /state.json, /metrics and the page in
headless Chromium while it goes on; then its report.html (offline), its
TensorBoard log and its Chrome trace. One run for all of it (the suite's budget).

The run is a child process (``python -c``) so that the test reads exactly what
a user sees on stderr: the run directory, the dashboard's address, the alert
lines the coordinator prints. Screenshots of the page go to the test's
tmp_path when a browser check fails.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elche.cli import main
from tests.integration.browser import COLUMNS, open_browser, page_view, screenshot

pytestmark = [pytest.mark.integration, pytest.mark.slow]
EPOCHS = 6

# The run's last epoch waits (in every rank's epoch_fn) until the test has read the
# live dashboard and creates RELEASE: the run cannot end before the test is done with
# it, however fast the machine (6 epochs once ended during the browser's checks).
SCRIPT = """
import json, os, sys, time
import elche
from elche.workloads import digits

RELEASE = {release!r}
LAST_EPOCH = {epochs} - 1


def hold_the_last_epoch(epoch, model, optimizer):
    deadline = time.monotonic() + 120.0  # a test that died does not hold the run for ever
    while epoch == LAST_EPOCH and not os.path.exists(RELEASE) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling cadence; the file is what synchronises


if __name__ == "__main__":
    train_set, _ = digits.load_digits_split(seed=0)
    result = elche.train(
        digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
        batch_size=32, epochs={epochs}, speeds=[1.0, 0.5, 0.25], progress=False,
        run_dir=sys.argv[1], dashboard="127.0.0.1:0", crash={{1: 1.0}},
        tensorboard_dir=sys.argv[2], epoch_fn=hold_the_last_epoch,
    )
    print(json.dumps(result.summary))
"""


class _Run:
    """The child process and the stderr lines it printed so far."""

    def __init__(self, run_dir: Path, epochs: int, tensorboard_dir: Path) -> None:
        self.release = run_dir.parent / "release"
        script = run_dir.parent / "dashboard_run.py"
        script.write_text(SCRIPT.format(release=str(self.release), epochs=epochs))
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(run_dir), str(tensorboard_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with contextlib.suppress(ValueError):  # the test's communicate() closed it: done
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))

    def line_starting(self, prefix: str) -> str | None:
        return next((line for line in list(self.lines) if line.startswith(prefix)), None)


def _poll(condition: Callable[[], Any], what: str, deadline_s: float = 60.0) -> Any:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.05)  # polling cadence; the condition is what synchronises
    raise AssertionError(f"timed out waiting for {what}")


def _get(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.headers.get("Content-Type", ""), response.read().decode("utf-8")


def _shows_one_of(cell: str, values: list[float], digits: int) -> bool:
    """Whether a cell is one of ``values`` written with ``digits`` decimals, or a dash.

    The page rounds a half up (JavaScript's ``toFixed``: 0.5625 is "0.563") where Python
    rounds it to even ("0.562"), so the cell is compared as a number, within half its last digit.
    """
    if cell == "–":
        return True
    half = 0.5 * 10.0**-digits
    return any(abs(float(cell) - value) <= half * (1 + 1e-9) for value in values)


def _check_page(driver: Any, url: str) -> None:
    """The page shows the ranks, speeds and shares ``/state.json`` reports, as the run goes on."""
    driver.get(url)

    def drawn() -> dict[str, Any] | None:
        view = page_view(driver)
        speeds = view["charts"].get("chart-speed")
        return view if len(view["rows"]) == 3 and speeds and len(speeds[0]) > 0 else None

    view = _poll(drawn, "the page to draw 3 ranks and their speeds", deadline_s=30)
    state = json.loads(_get(url + "state.json")[1])  # later than the page's: series only grow
    assert state["run"]["phase"] == "training"  # the run goes on
    assert view["canvases"] >= 5  # five charts
    assert all(r.startswith(url) for r in view["resources"])  # nothing from elsewhere
    for row in view["rows"]:
        rank, cells = row["rank"], dict(zip(COLUMNS, row["cells"], strict=True))
        entry = state["ranks"][rank]
        assert cells["rank"] == str(rank) and cells["host"] == (entry["host"] or "–")
        if cells["state"].startswith("lost"):  # the page drew it lost: so does the state
            assert entry["state"] == "lost" and (cells["samples/s"], cells["share"]) == (
                "0",
                "0.000",
            )
            continue
        # The page's values are from a state at most a second older: points of the series.
        speeds = [p[1] for p in state["series"]["samples_per_s"][str(rank)]]
        assert _shows_one_of(cells["samples/s"], speeds, digits=0), (cells, speeds)
        shares = [p[1] for p in state["series"]["share"][str(rank)]]
        assert _shows_one_of(cells["share"], shares, digits=3), (cells, shares)
    for chart, key in (("chart-speed", "samples_per_s"), ("chart-share", "share")):
        times, *columns = view["charts"][chart]
        for rank, column in enumerate(columns):
            points = [[t, v] for t, v in zip(times, column, strict=True) if v is not None]
            assert points == state["series"][key][str(rank)][: len(points)], chart
    loss_times, losses = view["charts"]["chart-loss"]
    assert [[t, v] for t, v in zip(loss_times, losses, strict=True)] == state["series"]["loss"][
        : len(losses)
    ]


def _check_lost_on_page(driver: Any) -> None:
    def shown() -> dict[str, Any] | None:
        view = page_view(driver)
        lost = [row for row in view["rows"] if row["cls"] == "lost"]
        alerted = any("[critical] rank_lost rank1" in a for a in view["alerts"])
        return view if alerted and [row["rank"] for row in lost] == [1] else None

    _poll(shown, "the page to show rank 1 lost and its rank_lost alert", deadline_s=30)


def _check_report(driver: Any, report: Path) -> None:
    """report.html opens with networking off and shows the finished run."""
    text = report.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text
    driver.set_network_conditions(offline=True, latency=0, download_throughput=0,
                                  upload_throughput=0)  # fmt: skip
    driver.get(report.as_uri())
    view = _poll(lambda: (v := page_view(driver))["rows"] and v, "the report to draw")
    assert view["resources"] == []  # it loaded nothing
    assert " done " in view["header"] and "completed" in view["header"]
    assert [row["rank"] for row in view["rows"]] == [0, 1, 2]
    assert [row["cls"] for row in view["rows"]] == ["live", "lost", "live"]
    assert view["canvases"] >= 5 and all(len(data[0]) > 0 for data in view["charts"].values())
    assert any("rank_lost rank1" in a for a in view["alerts"])


def test_the_dashboard_serves_state_and_metrics_and_shows_a_lost_rank(tmp_path: Path) -> None:
    driver, no_browser = open_browser()
    run = _Run(tmp_path / "run", epochs=EPOCHS, tensorboard_dir=tmp_path / "tb")
    step = "the live page"
    try:
        line = _poll(lambda: run.line_starting("elche: dashboard at "), "the dashboard line")
        url = line.removeprefix("elche: dashboard at ")
        assert url.startswith("http://127.0.0.1:") and url.endswith("/")
        assert run.line_starting(f"elche: run directory {tmp_path / 'run'}") is not None

        def ranks_measured() -> dict[str, Any] | None:
            state = json.loads(_get(url + "state.json")[1])
            ranks = state["ranks"]
            # Every rank has a window record (rank 1's may be its last before it dies).
            measured = all(r["samples"] > 0 and r["share"] is not None for r in ranks)
            return state if len(ranks) == 3 and measured else None

        state = _poll(ranks_measured, "3 ranks with speeds and shares")
        if driver is not None:
            _check_page(driver, url)
        assert state["run"]["mode"] == "cadence" and state["run"]["world_size"] == 3
        assert {r["rank"] for r in state["ranks"]} == {0, 1, 2}
        assert all(0 <= r["share"] <= 1 and r["samples_per_s"] >= 0 for r in state["ranks"])

        content_type, text = _get(url + "metrics")
        assert content_type.startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(text)}
        speeds = families["elche_rank_samples_per_second"].samples
        assert {s.labels["rank"] for s in speeds} == {"0", "1", "2"}
        trained = families["elche_samples_trained"].samples
        assert {s.labels["rank"] for s in trained if s.name.endswith("_total")} == {"0", "1", "2"}
        assert "elche_round_duration_seconds" in families

        def rank_lost_alert() -> dict[str, Any] | None:
            alerts = json.loads(_get(url + "state.json")[1])["alerts"]
            return next((a for a in alerts if a["name"] == "rank_lost"), None)

        alert = _poll(rank_lost_alert, "a rank_lost alert in state.json")
        assert alert["severity"] == "critical" and alert["path"] == "rank1"
        state = json.loads(_get(url + "state.json")[1])
        assert state["ranks"][1]["state"] == "lost"
        if driver is not None:
            _check_lost_on_page(driver)
        run.release.touch()  # the run's last epoch may go on
        out, _ = run.proc.communicate(timeout=120)
        step = "report.html"
        if driver is not None:
            _check_report(driver, tmp_path / "run" / "report.html")
    except BaseException:
        if driver is not None:
            print(f"screenshot of {step}: {screenshot(driver, tmp_path, 'failure')}")
        raise
    finally:
        run.release.touch()
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.communicate()
        if driver is not None:
            driver.quit()
    run._reader.join(timeout=10)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["outcome"] == "completed" and summary["dead_ranks"] == [1]
    printed = [line for line in run.lines if line.startswith("elche [critical] rank_lost rank1 — ")]
    assert len(printed) == 1, run.lines  # printed once
    assert printed[0].endswith("(x1)")
    assert summary["report"] == str(tmp_path / "run" / "report.html")
    assert summary["run_dir"] == str(tmp_path / "run")
    _check_tensorboard(tmp_path / "tb")
    _check_trace(tmp_path)
    if no_browser is not None:
        pytest.skip(f"the server's part passed; the page and the report were not: {no_browser}")


def _check_tensorboard(log_dir: Path) -> None:
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="the tensorboard package (TensorBoard's reader) is not installed",
    )
    reader = accumulator.EventAccumulator(str(log_dir))
    reader.Reload()
    tags = set(reader.Tags()["scalars"])
    assert {"loss", "rounds/anchor", "rounds/duration_ms"} <= tags
    assert {f"rank{r}/{name}" for r in range(3) for name in ("samples_per_s", "share")} <= tags
    assert len(reader.Scalars("loss")) == EPOCHS  # one per epoch


def _check_trace(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert main(["timeline", str(tmp_path / "run"), "--chrome", str(out)]) == 0
    events = json.loads(out.read_text(encoding="utf-8"))["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"coordinator", "rank 0", "rank 1", "rank 2"}
    trained = {e["pid"] for e in events if e["ph"] == "X" and e["name"].startswith("train e")}
    assert trained == {1, 2, 3}
