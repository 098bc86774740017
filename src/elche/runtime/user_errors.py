"""A rank's report of the user's exception, and the ``TrainingError`` it becomes.

Theory of operation. The worker runs the user's code (``model_fn``,
``optimizer_fn``, the collate, ``step_fn``, ``epoch_fn``) inside a guard;
what it raises becomes a ``Failed`` report (``elche.core.rank``), sent to the
coordinator before the rank exits, and a ``TrainingError`` raised in the
rank. A rank that fails before it connected (building its model, its
warm-up step) connects just to send that report. The coordinator decides
whether the run ends (``elche.core.failures``); the launcher turns the
summary's ``user_error`` into the ``TrainingError`` that ``elche.train``
raises. The exception object itself stays behind: only its type name,
message and traceback cross processes.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from elche.core import messages as m
from elche.core.errors import TrainingError, TransportError
from elche.core.rank import RankProtocol

if TYPE_CHECKING:
    from elche.runtime.worker import RankSpec

__all__ = [
    "ANSWER_WAIT_S",
    "USER_TRACEBACK_CHARS",
    "describe",
    "failed_report",
    "guarded",
    "report_unconnected",
    "training_error",
    "wait_answer",
]

T = TypeVar("T")

# The tail of a traceback kept in a report: the user's frames are at the end,
# and a control-plane frame stays small.
USER_TRACEBACK_CHARS = 20_000
# How long a failing rank waits for the coordinator to take its report (it
# answers within milliseconds; silence means it is gone, and the rank exits).
ANSWER_WAIT_S = 5.0
_ELCHE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def describe(exc: BaseException) -> tuple[str, str, str]:
    """The exception's type name, message and traceback (its tail) without elche's frames.

    The frames of elche's own code between the rank's loop and the user's
    function say nothing to the user; the user's frames, and those of the
    libraries the user's code called (torch), stay.
    """
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _in_elche(f.filename)]
    head = "Traceback (most recent call last):\n"
    text = "".join([head, *traceback.format_list(frames), *traceback.format_exception_only(exc)])
    return type(exc).__name__, str(exc), text[-USER_TRACEBACK_CHARS:]


def _in_elche(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_ELCHE_DIR)


def failed_report(proto: RankProtocol, exc: BaseException, epoch: int) -> m.Failed:
    """The ``Failed`` report of ``exc`` (the rank's protocol stops)."""
    error_type, message, text = describe(exc)
    return proto.failed(error_type=error_type, message=message, traceback=text, epoch=epoch)


def training_error(rank: int, report: m.Failed) -> TrainingError:
    """The ``TrainingError`` a rank raises for its own ``Failed`` report."""
    return TrainingError(
        rank=rank,
        epoch=report.epoch,
        error_type=report.error_type,
        message=report.message,
        traceback=report.traceback,
    )


def guarded(spec: RankSpec, user_code: Callable[[], T]) -> T:
    """Run ``user_code`` on a rank not yet connected; what it raises is reported.

    Raises:
        TrainingError: ``user_code`` raised (``from`` its exception).
    """
    try:
        return user_code()
    except Exception as exc:
        raise report_unconnected(spec, exc) from exc


def wait_answer(receive: Callable[[float], object]) -> None:
    """Wait (at most ``ANSWER_WAIT_S``) for the coordinator's answer to ``Failed``.

    A rank process ends with ``os._exit``, which drops frames not sent yet;
    once the coordinator answered (``Shutdown``), the report is known to be in.

    Args:
        receive: ``receive(timeout_s)`` gives the next inbound item or None.
    """
    deadline = time.monotonic() + ANSWER_WAIT_S
    while (left := deadline - time.monotonic()) > 0:
        item = receive(left)
        if not isinstance(item, tuple) or isinstance(item[0], m.Shutdown):
            return


def report_unconnected(spec: RankSpec, exc: BaseException) -> TrainingError:
    """A rank that failed before connecting: connect, send ``Failed``, disconnect.

    Returns:
        The ``TrainingError`` for the rank to raise. A coordinator that cannot
        be reached changes nothing: the launcher reports the exit anyway.
    """
    error_type, message, text = describe(exc)
    report = m.Failed(
        error_type=error_type, message=message, traceback=text, before_first_step=True
    )
    try:
        with spec.endpoint() as endpoint:
            endpoint.send(report)
            wait_answer(endpoint.recv)
    except (TransportError, ValueError):
        pass
    return training_error(spec.rank, report)
