"""The control plane: authenticated ZeroMQ frames between the coordinator and the ranks.

The coordinator binds a ROUTER; every rank connects a DEALER (design §4). Both
ends speak the message catalog of ``elche.core.messages`` inside the envelope of
``elche.runtime.frames`` (protocol version, sequence number, HMAC-SHA256 tag
keyed by a per-run secret); this module owns the sockets and the state of each
connection. It never imports torch: the coordinator process must start in well
under a second.

Theory of operation
-------------------

A receiver runs the envelope's checks (``frames.unseal``: part count, total
size, header size, magic, version, tag), then — only for an authentic frame —
the sender field against the connection's rank, the sequence number against
the last one accepted, and the body with ``messages.decode``. The first valid
frame of a new DEALER identity must be a ``Hello``; it binds that identity to
its rank for the endpoint's lifetime.

The coordinator turns every bad frame into ``Rejected`` and counts it; it never
answers one. ``Rejected.rank`` names a rank only when the frame's tag proved it
came from that rank's connection, so junk from a stranger cannot get a healthy
rank blamed. A rank treats a bad frame from the coordinator as fatal
(``TransportError``). One gap, on purpose: a single part larger than
``max_frame_bytes`` is cut off by libzmq (``MAXMSGSIZE``) before Python sees
it, which drops that peer's connection (a DEALER reconnects by itself) without
buffering the part, and without counting it either.

Threads: a ZeroMQ socket must be used from one thread at a time. Neither
endpoint locks; the owner (the host loop, the rank worker) serializes calls.
Heartbeats are the caller's business; ``poll`` and ``recv`` with a timeout are
a single ``zmq_poll`` each, cheap to call every few milliseconds.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import zmq

from elche.core import messages
from elche.core.errors import ConfigError, RemoteProtocolError, TransportError
from elche.runtime.frames import (
    COORDINATOR_SENDER,
    MAX_FRAME_BYTES,
    SECRET_ENV,
    Buffer,
    Opened,
    check_limits,
    check_secret,
    check_size,
    new_secret,
    seal,
    unseal,
)

# MAX_FRAME_BYTES and Buffer come from ``frames`` and belong to the endpoints'
# signatures too, so they are exported here as well.
__all__ = [
    "LINGER_MS",
    "MAX_FRAME_BYTES",
    "Buffer",
    "CoordinatorEndpoint",
    "Inbound",
    "Joined",
    "RankEndpoint",
    "Received",
    "Rejected",
]

# Long enough to flush a last Exiting/Shutdown over a live connection
# (microseconds on loopback, milliseconds on a LAN), short enough that closing
# next to a dead peer never stalls process exit.
LINGER_MS = 250
# One chatty peer must not keep ``poll`` draining forever and starve the host's
# timers: after 1024 frames ``poll`` returns, and the rest wait for the next call.
_DRAIN_LIMIT = 1024
# Frame numbers a coordinator may use before a restarted one takes over (2**40).
SEQ_SHIFT_PER_RESTART = 40


@dataclass(frozen=True, slots=True, kw_only=True)
class Joined:
    """A new connection's first valid frame was a ``Hello`` for ``rank``."""

    rank: int
    host: str
    held: messages.Held | None = None  # rejoining a restarted coordinator
    layout: str = ""  # a joiner's model's layout (``Hello.layout``)


@dataclass(frozen=True, slots=True, kw_only=True)
class Received:
    """An authentic message from a joined ``rank``.

    ``payload`` holds zero-copy memoryviews of the raw frames; each keeps its
    ZeroMQ frame alive for as long as the view lives.
    """

    rank: int
    message: messages.RankMessage
    payload: list[bytes | memoryview]


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejected:
    """A frame was dropped; ``rank`` is set only when the frame was authentic."""

    reason: str
    rank: int | None


Inbound = Joined | Received | Rejected


def _timeout_ms(timeout_s: float) -> int:
    return max(0, math.ceil(timeout_s * 1000))


def _is_loopback(address: str) -> bool:
    """Whether ``address`` (a ZeroMQ endpoint) is reachable from this host only."""
    scheme, _, rest = address.partition("://")
    if scheme == "inproc":
        return True
    host = rest.rpartition(":")[0].strip("[]")
    if scheme != "tcp" or ";" in host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name, a DNS name: assume reachable
        return False


def _socket(kind: int, max_frame_bytes: int) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Socket(zmq.Context.instance(), kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    # libzmq drops the connection of a peer that sends one part over this size
    # before Python sees it, so such a frame is not counted as Rejected.
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    return sock


class _Endpoint:
    """What both ends share: the socket, closing, the context manager."""

    _socket: zmq.Socket[bytes]
    _closed: bool = False

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The ZeroMQ socket, to register with a ``zmq.Poller`` next to others.

        Only for readiness polling: sending or receiving on it directly skips
        the envelope and desynchronizes the sequence numbers.
        """
        return self._socket

    def close(self) -> None:
        """Close the socket; pending frames get ``LINGER_MS`` to leave. Idempotent."""
        if not self._closed:
            self._closed = True
            self._socket.close(linger=LINGER_MS)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("endpoint is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(slots=True)
class _Peer:
    rank: int
    last_seq_in: int
    last_seq_out: int = 0


class CoordinatorEndpoint(_Endpoint):
    """The coordinator's ROUTER: one per run, bound before any rank starts.

    Args:
        world_size: the number of ranks (1 to 65534).
        join_slots: rank ids past ``world_size`` that may say Hello (ranks that
            join the running run).
        secret: the run's secret; None generates one, allowed on loopback only.
        bind: a ZeroMQ endpoint; port 0 picks a free port (see ``address``).
        max_frame_bytes: frames larger than this are refused both ways.

    Raises:
        ConfigError: bad ``world_size``, ``max_frame_bytes`` or secret, or no
            secret for a non-loopback ``bind``.
        TransportError: the address could not be bound.

    Not thread-safe: one thread (the host loop) makes every call.
    """

    def __init__(
        self,
        *,
        world_size: int,
        secret: bytes | None,
        bind: str = "tcp://127.0.0.1:0",
        max_frame_bytes: int = MAX_FRAME_BYTES,
        restarts: int = 0,
        join_slots: int = 0,
    ) -> None:
        check_limits(world_size + join_slots, max_frame_bytes)
        # A coordinator restarted on the run's address numbers its frames above
        # every one its predecessors sent, so a rank's replay check still holds.
        self._seq_out = restarts << SEQ_SHIFT_PER_RESTART
        self.restarted = restarts > 0
        self._asked: set[bytes] = set()  # connections told to Rejoin
        if secret is None:
            if not _is_loopback(bind):
                raise ConfigError(
                    "secret",
                    f"binding {bind!r} (not loopback) needs the run's secret: set {SECRET_ENV} "
                    "to 64 hex characters on the coordinator and on every rank, e.g. "
                    'the output of python -c "import secrets; print(secrets.token_hex(32))"',
                )
            secret = new_secret()
        check_secret(secret)
        self.secret = secret
        self.world_size = world_size
        self.join_slots = join_slots  # ranks past world_size that may join the running run
        self.max_frame_bytes = max_frame_bytes
        self.rejected = 0
        self._peers: dict[bytes, _Peer] = {}
        self._by_rank: dict[int, bytes] = {}
        self._socket = _socket(zmq.ROUTER, max_frame_bytes)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unreachable rank: error, not drop
        self._socket.setsockopt(zmq.IPV6, int(bind.startswith("tcp://[")))
        try:
            self._socket.bind(bind)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise TransportError(f"cannot bind {bind!r}: {exc}") from exc
        self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(
        self, rank: int, message: messages.CoordMessage, payload: Sequence[Buffer] = ()
    ) -> None:
        """Send ``message`` (and raw ``payload`` frames) to a joined rank.

        Payload buffers go out zero-copy when large: do not mutate them after
        the call (hand over a snapshot).

        Raises:
            TransportError: ``rank`` never joined, is disconnected, or its send
                queue is full. The frame was not sent; the endpoint stays usable.
            ValueError: the frame would exceed ``max_frame_bytes``.
            TypeError: a payload buffer is not C-contiguous.
        """
        self._send_rank(rank, messages.encode(message), payload)

    def broadcast(
        self, ranks: Iterable[int], message: messages.CoordMessage, payload: Sequence[Buffer] = ()
    ) -> list[int]:
        """Send ``message`` to each of ``ranks``, best effort.

        Returns:
            The ranks it failed to reach (not joined, disconnected, queue full;
            every rank once the endpoint is closed), in the order given.

        Raises:
            ValueError: the frame would exceed ``max_frame_bytes`` (nothing sent).
            TypeError: a payload buffer is not C-contiguous (nothing sent).
        """
        body = messages.encode(message)
        check_size(body, payload, self.max_frame_bytes)
        failed: list[int] = []
        for rank in ranks:
            try:
                self._send_rank(rank, body, payload)
            except TransportError:
                failed.append(rank)
        return failed

    def poll(self, timeout_s: float) -> list[Inbound]:
        """Wait up to ``timeout_s`` for a frame, then take every queued one.

        Returns:
            One ``Inbound`` per frame, in arrival order; empty on timeout. At
            most 1024 per call, so one chatty rank cannot starve the caller.

        Raises:
            TransportError: the endpoint is closed. Remote input never raises.
        """
        self._check_open()
        if not self._socket.poll(_timeout_ms(timeout_s)):
            return []
        inbound: list[Inbound] = []
        for _ in range(_DRAIN_LIMIT):
            try:
                frames = self._socket.recv_multipart(zmq.DONTWAIT, copy=False)
            except zmq.Again:
                break
            accepted = self._accept(frames[0].bytes, frames[1:])
            if accepted is not None:
                inbound.append(accepted)
        return inbound

    def _send_rank(self, rank: int, body: bytes, payload: Sequence[Buffer]) -> None:
        self._check_open()
        identity = self._by_rank.get(rank)
        if identity is None:
            raise TransportError(f"rank {rank} has not joined")
        peer = self._peers[identity]
        check_size(body, payload, self.max_frame_bytes)
        seq = peer.last_seq_out + 1
        parts = seal(
            self.secret,
            identity=identity,
            sender=COORDINATOR_SENDER,
            seq=seq,
            body=body,
            payload=payload,
        )
        try:
            self._socket.send_multipart([identity, *parts], zmq.DONTWAIT, copy=False)
        except zmq.Again as exc:
            raise TransportError(f"rank {peer.rank}: send queue is full") from exc
        except zmq.ZMQError as exc:  # EHOSTUNREACH under ROUTER_MANDATORY
            raise TransportError(f"rank {peer.rank} is unreachable: {exc}") from exc
        peer.last_seq_out = seq

    def _accept(self, identity: bytes, frames: list[zmq.Frame]) -> Inbound | None:
        peer = self._peers.get(identity)
        try:
            opened = unseal(
                [f.buffer for f in frames],
                secret=self.secret,
                identity=identity,
                max_frame_bytes=self.max_frame_bytes,
            )
        except RemoteProtocolError as exc:
            where = "" if peer is None else f" (on the connection of rank {peer.rank})"
            return self._reject(f"{exc}{where}", None)
        try:
            if peer is None and self.restarted and not _is_hello(opened):
                self._ask_rejoin(identity, opened.sender)  # a rank of the lost coordinator
                return None
            return self._join(identity, opened) if peer is None else self._receive(peer, opened)
        except RemoteProtocolError as exc:
            return self._reject(str(exc), exc.rank)

    def _join(self, identity: bytes, opened: Opened) -> Joined:
        hello = messages.decode(opened.body)
        if not isinstance(hello, messages.Hello):
            raise RemoteProtocolError(f"first frame must be Hello, got {type(hello).__name__}")
        if hello.world_size != self.world_size:
            raise RemoteProtocolError(
                f"Hello for world_size {hello.world_size}, this run has {self.world_size}"
            )
        slots = self.world_size + self.join_slots
        if not 0 <= hello.rank < slots or opened.sender != hello.rank:
            raise RemoteProtocolError(f"Hello for rank {hello.rank} from sender {opened.sender}")
        if hello.rank in self._by_rank:
            raise RemoteProtocolError(f"rank {hello.rank} already joined on another connection")
        self._peers[identity] = _Peer(
            rank=hello.rank, last_seq_in=opened.seq, last_seq_out=self._seq_out
        )
        self._by_rank[hello.rank] = identity
        return Joined(rank=hello.rank, host=hello.host, held=hello.held, layout=hello.layout)

    def _ask_rejoin(self, identity: bytes, sender: int) -> None:
        """Tell a connection of the run that has not joined to say Hello (once)."""
        if identity in self._asked:
            return
        self._asked.add(identity)
        self._seq_out += 1
        body = messages.encode(messages.Rejoin())
        parts = seal(
            self.secret, identity=identity, sender=COORDINATOR_SENDER, seq=self._seq_out, body=body
        )
        with contextlib.suppress(zmq.ZMQError):  # gone again: it will say something later
            self._socket.send_multipart([identity, *parts], zmq.DONTWAIT, copy=False)

    def _receive(self, peer: _Peer, opened: Opened) -> Received:
        if opened.sender != peer.rank:
            raise RemoteProtocolError(f"header names sender {opened.sender}", rank=peer.rank)
        if opened.seq <= peer.last_seq_in:
            raise RemoteProtocolError(
                f"sequence number {opened.seq} is not after {peer.last_seq_in} "
                "(replayed or reordered frame)",
                rank=peer.rank,
            )
        peer.last_seq_in = opened.seq
        message = messages.decode(opened.body, rank=peer.rank)
        if isinstance(message, messages.Hello):
            raise RemoteProtocolError("Hello after joining", rank=peer.rank)
        if not isinstance(message, messages.RankMessage):
            raise RemoteProtocolError(
                f"{type(message).__name__} is not a rank message", rank=peer.rank
            )
        return Received(rank=peer.rank, message=message, payload=opened.payload)

    def _reject(self, reason: str, rank: int | None) -> Rejected:
        self.rejected += 1
        return Rejected(reason=reason, rank=rank)


class RankEndpoint(_Endpoint):
    """A rank's DEALER; connects and sends ``Hello`` in the constructor.

    ZeroMQ connects in the background, so construction does not wait for the
    coordinator: the ``Hello`` is queued and leaves once the connection is up.
    The identity is ``b"rank<N>-"`` plus a random nonce, so a second process
    claiming the same rank shows up as a second connection (and is refused).
    Not thread-safe: the rank worker serializes every call on one thread.

    Args:
        address: the coordinator's ``CoordinatorEndpoint.address``.
        rank: this rank, in ``[0, world_size)``.
        world_size: the number of ranks, as the coordinator knows it.
        join_slots: the run's join slots (``rank`` may lie past ``world_size``).
        secret: the run's secret (``CoordinatorEndpoint.secret``).
        host: a name for logs, sent in ``Hello``.
        max_frame_bytes: must match the coordinator's.

    Raises:
        ConfigError: bad ``rank``, ``world_size`` or ``max_frame_bytes``, or a
            short secret.
        TransportError: ``address`` is malformed, or the ``Hello`` could not be queued.
    """

    def __init__(
        self,
        *,
        address: str,
        rank: int,
        world_size: int,
        secret: bytes,
        host: str = "",
        max_frame_bytes: int = MAX_FRAME_BYTES,
        join_slots: int = 0,
        layout: str = "",
    ) -> None:
        check_limits(world_size + join_slots, max_frame_bytes)
        if not 0 <= rank < world_size + join_slots:
            raise ConfigError("rank", f"must be in [0, {world_size + join_slots}), got {rank}")
        check_secret(secret)
        self.rank = rank
        self._secret = secret
        self.max_frame_bytes = max_frame_bytes
        self._identity = f"rank{rank}-{secrets.token_hex(8)}".encode()
        self._last_seq_in = 0
        self._last_seq_out = 0
        self._socket = _socket(zmq.DEALER, max_frame_bytes)
        self._socket.setsockopt(zmq.IDENTITY, self._identity)
        self._socket.setsockopt(zmq.IPV6, int(address.startswith("tcp://[")))
        try:
            self._socket.connect(address)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise TransportError(f"cannot connect to {address!r}: {exc}") from exc
        hello = messages.Hello(
            rank=rank, world_size=world_size, host=host, pid=os.getpid(), layout=layout
        )
        try:
            self.send(hello)
        except TransportError:
            self.close()
            raise

    def send(self, message: messages.RankMessage, payload: Sequence[Buffer] = ()) -> None:
        """Send ``message`` (and raw ``payload`` frames) to the coordinator.

        Payload buffers go out zero-copy when large: do not mutate them after
        the call (hand over a snapshot).

        Raises:
            TransportError: the endpoint is closed, or the send queue is full
                (coordinator gone or not reading). Nothing was sent.
            ValueError: the frame would exceed ``max_frame_bytes``.
            TypeError: a payload buffer is not C-contiguous.
        """
        self._check_open()
        seq = self._last_seq_out + 1
        body = messages.encode(message)
        check_size(body, payload, self.max_frame_bytes)
        parts = seal(
            self._secret,
            identity=self._identity,
            sender=self.rank,
            seq=seq,
            body=body,
            payload=payload,
        )
        try:
            self._socket.send_multipart(parts, zmq.DONTWAIT, copy=False)
        except zmq.ZMQError as exc:
            raise TransportError(
                f"rank {self.rank}: cannot send to the coordinator: {exc}"
            ) from exc
        self._last_seq_out = seq

    def recv(
        self, timeout_s: float
    ) -> tuple[messages.CoordMessage, list[bytes | memoryview]] | None:
        """Wait up to ``timeout_s`` for the coordinator's next frame.

        Returns:
            The message and its payload frames, or None on timeout.

        Raises:
            TransportError: the endpoint is closed, or the frame failed a check
                (``from`` the ``RemoteProtocolError``). The frame is dropped and
                the endpoint stays usable, but the caller should treat this as
                fatal: only the coordinator can reach this socket.
        """
        self._check_open()
        if not self._socket.poll(_timeout_ms(timeout_s)):
            return None
        frames = self._socket.recv_multipart(copy=False)
        try:
            return self._accept(frames)
        except RemoteProtocolError as exc:
            raise TransportError(
                f"rank {self.rank}: bad frame from the coordinator: {exc}"
            ) from exc

    def _accept(
        self, frames: list[zmq.Frame]
    ) -> tuple[messages.CoordMessage, list[bytes | memoryview]]:
        opened = unseal(
            [f.buffer for f in frames],
            secret=self._secret,
            identity=self._identity,
            max_frame_bytes=self.max_frame_bytes,
        )
        if opened.sender != COORDINATOR_SENDER:
            raise RemoteProtocolError(f"header names sender {opened.sender}, not the coordinator")
        if opened.seq <= self._last_seq_in:
            raise RemoteProtocolError(
                f"sequence number {opened.seq} is not after {self._last_seq_in} "
                "(replayed or reordered frame)"
            )
        self._last_seq_in = opened.seq
        message = messages.decode(opened.body)
        if not isinstance(message, messages.CoordMessage):
            raise RemoteProtocolError(f"{type(message).__name__} is not a coordinator message")
        return message, opened.payload


def _is_hello(opened: Opened) -> bool:
    try:
        return isinstance(messages.decode(opened.body), messages.Hello)
    except RemoteProtocolError:
        return False
