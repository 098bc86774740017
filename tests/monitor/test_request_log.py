"""aiohttp's server log, as the dashboard handles it: malformed requests counted."""

from __future__ import annotations

import io
import logging

from aiohttp.http_exceptions import BadHttpMethod, LineTooLong
from prometheus_client import CollectorRegistry, Counter

from elche.monitor.dashboard import REJECTED_REPORT_EVERY, RequestLog


def _record(exc: BaseException | None, level: int = logging.ERROR) -> logging.LogRecord:
    message = "Error handling request from %s" if exc is not None else "Ignored disconnection"
    args = ("10.0.0.7",) if exc is not None else ()
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("aiohttp", level, __file__, 1, message, args, exc_info)


def _handler() -> tuple[RequestLog, Counter, io.StringIO]:
    counter = Counter("rejected", "rejected", registry=CollectorRegistry())
    out = io.StringIO()
    return RequestLog(counter, out), counter, out


def test_malformed_requests_are_all_counted_and_a_few_printed() -> None:
    handler, counter, out = _handler()
    for _ in range(REJECTED_REPORT_EVERY):
        handler.handle(_record(LineTooLong(b"\x1b[2J" + b"a" * 9000, 8190)))
    handler.handle(_record(BadHttpMethod("\x16\x03"), logging.DEBUG))  # TLS on the port
    assert counter._value.get() == REJECTED_REPORT_EVERY + 1
    assert out.getvalue().splitlines() == [
        "elche: the dashboard rejected a malformed request from 10.0.0.7 "
        "(LineTooLong, 400; 1 rejected so far)",
        "elche: the dashboard rejected a malformed request from 10.0.0.7 "
        f"(LineTooLong, 400; {REJECTED_REPORT_EVERY} rejected so far)",
    ]
    assert "\x1b" not in out.getvalue()  # the request's bytes never reach the terminal


def test_a_failed_handler_is_said_whole_once_and_debug_chatter_not_at_all() -> None:
    handler, counter, out = _handler()
    handler.handle(_record(None, logging.DEBUG))
    handler.handle(_record(KeyError("run")))
    handler.handle(_record(KeyError("run")))  # the second: counted, not said
    assert counter._value.get() == 0
    assert out.getvalue().splitlines() == [  # a bug of elche's: the first in full
        "elche: the dashboard failed a request: Error handling request from 10.0.0.7: "
        "KeyError('run') (1 failed so far)",
        "KeyError: 'run'",
    ]
