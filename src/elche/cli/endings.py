"""How an ``elche`` command ends when something outside it stops it.

- SIGINT (Ctrl-C) or SIGTERM that no run handles (start-up: torch's import,
  the data's load; ``elche compare``'s DDP phase): one line, ``elche CMD:
  interrupted by SIGINT``, and the status a shell gives a process that signal
  ends (130, 143), with no traceback. ``sigterm_raises`` turns SIGTERM into
  ``Terminated``, a ``KeyboardInterrupt``, so it unwinds through the same
  ``finally`` blocks as Ctrl-C. A run's own handler
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
    "sigterm_raises",
    "stdout_closed",
    "stdout_to_devnull",
    "stop_signal",
]


class Terminated(KeyboardInterrupt):
    """SIGTERM outside a run's own handling: unwinds like Ctrl-C, through every ``finally``."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While entered (on the main thread), SIGTERM raises ``Terminated``, so start-up
    and a baseline's processes are cleaned up as for Ctrl-C; a run's own handler
    (``elche.runtime.lifetimes.StopSignals``) takes over while it runs."""
    ignored = signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # it stays so
    if ignored or threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted_status(command: str, exc: KeyboardInterrupt) -> int:
    """The exit status of a command a signal stopped; one line on stderr unless a run
    already said where it stopped (``elche.Interrupted``)."""
    if isinstance(exc, SystemExit):  # elche.Interrupted: its line is said, its code 130/143/129
        return int(exc.code)  # type: ignore[arg-type]  # Interrupted's code is an int
    signum = stop_signal(exc)
    print(f"elche {command}: interrupted by {signum.name}", file=sys.stderr)
    return 128 + signum


def stop_signal(exc: KeyboardInterrupt) -> signal.Signals:
    """The signal that raised ``exc``: a run's ``elche.Interrupted`` names its own,
    ``Terminated`` is SIGTERM's, any other ``KeyboardInterrupt`` Ctrl-C's."""
    from elche.runtime.lifetimes import Interrupted

    if isinstance(exc, Interrupted):
        return exc.signal
    return signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT


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
