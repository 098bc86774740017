"""Hypothesis state machine: random event streams against the coordinator.

The rules play well-behaved ranks (train what they were given, ack rounds),
badly-behaved ones (junk batches, stale acks, hellos) and the shell (deaths,
timers, rejected frames) in random order. After every step the invariants
must hold; two coordinators fed the same stream emit the same commands.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from elche.core import messages as m
from elche.core.commands import Broadcast, Command, Send
from elche.core.config import CoordinatorConfig, Mode
from elche.core.coordinator import Coordinator, RankState, RunState
from elche.core.events import (
    AverageComputed,
    Event,
    FrameRejected,
    MessageReceived,
    RankJoined,
    RankLost,
    Started,
    TimerFired,
)
from tests.core.harness import state_saved

WORLD = 3


class CoordinatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core: Coordinator | None = None
        self.twin: Coordinator | None = None
        self.now = 0.0
        self.chunks: list[list[list[int]]] = [[] for _ in range(WORLD)]
        self.gone: set[int] = set()
        self.faults = 0  # kills and misbehaviour, rationed so runs can finish

    @rule(mode=st.sampled_from(list(Mode)), samples=st.integers(1, 400), bs=st.integers(1, 40))
    @precondition(lambda self: self.core is None)
    def start(self, mode: Mode, samples: int, bs: int) -> None:
        cfg = CoordinatorConfig(
            mode=mode, world_size=WORLD, num_samples=samples, batch_size=bs, epochs=2,
            heartbeat_timeout_s=3.0, has_eval_fn=True, checkpoint_every=1, save_path="x",
        )  # fmt: skip
        self.core, self.twin = Coordinator(cfg), Coordinator(cfg)
        self.feed(Started())
        for rank in range(WORLD):
            self.feed(RankJoined(rank=rank))

    def feed(self, event: Event) -> list[Command]:
        assert self.core is not None and self.twin is not None
        gone_before = {
            r for r, s in enumerate(self.core.rank_state) if s.value in ("dead", "errored")
        }
        out = self.core.handle(event, self.now)
        assert out == self.twin.handle(event, self.now), "same events, same commands"
        for command in out:
            targets = {command.rank} if isinstance(command, Send) else set()
            if isinstance(command, Broadcast):
                targets = set(command.ranks)
            told_refused = isinstance(command, Send) and _refusal(command.message)
            if not told_refused:  # a gone rank that spoke again is told so, nothing else
                assert not targets & gone_before, f"{command} targets a gone rank"
            if isinstance(command, Send) and isinstance(command.message, m.AssignChunk):
                c = command.message
                self.chunks[command.rank].append([c.epoch, c.offset, c.size])
        return out

    def live(self) -> list[int]:
        assert self.core is not None
        return [r for r, s in enumerate(self.core.rank_state) if s is RankState.LIVE]

    @rule(rank=st.integers(0, WORLD - 1), steps=st.integers(1, 5))
    @precondition(lambda self: self.core is not None)
    def train(self, rank: int, steps: int) -> None:
        assert self.core is not None
        bs = self.core.config.batch_size
        for _ in range(steps):
            if not self.chunks[rank] or rank not in self.live():
                return
            epoch, offset, size = self.chunks[rank][0]
            take = min(bs, size)
            self.feed(MessageReceived(rank=rank, message=m.BatchDone(
                epoch=epoch, offset=offset, size=take, batch_ms=10.0 * (rank + 1))))  # fmt: skip
            if take == size:
                self.chunks[rank].pop(0)
            else:
                self.chunks[rank][0] = [epoch, offset + take, size - take]

    @rule()
    @precondition(lambda self: self.core is not None)
    def train_windows(self) -> None:
        """Every live rank trains up to its budget."""
        assert self.core is not None
        for rank in self.live():
            left = self.core.planner.budget[rank] - self.core.work.steps_since_sync(rank)
            if left > 0:
                self.train(rank, left)

    @rule()
    @precondition(lambda self: self.core is not None)
    def ack_round(self) -> None:
        assert self.core is not None
        rnd = self.core.round
        if not rnd.in_flight:
            return
        for rank in sorted(rnd.members & set(self.live())):
            if self.core.config.mode.backend.value == "coordinator":
                if rnd.phase.value == "collecting":
                    steps = self.core.work.steps_since_sync(rank)
                    self.feed(MessageReceived(rank=rank, message=m.SnapshotReady(
                        round=rnd.number, steps=steps)))  # fmt: skip
                elif rnd.phase.value == "applying":
                    self.feed(MessageReceived(rank=rank, message=m.SyncAck(
                        round=rnd.number, steps=0)))  # fmt: skip
            else:
                steps = self.core.work.steps_since_sync(rank)
                self.feed(MessageReceived(rank=rank, message=m.SyncAck(
                    round=rnd.number, steps=steps, divergence=0.01)))  # fmt: skip
            if not rnd.in_flight:
                return
        if rnd.phase.value == "averaging":
            self.feed(AverageComputed(round=rnd.number))

    @rule(fail=st.booleans())
    @precondition(lambda self: self.core is not None)
    def callbacks_answer(self, fail: bool) -> None:
        """The ranks asked to run callbacks (or to save) answer."""
        assert self.core is not None
        error = "boom" if fail else None
        for epoch, rank in sorted(self.core.callbacks.pending_evals.items()):
            self.feed(MessageReceived(rank=rank, message=m.EvalResult(
                epoch=epoch, metric=0.5, elapsed_ms=3.0, error=error)))  # fmt: skip
        for version, rank in sorted(self.core.callbacks.pending_checkpoints.items()):
            self.feed(MessageReceived(rank=rank, message=m.CheckpointResult(
                version=version, elapsed_ms=1.0, error=error)))  # fmt: skip
        for save in list(self.core.saves.rounds.values()):
            for rank in sorted(save.awaiting):
                self.feed(MessageReceived(rank=rank, message=state_saved(save, rank, error)))

    @rule(rank=st.integers(0, WORLD - 1))
    @precondition(lambda self: self.core is not None and self.faults < 2)
    def kill(self, rank: int) -> None:
        self.faults += 1
        self.feed(RankLost(rank=rank, reason="SIGKILL"))
        self.gone.add(rank)

    @rule(
        rank=st.integers(0, WORLD - 1),
        offset=st.integers(0, 1000),
        number=st.integers(0, 9),
        kind=st.integers(0, 3),
    )
    @precondition(lambda self: self.core is not None and self.faults < 2)
    def misbehave(self, rank: int, offset: int, number: int, kind: int) -> None:
        self.faults += 1
        junk = [
            m.BatchDone(epoch=0, offset=offset, size=1, batch_ms=1.0),
            m.SyncAck(round=number, steps=offset),
            m.SnapshotReady(round=number, steps=offset),
            m.Hello(rank=rank, world_size=WORLD),
        ][kind]
        self.feed(MessageReceived(rank=rank, message=junk))
        self.feed(FrameRejected(reason="bad tag", rank=rank))

    @rule(dt=st.floats(0.1, 5.0))
    @precondition(lambda self: self.core is not None)
    def tick(self, dt: float) -> None:
        self.now += dt
        self.feed(TimerFired())
        for rank in self.live():
            if rank not in self.gone:
                self.feed(MessageReceived(rank=rank, message=m.Heartbeat()))

    @invariant()
    def books_balance(self) -> None:
        if self.core is None:
            return
        core = self.core
        for pool in core.work.pools.values():
            held = sum(pool.outstanding(r) for r in range(WORLD))
            assert pool.committed() + held + pool.remaining() == pool.total
        for rank in range(WORLD):
            assert core.work.steps_since_sync(rank) >= 0
            assert core.elche.batch_counts[rank] >= 1
        if core.state in (RunState.TRAINING, RunState.FINISHING):
            assert self.live(), "training without a live rank"
        if core.outcome == "completed":
            assert core.epochs_completed == 2


CoordinatorMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=60, deadline=None
)
TestCoordinatorMachine = pytest.mark.slow(CoordinatorMachine.TestCase)


def _refusal(message: m.CoordMessage) -> bool:
    """A ``Shutdown`` telling a rank the run went on without it."""
    return isinstance(message, m.Shutdown) and bool(message.refused)
