"""A fake rank: the real control-plane protocol around a four-float "model".

``FakeRank`` connects a real ``RankEndpoint`` (so every frame it sends is
sealed, sequenced and checked like a worker's) and behaves like a
well-behaved ``elche.runtime.worker.Worker`` whose model is four float32
numbers and whose step takes no time. It never imports torch, so a test can
run a ``Host`` and a few fake ranks as threads of one process in well under a
second.

Rules (the worker's, ``elche/runtime/worker.py``):

- ``AssignChunk`` queues a chunk and sets the budget; ``SetBudget`` sets it.
  Each batch of each chunk is reported with ``BatchDone(epoch, offset,
  size=min(batch_size, left), batch_ms=1.0)``. The rank holds (trains
  nothing) once its steps since the last average reach the budget.
- ``SyncNow`` is answered at once with ``SyncAck(steps=...)``: there is no
  group, so the "collective" is a no-op.
- ``RequestParams`` is answered with ``SnapshotReady`` carrying
  ``[msgpack(Layout), weight]``; in ``cpu-sync`` and ``cpu-cadence`` the rank
  then holds until ``Update`` (with or without an average) and acknowledges
  it with ``SyncAck``; in ``cpu-async`` it keeps training meanwhile.
- ``RunEval``/``RunCheckpoint`` get an ``EvalResult``/``CheckpointResult``.
- A ``Heartbeat`` leaves at least every ``heartbeat_interval_s``.
- ``Shutdown`` ends the run; ``ShutdownWithSave`` is answered with
  ``StateSaved`` first.

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
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

import msgspec

from elche.core import messages as m
from elche.core.config import Mode, Policy
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


@dataclass(slots=True)
class _Chunk:
    epoch: int
    offset: int
    size: int


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
        self._ran = False
        self._chunks: deque[_Chunk] = deque()
        self._budget = 0  # no training before the first AssignChunk
        self._steps_since_sync = 0
        self._pending: m.SyncNow | m.RequestParams | None = None
        self._callbacks: deque[m.RunEval | m.RunCheckpoint] = deque()
        self._waiting_update = False
        self._snapshot_steps = 0
        self._starved = False  # the last turn wanted a pace token and got none

    def run(self, deadline_s: float) -> str:
        """Join the run and play the rank until the coordinator stops it.

        Args:
            deadline_s: a ``time.monotonic()`` instant; the rank gives up then.

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

    def _loop(self, endpoint: RankEndpoint, deadline_s: float) -> str:
        next_beat_s = time.monotonic() + self.heartbeat_interval_s
        while self.stopped is None:
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
            if not self._act(endpoint):
                wait_s = min(next_beat_s, deadline_s) - now
                if self._starved:
                    wait_s = min(wait_s, PACE_WAIT_S)
            self._receive(endpoint, max(wait_s, 0.0))
        return self.stopped

    def _act(self, endpoint: RankEndpoint) -> bool:
        """Do the first thing that applies; False when there is nothing to do."""
        self._starved = False
        if self._waiting_update:
            return False
        if self._pending is not None:
            self._serve_round(endpoint, self._pending)
            self._pending = None
            return True
        if self._callbacks:
            self._run_callback(endpoint, self._callbacks.popleft())
            return True
        if not self._chunks or self._steps_since_sync >= self._budget:
            return False
        if self._pace is not None and not self._pace.acquire(blocking=False):
            self._starved = True
            return False
        self._train_one(endpoint)
        return True

    def _receive(self, endpoint: RankEndpoint, wait_s: float) -> None:
        """Wait up to ``wait_s`` for a message, then take every queued one."""
        item = endpoint.recv(wait_s)
        while item is not None and self.stopped is None:
            self._handle(endpoint, *item)
            item = endpoint.recv(0.0)

    def _send(self, endpoint: RankEndpoint, message: m.RankMessage, *payload: Buffer) -> None:
        endpoint.send(message, payload)
        self.num_sent += 1

    def _handle(
        self, endpoint: RankEndpoint, message: m.CoordMessage, payload: list[bytes | memoryview]
    ) -> None:
        match message:
            case m.AssignChunk(epoch=epoch, offset=offset, size=size, budget=budget):
                self._chunks.append(_Chunk(epoch, offset, size))
                self._budget = budget
            case m.SetBudget(budget=budget):
                self._budget = budget
            case m.SyncNow() | m.RequestParams():
                self._pending = message
            case m.Update():
                self._apply_update(endpoint, message, payload)
            case m.RunEval() | m.RunCheckpoint():
                self._callbacks.append(message)
            case m.EpochDone(epoch=epoch):
                self.epochs_done.append(epoch)
            case m.Shutdown():
                self.stopped = "completed"
            case m.ShutdownWithSave(reason=reason):
                self._send(endpoint, m.StateSaved(path=None))
                self.stopped = f"saved: {reason}"
            case m.Regroup() | m.SetEpochCallbackRole() | m.EvalBroadcast() | m.CoordHeartbeat():
                pass
            case _:
                assert_never(message)

    # -- training, averaging, callbacks -------------------------------------------

    def _train_one(self, endpoint: RankEndpoint) -> None:
        chunk = self._chunks[0]
        size = min(self.batch_size, chunk.size)
        self.weight = [w - STEP * (i + 1) for i, w in enumerate(self.weight)]
        self.num_batches += 1
        self.num_samples += size
        self._steps_since_sync += 1
        loss = 1.0 / self.num_batches  # falls, like a loss should
        done = m.BatchDone(
            epoch=chunk.epoch, offset=chunk.offset, size=size, batch_ms=BATCH_MS, loss=loss
        )
        self._send(endpoint, done)
        chunk.offset += size
        chunk.size -= size
        if chunk.size == 0:
            self._chunks.popleft()

    def _serve_round(self, endpoint: RankEndpoint, request: m.SyncNow | m.RequestParams) -> None:
        steps = self._steps_since_sync
        if isinstance(request, m.SyncNow):
            self._steps_since_sync -= steps
            self.num_rounds += 1
            self._send(endpoint, m.SyncAck(cycle=request.cycle, steps=steps))
            return
        self._snapshot_steps = steps
        ready = m.SnapshotReady(cycle=request.cycle, steps=steps)
        self._send(endpoint, ready, _LAYOUT_FRAME, _WEIGHT.pack(*self.weight))
        self._waiting_update = self.mode.policy is not Policy.ASYNC

    def _apply_update(
        self, endpoint: RankEndpoint, update: m.Update, payload: Sequence[bytes | memoryview]
    ) -> None:
        """Load the average (if any), then acknowledge the round.

        Raises:
            ValueError: the average does not match ``LAYOUT``.
        """
        if payload:
            self._load_average(payload, update.alpha)
        steps = self._snapshot_steps
        self._snapshot_steps = 0
        self._waiting_update = False
        self._steps_since_sync -= steps
        self.num_rounds += 1
        self._send(endpoint, m.SyncAck(cycle=update.cycle, steps=steps))

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

    def _run_callback(self, endpoint: RankEndpoint, request: m.RunEval | m.RunCheckpoint) -> None:
        if isinstance(request, m.RunEval):
            metric = 1.0 / (1.0 + sum(abs(w) for w in self.weight))
            self._send(endpoint, m.EvalResult(epoch=request.epoch, metric=metric, elapsed_ms=0.0))
        else:
            self._send(endpoint, m.CheckpointResult(version=request.version, elapsed_ms=0.0))
