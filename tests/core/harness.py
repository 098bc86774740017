"""A hand-driven shell for coordinator unit tests: no threads, no clocks."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterable

from elche.core import messages as m
from elche.core.commands import Broadcast, Command, Send
from elche.core.config import CoordinatorConfig, Mode, SchedulerConfig
from elche.core.coordinator import Coordinator, RunState
from elche.core.events import Event, MessageReceived, RankJoined, Started
from elche.core.rank import SaveKind
from elche.core.saves import SaveRound


def config(*, fill_wait: bool = False, **overrides: object) -> CoordinatorConfig:
    """A test run's configuration.

    ``fill_wait`` is off unless asked for: the harness's clock stands still
    while a rank trains, so a rank out of budget would see every peer's
    steps left as time still ahead of it and fill it, where a real rank's
    peers train on meanwhile (the fill has its own tests, with a clock).
    """
    scheduler = overrides.pop("scheduler", None) or SchedulerConfig()
    assert isinstance(scheduler, SchedulerConfig)
    overrides["scheduler"] = dataclasses.replace(scheduler, fill_wait=fill_wait)
    base: dict[str, object] = {
        "mode": Mode.CADENCE,
        "world_size": 2,
        "num_samples": 640,
        "batch_size": 32,
        "epochs": 1,
        "heartbeat_timeout_s": 5.0,
    }
    base.update(overrides)
    return CoordinatorConfig(**base)  # type: ignore[arg-type]  # test factory


class Harness:
    """Feeds events at a hand-set time and keeps what each rank was told."""

    def __init__(self, cfg: CoordinatorConfig | None = None, **overrides: object) -> None:
        self.cfg = cfg if cfg is not None else config(**overrides)
        self.core = Coordinator(self.cfg)
        self.now = 0.0
        self.log: list[Command] = []
        ws = self.cfg.num_slots  # the join slots' ranks too
        self.inbox: list[list[m.CoordMessage]] = [[] for _ in range(ws)]
        self.chunks: list[deque[list[int]]] = [deque() for _ in range(ws)]
        # What each rank's model holds, as a real rank keeps it (``m.Held``),
        # and every batch an applied average took, by rank: the ranks' own books.
        self.last_round = [0] * ws
        self.averaged: list[list[tuple[int, int, int]]] = [[] for _ in range(ws)]
        self.since: list[list[tuple[int, int, int]]] = [[] for _ in range(ws)]
        self.in_averages: list[tuple[int, int, int]] = []
        self.loss: float | None = None  # the loss every ``BatchDone`` reports

    def held(self, rank: int) -> m.Held:
        return m.Held(
            last_round=self.last_round[rank],
            averaged=tuple(self.averaged[rank]),
            since=tuple(self.since[rank]),
        )

    def feed(self, event: Event, *, at: float | None = None) -> list[Command]:
        if at is not None:
            self.now = at
        out = self.core.handle(event, self.now)
        self.log.extend(out)
        for command in out:
            targets: Iterable[int] = ()
            if isinstance(command, Send):
                targets = (command.rank,)
            elif isinstance(command, Broadcast):
                targets = command.ranks
            for rank in targets:
                message = command.message  # type: ignore[union-attr]  # Send or Broadcast
                self.inbox[rank].append(message)
                if isinstance(message, m.AssignChunk):
                    self.chunks[rank].append([message.epoch, message.offset, message.size])
        return out

    def form(self) -> list[Command]:
        out = self.feed(Started())
        for rank in range(self.cfg.world_size):
            out += self.feed(RankJoined(rank=rank))
        return out

    def send(self, rank: int, message: m.RankMessage) -> list[Command]:
        if isinstance(message, m.BatchDone):
            self.since[rank].append((message.epoch, message.offset, message.size))
        elif isinstance(message, m.SyncAck):  # the rank applied the average
            held = self.since[rank]
            took, self.since[rank] = held[: message.steps], held[message.steps :]
            self.averaged[rank] = took
            self.in_averages += took
            self.last_round[rank] = message.round
        return self.feed(MessageReceived(rank=rank, message=message))

    def train(
        self, rank: int, steps: int, batch_ms: float = 10.0, *, nonfinite: bool = False
    ) -> list[Command]:
        """Report ``steps`` batches of the rank's assigned work, in order (``nonfinite``:
        each with a non-finite loss)."""
        out: list[Command] = []
        bs = self.cfg.batch_size
        for _ in range(steps):
            epoch, offset, size = self.chunks[rank][0]
            take = min(bs, size)
            done = m.BatchDone(
                epoch=epoch, offset=offset, size=take, batch_ms=batch_ms, loss=self.loss,
                nonfinite=nonfinite,
            )  # fmt: skip
            out += self.send(rank, done)
            if take == size:
                self.chunks[rank].popleft()
            else:
                self.chunks[rank][0] = [epoch, offset + take, size - take]
        return out

    def averaging(self, rank: int) -> bool:
        """Whether ``rank`` was asked to average and has not acknowledged yet."""
        rnd = self.core.round
        return rnd.in_flight and rank in rnd.members and rank not in rnd.acks

    def quota(self, rank: int) -> int:
        """Steps ``rank`` trains before it waits for the others.

        While the probe streams (``Planner.probing``) that is its probe
        steps, as a real rank is still training when the slowest one ends
        its probe; after that, its budget.
        """
        planner = self.core.planner
        return planner.window_steps(rank) if planner.probing else planner.budget[rank]

    def train_window(self, ms: dict[int, float] | None = None) -> list[Command]:
        """Train every live rank up to its quota, in turns, until none can train.

        The first window's probe comes first (everyone's probe steps), then
        the rest of the window. Rank ``r`` takes ``ms[r]`` per batch (10 ms).
        """
        out: list[Command] = []
        moved = True
        while moved and self.core.state is RunState.TRAINING:
            moved = False
            for rank in self.core.live:
                steps = self.core.work.steps_since_sync
                # A rank serves its round before it trains (``core.rank``).
                while (
                    not self.averaging(rank)
                    and self.chunks[rank]
                    and steps(rank) < self.quota(rank)
                ):
                    out += self.train(rank, 1, batch_ms=(ms or {}).get(rank, 10.0))
                    moved = True
        return out

    def received(self, rank: int, kind: type) -> list[m.CoordMessage]:
        return [msg for msg in self.inbox[rank] if isinstance(msg, kind)]

    def answer_saves(self, *, final: bool = True) -> list[Command]:
        """Answer every save in flight (but the final one unless ``final``) as
        ranks that wrote their files would."""
        out: list[Command] = []
        for save in list(self.core.saves.rounds.values()):
            if save.kind is SaveKind.FINAL and not final:
                continue
            for rank in sorted(save.awaiting):
                out += self.send(rank, state_saved(save, rank))
        return out

    def run_to_end(
        self,
        ms: dict[int, float] | None = None,
        *,
        periodic: bool = True,
        final: bool = True,
        until: Callable[[], bool] | None = None,
    ) -> list[Command]:
        """Train every live rank through every window until training is over.

        Rank ``r`` takes ``ms[r]`` per batch (10 ms by default). Periodic
        bundles are answered as they come (unless ``periodic`` is false), the
        final model once training is over (unless ``final`` is false). With
        ``until``, it stops (answering nothing more) once ``until()`` is true.
        """
        out: list[Command] = []
        number = 0
        for _ in range(200):
            if self.core.state is not RunState.TRAINING:
                break
            if until is not None and until():
                return out
            out += self.train_window(ms)
            rnd = self.core.round
            if until is not None and until():
                return out
            if rnd.in_flight and rnd.number != number:
                number = rnd.number
                for rank in sorted(rnd.members):
                    steps = self.core.work.steps_since_sync(rank)
                    out += self.send(rank, m.SyncAck(round=number, steps=steps))
            if periodic:
                out += self.answer_saves(final=False)
        return out + (self.answer_saves() if final else [])


def of(commands: Iterable[Command], kind: type) -> list[Command]:
    return [c for c in commands if isinstance(c, kind)]


def messages(commands: Iterable[Command], kind: type) -> list[m.CoordMessage]:
    found = []
    for c in commands:
        if isinstance(c, Send | Broadcast) and isinstance(c.message, kind):
            found.append(c.message)
    return found


def state_saved(save: SaveRound, rank: int, error: str | None = None) -> m.StateSaved:
    """The answer of ``rank`` to ``save`` had it written its files (or failed with ``error``)."""
    if error is not None:
        return m.StateSaved(seq=save.seq, error=error, writer=rank == save.writer)
    final = save.kind is SaveKind.FINAL
    kinds = ["final"] if final else ["optim"] + (["model"] if rank == save.writer else [])
    files = [
        m.SavedFile(kind=kind, name=f"run.s{save.seq}.{rank}.{kind}", size=1, sha256="0" * 64)
        for kind in kinds
    ]
    return m.StateSaved(seq=save.seq, files=files, writer=rank == save.writer)


__all__ = ["Harness", "SchedulerConfig", "config", "messages", "of", "state_saved"]
