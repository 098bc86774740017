"""Lifetimes and stops: one owner for every process, and what a signal does.

Rules:

- The launching process owns the run: ``elche.train`` in the user's script
  (a local run), or each rank's own process under ``elche run``/``torchrun``,
  whose rank 0 also owns the coordinator. No elche process outlives it.
- SIGINT, SIGTERM and SIGHUP (``STOP_SIGNALS``) are the launching process's
  to act on. Ctrl-C sends SIGINT to the whole process group, and a closed
  terminal SIGHUP (the shell passes it to each of its jobs' groups), so the
  coordinator runs in a process group of its own (SIGTERM sent to it alone
  asks it to stop, as if the launcher had), the fork server ignores all
  three (``elche.runtime.forkserved``), and the ranks of a local run fork
  with them ignored and leave for process groups of their own: nothing dies
  mid-write, and the launcher orders the stop. SIGHUP stops the run as
  SIGTERM does; under ``nohup`` it is ignored, and stays so. A terminal
  that hung up fails every write: the launcher's stdout and stderr on it
  then go to ``/dev/null``.
- Every launcher marks each stop of its run before it orders it
  (``mark_stop``), in a pipe whose read end each of its ranks holds
  (``elche run``'s: ``RUN_STOPS_ENV``; a local run's: ``marked_stop_signals``).
  A rank that gets a stop signal waits up to ``STOP_MARK_GRACE_S`` for that
  mark (``stop_came_alone``). Marked, the signal went to every process of
  the run (systemd stopping a service, Slurm's ``scancel``, ``pkill -f``),
  the launcher included: the rank leaves the stop to it, which saves the
  run. Unmarked, it was sent to that rank alone (``kill PID``, a scheduler
  ending one rank): the rank leaves the run as a lost rank does, its data
  trained by the others (``leave_on_stop_signals``, ``leave_run``); but
  rank 0 of ``elche run``, the coordinator's host, stops the whole run,
  which cannot go on without it. Under torchrun, whose agent signals every
  worker, each stop signal is the run's.
- The launcher asks the coordinator to stop with a ``stop REASON`` line on
  its stdin; the coordinator turns it into ``StopRequested``: a training run
  saves a bundle (``SaveReason.GRACEFUL_SHUTDOWN``) and the ranks exit. Then
  ``elche.train`` raises ``Interrupted``. A second Ctrl-C stops at once:
  ``KeyboardInterrupt``, the children killed, nothing saved.
- The coordinator's stdin reaching EOF means its launcher is gone (even by
  SIGKILL): it stops the same way and exits within ``ORPHAN_GRACE_S``
  whatever happens. Each rank watches its launcher's pid
  (``watch_launcher``) and exits within ``ORPHAN_GRACE_S`` of its death;
  normally it has saved and exited well before, told by the coordinator.

Theory of operation. ``PR_SET_PDEATHSIG`` is not used: it fires when the
*thread* that started a child exits (``elche.train`` called from a worker
thread would kill its run when that thread ends), and a local run's ranks
are children of the multiprocessing fork server, not of the launcher; the
fork server lives until its last client (the ranks included) exits. A pipe's
EOF (the coordinator) and a pidfd (Linux; a 0.2 s poll elsewhere) follow the
launcher itself, on every way it can die.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import select
import signal
import stat
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from multiprocessing.connection import Connection
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

__all__ = [
    "BEACON_S",
    "CTRL_Z_LINE",
    "EXIT_ORPHANED",
    "ORPHAN_GRACE_S",
    "RANKS_MET_ENV",
    "RANKS_WAITING_ENV",
    "RANK_EXITS_ENV",
    "RESUME_HINT",
    "RUN_STOPS_ENV",
    "SERVER_GONE",
    "SILENT_PROCESS_S",
    "STOP_MARK_GRACE_S",
    "Forked",
    "Interrupted",
    "StopSignals",
    "announce",
    "beacon",
    "ctrl_z_said",
    "drop_hung_up_streams",
    "end_as_signalled",
    "held_stop_signals",
    "ignore_stop_signals",
    "launcher_stream",
    "launcher_streams",
    "leave_on_stop_signals",
    "leave_run",
    "mark_stop",
    "marked_stop_signals",
    "process_state",
    "relay_stop_signals",
    "say_ranks_met",
    "say_waiting",
    "stop_came_alone",
    "stop_marks",
    "take_environment",
    "take_streams",
    "watch_launcher",
]

# How often a rank process that a launcher waits on says it runs (``beacon``), and
# how long without a word says it does not: stopped, or its interpreter held.
BEACON_S = 0.5
SILENT_PROCESS_S = 3.0
# Time an orphaned process has to finish its save before it ends itself; the
# acceptance bound is 10 s from the launcher's death to no process left.
ORPHAN_GRACE_S = 6.0
# Exit status of a process that ended itself because its launcher was gone.
EXIT_ORPHANED = 4
# How often the fallback (no pidfd) looks whether the launcher still lives.
WATCH_EVERY_S = 0.2
# SIGHUP: the terminal closed. Its default ends the launcher and (in its group)
# a local run's ranks and fork server unsaved; as a stop, the run is saved.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Under ``elche run``, in rank 0 alone: the file descriptor of a pipe's write end,
# where rank 0 writes once every rank has met in torch's rendezvous. Until then a
# rank that fails leaves the others waiting there for it, so the launcher stops
# them all; after, the run survives the loss. (A pipe, not a file in the run
# directory: a full disk, a tmp cleaner or another run in an exported
# ``ELCHE_RUN_DIR`` took a formed run for one that had not formed.)
RANKS_MET_ENV = "ELCHE_RANKS_MET"
# Under ``elche run``, in rank 0 alone: the file descriptor where the launcher
# reports each other rank's exit, one ``RANK CODE`` line each. Rank 0 passes
# them on to its coordinator, which loses the rank at once: its heartbeats
# would take ``heartbeat_timeout_s`` (30 s by default), the run waiting for it.
RANK_EXITS_ENV = "ELCHE_RANK_EXITS"
# Under ``elche run``, in every rank: the file descriptor where the rank says it
# has reached torch's rendezvous (``say_waiting``). A rank that ended before the
# run formed, even with status 0 (its script never called ``elche.train``),
# leaves those there waiting for it; once one is, the launcher stops them.
RANKS_WAITING_ENV = "ELCHE_RANKS_WAITING"
# Under ``elche run``, in every rank: the file descriptor of a pipe's read end;
# the launcher writes to the pipe before it passes a stop signal on to the
# ranks. A rank whose stop signal finds it empty was sent the signal alone.
RUN_STOPS_ENV = "ELCHE_RUN_STOPS"
# How long a rank that got a stop signal waits for its launcher's mark before it
# takes the signal for one sent to it alone. Sent to every process at once (systemd
# stopping a service, Slurm's scancel, ``pkill -f train.py``), the signal may reach a
# rank before its launcher has marked it, within milliseconds (as the signal is
# delivered: ``marked_stop_signals``).
# A rank sent a signal alone leaves this much later; one the run's stop reached
# goes on as soon as the mark comes.
STOP_MARK_GRACE_S = 1.0


def _resume_from(stem: str) -> str:
    return f"resume_from={stem!r}"


# How the one line an interrupted run prints says to resume bundle ``stem``:
# ``elche demo`` sets its own command line here; None where nothing resumes the
# run (``elche bench``'s runs): the line says where it is saved, not how to resume.
RESUME_HINT: ContextVar[Callable[[str], str] | None] = ContextVar(
    "RESUME_HINT", default=_resume_from
)


class Interrupted(SystemExit, KeyboardInterrupt):
    """``elche.train`` was stopped by SIGINT, SIGTERM or SIGHUP; what it trained is saved.

    Raised once the ranks have written the bundle (``bundle``, resumable with
    ``resume_from=bundle``; None when the run had not formed yet) and one line
    on stderr said where. It is a ``KeyboardInterrupt``, so ``except
    KeyboardInterrupt`` catches it, and a ``SystemExit`` with code 130
    (SIGINT), 143 (SIGTERM) or 129 (SIGHUP): uncaught, the script stops
    without a traceback and with the exit status a shell gives a process
    those signals end.

    Attributes:
        signal: the signal that stopped the run.
        bundle: the saved bundle's stem, or None if nothing was saved.
        result: the run's ``TrainResult`` (its summary says
            ``saved_and_shutdown``), or None where this process has none.
    """

    def __init__(self, signum: int, bundle: str | None, result: Any = None) -> None:
        super().__init__(128 + signum)
        self.signal = signal.Signals(signum)
        self.bundle = bundle
        self.result = result

    def __str__(self) -> str:
        saved = f"saved under {self.bundle}" if self.bundle else "nothing saved"
        return f"interrupted by {self.signal.name}; {saved}"


def announce(
    stop: Interrupted,
    resumed_from: str | None = None,
    *,
    earlier: bool = False,
    unsaved: str | None = None,
) -> None:
    """The one line on stderr an interrupted run prints: where it is and how to resume
    (``RESUME_HINT``; ``resumed_from``: the bundle the run started from, which a stop
    saving nothing leaves as it was; ``earlier``: ``stop.bundle`` is a checkpoint this
    run committed before, its stop's own save having failed; ``unsaved``: why a run
    that began and has no result saved nothing). A run with neither a result nor
    ``unsaved`` had not formed."""
    name = stop.signal.name
    summary = getattr(stop.result, "summary", None) or {}
    if summary.get("outcome") == "failed":  # it trained; none fit
        unsaved = str(summary.get("reason"))
    if earlier and stop.bundle is not None:
        why = unsaved or summary.get("reason")
        text = (
            f"elche: interrupted by {name}; the stop's save failed ({why}), "
            f"but the run's last checkpoint, {stop.bundle}, is whole{_resume(stop.bundle)}"
        )
    elif stop.bundle is None and unsaved is not None:
        text = f"elche: interrupted by {name}; nothing could be saved: {unsaved}"
    elif stop.bundle is None:
        text = f"elche: interrupted by {name} before the run formed; nothing was saved"
    else:
        text = f"elche: interrupted by {name}; the run is saved under {stop.bundle}"
        text += _resume(stop.bundle, ";")
    if stop.bundle is None and resumed_from is not None:
        text += f"; the bundle it resumed from is as it was{_resume(resumed_from)}"
    print(text, file=sys.stderr, flush=True)


def _resume(stem: str, after: str = ":") -> str:
    """How ``announce``'s line goes on to say to resume bundle ``stem`` (``RESUME_HINT``):
    ``after`` and ``resume with: …``, or nothing where nothing resumes the run."""
    hint = RESUME_HINT.get()
    return "" if hint is None else f"{after} resume with: {hint(stem)}"


class StopSignals:
    """While entered, SIGINT, SIGTERM and SIGHUP (``STOP_SIGNALS``) stop the run cleanly.

    Only the main thread may set signal handlers: entered on another thread,
    it takes the signals ``relay_stop_signals`` catches on the main thread
    (``elche.Session`` trains on a thread of its own). Without a relay the
    signals act as before: Ctrl-C raises ``KeyboardInterrupt`` on the main
    thread; if that ends it (uncaught), the interpreter, before it waits for
    the other threads, hands this the SIGINT (``_on_main_thread_end``).

    The first signal is recorded in ``received`` (and passed to
    ``on_signal``, run in the signal handler: keep it short); a later SIGINT
    raises ``KeyboardInterrupt`` when ``force_on_repeat``, and any other
    later signal is ignored (a SIGTERM may come twice at once). A
    signal the process ignored already stays ignored. The previous handlers
    come back on exit.

    Args:
        on_signal: called with the first signal's number.
        force_on_repeat: a later SIGINT raises ``KeyboardInterrupt``.
    """

    def __init__(
        self, *, on_signal: Callable[[int], None] | None = None, force_on_repeat: bool = True
    ) -> None:
        self.received: int | None = None
        self._on_signal = on_signal
        self._force = force_on_repeat
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            _quiet_interrupted_threads()
            if _RELAYS:
                _RELAYS[-1].attach(self)
            else:
                _wait_main_thread_end(self)
            return self
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        for relay in _RELAYS:
            relay.detach(self)
        _UNRELAYED.pop(self, None)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            drop_hung_up_streams()
        if self.received is not None:
            # Only a person presses Ctrl-C twice. Tools send SIGTERM, some of them
            # twice (``timeout`` to its child and then to its group), and end a
            # stop that takes too long with SIGKILL themselves.
            if self._force and signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.received = signum
        if self._on_signal is not None:
            self._on_signal(signum)


# ``StopSignals`` entered on threads but the main one, with no relay, each with the
# end of its thread (``_end_of_this_thread``): the SIGINT of a main thread that
# Ctrl-C ends is theirs.
_UNRELAYED: dict[StopSignals, threading.Event] = {}


def _wait_main_thread_end(taker: StopSignals) -> None:
    """Give ``taker`` the SIGINT of a main thread that Ctrl-C ends (``_on_main_thread_end``).

    ``threading._register_atexit`` (CPython's, since 3.9; ``concurrent.futures``
    uses it) runs a function when the main thread is done, before the
    interpreter waits for the others: ``atexit`` runs after, and a thread
    joining the main thread wakes only after an executor's threads ended.
    Without it, a Ctrl-C leaves the run training as before.
    """
    _hook_main_thread_end()
    _UNRELAYED[taker] = _end_of_this_thread()


@functools.cache
def _hook_main_thread_end() -> None:
    register = getattr(threading, "_register_atexit", None)
    with contextlib.suppress(RuntimeError):  # (the interpreter is shutting down)
        if register is not None:
            register(_on_main_thread_end)


def _on_main_thread_end() -> None:
    """The main thread is done: if its uncaught ``KeyboardInterrupt`` ended it (Ctrl-C,
    which it alone hears), the runs training on other threads stop as that SIGINT
    stops one on the main thread. The interpreter then waits for their threads.

    A main thread that ended otherwise (its code done, the run left to its thread)
    leaves them training.
    """
    if not isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
        return
    stopping = dict(_UNRELAYED)
    for taker in stopping:
        if taker.received is None:
            taker._handle(signal.SIGINT, None)
    # Python 3.11's ``Thread.join``, interrupted, marks the thread it waited for as
    # ended, and the interpreter would then exit under the run's stop, cutting it
    # short: wait for each thread as the interpreter waits for a thread that runs.
    # A second Ctrl-C ends the wait, and the process.
    for ended in stopping.values():
        ended.wait()


@functools.cache
def _quiet_interrupted_threads() -> None:
    """A thread that an uncaught ``Interrupted`` ends ends quietly, as one that
    ``SystemExit`` ends: the one line said the stop, where Python's hook, which
    spares ``SystemExit`` alone, printed a traceback. A hook of the script's own
    (``threading.excepthook`` set) is left as it is."""
    if threading.excepthook is not threading.__excepthook__:
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is None or not issubclass(args.exc_type, Interrupted):
            threading.__excepthook__(args)

    threading.excepthook = hook


class _Marker:
    """An object the thread-local data of one thread alone holds."""


_THIS_THREAD = threading.local()


def _end_of_this_thread() -> threading.Event:
    """An event set once the calling thread has ended: its thread-local data, dropped
    then, held the only reference to a marker whose finalizer sets it."""
    ended: threading.Event | None = getattr(_THIS_THREAD, "ended", None)
    if ended is None:
        ended = threading.Event()
        marker = _Marker()
        weakref.finalize(marker, ended.set).atexit = False
        _THIS_THREAD.marker, _THIS_THREAD.ended = marker, ended
    return ended


def drop_hung_up_streams() -> None:
    """Point stdout and stderr at ``/dev/null`` where they are a terminal that hung up.

    After a hang-up every write to the terminal fails (``EIO``): the run's last
    lines (where its bundle is, the report) would end the stop in an
    ``OSError``. Nobody reads them now, as under ``nohup``; a stream that is a
    file or a pipe, or a SIGHUP sent by hand, leaves them as they are.
    """
    for fd in (1, 2):
        try:
            os.write(fd, b"")
        except OSError as exc:
            if exc.errno != errno.EIO:
                continue
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)


class _Relay:
    """The main thread's stop signals, for ``StopSignals`` entered on other threads."""

    def __init__(self) -> None:
        self._takers: list[StopSignals] = []
        self._first: int | None = None  # the first signal caught
        self._kept = False  # it came before any taker, which has not had it yet

    def attach(self, taker: StopSignals) -> None:
        self._takers.append(taker)
        if self._kept and self._first is not None:
            self._kept = False
            taker._handle(self._first, None)

    def detach(self, taker: StopSignals) -> None:
        if taker in self._takers:
            self._takers.remove(taker)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self._takers:
            self._first = signum if self._first is None else self._first
            for taker in list(self._takers):
                taker._handle(signum, frame)
        elif self._first is None:
            self._first, self._kept = signum, True
        else:
            raise KeyboardInterrupt  # another signal, and no run to stop cleanly


_RELAYS: list[_Relay] = []


@contextlib.contextmanager
def relay_stop_signals() -> Iterator[None]:
    """On the main thread: ``STOP_SIGNALS`` go to a ``StopSignals`` on another thread.

    While entered, a stop signal is handed to every ``StopSignals`` entered on
    another thread (``elche.Session``'s training thread), which stops the run
    cleanly as on the main thread; one that comes before any is entered is
    kept for the first. Elsewhere than the main thread it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    relay = _Relay()
    previous = {
        sig: signal.signal(sig, relay.handle)
        for sig in STOP_SIGNALS
        if signal.getsignal(sig) is not signal.SIG_IGN
    }
    _RELAYS.append(relay)
    try:
        yield
    finally:
        _RELAYS.remove(relay)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# What a launcher says when Ctrl-Z stops it (``ctrl_z_said``).
CTRL_Z_LINE = (
    "elche: Ctrl-Z stopped this launcher only: the run's ranks and coordinator train on "
    "without it (fg follows the run again; Ctrl-C then stops it, saved)"
)


@contextlib.contextmanager
def ctrl_z_said() -> Iterator[None]:
    """While entered on the main thread, Ctrl-Z (SIGTSTP) says ``CTRL_Z_LINE``, then
    stops this process as Ctrl-Z does.

    A launcher's ranks and coordinator run in process groups of their own (the
    stop signals are the launcher's to order), so the terminal's Ctrl-Z stops
    the launcher's group alone: the shell said "Stopped" while the run trained
    on, unsaid. Stopping them too would take more than the signal: a pause
    longer than ``heartbeat_timeout_s`` would make each side take the other
    for lost. Where Ctrl-Z is ignored or the script handles it, it is left so.
    """
    tstp = getattr(signal, "SIGTSTP", None)
    if (
        tstp is None
        or threading.current_thread() is not threading.main_thread()
        or signal.getsignal(tstp) is not signal.SIG_DFL  # ignored, or the script's own
    ):
        yield
        return

    def on_ctrl_z(signum: int, frame: FrameType | None) -> None:
        print(CTRL_Z_LINE, file=sys.stderr, flush=True)
        signal.signal(tstp, signal.SIG_DFL)
        try:
            os.kill(os.getpid(), tstp)  # stopped here until SIGCONT (the shell's fg or bg)
        finally:
            signal.signal(tstp, on_ctrl_z)

    signal.signal(tstp, on_ctrl_z)
    try:
        yield
    finally:
        signal.signal(tstp, signal.SIG_DFL)


@contextlib.contextmanager
def held_stop_signals() -> Iterator[None]:
    """While entered (on the main thread), a stop signal (``STOP_SIGNALS``) waits: on
    a clean exit it is raised again, to the handlers of before.

    For a step that a stop must not cut in two, such as starting processes
    that only their parent's cleanup ends, the parent knowing none of them
    yet. A second Ctrl-C ends the wait at once (``StopSignals``). Elsewhere
    than the main thread it holds nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with StopSignals() as held:
        yield
    if held.received is not None:
        signal.raise_signal(held.received)


def ignore_stop_signals() -> None:
    """``STOP_SIGNALS`` do nothing here: the launching process orders the stop."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def stop_marks() -> tuple[int, int]:
    """A pipe where a launcher marks its run's stops (``mark_stop``), for its ranks to
    look in (``stop_came_alone``): its read end and its write end."""
    marks, marks_out = os.pipe()
    os.set_blocking(marks_out, False)  # (drained by no one: a full pipe is marked already)
    return marks, marks_out


def mark_stop(marks_out: int) -> None:
    """Mark a stop of the run in the ranks' pipe (``stop_marks``' write end), before it
    is ordered (run in the signal handler)."""
    with contextlib.suppress(OSError):  # (full: marked already; a byte stays there)
        os.write(marks_out, b"s")


@contextlib.contextmanager
def marked_stop_signals() -> Iterator[tuple[StopSignals, int]]:
    """A local run's launcher's ``StopSignals``, each stop marked first (``mark_stop``);
    and the read end of the marks' pipe, for each rank (``leave_on_stop_signals``).
    The pipe is closed on exit."""
    marks, marks_out = stop_marks()
    try:
        with (
            _marked_at_delivery(marks_out),
            ctrl_z_said(),
            StopSignals(on_signal=lambda _: mark_stop(marks_out)) as signals,
        ):
            yield signals, marks
    finally:
        os.close(marks)
        os.close(marks_out)


@contextlib.contextmanager
def _marked_at_delivery(marks_out: int) -> Iterator[None]:
    """While entered, each stop signal is marked (``mark_stop``) as it is delivered.

    Python runs a handler on the main thread between two bytecodes: one busy
    inside a single long C call (a hook's tensor operation) ran the
    launcher's handler, and so its mark, after the ranks' grace, and each
    rank left the run as if signalled alone. The interpreter's C handler
    writes each caught signal's number to the wakeup fd
    (``signal.set_wakeup_fd``) at once; a thread of this one reads it there
    and marks the stops. That thread needs the GIL: a C call that keeps it
    (few do; tensor operations release it) still delays the mark. On the
    main thread only, and where no one else (an event loop) has the wakeup
    fd: there the handler's mark stays the only one. A process forked
    meanwhile (a hook's fork-context pool) drops both (``_forget_wakeup``):
    its own signals are no stop of the run.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wake, wake_out = os.pipe()
    os.set_blocking(wake_out, False)  # (the C handler never waits on it)
    previous = signal.set_wakeup_fd(wake_out, warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous, warn_on_full_buffer=False)
        os.close(wake)
        os.close(wake_out)
        yield
        return
    _WAKEUP[:] = [wake, wake_out]
    stops = {int(sig) for sig in STOP_SIGNALS}
    done = threading.Event()

    def mark_delivered() -> None:
        while not done.is_set():
            caught = os.read(wake, 64)
            if stops.intersection(caught) and not done.is_set():
                mark_stop(marks_out)

    reader = threading.Thread(target=mark_delivered, name="elche-stop-marks", daemon=True)
    reader.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(-1)
        done.set()
        with contextlib.suppress(OSError):  # (full: the reader is awake already)
            os.write(wake_out, b"\0")
        reader.join()
        _WAKEUP.clear()
        os.close(wake)
        os.close(wake_out)


# The stop marks' wakeup pipe while a launcher has it (``_marked_at_delivery``).
_WAKEUP: list[int] = []


def _forget_wakeup() -> None:
    """In a child forked from a launcher: the launcher's wakeup fd is not its own."""
    if _WAKEUP:
        with contextlib.suppress(ValueError):  # (forked off the main thread)
            signal.set_wakeup_fd(-1)
        for fd in _WAKEUP:
            with contextlib.suppress(OSError):
                os.close(fd)
        _WAKEUP.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_wakeup)


def stop_came_alone(marks: int | None = None) -> bool:
    """Whether the stop signal this rank just got was sent to it alone, not to its launcher.

    Every stop of the run the launcher marks first (``mark_stop``) in the
    pipe whose read end is ``marks`` (under ``elche run``, the one
    ``RUN_STOPS_ENV`` names). A signal sent to every process of the run at
    once may come here before the launcher's mark, so a rank waits for it up
    to ``STOP_MARK_GRACE_S``; a signal still unmarked then came to this rank
    alone. Elsewhere (torchrun, whose agent stops the run by signalling every
    worker; a pipe this process no longer has), every stop signal is the
    run's. A second signal during the wait interrupts nothing: the caller's
    handler ignores it (the select goes on).
    """
    fd = _launchers_pipe(RUN_STOPS_ENV) if marks is None else marks
    if fd is None:
        return False
    try:
        readable, _, _ = select.select([fd], [], [], STOP_MARK_GRACE_S)
    except (OSError, ValueError):
        return False
    return not readable  # (the launcher's death, EOF, reads as its stop)


def _launchers_pipe(name: str) -> int | None:
    """The pipe end the launcher passed this process as environment variable ``name``,
    or None where there is none."""
    fd = os.environ.get(name, "")
    if not fd.isdigit():
        return None
    try:
        if not stat.S_ISFIFO(os.fstat(int(fd)).st_mode):
            return None  # (the script closed it, and the number went to another file)
    except OSError:
        return None
    return int(fd)


def leave_on_stop_signals(rank: int, launcher: str, marks: Connection) -> None:
    """A stop signal sent to this rank's process alone makes the rank leave the run
    (``leave_run``); one sent to the whole run, its launcher included (which marks it
    in the pipe ``marks`` reads), is ignored: the launcher stops the run through the
    coordinator. For a local run's rank, in a process group of its own, which its
    launcher never signals.

    The first signal decides (``stop_came_alone``); others, during its wait or
    after the run's stop, are ignored.
    """
    decided = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal decided
        if decided:
            return
        decided = True
        if stop_came_alone(marks.fileno()):
            leave_run(rank, signum, launcher)

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)


def leave_run(rank: int, signum: int, launcher: str) -> None:
    """A stop signal came to this rank alone: the rank leaves the run as a lost rank
    does (its launcher tells the coordinator at once, and its unfinished data goes to
    the others), saying so; its process ends by that signal (``end_as_signalled``).
    ``launcher``: what to signal to stop the whole run instead."""
    name = signal.Signals(signum).name
    line = (f"elche rank {rank}: {name} came to this rank alone: it leaves the run, which "
            f"goes on without it (to stop the whole run, signal {launcher})\n")  # fmt: skip
    with contextlib.suppress(OSError):  # (os.write: a print may be under way here)
        os.write(2, line.encode())
    end_as_signalled(signum)


def end_as_signalled(signum: int) -> None:
    """End this process at once, as stop signal ``signum`` does by default: its
    launcher sees it killed by that signal. Nothing here is cleaned up, as for
    a rank SIGKILLed: the run goes on without it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        signal.raise_signal(signum)
    os._exit(128 + signum)  # (off the main thread: the shell's status for that signal)


def take_environment(env: Mapping[str, str]) -> None:
    """Make ``env`` this process's environment.

    A process forked from the fork server inherits the server's environment,
    from when it started (the first run of the launching process); the
    launcher's environment at launch, ``env``, is the one that counts.
    """
    os.environ.clear()
    os.environ.update(env)


def launcher_stream(fd: int) -> Connection:
    """A copy of this process's file descriptor ``fd`` (1: stdout, 2: stderr; a pipe's
    end, ``marked_stop_signals``), to send to a process it starts.

    A process forked from the fork server inherits the server's streams, as
    they were when it started (the first run of the launching process,
    maybe under another redirection since); it takes the launcher's with
    ``take_streams``.
    """
    return Connection(os.dup(fd))


@contextlib.contextmanager
def launcher_streams(start_method: str) -> Iterator[tuple[Connection, ...]]:
    """This process's stdout and stderr (``launcher_stream``) for the processes
    started inside, if they fork from the fork server (none otherwise: a
    spawned process inherits them); closed here once they are started."""
    forked = start_method == "forkserver"
    streams = (launcher_stream(1), launcher_stream(2)) if forked else ()
    try:
        yield streams
    finally:
        for stream in streams:
            stream.close()


def take_streams(streams: Sequence[Connection], *, first_fd: int = 1) -> None:
    """Make ``streams`` (``launcher_streams``, or pipe ends) this process's
    file descriptors from ``first_fd`` on, in order; close them."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, stream in enumerate(streams, start=first_fd):
        os.dup2(stream.fileno(), fd)
        stream.close()


def say_ranks_met() -> None:
    """Rank 0, past torch's rendezvous: tell a launcher that asked (``RANKS_MET_ENV``)."""
    _tell_launcher(RANKS_MET_ENV, b"m")


def say_waiting() -> None:
    """A rank at torch's rendezvous: tell a launcher that asked (``RANKS_WAITING_ENV``)."""
    _tell_launcher(RANKS_WAITING_ENV, b"w")


def _tell_launcher(name: str, what: bytes) -> None:
    """Write ``what`` to the pipe the launcher passed as ``name``, if it did."""
    fd = _launchers_pipe(name)
    if fd is not None:
        with contextlib.suppress(OSError):  # (a launcher gone: its ranks end)
            os.write(fd, what)


def beacon(beat: Callable[[], None]) -> None:
    """Call ``beat`` every ``BEACON_S`` on a daemon thread, for as long as this process
    runs: for the launcher waiting on it, which tells a hung rank (declared lost, and
    silent here too) from one cut off from the run (declared lost, but running: it
    ends itself once it hears so, or gives its coordinator up). ``beat`` raising
    ``OSError`` (nobody listens any more) ends the beats."""

    def beats() -> None:
        with contextlib.suppress(OSError):
            while True:
                beat()
                time.sleep(BEACON_S)  # the beacon's period, not synchronisation

    threading.Thread(target=beats, name="elche-beacon", daemon=True).start()


def watch_launcher(
    pid: int, *, on_gone: Callable[[], None] | None = None, grace_s: float = ORPHAN_GRACE_S
) -> None:
    """On a daemon thread: once process ``pid`` is gone, end this process.

    ``on_gone`` runs first (e.g. to ask the coordinator to stop); then this
    process has ``grace_s`` to finish on its own before it exits with
    ``EXIT_ORPHANED``.
    """

    def watch() -> None:
        _wait_gone(pid)
        if on_gone is not None:
            with contextlib.suppress(Exception):  # the exit below must happen
                on_gone()
        time.sleep(grace_s)  # the grace period, not synchronisation
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="elche-launcher-watch", daemon=True).start()


def _wait_gone(pid: int) -> None:
    """Block until process ``pid`` has exited (a zombie counts as gone)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # not Linux >= 5.3: poll
        while pid_alive(pid):
            time.sleep(WATCH_EVERY_S)
        return
    try:
        select.select([fd], [], [])  # readable once the process exits
    finally:
        os.close(fd)


# ``multiprocessing``'s exit code for every child of a fork server that died, whether
# the child did or not: it reads each child's status from its server.
SERVER_GONE = 255


class Forked:
    """A process the fork server started, followed past that server's death.

    ``multiprocessing`` learns a forked process's end from its fork server; a
    server that dies (killed, the OOM killer) reads as ``SERVER_GONE`` for
    every child, which it then no longer signals. A local run's launcher took
    each rank and the coordinator for lost though they trained on: it started
    a second coordinator beside the first, and the run failed with no rank
    left to write the model. Past the server's death the process is followed
    by its pid, until it is seen gone (never again after: the pid may be
    another's by then); its exit code is unknown (``known_exitcode`` None).
    """

    def __init__(self, process: Any) -> None:
        self.process = process
        self.pid: int = process.pid
        found = process_state(self.pid)
        self._server = found[1] if found else None  # its parent: the fork server
        self._gone = False  # seen ended after its server's death

    def _orphaned(self) -> bool:
        """The server died, and the process lives on (re-parented, no zombie)."""
        if self._gone or self.process.exitcode != SERVER_GONE:
            return False
        if _running(self.pid):
            return True
        self._gone = True
        return False

    @property
    def exitcode(self) -> int | None:
        """Its exit code (negative: the signal that ended it), or None while it runs."""
        return None if self._orphaned() else self.process.exitcode

    @property
    def known_exitcode(self) -> int | None:
        """Its exit code, None while it runs or where its server died with it unknown."""
        code = self.exitcode
        if code != SERVER_GONE or self._server is None:  # (the supervision's every tick)
            return code
        return code if _running(self._server) else None

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds (None: for ever) for the process to end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.process.join(timeout)  # (returns at the server's death too)
        while self._orphaned() and (deadline is None or time.monotonic() < deadline):
            time.sleep(WATCH_EVERY_S)  # polling a process that is not ours, bounded

    def kill(self) -> None:
        if self._orphaned():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        elif not self._gone:
            self.process.kill()


def process_state(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter (``Z``: a zombie) and parent's pid, from
    ``/proc``; None where it is gone or there is no ``/proc``."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = status.rsplit(")", 1)[1].split()  # after the name: state, ppid, ...
    return fields[0], int(fields[1])


# Whether this system has ``/proc`` (looked at once: ``Forked`` asks every tick).
_PROC = Path("/proc/self/stat").exists()


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    if not _PROC:  # the signal test, a zombie counted alive
        return pid_alive(pid)
    found = process_state(pid)
    return found is not None and found[0] != "Z"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
