"""``elche.runtime.lifetimes``: the stop signals' handler and ``Interrupted``."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from elche.runtime import lifetimes
from elche.runtime.lifetimes import (
    RESUME_HINT,
    Interrupted,
    StopSignals,
    announce,
    marked_stop_signals,
    relay_stop_signals,
    stop_came_alone,
    stop_marks,
)


def test_interrupted_is_a_keyboard_interrupt_and_a_quiet_exit_status() -> None:
    stop = Interrupted(signal.SIGTERM, "/tmp/b")
    assert isinstance(stop, KeyboardInterrupt)
    assert isinstance(stop, SystemExit)
    assert stop.code == 143
    assert stop.signal is signal.SIGTERM
    assert str(stop) == "interrupted by SIGTERM; saved under /tmp/b"
    assert Interrupted(signal.SIGINT, None).code == 130


@pytest.mark.slow  # a Python subprocess
def test_uncaught_interrupted_ends_a_script_without_a_traceback() -> None:
    code = "from elche.runtime.lifetimes import Interrupted; raise Interrupted(2, 'b')"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )
    assert (done.returncode, done.stderr) == (130, "")


def test_stop_signals_records_the_first_signal_and_forces_on_the_second() -> None:
    before = signal.getsignal(signal.SIGINT)
    seen: list[int] = []
    with StopSignals(on_signal=seen.append) as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert seen == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGINT) is before


def test_stop_signals_takes_a_repeated_sigterm_as_the_same_stop() -> None:
    # ``timeout`` sends SIGTERM to its child and then to its group: it used to force.
    seen: list[int] = []
    with StopSignals(on_signal=seen.append) as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):  # a person's Ctrl-C still forces
            os.kill(os.getpid(), signal.SIGINT)
    assert seen == [signal.SIGTERM]


def test_stop_signals_can_ignore_repeats() -> None:
    with StopSignals(force_on_repeat=False) as signals:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
    assert signals.received == signal.SIGINT


def test_a_stop_the_launcher_got_is_marked_for_its_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stop signal sent to every process at once reaches the ranks too: the launcher's
    # mark tells them it is the run's, not theirs alone.
    monkeypatch.setattr(lifetimes, "STOP_MARK_GRACE_S", 0.0)  # unmarked: said at once
    with marked_stop_signals() as (signals, marks):
        assert stop_came_alone(marks)  # nothing marked: a rank's signal came to it alone
        signal.raise_signal(signal.SIGTERM)
        assert signals.received == signal.SIGTERM
        assert not stop_came_alone(marks)  # the launcher's own stop: the run's
        signal.raise_signal(signal.SIGTERM)  # (a second mark changes nothing)
        assert not stop_came_alone(marks)


def test_the_marks_wakeup_fd_is_put_back_and_anothers_is_left_alone() -> None:
    with marked_stop_signals():
        ours = signal.set_wakeup_fd(-1)
        assert ours != -1  # the launcher's marks at delivery
        signal.set_wakeup_fd(ours, warn_on_full_buffer=False)
    assert signal.set_wakeup_fd(-1) == -1  # put back
    mine, mine_out = os.pipe()
    os.set_blocking(mine_out, False)
    try:
        signal.set_wakeup_fd(mine_out)  # an event loop's, say
        with marked_stop_signals() as (signals, marks):
            assert signal.set_wakeup_fd(mine_out) == mine_out  # untouched
            signal.raise_signal(signal.SIGTERM)
            assert signals.received == signal.SIGTERM and not stop_came_alone(marks)
    finally:
        signal.set_wakeup_fd(-1)
        os.close(mine)
        os.close(mine_out)


def test_a_child_forked_while_stops_are_marked_neither_marks_them_nor_holds_them() -> None:
    # A child forked meanwhile (a hook's fork-context pool) kept the wakeup fd: its own
    # signals marked the run's stop, and the launcher's exit waited for it to end.
    said, said_out = os.pipe()
    go, go_out = os.pipe()
    with marked_stop_signals():
        pid = os.fork()
        if pid == 0:  # the child: no wakeup fd of the launcher's; waits for the test
            os.write(said_out, b"y" if signal.set_wakeup_fd(-1) == -1 else b"n")
            select.select([go], [], [], 30)
            os._exit(0)
        assert os.read(said, 1) == b"y"
    try:
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # the launcher left; the child lives
    finally:
        os.write(go_out, b"go")
        os.waitpid(pid, 0)
        for fd in (said, said_out, go, go_out):
            os.close(fd)


def test_a_process_that_outlives_its_fork_server_is_followed_by_its_pid() -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    killed: list[str] = []
    server_gone = SimpleNamespace(
        exitcode=lifetimes.SERVER_GONE, pid=sleeper.pid, join=lambda timeout=None: None,
        kill=lambda: killed.append("through the server"),
    )  # fmt: skip
    forked = lifetimes.Forked(server_gone)  # (its parent: this process, alive)
    try:
        assert forked.exitcode is None and forked.is_alive()
        forked.kill()  # the server cannot: its pid is killed
        sleeper.wait(timeout=10)  # (reaped: a zombie would count as ended too)
        assert killed == [] and forked.exitcode == lifetimes.SERVER_GONE
        forked.join()
        forked.kill()  # seen gone: never signalled again (its pid may be another's)
        assert killed == []
    finally:
        sleeper.kill()
        sleeper.wait()


def test_an_exit_code_read_once_the_fork_server_died_is_unknown() -> None:
    ended = subprocess.Popen(["true"])
    ended.wait()
    server = subprocess.Popen(["sleep", "60"])
    forked = lifetimes.Forked(SimpleNamespace(exitcode=lifetimes.SERVER_GONE, pid=ended.pid))
    forked._server = server.pid  # its fork server, as read at its start
    try:
        assert forked.known_exitcode == lifetimes.SERVER_GONE  # the server lives: a real 255
    finally:
        server.kill()
        server.wait()
    assert forked.exitcode == lifetimes.SERVER_GONE and forked.known_exitcode is None


def test_a_zombie_is_not_running() -> None:
    child = subprocess.Popen(["true"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    try:
        assert lifetimes.pid_alive(child.pid) and not lifetimes._running(child.pid)
    finally:
        child.wait()


def test_a_launcher_gone_counts_as_its_stop() -> None:
    marks, marks_out = stop_marks()
    os.close(marks_out)  # as its death closes it: EOF, at once
    try:
        assert not stop_came_alone(marks)
    finally:
        os.close(marks)


def _enter_on_a_thread(
    signals: StopSignals, entered: threading.Event, done: threading.Event
) -> None:
    with signals:
        entered.set()
        done.wait(timeout=30)


def test_relayed_stop_signals_reach_a_stop_signals_on_another_thread() -> None:
    before = signal.getsignal(signal.SIGTERM)
    seen: list[int] = []
    late = StopSignals(on_signal=seen.append, force_on_repeat=False)
    entered, done = threading.Event(), threading.Event()
    with relay_stop_signals():
        os.kill(os.getpid(), signal.SIGTERM)  # before the thread's handler exists: kept
        thread = threading.Thread(target=_enter_on_a_thread, args=(late, entered, done))
        thread.start()
        assert entered.wait(timeout=30)
        assert late.received == signal.SIGTERM  # handed over as it was entered
        os.kill(os.getpid(), signal.SIGINT)  # a repeat, ignored as this taker asks
        done.set()
        thread.join(timeout=30)
        with pytest.raises(KeyboardInterrupt):  # no taker now: the second signal forces
            os.kill(os.getpid(), signal.SIGINT)
    assert seen == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_interrupted_run_whose_bundle_did_not_fit_says_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    reason = "graceful_shutdown: the bundle could not be written (rank 0: OSError: [Errno 28] …)"
    result = SimpleNamespace(summary={"outcome": "failed", "reason": reason})
    announce(Interrupted(signal.SIGTERM, None, result))
    assert capsys.readouterr().err == (
        f"elche: interrupted by SIGTERM; nothing could be saved: {reason}\n"
    )
    announce(Interrupted(signal.SIGINT, None, None))
    assert "SIGINT before the run formed; nothing was saved" in capsys.readouterr().err


def test_a_resumed_run_stopped_before_it_saved_points_back_at_its_bundle(
    capsys: pytest.CaptureFixture[str],
) -> None:
    announce(Interrupted(signal.SIGINT, None, None), resumed_from="/tmp/b/run")
    assert capsys.readouterr().err == (
        "elche: interrupted by SIGINT before the run formed; nothing was saved; the bundle "
        "it resumed from is as it was: resume with: resume_from='/tmp/b/run'\n"
    )
    announce(Interrupted(signal.SIGINT, "/tmp/b/run", None), resumed_from="/tmp/b/run")
    assert "as it was" not in capsys.readouterr().err  # it saved anew: that is the line


def test_a_run_nothing_resumes_says_where_it_is_saved_and_no_more(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # elche bench's runs: "resume with: resume_from=…" was untrue there.
    token = RESUME_HINT.set(None)
    try:
        announce(Interrupted(signal.SIGINT, "/tmp/b/run", None))
        announce(Interrupted(signal.SIGTERM, "/tmp/b/run", None), earlier=True)
        announce(Interrupted(signal.SIGINT, None, None), resumed_from="/tmp/b/run")
    finally:
        RESUME_HINT.reset(token)
    assert capsys.readouterr().err.splitlines() == [
        "elche: interrupted by SIGINT; the run is saved under /tmp/b/run",
        "elche: interrupted by SIGTERM; the stop's save failed (None), but the run's last "
        "checkpoint, /tmp/b/run, is whole",
        "elche: interrupted by SIGINT before the run formed; nothing was saved; the bundle "
        "it resumed from is as it was",
    ]
