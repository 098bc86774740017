"""The stall watchdog: no progress for a while, with ranks live, is dumped.

Rules:

- *Progress* is any change of (rounds done, steps averaged, batches in the
  current window, epochs completed, ranks lost): the coordinator heard of
  work or a decision moved the run.
- With ranks live and the run training or finishing, ``stall_dump_s``
  (default 120 s, the reference's figure) without progress gives one
  ``Stalled`` record and a warning notice that say what each rank is doing
  and what the coordinator waits for; it repeats every ``stall_dump_s``
  while the stall lasts. Progress rearms it.
- The watchdog only reports. The round watchdog (``Coordinator._on_timer``)
  and the heartbeat timeout decide what a stall means for the run.

It is checked on the coordinator's heartbeat timer, so a dump comes within
one heartbeat interval of being due. Nothing here reads a clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elche.core import timeline as tl
from elche.core.commands import Command, Emit, Notice
from elche.core.rank import SaveKind

if TYPE_CHECKING:
    from elche.core.coordinator import Coordinator

__all__ = ["StallWatch", "describe_ranks", "waiting_for"]

Marker = tuple[int, int, int, int, int]


class StallWatch:
    """Watches a coordinator's progress; ``check`` on every timer.

    Args:
        interval_s: seconds without progress before a dump, and between dumps.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._marker: Marker | None = None
        self._since_s = 0.0  # the last progress
        self._next_s = 0.0  # the next dump is due at this time

    def check(self, coord: Coordinator, now_s: float) -> list[Command]:
        """The dump, if one is due at ``now_s``; else nothing."""
        marker = (
            coord.rounds_done, coord.global_step, coord.ledger.total_steps(),
            coord.epochs_completed, len(coord.dead_ranks),
        )  # fmt: skip
        if marker != self._marker:
            self._marker, self._since_s = marker, now_s
            self._next_s = now_s + self.interval_s
            return []
        active = coord.state.value in ("training", "finishing") and bool(coord.live)
        if not active or now_s < self._next_s:
            return []
        self._next_s = now_s + self.interval_s
        silent_s = now_s - self._since_s
        event = tl.Stalled(
            silent_s=round(silent_s, 3),
            waiting_for=waiting_for(coord),
            ranks=describe_ranks(coord, now_s),
        )
        lines = "\n".join(f"  {line}" for line in event.ranks)
        text = (
            f"[stall-watch] no progress for {silent_s:.0f} s; the coordinator waits for "
            f"{event.waiting_for}\n{lines}"
        )
        return [Emit(event=event), Notice(level="warning", text=text)]


def waiting_for(coord: Coordinator) -> str:
    """What the coordinator waits for, in words."""
    rnd = coord.round
    live = set(coord.live)
    parts = []
    if rnd.in_flight:
        missing = sorted(live & rnd.members - set(rnd.acks))
        parts.append(f"round {rnd.number} ({rnd.phase.value}): answers from ranks {missing}")
    elif coord.unsatisfied:
        parts.append(f"ranks {sorted(coord.unsatisfied)} to finish their windows")
    cb = coord.callbacks
    for epoch, rank in sorted(cb.pending_evals.items()):
        parts.append(f"the eval after epoch {epoch} from rank {rank}")
    for version, rank in sorted(cb.pending_checkpoints.items()):
        parts.append(f"checkpoint v{version} from rank {rank}")
    for kind in SaveKind:
        if kind in coord.saves:
            parts.append(f"the {kind.value} save")
    return "; ".join(parts) or "nothing it knows of (no round, callback or save pending)"


def describe_ranks(coord: Coordinator, now_s: float) -> tuple[str, ...]:
    """One line per rank at ``now_s``: its state, host, window and work in hand."""
    lines = []
    for rank, state in enumerate(coord.rank_state):
        text = f"rank {rank}: {state.value}"
        if state.value == "live":
            text += (
                f" on {coord.hosts[rank] or '?'}, {coord.work.steps_since_sync(rank)} steps of a "
                f"{coord.planner.budget[rank]}-step budget since the last average, "
                f"{coord.work.busy_samples(rank)} samples in hand, last heard "
                f"{now_s - coord.last_seen_s[rank]:.1f} s ago"
            )
        lines.append(text)
    return tuple(lines)
