"""``elche bench`` stopped by Ctrl-C, SIGTERM or SIGHUP keeps what it measured.

End to end, the bench CLI runs in a session of its own on a tiny suite (solo,
cadence, torch DDP); the test signals its whole process group, as Ctrl-C
would, once cadence's run has finished an epoch (its timeline's first
``EpochEnd``), or closes the terminal of a bench whose DDP cell is next,
then finds every process of the session by its id (``test_lifetimes``). The
others stop a fake measuring step in the CLI's own process, as the signal's
handler would (``test_bench_storage``). Before, nothing was written until the
last run was over: a stopped bench lost every run it had measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import elche.bench
import elche.bench.charts
import elche.bench.runner
from elche.bench import suites
from elche.bench.kept_weights import KeepWeights
from elche.cli import endings, main
from tests.bench.test_bench_storage import FAKE
from tests.bench.test_metrics import fake_run
from tests.promises.test_lifetimes import (
    MID_RUN_WITHIN_S,
    TAKE_THE_TERMINAL,
    kill_session,
    show_terminal,
    wait_session_gone,
)

# Cadence trains long enough (20 epochs of ~0.1 s) that the signal, sent at its
# first epoch's end, finds it training.
SCRIPT = """
import sys
from elche.bench import suites
from elche.bench.suites import Suite, WorkloadPlan
from elche.cli import main

if __name__ == "__main__":
    suites.SUITES["quick"] = Suite(
        name="quick", workloads=(WorkloadPlan("digits-logreg", epochs=20),),
        rigs=((1.0, 0.5),), systems=("cadence", "torch-ddp"), capacity_s=0,
    )
    sys.exit(main(["bench", "--suite", "quick", "--no-progress", *sys.argv[1:]]))
"""
NOT_RUN = ["digits-logreg [1,0.5] cadence (repeat 1)", "digits-logreg [1,0.5] torch-ddp (repeat 1)"]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_mid_bench_writes_the_runs_it_measured_and_exits_130(tmp_path: Path) -> None:
    sig, code, json_out = signal.SIGINT, 130, True  # SIGTERM's 143 is the next test's
    out = tmp_path / "bench"
    script = tmp_path / "bench.py"
    script.write_text(SCRIPT)
    # Short: the fork server's socket goes in it, and an AF_UNIX path holds 107 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="eb-"))
    env = dict(os.environ, TMPDIR=str(scratch), PYTHONUNBUFFERED="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    args = [sys.executable, str(script), "--out", str(out), *(["--json"] if json_out else [])]
    with (tmp_path / "stderr").open("w+") as stderr:
        proc = subprocess.Popen(
            args, start_new_session=True, env=env, text=True, cwd=tmp_path,
            stdout=subprocess.PIPE, stderr=stderr,
        )  # fmt: skip
        try:
            _wait_for(proc, out / "runs" / "01-digits-logreg-cadence" / "timeline.jsonl")
            # Written after each run: a bench killed outright keeps what it measured.
            so_far = json.loads((out / "results.json").read_text())
            assert [r["system"] for r in so_far["runs"]] == ["solo"]
            assert so_far["interrupted"] is None
            assert [cell["cell"] for cell in so_far["not_run"]] == NOT_RUN
            os.killpg(proc.pid, sig)  # Ctrl-C reaches every process of the group
            stdout, _ = proc.communicate(timeout=60)
            wait_session_gone(proc.pid)
        finally:
            kill_session(proc.pid)
            proc.kill()
            proc.communicate(timeout=30)
            shutil.rmtree(scratch, ignore_errors=True)
        stderr.seek(0)
        err = stderr.read()
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "resume" not in err, err[-3000:]  # the bench resumes none of its runs
    assert err.splitlines()[-1] == (
        f"elche bench: interrupted by {sig.name} after 1 of 3 runs; "
        f"what was measured is in {out}/results.json"
    )
    doc = json.loads((out / "results.json").read_text())
    assert doc["interrupted"] == sig.name
    assert [r["system"] for r in doc["runs"]] == ["solo"]
    assert doc["runs"][0]["error"] is None and doc["runs"][0]["wall_s"] > 0
    assert [cell["cell"] for cell in doc["not_run"]] == NOT_RUN  # the stopped run first
    assert [row["system"] for row in doc["rows"]] == ["solo"]
    assert (out / doc["charts"]["digits-logreg"]["loss"]).read_bytes()[:4] == b"\x89PNG"
    assert json.loads(stdout) == doc if json_out else stdout == ""
    assert (
        f"- **partial: interrupted by {sig.name} after 1 of 3 runs**; not run: "
        f"{', '.join(NOT_RUN)}\n"
    ) in (out / "report.md").read_text()


def _wait_for(proc: subprocess.Popen[str], path: Path, text: str = '"EpochEnd"') -> None:
    """Until ``path`` holds ``text`` (a timeline's first ``EpochEnd`` record)."""
    deadline = time.monotonic() + MID_RUN_WITHIN_S
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        assert proc.poll() is None, "the bench ended before it was interrupted"
        time.sleep(0.02)  # polling for a condition, with a deadline
    raise AssertionError(f"{path} never held {text}")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_closed_terminal_outside_an_elche_run_writes_what_was_measured_and_exits_129(
    tmp_path: Path,
) -> None:
    # The bench's terminal hangs up once solo is measured, torch DDP's cell next: the
    # kernel sends SIGHUP to the terminal's foreground process group (the bench, DDP's
    # ranks). Outside an elche run nothing handled it: the bench died there and then,
    # its results.json still saying it was running, DDP's cell not named as not run.
    out = tmp_path / "bench"
    script = tmp_path / "bench.py"
    ddp_only = SCRIPT.replace('("cadence", "torch-ddp")', '("torch-ddp",)')
    script.write_text(ddp_only.replace("epochs=20", "epochs=5"))  # DDP starts for seconds
    scratch = Path(tempfile.mkdtemp(prefix="eb-"))
    env = dict(os.environ, TMPDIR=str(scratch), PYTHONUNBUFFERED="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    args = [sys.executable, str(script), "--out", str(out), "--json"]
    master, terminal = os.openpty()
    with (tmp_path / "stdout").open("w") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-c", TAKE_THE_TERMINAL, *args], stdin=terminal, stdout=stdout,
            stderr=terminal, start_new_session=True, env=env, text=True, cwd=tmp_path,
        )  # fmt: skip
    os.close(terminal)
    shown = threading.Event()  # set: the terminal stops showing what the bench prints
    reader = threading.Thread(target=show_terminal, args=(master, shown), daemon=True)
    reader.start()
    try:
        _wait_for(proc, out / "results.json", '"system": "solo"')  # written after each run
        shown.set()
        reader.join()
        os.close(master)  # the terminal closes
        returncode = proc.wait(timeout=60)
        wait_session_gone(proc.pid)
    finally:
        kill_session(proc.pid)
        proc.kill()
        proc.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)
    printed = (tmp_path / "stdout").read_text()
    assert returncode == 129, printed[-3000:]  # its stderr went with the terminal
    doc = json.loads((out / "results.json").read_text())
    assert doc["interrupted"] == "SIGHUP"
    assert [r["system"] for r in doc["runs"]] == ["solo"]
    assert [cell["cell"] for cell in doc["not_run"]] == NOT_RUN[1:]
    assert json.loads(printed) == doc


def _measure_one_then(
    stop: Callable[[], None],
) -> Callable[..., list[dict[str, Any]]]:
    """A ``run_suite`` that measures solo, then is stopped by ``stop``."""

    def run_suite(suite: suites.Suite, **kwargs: Any) -> list[dict[str, Any]]:
        kwargs["on_run"](fake_run("solo", 2.0, final_loss=0.1, eval_=0.9))
        stop()
        raise AssertionError("not stopped")

    return run_suite


def test_sigterm_between_runs_writes_what_was_measured_and_exits_143(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def terminated() -> None:
        raise endings.Terminated  # SIGTERM's handler, in main, outside an elche run

    monkeypatch.setattr(elche.bench.runner, "run_suite", _measure_one_then(terminated))
    monkeypatch.setitem(suites.SUITES, "quick", FAKE)
    code = main(["bench", "--suite", "quick", "--no-progress", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 143  # it was 143 too, with nothing written
    assert captured.out == ""
    assert captured.err == (
        "elche bench: interrupted by SIGTERM after 1 of 2 runs; "
        f"what was measured is in {tmp_path}/results.json\n"
    )
    doc = json.loads((tmp_path / "results.json").read_text())
    assert (doc["interrupted"], [r["system"] for r in doc["runs"]]) == ("SIGTERM", ["solo"])
    assert doc["not_run"] == [
        {
            "workload": "digits-cnn", "system": "torch-ddp", "speeds": [1.0, 0.5],
            "link_mbit": None, "repeat": 0, "seed": 0,
            "cell": "digits-cnn [1,0.5] torch-ddp (repeat 1)",
        }
    ]  # fmt: skip
    assert (
        "- **partial: interrupted by SIGTERM after 1 of 2 runs**; "
        "not run: digits-cnn [1,0.5] torch-ddp (repeat 1)\n"
    ) in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("during", ["charts", "results.json"])
def test_a_second_ctrl_c_while_writing_leaves_each_file_whole(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    during: str,
) -> None:
    write_whole = elche.bench.write_whole

    def part_then_ctrl_c(path: Path, write: object, *, sync: bool) -> None:
        def part(f: Any) -> None:
            f.write(b'{"suite": ')
            raise KeyboardInterrupt

        write_whole(path, part, sync=sync)

    def ctrl_c(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    def twice() -> None:  # the first stops the suite, the second comes while it writes
        if during == "charts":
            monkeypatch.setattr(elche.bench.charts, "_figure", ctrl_c)
        else:
            monkeypatch.setattr(elche.bench, "write_whole", part_then_ctrl_c)
        raise KeyboardInterrupt

    monkeypatch.setattr(elche.bench.runner, "run_suite", _measure_one_then(twice))
    monkeypatch.setitem(suites.SUITES, "quick", FAKE)
    code = main(["bench", "--suite", "quick", "--no-progress", "--out", str(tmp_path)])
    assert code == 130
    assert capsys.readouterr().err == "elche bench: interrupted by SIGINT\n"
    # Each file is whole: results.json the one written after the last run.
    doc = json.loads((tmp_path / "results.json").read_text())
    assert (doc["interrupted"], [r["system"] for r in doc["runs"]]) == (None, ["solo"])
    assert [cell["system"] for cell in doc["not_run"]] == ["torch-ddp"]
    assert "- **partial: 1 of 2 runs so far" in (tmp_path / "report.md").read_text()
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


# Solo trains in the bench's own process: a signal it sends itself lands in the run.
SOLO_FIRST = suites.Suite(
    name="quick", workloads=(suites.WorkloadPlan("digits-logreg", epochs=2),),
    rigs=((1.0, 0.5),), systems=("torch-ddp",), capacity_s=0,
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _StoppedAtTheFirstEval(KeepWeights):
    """The bench's ``eval_fn`` (it runs at each epoch's end, in the clock), which sends
    this process SIGINT at the first, as Ctrl-C would."""

    def __call__(self, model: Any, dataset: Any) -> float:
        if not any(Path(self.directory).iterdir()):
            os.kill(os.getpid(), signal.SIGINT)
        return super().__call__(model, dataset)


def test_a_stopped_run_says_where_it_is_saved_not_how_to_resume_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its line said "resume with: resume_from=…", which the bench never does.
    monkeypatch.setattr(elche.bench.runner, "KeepWeights", _StoppedAtTheFirstEval)
    monkeypatch.setitem(suites.SUITES, "quick", SOLO_FIRST)
    code = main(["bench", "--suite", "quick", "--no-progress", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 130, err
    run_dir = tmp_path / "runs" / "00-digits-logreg-solo"
    assert "resume" not in err
    assert err.splitlines()[-2:] == [  # after its run's first line: where it is
        f"elche: interrupted by SIGINT; the run is saved under {run_dir}/checkpoint",
        "elche bench: interrupted by SIGINT after 0 of 2 runs; "
        f"what was measured is in {tmp_path}/results.json",
    ]
    assert (run_dir / "checkpoint.meta.json").exists()


@pytest.mark.parametrize(
    "system", ["solo", pytest.param("cadence", marks=[pytest.mark.slow, pytest.mark.integration])]
)
def test_a_stop_once_a_run_has_trained_waits_for_its_record(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    system: str,
) -> None:
    # SIGTERM while the bench evaluated a trained run's kept copies ended the evaluation:
    # the run, trained to its end, was not recorded, and was listed as not run.
    evaluate_kept = elche.bench.runner.evaluate_kept
    evaluated: list[str] = []

    def stopped_meanwhile(workload: str, directory: Path, *args: Any, **kwargs: Any) -> Any:
        evaluated.append(directory.parent.name)
        if directory.parent.name.endswith(system):
            os.kill(os.getpid(), signal.SIGTERM)  # the signal comes while it evaluates
        return evaluate_kept(workload, directory, *args, **kwargs)

    monkeypatch.setattr(elche.bench.runner, "evaluate_kept", stopped_meanwhile)
    suite = dataclasses.replace(SOLO_FIRST, systems=(system,)) if system != "solo" else SOLO_FIRST
    monkeypatch.setitem(suites.SUITES, "quick", suite)
    code = main(["bench", "--suite", "quick", "--no-progress", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    done = ["solo"] if system == "solo" else ["solo", system]
    assert code == 143, err
    assert evaluated == [f"{i:02d}-digits-logreg-{name}" for i, name in enumerate(done)]
    assert err.splitlines()[-1] == (
        f"elche bench: interrupted by SIGTERM after {len(done)} of 2 runs; "
        f"what was measured is in {tmp_path}/results.json"
    )
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["interrupted"] == "SIGTERM"
    assert [r["system"] for r in doc["runs"]] == done
    stopped = doc["runs"][-1]
    assert stopped["error"] is None and stopped["wall_s"] > 0 and stopped["total_s"] > 0
    # Every kept copy evaluated: accuracies, not the copies' numbers (0, 1).
    assert 0 < stopped["eval"] < 1
    assert [0 < epoch["eval"] < 1 for epoch in stopped["per_epoch"]] == [True, True]
    assert len(doc["not_run"]) == 2 - len(done)


def test_a_run_that_fails_once_a_stop_waits_is_recorded_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def stopped_then_refused(workload: str, directory: Path, *args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        raise OSError(28, "No space left on device", str(directory / "000000.kept.pt"))

    monkeypatch.setattr(elche.bench.runner, "evaluate_kept", stopped_then_refused)
    monkeypatch.setitem(suites.SUITES, "quick", SOLO_FIRST)
    code = main(["bench", "--suite", "quick", "--no-progress", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 143, err
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["interrupted"] == "SIGTERM"
    kept = tmp_path / "runs" / "00-digits-logreg-solo" / "kept" / "000000.kept.pt"
    assert [(r["system"], r["error"]) for r in doc["runs"]] == [
        ("solo", f"OSError: [Errno 28] No space left on device: '{kept}'")
    ]
    assert [cell["system"] for cell in doc["not_run"]] == ["torch-ddp"]
