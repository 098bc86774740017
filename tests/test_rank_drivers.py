"""One scripted coordinator, three rank drivers, the same answers.

The real worker (``elche.runtime.worker``), the simulator's ranks
(``elche.sim.engine``) and ``FakeRank`` all drive ``elche.core.rank``. Each is
fed the same scripted coordinator messages in stages: a stage is delivered,
the rank works until it holds, then the next stage comes. What each driver
sends back, stage by stage, must be the same, and what the rules say.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.commands import ArmTimer, Command, Emit, Finish, Send
from elche.core.config import Mode
from elche.core.events import Event, MessageReceived, RankJoined, TimerFired
from elche.runtime.worker import RankSpec, UserFns, Worker
from elche.sim.engine import SimConfig, Simulation
from elche.testing import FakeRank

Script = list[list[m.CoordMessage]]
Seen = tuple[object, ...]

COLLECTIVE: Script = [
    [m.AssignChunk(epoch=0, offset=0, size=96, budget=2, window=2)],
    [m.SyncNow(round=1, generation=0)],
    [m.RunEval(epoch=0), m.AssignChunk(epoch=0, offset=96, size=64, budget=2)],
    [m.Regroup(generation=1, members=[0]), m.SyncNow(round=2, generation=1)],
    [m.RunCheckpoint(version=1)],
    [m.Shutdown(writer=0, seq=1)],
    [m.Shutdown(writer=-1)],
]
COLLECTIVE_ANSWERS: list[list[Seen]] = [
    [("BatchDone", 0, 0, 32), ("BatchDone", 0, 32, 32)],
    [("SyncAck", 1, 2), ("BatchDone", 0, 64, 32)],
    [("EvalResult", 0), ("BatchDone", 0, 96, 32)],
    [("SyncAck", 2, 2), ("BatchDone", 0, 128, 32)],
    [("CheckpointResult", 1)],
    [("StateSaved", 1)],
    [],
]
COORDINATOR: Script = [
    [m.AssignChunk(epoch=0, offset=0, size=64, budget=2)],
    [m.RequestParams(round=1)],
    [m.Update(round=7), m.AssignChunk(epoch=0, offset=64, size=32, budget=2)],
    [m.Update(round=1)],
    [m.ShutdownWithSave(reason="unrecoverable", writer=0, seq=1)],
    [m.Shutdown(writer=-1)],
]
COORDINATOR_ANSWERS: list[list[Seen]] = [
    [("BatchDone", 0, 0, 32), ("BatchDone", 0, 32, 32)],
    [("SnapshotReady", 1, 2)],
    [],  # a stale Update, and the rank still holds for its own
    [("SyncAck", 1, 2), ("BatchDone", 0, 64, 32)],
    [("StateSaved", 1)],
    [],
]
CASES = [
    pytest.param(Mode.CADENCE, COLLECTIVE, COLLECTIVE_ANSWERS, "completed", id="collective"),
    pytest.param(
        Mode.CPU_CADENCE, COORDINATOR, COORDINATOR_ANSWERS, "saved: unrecoverable", id="coordinator"
    ),
]


def seen(message: m.RankMessage) -> list[Seen]:
    """What the comparison looks at: the protocol's facts, not timings or metrics."""
    match message:
        case m.Batches(items=items):
            return [x for item in items for x in seen(item)]
        case m.BatchDone(epoch=epoch, offset=offset, size=size):
            return [("BatchDone", epoch, offset, size)]
        case m.SyncAck(round=number, steps=steps) | m.SnapshotReady(round=number, steps=steps):
            return [(type(message).__name__, number, steps)]
        case m.EvalResult(epoch=epoch):
            return [("EvalResult", epoch)]
        case m.CheckpointResult(version=version):
            return [("CheckpointResult", version)]
        case m.StateSaved(seq=seq):
            return [("StateSaved", seq)]
        case m.Heartbeat():
            return []
    raise AssertionError(f"unexpected message {message!r}")


END = tl.RunEnd(
    outcome="completed",
    reason="",
    epochs_completed=0,
    rounds_done=0,
    lost_samples=0,
    dead_ranks=(),
    rejected_frames=0,
    anchor=0,
    samples_per_rank=(0,),
)


class ScriptedLink:
    """The coordinator's side for the worker (as its bridge) and FakeRank (as its endpoint).

    A receive that may wait means the rank holds: the next stage is delivered.
    """

    def __init__(self, script: Script) -> None:
        self._stages = deque(deque((msg, []) for msg in stage) for stage in script)
        self._queue: deque[tuple[m.CoordMessage, list[bytes]]] = deque()
        self.answers: list[list[Seen]] = []
        self.step = 0  # the bridge's heartbeat counter

    def _next(self, timeout_s: float) -> tuple[m.CoordMessage, list[bytes]] | None:
        if not self._queue and timeout_s > 0:
            if not self._stages:
                raise AssertionError("the script is over and the rank has not stopped")
            self._queue = self._stages.popleft()
            self.answers.append([])
        return self._queue.popleft() if self._queue else None

    get = recv = _next

    def send(self, message: m.RankMessage, payload: Sequence[object] = ()) -> None:
        self.answers[-1].extend(seen(message))

    def close(self) -> None:
        pass


class ScriptedCore:
    """The coordinator's side for the simulator: one stage per virtual second."""

    def __init__(self, script: Script) -> None:
        self._stages = deque(script)
        self.answers: list[list[Seen]] = []

    def handle(self, event: Event, now_s: float) -> list[Command]:
        match event:
            case RankJoined() | TimerFired():
                if not self._stages:
                    return [Emit(event=END), Finish(outcome="completed")]
                self.answers.append([])
                stage = self._stages.popleft()
                return [
                    *(Send(rank=0, message=msg) for msg in stage),
                    ArmTimer(deadline_s=now_s + 1),
                ]
            case MessageReceived(message=message):
                self.answers[-1].extend(seen(message))
        return []


def run_worker(mode: Mode, script: Script, tmp_path: Path) -> tuple[list[list[Seen]], str]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(200, 4), torch.randn(200, 1))
    fns = UserFns(
        model_fn=lambda device: nn.Linear(4, 1),
        optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.1),
        step_fn=lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1]),
        dataset=data,
    )
    spec = RankSpec(
        rank=0,
        world_size=1,
        address="",
        secret_hex="",
        run_dir=str(tmp_path),
        mode=mode.value,
        seed=0,
        num_samples=len(data),
    )
    worker = Worker(spec, fns, 32)
    link = ScriptedLink(script)
    worker.bridge = link  # type: ignore[assignment]  # the script plays the bridge
    return link.answers, worker.run()


def run_fake(mode: Mode, script: Script) -> tuple[list[list[Seen]], str]:
    fake = FakeRank("", 0, 1, b"", mode=mode, batch_size=32, heartbeat_interval_s=3600.0)
    link = ScriptedLink(script)
    stopped = fake.run(time.monotonic() + 60.0, endpoint=link)
    return link.answers, stopped


def run_sim(mode: Mode, script: Script) -> tuple[list[list[Seen]], str]:
    config = SimConfig(speeds=(1.0,), mode=mode, samples=200, heartbeat_interval_s=1e6)
    core = ScriptedCore(script)
    sim = Simulation(config, core=core)  # type: ignore[arg-type]  # a scripted coordinator
    sim.run()
    reason = sim.ranks[0].proto.stop_reason
    assert reason is not None
    return core.answers, reason


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "script", "answers", "stopped"), CASES)
def test_every_driver_answers_a_script_alike(
    mode: Mode, script: Script, answers: list[list[Seen]], stopped: str, tmp_path: Path
) -> None:
    results = {
        "worker": run_worker(mode, script, tmp_path),
        "fake": run_fake(mode, script),
        "sim": run_sim(mode, script),
    }
    for driver, result in results.items():
        assert result == (answers, stopped), driver
