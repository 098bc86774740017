"""The host executes the core's commands in the order they were returned.

A host averages in place (cpu-* modes) and answers ``AverageSnapshots`` with an
``AverageComputed`` event. That event is fed to the core only after the rest
of the command list it came in was executed, so the follow-up's commands run
after everything the core asked for before it. The core here is scripted (a
real ``Coordinator`` whose ``handle`` answers from a table) and the endpoint
records what it was asked to send: no sockets, no threads.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from pathlib import Path

from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.commands import ArmTimer, AverageSnapshots, Command, Emit, Finish, Send
from elche.core.config import CoordinatorConfig, Mode
from elche.core.coordinator import Coordinator
from elche.core.events import AverageComputed, Event, MessageReceived, Started, TimerFired
from elche.runtime.frames import Buffer
from elche.runtime.host import Host
from elche.runtime.transport import Inbound, Received

CONFIG = CoordinatorConfig(
    mode=Mode.parse("cpu-sync"), world_size=1, num_samples=8, batch_size=4, epochs=1
)

END = tl.RunEnd(
    outcome="completed",
    reason="",
    epochs_completed=1,
    rounds_done=1,
    lost_samples=0,
    dead_ranks=(),
    rejected_frames=0,
    anchor=1,
    samples_per_rank=(8,),
)


class ScriptedCore(Coordinator):
    """A coordinator whose ``handle`` answers each event type from ``script``."""

    def __init__(self, script: dict[type[Event], list[Command]]) -> None:
        super().__init__(CONFIG)
        self.script = script
        self.seen: list[Event] = []

    def handle(self, event: Event, now_s: float) -> list[Command]:
        self.seen.append(event)
        return list(self.script.get(type(event), []))


class RecordingEndpoint:
    """Stands in for ``CoordinatorEndpoint``: nothing arrives, sends are recorded."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, m.CoordMessage]] = []

    def poll(self, timeout_s: float) -> list[Inbound]:
        return []

    def send(self, rank: int, message: m.CoordMessage, payload: Sequence[Buffer] = ()) -> None:
        self.sent.append((rank, message))

    def broadcast(
        self, ranks: Iterable[int], message: m.CoordMessage, payload: Sequence[Buffer] = ()
    ) -> list[int]:
        self.sent.extend((rank, message) for rank in ranks)
        return []


def test_an_average_is_handled_after_the_rest_of_its_command_list(tmp_path: Path) -> None:
    endpoint = RecordingEndpoint()
    host = Host(CONFIG, endpoint, tmp_path, log=io.StringIO())  # type: ignore[arg-type]
    core = ScriptedCore(
        {
            Started: [
                AverageSnapshots(round=1, param_mass=(), buffer_mass=()),
                Send(rank=0, message=m.SetBudget(budget=4)),
                ArmTimer(deadline_s=5.0),
            ],
            AverageComputed: [
                Send(rank=0, message=m.Update(round=1, alpha=None)),
                ArmTimer(deadline_s=9.0),
                Emit(event=END),  # the core's account, always just before Finish
                Finish(outcome="completed"),
            ],
        }
    )
    host.core = core

    finish = host.run()

    assert finish == Finish(outcome="completed")
    assert core.seen == [Started(), AverageComputed(round=1)]
    assert endpoint.sent == [(0, m.SetBudget(budget=4)), (0, m.Update(round=1, alpha=None))]
    assert host._deadline == 9.0  # the follow-up's timer was armed last


class LateEndpoint(RecordingEndpoint):
    """Nothing at the first poll; then the heartbeat that came while the host was busy."""

    def __init__(self) -> None:
        super().__init__()
        self.polls: list[list[Inbound]] = [
            [], [Received(rank=0, message=m.Heartbeat(step=3), payload=[])]
        ]  # fmt: skip

    def poll(self, timeout_s: float) -> list[Inbound]:
        return self.polls.pop(0) if self.polls else []


def test_the_timer_judges_silence_after_reading_what_came_while_the_host_was_busy(
    tmp_path: Path,
) -> None:
    # A slow journal write or a starved process keeps the loop from polling past the
    # timer's deadline; the ranks' heartbeats of that time wait in the socket. Fed to
    # the timer first, they would be read as silence and every rank declared lost.
    endpoint = LateEndpoint()
    host = Host(CONFIG, endpoint, tmp_path, log=io.StringIO())  # type: ignore[arg-type]
    core = ScriptedCore(
        {
            Started: [ArmTimer(deadline_s=0.0)],  # already due
            TimerFired: [Emit(event=END), Finish(outcome="completed")],
        }
    )
    host.core = core

    host.run()

    heartbeat = MessageReceived(rank=0, message=m.Heartbeat(step=3))
    assert core.seen == [Started(), heartbeat, TimerFired()]
