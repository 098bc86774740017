"""A real 3-rank run with its dashboard: /state.json and /metrics while it goes on.

The run is a child process (``python -c``) so that the test reads exactly what
a user sees on stderr: the run directory, the dashboard's address, the alert
lines the coordinator prints.
"""

from __future__ import annotations

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

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = """
import json, sys
import elche
from elche.workloads import digits

train_set, _ = digits.load_digits_split(seed=0)
result = elche.train(
    digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
    batch_size=32, epochs=int(sys.argv[2]), speeds=[1.0, 0.5, 0.25], progress=False,
    run_dir=sys.argv[1], dashboard="127.0.0.1:0", crash={1: 1.0},
)
print(json.dumps(result.summary))
"""


class _Run:
    """The child process and the stderr lines it printed so far."""

    def __init__(self, run_dir: Path, epochs: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(run_dir), str(epochs)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
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


def test_the_dashboard_serves_state_and_metrics_and_shows_a_lost_rank(tmp_path: Path) -> None:
    run = _Run(tmp_path / "run", epochs=6)
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
        out, _ = run.proc.communicate(timeout=120)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.communicate()
    run._reader.join(timeout=10)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["outcome"] == "completed" and summary["dead_ranks"] == [1]
    printed = [line for line in run.lines if line.startswith("elche [critical] rank_lost rank1 — ")]
    assert len(printed) == 1, run.lines  # printed once
    assert printed[0].endswith("(x1)")
