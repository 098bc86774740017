"""The live dashboard's server: ``/``, ``/state.json`` and ``/metrics`` over HTTP.

Theory of operation. The process that launched the run (``elche.train``'s
process, or rank 0's under a launcher) starts a ``Dashboard``: one daemon
thread running an asyncio loop, with an aiohttp server and a task that
follows ``RUN_DIR/timeline.jsonl`` every ``FOLLOW_EVERY_S``, folding each new
record into the run's state (``elche.monitor.state``) and its Prometheus
metrics (``elche.monitor.metrics``). Requests and the follower share that
one loop thread, so they need no lock.

It sits outside the coordinator's decision loop on purpose: the coordinator
process only appends records to the timeline, as it always does, and never
waits for the dashboard; a dashboard that fails (a port taken, a bug) is
reported and the run goes on without it.

Endpoints:

- ``/`` — the page: charts (uPlot, vendored in ``static/`` with its licence),
  the rank table and the alerts, kept live by ``/events``; every script and
  style comes from ``/static/``, so it works offline;
- ``/state.json`` — the run's state: run, ranks, series, alerts;
- ``/events`` — server-sent events: the state whenever it changed (checked
  every ``EVENTS_EVERY_S``), and ``complete`` when the run is over, right
  after the state with the follower's last fold in it (the run's end);
- ``/metrics`` — the Prometheus text exposition;
- ``/static/NAME`` — the page's files;
- anything else — 404 with the list of endpoints.

A request the server cannot parse (an oversized header or URL, bytes that
are not HTTP) is answered 400 by aiohttp and reported to the server's
logger; ``RequestLog`` is that logger's handler: it counts the request
(``elche_dashboard_rejected_requests_total``) and prints one line for the
first and every ``REJECTED_REPORT_EVERY``-th, never the traceback, so a
scanner cannot fill the run's stderr. At most ``MAX_CONNECTIONS`` are open
at once: one past them is closed as it opens (said as rejections are), so
clients that open connections and hold them cannot take the file
descriptors the training process needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import threading
import traceback
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TextIO

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, Counter

from elche.monitor.address import DEFAULT_HOST
from elche.monitor.metrics import RunMetrics
from elche.monitor.state import RunView
from elche.monitor.timeline import TimelineReader

__all__ = ["Dashboard", "RequestLog"]

# How often the follower reads the timeline: a human watching sees no lag,
# and a read of a file that did not grow costs a stat and a seek.
FOLLOW_EVERY_S = 0.2
# The reference's dashboard pushes to its subscribers every 1000 ms.
EVENTS_EVERY_S = 1.0
# The coordinator reports its rejected frames so: the first is news, then one
# line a thousand keeps the output readable under a flood.
REJECTED_REPORT_EVERY = 1000
# Each connection takes a file descriptor of the process that runs the dashboard
# (elche.train's, or rank 0's under elche run and torchrun), which needs them to
# train: connections opened and held (1000 of them, under the usual limit of
# 1024) left it none, and its next open of the timeline ended the run. A few
# pages and a scraper need a handful; past this many, a new one is closed.
MAX_CONNECTIONS = 64
ENDPOINTS = ["/", "/state.json", "/events", "/metrics"]
_STATIC_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css",
                 ".txt": "text/plain"}  # fmt: skip
_NO_CACHE = {"Cache-Control": "no-cache", "Access-Control-Allow-Origin": "*"}
# A long run's state is megabytes of JSON (5000 points a series): msgspec encodes it
# several times faster than json, writes a float that is not finite as null, and
# the state is encoded once per change, not once per client and request. Under
# elche run and torchrun the dashboard shares rank 0's process, so every
# encoding is time taken from that rank's training.
_ENCODER = msgspec.json.Encoder(enc_hook=str)


class Dashboard:
    """Serves a run's state while it goes on.

    Args:
        run_dir: the run directory whose timeline is followed.
        world_size: ranks in the run.
        host: the address to bind.
        port: the port to bind (0: a free one).
        devices: each rank's device, for the rank table.
        log: where a failure of the dashboard is reported.
    """

    def __init__(
        self, run_dir: Path, world_size: int, *, host: str = DEFAULT_HOST, port: int = 0,
        devices: list[str] | None = None, log: TextIO = sys.stderr,
    ) -> None:  # fmt: skip
        self.view = RunView(world_size, devices=devices, run_dir=str(run_dir))
        self.metrics = RunMetrics()
        self._reader = TimelineReader(run_dir)
        self._host, self._port = host, port
        self._log = log
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._final: asyncio.Event | None = None  # set once the last fold is done
        self._error: BaseException | None = None
        self._failed_follow = False
        self._num_refused = 0  # connections closed past MAX_CONNECTIONS
        self._encoded: tuple[int, bytes] = (-1, b"")  # the state's JSON, for that many records
        self._thread = threading.Thread(target=self._serve, name="elche-dashboard", daemon=True)
        self.url: str | None = None
        self._static = _static_files()
        self._server_log = logging.Logger("elche.dashboard.server", logging.DEBUG)
        self._server_log.addHandler(RequestLog(self.metrics.rejected_requests, log))

    def start(self, timeout_s: float = 10.0) -> str:
        """Bind and start serving; returns the URL (``http://HOST:PORT/``).

        Raises:
            OSError: the address cannot be bound (or the server did not come up
                within ``timeout_s``); nothing is left running.
        """
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise OSError(f"the dashboard did not start within {timeout_s:g} s")
        if self._error is not None:
            self._thread.join(timeout_s)
            raise OSError(f"the dashboard could not serve on {self._host}:{self._port}: "
                          f"{self._error}")  # fmt: skip
        assert self.url is not None
        return self.url

    def stop(self, timeout_s: float = 5.0) -> None:
        """Read the timeline one last time and stop serving."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and self._thread.is_alive():
            loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout_s)

    def follow(self) -> None:
        """Fold the records appended since the last call (the follower task's step)."""
        try:
            for event in self._reader.new_records():
                self.view.observe(event)
                self.metrics.observe(event)
        except Exception as exc:  # the dashboard must never end the run
            if not self._failed_follow:
                self._failed_follow = True
                print(f"elche: the dashboard stopped following the run: {exc!r}",
                      file=self._log, flush=True)  # fmt: skip

    # -- the server thread ---------------------------------------------------

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start(), or lost with the dashboard
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._final = asyncio.Event()
        app = web.Application()
        app.router.add_get("/", self._page)
        app.router.add_get("/state.json", self._state)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/events", self._events)
        app.router.add_get("/static/{name}", self._file)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, logger=self._server_log)
        await runner.setup()
        listener: asyncio.Server | None = None
        try:
            listener = await self._loop.create_server(self._protocol(runner), self._host,
                                                      self._port)  # fmt: skip
            host, port = listener.sockets[0].getsockname()[:2]
            self.url = f"http://{_url_host(str(host))}:{port}/"
            self._ready.set()
            while not self._stop.is_set():
                self.follow()
                with contextlib.suppress(TimeoutError):  # the follow cadence
                    await asyncio.wait_for(self._stop.wait(), FOLLOW_EVERY_S)
            self.follow()  # what the run wrote last: its RunEnd
        finally:
            if listener is not None:
                listener.close()
            self._final.set()
            await runner.cleanup()

    def _protocol(self, runner: web.AppRunner) -> Callable[[], asyncio.BaseProtocol]:
        """aiohttp's protocol for a new connection, or one that closes it past
        ``MAX_CONNECTIONS`` (aiohttp takes every connection it is offered)."""
        server = runner.server
        assert server is not None  # set up

        def protocol() -> asyncio.BaseProtocol:
            if len(server.connections) < MAX_CONNECTIONS:
                return server()
            self._num_refused += 1
            if self._num_refused == 1 or self._num_refused % REJECTED_REPORT_EVERY == 0:
                print(f"elche: the dashboard closed a connection past its {MAX_CONNECTIONS} "
                      f"open ({self._num_refused} closed so far)", file=self._log,
                      flush=True)  # fmt: skip
            return _Refused()

        return protocol

    async def _page(self, request: web.Request) -> web.Response:
        body, _ = self._static["dashboard.html"]
        return web.Response(body=body, content_type="text/html", headers=_NO_CACHE)

    async def _file(self, request: web.Request) -> web.Response:
        found = self._static.get(request.match_info["name"])
        if found is None:
            return await self._not_found(request)
        body, content_type = found
        return web.Response(body=body, content_type=content_type, headers=_NO_CACHE)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        assert self._stop is not None and self._final is not None
        headers = dict(_NO_CACHE, **{"Content-Type": "text/event-stream"})
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        sent = -1
        try:
            while not self._stop.is_set():
                if self.view.records != sent:
                    sent = self.view.records
                    await response.write(self._event_bytes())
                with contextlib.suppress(TimeoutError):  # the push cadence
                    await asyncio.wait_for(self._stop.wait(), EVENTS_EVERY_S)
            # Woken with the follower, maybe before it: the last push waits for
            # its last fold, so the page that closes on `complete` shows the end.
            await self._final.wait()
            await response.write(self._event_bytes() + b"event: complete\ndata: {}\n\n")
        except ConnectionResetError:
            pass  # the page went away
        return response

    def _event_bytes(self) -> bytes:
        return b"data: " + self._state_json() + b"\n\n"

    def _state_json(self) -> bytes:
        """The state as JSON, encoded once per change however many clients ask for it."""
        if self._encoded[0] != self.view.records:
            self._encoded = (self.view.records, _ENCODER.encode(self.view.state()))
        return self._encoded[1]

    async def _state(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self._state_json(), content_type="application/json", headers=_NO_CACHE
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        headers = dict(_NO_CACHE, **{"Content-Type": CONTENT_TYPE_LATEST})
        return web.Response(body=self.metrics.text(), headers=headers)

    async def _not_found(self, request: web.Request) -> web.Response:
        body = json.dumps({"error": "not found", "endpoints": ENDPOINTS})
        return web.Response(
            status=404, text=body, content_type="application/json", headers=_NO_CACHE
        )


class _Refused(asyncio.Protocol):
    """A connection past ``MAX_CONNECTIONS``: closed as it opens, its descriptor freed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)  # a TCP server's
        transport.abort()


class RequestLog(logging.Handler):
    """The aiohttp server logger's handler: a malformed request is counted, not a traceback.

    Args:
        rejected: the counter of requests refused as malformed.
        log: where the lines go.
    """

    def __init__(self, rejected: Counter, log: TextIO) -> None:
        super().__init__(logging.DEBUG)
        self._rejected = rejected
        self._log = log
        self.num_rejected = 0
        self.num_failed = 0

    def emit(self, record: logging.LogRecord) -> None:
        """Count and maybe print one record of aiohttp's; debug chatter without an error goes."""
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):  # a request aiohttp could not parse: 400
            self._rejected.inc()
            self.num_rejected += 1
            if self._due(self.num_rejected):
                # Class and status only: the request's own bytes stay off the terminal.
                self._print(
                    f"the dashboard rejected a malformed request from {_remote(record)} "
                    f"({type(exc).__name__}, {exc.code}; {self.num_rejected} rejected so far)"
                )
        elif record.levelno >= logging.WARNING:  # a handler failed: a bug of elche's
            self.num_failed += 1
            if self._due(self.num_failed):
                self._print(
                    f"the dashboard failed a request: {record.getMessage()}: {exc!r} "
                    f"({self.num_failed} failed so far)"
                )
            if self.num_failed == 1 and exc is not None:  # the first, whole: it is to be fixed
                print("".join(traceback.format_exception(exc)).rstrip(), file=self._log, flush=True)

    @staticmethod
    def _due(count: int) -> bool:
        return count == 1 or count % REJECTED_REPORT_EVERY == 0

    def _print(self, line: str) -> None:
        print(f"elche: {line}", file=self._log, flush=True)


def _remote(record: logging.LogRecord) -> str:
    """The peer of aiohttp's "Error handling request from %s" (its only argument)."""
    args = record.args if isinstance(record.args, tuple) else ()
    return str(args[0]) if len(args) == 1 else "a peer"


def _static_files() -> dict[str, tuple[bytes, str]]:
    """The page's files, read once: name -> (bytes, content type)."""
    folder = resources.files("elche.monitor") / "static"
    return {
        item.name: (item.read_bytes(), _STATIC_TYPES.get(Path(item.name).suffix, "text/plain"))
        for item in folder.iterdir()
        if item.is_file()
    }


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
