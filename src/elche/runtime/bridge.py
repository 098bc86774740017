"""The rank's IO thread: the only owner of its control-plane socket.

Theory of operation. Training blocks — in a long step, in a collective that
waits for a dead peer — but liveness must not: a rank that stops
heartbeating is declared dead. So one thread owns the ``RankEndpoint`` and
does all of its IO:

- outbound: the training thread calls ``send``; the message goes on a queue
  and a one-byte poke on an inproc ZeroMQ pair wakes the IO thread at once;
- inbound: every frame from the coordinator goes on ``inbox``;
- heartbeats go out every ``heartbeat_interval_s`` whatever training does;
- coordinator liveness: no frame for ``coordinator_timeout_s`` (the
  coordinator beacons every second), a bad frame, or the launcher's word
  that it will not restart a lost coordinator (``gone_file``,
  ``elche.runtime.salvage``) puts ``CoordinatorLost`` on the inbox, once.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import zmq

from elche.core import messages as m
from elche.core.errors import TransportError
from elche.runtime.frames import Buffer
from elche.runtime.transport import RankEndpoint

__all__ = ["Bridge", "CoordinatorLost", "Inbound"]

_ids = itertools.count()


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorLost:
    """The coordinator went silent or sent something unreadable."""

    reason: str


Inbound = tuple[m.CoordMessage, list[bytes | memoryview]] | CoordinatorLost


class Bridge:
    """Runs the rank's control-plane IO on a daemon thread.

    Args:
        endpoint: the connected endpoint; the bridge owns it from now on.
        heartbeat_interval_s: how often to send ``Heartbeat``.
        coordinator_timeout_s: silence after which the coordinator is lost.
        gone_file: a file whose appearance means the coordinator is lost for
            good (its launcher will not restart it), looked for every heartbeat.
    """

    def __init__(
        self,
        endpoint: RankEndpoint,
        *,
        heartbeat_interval_s: float = 1.0,
        coordinator_timeout_s: float = 30.0,
        gone_file: Path | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.inbox: queue.Queue[Inbound | object] = queue.Queue()
        self.step = 0  # read by the heartbeat; written by the training thread
        self._heartbeat_s = heartbeat_interval_s
        self._timeout_s = coordinator_timeout_s
        self._gone_file = gone_file
        self._outbox: queue.Queue[tuple[m.RankMessage, Sequence[Buffer]]] = queue.Queue()
        self._stop = threading.Event()
        self._frozen = threading.Event()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        name = f"inproc://elche-bridge-{id(self)}-{next(_ids)}"
        self._wake_rx: zmq.Socket[bytes] = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(name)
        self._wake_tx: zmq.Socket[bytes] = ctx.socket(zmq.PAIR)
        self._wake_tx.connect(name)
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="elche-bridge", daemon=True)
        self._thread.start()

    def send(self, message: m.RankMessage, payload: Sequence[Buffer] = ()) -> None:
        """Queue ``message`` for the coordinator (never blocks)."""
        self._outbox.put((message, payload))
        with self._wake_lock:
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def get(self, timeout_s: float | None) -> Inbound | None:
        """The next inbound item, waiting up to ``timeout_s`` (None: forever)."""
        try:
            return cast("Inbound", self.inbox.get(timeout=timeout_s))
        except queue.Empty:
            return None

    def freeze(self) -> None:
        """Testing hook: go silent, as a hung process would (no IO at all)."""
        self._frozen.set()

    def close(self, *, flush_s: float = 2.0) -> None:
        """Send what is queued (up to ``flush_s``), stop the thread, close sockets."""
        deadline = time.monotonic() + flush_s
        while not self._outbox.empty() and time.monotonic() < deadline:
            time.sleep(0.005)
        self._stop.set()
        with self._wake_lock:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        self._thread.join(timeout=flush_s)
        self._wake_tx.close(linger=0)
        self._wake_rx.close(linger=0)
        self.endpoint.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.endpoint.socket, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_beat = time.monotonic() + self._heartbeat_s
        last_inbound = time.monotonic()
        lost = False
        while not self._stop.is_set():
            if self._frozen.is_set():
                self._stop.wait(0.2)
                continue
            wait_ms = max(0, int((next_beat - time.monotonic()) * 1000))
            ready = dict(poller.poll(min(wait_ms, 200)))
            if self._wake_rx in ready:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            lost = self._flush_outbox() or lost
            if self.endpoint.socket in ready:
                got, failure = self._drain_inbound()
                if got:
                    last_inbound = time.monotonic()
                if failure is not None and not lost:
                    lost = True
                    self.inbox.put(CoordinatorLost(reason=failure))
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self._heartbeat_s
                self._outbox.put((m.Heartbeat(step=self.step), ()))
                lost = self._flush_outbox() or lost
                if not lost and self._gone_file is not None and self._gone_file.exists():
                    lost = True
                    self.inbox.put(CoordinatorLost(reason="its launcher cannot restart it"))
            if not lost and now - last_inbound > self._timeout_s:
                got, failure = self._drain_inbound()  # what came while this thread starved
                if got:
                    last_inbound = time.monotonic()
                if got and failure is None:
                    continue
                lost = True
                silence = f"no word from the coordinator for {self._timeout_s:g} s"
                self.inbox.put(CoordinatorLost(reason=failure or silence))

    def _flush_outbox(self) -> bool:
        while True:
            try:
                message, payload = self._outbox.get_nowait()
            except queue.Empty:
                return False
            try:
                self.endpoint.send(message, payload)
            except TransportError as exc:
                self.inbox.put(CoordinatorLost(reason=str(exc)))
                return True

    def _drain_inbound(self) -> tuple[bool, str | None]:
        got = False
        while True:
            try:
                item = self.endpoint.recv(0.0)
            except TransportError as exc:
                return got, str(exc)
            if item is None:
                return got, None
            got = True
            if not isinstance(item[0], m.CoordHeartbeat):
                self.inbox.put(item)
