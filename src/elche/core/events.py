"""Events: the facts the IO shell feeds into ``Coordinator.handle``.

Events are past-tense. Each carries only what the shell observed; the core
gets the current time separately (``handle(event, now_s)``) and never reads a
clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from elche.core.messages import Held, RankMessage

__all__ = [
    "AverageComputed",
    "Event",
    "FrameRejected",
    "MessageReceived",
    "MetaWriteFailed",
    "RankJoined",
    "RankLost",
    "Started",
    "StopRequested",
    "TimerFired",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Started:
    """The shell is up; the core may arm its first timers."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankJoined:
    """A rank connected and said hello."""

    rank: int
    host: str = ""
    held: Held | None = None  # what it holds, rejoining a restarted coordinator
    layout: str = ""  # a joiner's model's layout (``Hello.layout``)


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageReceived:
    """A decoded, authenticated message arrived from ``rank``."""

    rank: int
    message: RankMessage


@dataclass(frozen=True, slots=True, kw_only=True)
class RankLost:
    """The shell saw ``rank`` go: its process exited or its connection dropped."""

    rank: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FrameRejected:
    """The shell dropped a frame (bad tag, replay, oversize, undecodable)."""

    reason: str
    rank: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AverageComputed:
    """Coordinator backend: the shell finished averaging ``round``."""

    round: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerFired:
    """A deadline the core armed with ``ArmTimer`` has passed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StopRequested:
    """The run was asked to stop: a signal, or the launching process went away.

    A training run saves a bundle and stops (``SaveReason.GRACEFUL_SHUTDOWN``;
    ``COORDINATOR_HOST_LOST`` where ``host_lost``: the rank whose process
    started the coordinator is gone, and nobody asked); one still forming
    fails; one whose training is over completes.
    """

    reason: str
    host_lost: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class MetaWriteFailed:
    """The meta of save ``seq`` (``WriteMeta``) could not be written: the save is
    not committed, and the meta on disk still names the save before it."""

    seq: int
    error: str


Event = (
    Started | RankJoined | MessageReceived | RankLost | FrameRejected | AverageComputed
    | TimerFired | StopRequested | MetaWriteFailed
)  # fmt: skip
