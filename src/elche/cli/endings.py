"""How an ``elche`` command ends when something outside it stops it.

- SIGINT (Ctrl-C), SIGTERM or SIGHUP (a closed terminal) that no run handles
  (start-up: torch's import, the data's load; ``elche compare``'s DDP phase;
  ``elche bench`` between runs and in its baselines): one line, ``elche CMD:
  interrupted by SIGINT``, and the status a shell gives a process that signal
  ends (130, 143, 129), with no traceback. ``stop_signals_raise`` turns SIGTERM
  and SIGHUP into ``Terminated``, a ``KeyboardInterrupt``, so they unwind
  through the same ``finally`` blocks as Ctrl-C; a SIGHUP the process ignores
  (``nohup``) stays ignored. A run's own handler
  (``elche.runtime.lifetimes.StopSignals``) takes over while it runs, and the
  ``elche.Interrupted`` it raises has said its line already.
- A stdout whose reader went away (``elche timeline RUN | head -1``): quiet,
  status 141 (SIGPIPE's), stdout pointed at /dev/null so the interpreter's
  last flush does not fail again (the recipe in the Python docs' ``signal``
  module notes).

``elche.cli.main`` applies them to every subcommand.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = [
    "Terminated",
    "interrupted_status",
    "stdout_closed",
    "stdout_to_devnull",
    "stop_signal",
    "stop_signals_raise",
]

# The stop signals ``stop_signals_raise`` turns into ``Terminated``; SIGINT raises
# Python's own ``KeyboardInterrupt``.
RAISED = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP outside a run's own handling: unwinds like Ctrl-C, through every
    ``finally``.

    Attributes:
        signal: the signal that raised it (SIGTERM unless given).
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.signal = signal.Signals(signum)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """While entered (on the main thread), SIGTERM and SIGHUP raise ``Terminated``, so
    start-up, a bench and a baseline's processes are cleaned up as for Ctrl-C; a run's
    own handler (``elche.runtime.lifetimes.StopSignals``) takes over while it runs.

    A signal the process ignores (``nohup``'s SIGHUP) stays ignored. A SIGHUP first
    points stdout and stderr at /dev/null where they are a terminal that hung up
    (``lifetimes.drop_hung_up_streams``): the command's last lines would fail there.
    """
    from elche.runtime.lifetimes import drop_hung_up_streams

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            drop_hung_up_streams()
        raise Terminated(signum)

    previous = {
        sig: signal.signal(sig, terminate)
        for sig in RAISED
        if signal.getsignal(sig) is not signal.SIG_IGN  # it stays so
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def interrupted_status(command: str, exc: KeyboardInterrupt) -> int:
    """The exit status of a command a signal stopped; one line on stderr unless a run
    already said where it stopped (``elche.Interrupted``)."""
    if isinstance(exc, SystemExit):  # elche.Interrupted: its line is said, its code 130/143/129
        return int(exc.code)  # type: ignore[arg-type]  # Interrupted's code is an int
    signum = stop_signal(exc)
    print(f"elche {command}: interrupted by {signum.name}", file=sys.stderr)
    return 128 + signum


def stop_signal(exc: KeyboardInterrupt) -> signal.Signals:
    """The signal that raised ``exc``: a run's ``elche.Interrupted`` and ``Terminated``
    name their own, any other ``KeyboardInterrupt`` is Ctrl-C's."""
    from elche.runtime.lifetimes import Interrupted

    if isinstance(exc, Interrupted | Terminated):
        return exc.signal
    return signal.SIGINT


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (the write end polls POLLERR)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no real stdout: a capture, a closed one
        return False


def stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush at exit does not
    fail again (the Python docs' recipe for SIGPIPE, ``signal`` module notes)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
