"""Commands: what ``Coordinator.handle`` asks the IO shell to do.

Commands are imperative. The shell executes them in order and feeds the
outcome back as events. A failed send is not reported back: a rank that can
no longer be reached shows up as ``RankLost``.
"""

from __future__ import annotations

from dataclasses import dataclass

from elche.core.checkpoint import CheckpointMeta
from elche.core.journal import JournalRecord
from elche.core.messages import CoordMessage
from elche.core.timeline import TimelineEvent

__all__ = [
    "AppendJournal",
    "ArmTimer",
    "AverageSnapshots",
    "Broadcast",
    "Command",
    "Emit",
    "Finish",
    "Notice",
    "ReformFirstGroup",
    "Send",
    "WriteMeta",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Send:
    """Send ``message`` to ``rank``."""

    rank: int
    message: CoordMessage


@dataclass(frozen=True, slots=True, kw_only=True)
class Broadcast:
    """Send ``message`` to each rank in ``ranks`` (best effort)."""

    ranks: tuple[int, ...]
    message: CoordMessage


@dataclass(frozen=True, slots=True, kw_only=True)
class ArmTimer:
    """Feed ``TimerFired`` once the monotonic clock reaches ``deadline_s``."""

    deadline_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class AverageSnapshots:
    """Coordinator backend: average the uploaded snapshots of ``round``.

    ``param_mass[r]`` weighs rank r's parameters (steps ** gamma);
    ``buffer_mass[r]`` weighs its buffers (1 if it moved, else 0). Ranks not
    listed are left out. Reply with ``AverageComputed``.
    """

    round: int
    param_mass: tuple[tuple[int, float], ...]
    buffer_mass: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteMeta:
    """Write the checkpoint meta sidecar next to ``stem``."""

    stem: str
    meta: CheckpointMeta


@dataclass(frozen=True, slots=True, kw_only=True)
class AppendJournal:
    """Append ``record`` to the run's journal and make it durable before going on.

    ``compact``: the record replaces the journal's records (the open epochs
    changed), written so that a crash leaves the old journal or the new one.
    """

    record: JournalRecord
    compact: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Notice:
    """Log ``text`` at ``level`` (``"info"``, ``"warning"`` or ``"error"``)."""

    level: str
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Emit:
    """Append ``event`` to the run's timeline (the shell stamps its time)."""

    event: TimelineEvent


@dataclass(frozen=True, slots=True, kw_only=True)
class ReformFirstGroup:
    """A rank was lost while the ranks gather for their first collective group: tell
    those still gathering (through the group store) to form ``generation`` of
    ``members`` instead. Ranks past the first group ignore it; ``Regroup`` follows."""

    generation: int
    members: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Finish:
    """The run is over: ``outcome`` is ``completed`` or ``saved_and_shutdown``.

    Always right after ``Emit(event=RunEnd(...))``, the core's account of the run.
    """

    outcome: str
    reason: str = ""


Command = (
    Send
    | Broadcast
    | ArmTimer
    | AverageSnapshots
    | WriteMeta
    | AppendJournal
    | Notice
    | Emit
    | ReformFirstGroup
    | Finish
)
