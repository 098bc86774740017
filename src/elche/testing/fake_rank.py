"""A fake rank: the real control-plane protocol around a four-float "model".

``FakeRank`` connects a real ``RankEndpoint`` (so every frame it sends is
sealed, sequenced and checked like a worker's) and behaves like a
well-behaved ``elche.runtime.worker.Worker`` whose model is four float32
numbers and whose step takes no time. It never imports torch, so a test can
run a ``Host`` and a few fake ranks as threads of one process in well under a
second.

Rules: the worker's, from the same state machine (``elche.core.rank``).
Each batch is reported at once with ``batch_ms=1.0``; ``SyncNow`` is
answered at once (there is no group, so the "collective" is a no-op);
``RequestParams`` is answered with ``SnapshotReady`` carrying
``[msgpack(Layout), weight]``; ``RunEval``/``RunCheckpoint`` get an
``EvalResult``/``CheckpointResult``; a ``Heartbeat`` leaves at least every
``heartbeat_interval_s``; ``ShutdownWithSave`` is answered with
``StateSaved(path=None)``.

Theory of operation: ``run`` is one synchronous loop on the calling thread.
Each turn it beats if due, does the first thing that applies (serve a round,
run a callback, train one batch), then reads the socket: without waiting
after a step, or up to the next heartbeat when there is nothing to do. The
endpoint is created and closed inside ``run``, so one ``FakeRank`` per thread
is safe; a ZeroMQ socket never crosses threads.

Pacing: a test that must keep the run alive (say, until an attack is over)
hands in a ``threading.Semaphore``; the rank takes one token per batch and
holds, still serving messages and heartbeating, while there is none.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Sequence
from typing import Protocol, assert_never

import msgspec

from elche.core import messages as m
from elche.core.config import Mode
from elche.core.rank import (
    Average,
    Callback,
    Discard,
    Done,
    FormGroup,
    Hold,
    Land,
    Load,
    RankProtocol,
    Save,
    StartEpoch,
    Train,
    Upload,
)
from elche.runtime.snapshots import Layout, TensorSpec
from elche.runtime.transport import MAX_FRAME_BYTES, Buffer, RankEndpoint

__all__ = ["HEARTBEAT_INTERVAL_S", "LAYOUT", "FakeRank"]

# Twice a real rank's beat (1 s, ``RankSpec.heartbeat_interval_s``): a fake
# rank lives in tests that shorten ``heartbeat_timeout_s``.
HEARTBEAT_INTERVAL_S = 0.5
# While a pace token is missing the rank re-checks the semaphore this often
# (5 ms: far below any test's timeout, far above a busy loop's cost).
PACE_WAIT_S = 0.005
# What one "step" moves each weight by; any nonzero value makes the ranks'
# snapshots differ, so an average is visible.
STEP = 0.001
BATCH_MS = 1.0  # reported compute time of every batch

LAYOUT = Layout(tensors=(TensorSpec(name="weight", dtype="float32", shape=(4,)),), num_params=1)
_WEIGHT = struct.Struct("<4f")  # snapshot frames are little-endian (elche.runtime.snapshots)
_LAYOUT_FRAME = msgspec.msgpack.encode(LAYOUT)


class Endpoint(Protocol):
    """What a fake rank talks through: a ``RankEndpoint``, or a test's script."""

    def send(self, message: m.RankMessage, payload: Sequence[Buffer] = ()) -> None: ...

    def recv(self, timeout_s: float) -> tuple[m.CoordMessage, list[bytes | memoryview]] | None: ...

    def close(self) -> None: ...


class FakeRank:
    """A torch-free rank that trains a four-float model (see the module docstring).

    Args:
        address: the coordinator's ``CoordinatorEndpoint.address``.
        rank: this rank, in ``[0, world_size)``.
        world_size: the number of ranks of the run.
        secret: the run's secret.
        mode: the run's mode; ``cpu-async`` ranks do not hold for ``Update``.
        batch_size: samples per step, as in the run's ``CoordinatorConfig``.
        pace: one token per batch when given (see "Pacing" above).
        max_frame_bytes: must match the coordinator endpoint's.
        heartbeat_interval_s: the longest gap between two ``Heartbeat``.

    Raises:
        ValueError: ``batch_size`` below 1 or a non-positive heartbeat
            interval. (``rank``, ``world_size`` and ``secret`` are checked by
            the ``RankEndpoint`` that ``run`` opens.)

    After ``run`` the counters below tell what the rank did; read them once
    its thread has been joined.
    """

    def __init__(
        self,
        address: str,
        rank: int,
        world_size: int,
        secret: bytes,
        *,
        mode: Mode,
        batch_size: int,
        pace: threading.Semaphore | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if not heartbeat_interval_s > 0:
            raise ValueError(f"heartbeat_interval_s must be positive, got {heartbeat_interval_s}")
        self.address = address
        self.rank = rank
        self.world_size = world_size
        self.mode = mode
        self.batch_size = batch_size
        self.max_frame_bytes = max_frame_bytes
        self.heartbeat_interval_s = heartbeat_interval_s
        self._secret = secret
        self._pace = pace
        self.weight = [float(rank)] * 4  # the "model"
        self.num_batches = 0
        self.num_samples = 0
        self.num_sent = 0  # frames sent, the Hello and heartbeats included
        self.num_rounds = 0  # averaging rounds acknowledged
        self.epochs_done: list[int] = []
        self.stopped: str | None = None
        self.proto = RankProtocol(rank, mode=mode, batch_size=batch_size)
        self._ran = False
        self._update_payload: Sequence[bytes | memoryview] = ()
        self._starved = False  # the last turn wanted a pace token and got none

    def run(self, deadline_s: float, *, endpoint: Endpoint | None = None) -> str:
        """Join the run and play the rank until the coordinator stops it.

        Args:
            deadline_s: a ``time.monotonic()`` instant; the rank gives up then.
            endpoint: play on this endpoint instead of opening a
                ``RankEndpoint`` (a test that scripts the coordinator's side).

        Returns:
            Why it stopped: ``"completed"`` (``Shutdown``) or ``"saved: <reason>"``
            (``ShutdownWithSave``). Also kept in ``stopped``.

        Raises:
            RuntimeError: ``run`` was called before (a ``FakeRank`` is single-use).
            ValueError: ``deadline_s`` is already past (it is an instant, not a
                duration), or an ``Update`` carried an average unlike ``LAYOUT``.
            TimeoutError: the deadline passed before the coordinator said stop.
            ConfigError: bad ``rank``, ``world_size``, ``max_frame_bytes`` or secret.
            TransportError: the coordinator sent a bad frame, or could not be
                reached (fatal, as for a real rank).

        The endpoint is closed whatever happens.
        """
        if self._ran:
            raise RuntimeError("FakeRank.run was already called; make a new FakeRank")
        if deadline_s <= time.monotonic():
            raise ValueError(f"deadline_s={deadline_s} is past; pass time.monotonic() + timeout")
        self._ran = True
        if endpoint is None:
            endpoint = RankEndpoint(
                address=self.address,
                rank=self.rank,
                world_size=self.world_size,
                secret=self._secret,
                host=f"fake-{self.rank}",
                max_frame_bytes=self.max_frame_bytes,
            )
        self.num_sent = 1  # the Hello, sent by the constructor
        try:
            return self._loop(endpoint, deadline_s)
        finally:
            endpoint.close()

    # -- the loop ----------------------------------------------------------------

    def _loop(self, endpoint: Endpoint, deadline_s: float) -> str:
        next_beat_s = time.monotonic() + self.heartbeat_interval_s
        while (done := self._act(endpoint)) is not None:
            now = time.monotonic()
            if now >= deadline_s:
                raise TimeoutError(
                    f"fake rank {self.rank}: no Shutdown by the deadline "
                    f"({self.num_batches} batches done)"
                )
            if now >= next_beat_s:
                self._send(endpoint, m.Heartbeat(step=self.num_batches))
                next_beat_s = now + self.heartbeat_interval_s
            wait_s = 0.0
            if not done:
                wait_s = min(next_beat_s, deadline_s) - now
                if self._starved:
                    wait_s = min(wait_s, PACE_WAIT_S)
            self._receive(endpoint, max(wait_s, 0.0))
        assert self.stopped is not None
        return self.stopped

    def _act(self, endpoint: Endpoint) -> bool | None:
        """Do the protocol's next action: True if it did one, False if it holds,
        None once the rank has stopped."""
        self._starved = False
        action = self.proto.next_action()
        match action:
            case Done(reason=reason):
                self.stopped = reason
                return None
            case Hold():
                return False
            case Train():
                if self._pace is not None and not self._pace.acquire(blocking=False):
                    self._starved = True
                    return False
                self._train_one(endpoint, action)
            case Average():
                self.num_rounds += 1
                self._send(endpoint, self.proto.averaged())
            case Upload():
                ready = self.proto.uploaded()
                self._send(endpoint, ready, _LAYOUT_FRAME, _WEIGHT.pack(*self.weight))
            case Load(alpha=alpha):
                payload, self._update_payload = self._update_payload, ()
                if payload:
                    self._load_average(payload, alpha)
                self.num_rounds += 1
                self._send(endpoint, self.proto.loaded())
            case Callback(request=request):
                self._run_callback(endpoint, request)
            case FormGroup(generation=generation):
                self.proto.regrouped(generation)
            case Save():
                self._send(endpoint, self.proto.saved(files=action.nominal_files(self.rank)))
            case Discard():  # a fake rank writes no files
                self.proto.discarded()
            case StartEpoch():
                raise AssertionError("a fake rank runs no epoch_fn")
            case Land():
                raise AssertionError("a fake rank averages at once: it never launches")
            case _:
                assert_never(action)
        return True

    def _receive(self, endpoint: Endpoint, wait_s: float) -> None:
        """Wait up to ``wait_s`` for a message, then take every queued one."""
        item = endpoint.recv(wait_s)
        while item is not None:
            self._handle(*item)
            item = endpoint.recv(0.0)

    def _send(self, endpoint: Endpoint, message: m.RankMessage, *payload: Buffer) -> None:
        endpoint.send(message, payload)
        self.num_sent += 1

    def _handle(self, message: m.CoordMessage, payload: list[bytes | memoryview]) -> None:
        if isinstance(message, m.EpochDone):
            self.epochs_done.append(message.epoch)
        elif isinstance(message, m.Update):
            self._update_payload = payload
        self.proto.handle(message)

    # -- training, averaging, callbacks -------------------------------------------

    def _train_one(self, endpoint: Endpoint, action: Train) -> None:
        self.weight = [w - STEP * (i + 1) for i, w in enumerate(self.weight)]
        self.num_batches += 1
        self.num_samples += action.size
        loss = 1.0 / self.num_batches  # falls, like a loss should
        self._send(endpoint, self.proto.trained(action, batch_ms=BATCH_MS, data_ms=0.0, loss=loss))

    def _load_average(self, payload: Sequence[bytes | memoryview], alpha: float | None) -> None:
        try:
            layout = msgspec.msgpack.decode(bytes(payload[0]), type=Layout)
        except msgspec.DecodeError as exc:
            raise ValueError(f"fake rank {self.rank}: unreadable Update layout: {exc}") from exc
        if layout != LAYOUT:
            raise ValueError(f"fake rank {self.rank}: Update layout {layout} is not {LAYOUT}")
        frames = payload[1:]
        layout.check(frames)
        average = _WEIGHT.unpack(bytes(frames[0]))
        if alpha is None:  # overwrite
            self.weight = list(average)
        else:  # EASGD blend: move alpha of the way to the average
            self.weight = [w + alpha * (a - w) for w, a in zip(self.weight, average, strict=True)]

    def _run_callback(self, endpoint: Endpoint, request: m.RunEval | m.RunCheckpoint) -> None:
        if isinstance(request, m.RunEval):
            metric = 1.0 / (1.0 + sum(abs(w) for w in self.weight))
            self._send(endpoint, self.proto.evaluated(metric=metric, elapsed_ms=0.0, error=None))
        else:
            self._send(endpoint, self.proto.checkpointed(elapsed_ms=0.0, error=None))
