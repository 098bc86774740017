"""How a joined rank ends when the run did not complete (``runtime.joined``).

It hears nothing of the run but its own rank's report; before, it returned as
if the run had completed whatever the report said.
"""

from __future__ import annotations

import signal

import pytest

from elche.core.errors import TrainingError
from elche.runtime.joined import _run_ended_short
from elche.runtime.lifetimes import Interrupted
from elche.runtime.plan import TrainResult

STEM = "/runs/a/bundle"


def result() -> TrainResult:
    return TrainResult(state_dict={}, summary={"joined_as": 3}, epochs=[], run_dir="/tmp/r")


def test_a_run_stopped_on_request_interrupts_it_naming_the_bundle(
    capsys: pytest.CaptureFixture[str],
) -> None:
    mine = result()
    with pytest.raises(Interrupted) as stop:
        _run_ended_short(3, {"stopped": "saved: graceful_shutdown"}, STEM, mine)
    assert (stop.value.signal, stop.value.bundle, stop.value.code) == (signal.SIGTERM, STEM, 143)
    assert stop.value.result is mine
    assert capsys.readouterr().err == (
        f"elche rank 3: the run stopped (graceful_shutdown) and is saved under {STEM} on its "
        "own host; this joined rank's model is no part of it\n"
    )


def test_a_run_saved_for_another_reason_returns_saying_where(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _run_ended_short(3, {"stopped": "saved: max_failure_exceeded"}, STEM, result())
    assert "the run stopped (max_failure_exceeded) and is saved under" in capsys.readouterr().err


def test_a_run_that_failed_on_the_users_code_raises_that_error() -> None:
    error = {"rank": 1, "epoch": 2, "error_type": "ValueError", "message": "bad batch"}
    report = {"stopped": "failed: ValueError: bad batch", "user_error": error}
    with pytest.raises(TrainingError, match="bad batch") as raised:
        _run_ended_short(3, report, STEM, result())
    assert (raised.value.rank, raised.value.error_type) == (1, "ValueError")


def test_a_run_that_failed_otherwise_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    report = {"stopped": "failed: graceful_shutdown: the bundle could not be written (…)"}
    _run_ended_short(3, report, STEM, result())
    assert capsys.readouterr().err == (
        "elche rank 3: the run failed: graceful_shutdown: the bundle could not be written (…)\n"
    )


def test_a_completed_run_says_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    _run_ended_short(3, {"stopped": "completed", "user_error": None}, STEM, result())
    assert capsys.readouterr().err == ""
