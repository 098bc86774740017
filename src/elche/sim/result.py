"""What a simulated run measured, and the coverage audit behind it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from elche.core.checkpoint import CheckpointMeta

__all__ = ["RankResult", "SimResult", "coverage_errors"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankResult:
    rank: int
    speed: float
    samples: int  # samples this rank contributed to a consensus model
    busy_s: float  # virtual seconds spent training or in callbacks
    idle_s: float  # virtual seconds alive but not busy

    def to_json(self) -> dict[str, float | int]:
        return {
            "rank": self.rank,
            "speed": self.speed,
            "samples": self.samples,
            "busy_s": self.busy_s,
            "idle_s": self.idle_s,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """The ``elche sim --json`` contract (design.md §6), plus diagnostics."""

    mode: str
    world_size: int
    epochs_completed: int
    samples_trained: int
    virtual_wall_s: float
    throughput: float  # samples/s of virtual time
    ideal_throughput: float  # sum of the ranks' solo throughputs
    efficiency: float  # throughput / ideal_throughput
    syncs: int
    lost_samples: int
    duplicated_samples: int
    dead_ranks: list[int]
    outcome: str
    reason: str
    per_rank: list[RankResult]
    rejected_frames: int
    stale_messages: int
    anchor: int
    saved_meta: CheckpointMeta | None = None
    joined_ranks: list[int] = field(default_factory=list)  # ranks that joined the running run

    def to_json(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "world_size": self.world_size,
            "epochs_completed": self.epochs_completed,
            "samples_trained": self.samples_trained,
            "virtual_wall_s": self.virtual_wall_s,
            "throughput": self.throughput,
            "ideal_throughput": self.ideal_throughput,
            "efficiency": self.efficiency,
            "syncs": self.syncs,
            "lost_samples": self.lost_samples,
            "duplicated_samples": self.duplicated_samples,
            "dead_ranks": self.dead_ranks,
            "joined_ranks": self.joined_ranks,
            "outcome": self.outcome,
            "reason": self.reason,
            "anchor": self.anchor,
            "rejected_frames": self.rejected_frames,
            "stale_messages": self.stale_messages,
            "per_rank": [r.to_json() for r in self.per_rank],
        }


def coverage_errors(
    committed: Mapping[int, Sequence[tuple[int, int]]],
    *,
    num_samples: int,
    epochs: Iterable[int],
    resumed: CheckpointMeta | None = None,
    saved: CheckpointMeta | None = None,
) -> tuple[int, int]:
    """Audit the ground truth: samples lost and samples trained twice.

    A sample of an epoch is accounted for when a consensus model saw it
    (``committed``), when a checkpoint we resumed from says it was covered
    before, or when the bundle we saved lists it as still to do.

    Returns:
        ``(lost, duplicated)`` summed over ``epochs``.
    """
    lost = duplicated = 0
    resumed_holes = {c.epoch: c.uncovered for c in resumed.coverage} if resumed else {}
    saved_holes = {c.epoch: c.uncovered for c in saved.coverage} if saved else {}
    for epoch in epochs:
        spans = list(committed.get(epoch, ()))
        if saved is not None and epoch >= saved.epoch and epoch not in saved_holes:
            if spans:
                duplicated += _union_and_overlap(spans)[1]
            continue  # never started: all of it is still to do
        if epoch in resumed_holes:
            spans.extend(_complement(resumed_holes[epoch], num_samples))
        if epoch in saved_holes:
            spans.extend(saved_holes[epoch])
        union, overlap = _union_and_overlap(spans)
        lost += num_samples - union
        duplicated += overlap
    return lost, duplicated


def _complement(holes: Sequence[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    spans, cursor = [], 0
    for offset, size in sorted(holes):
        if offset > cursor:
            spans.append((cursor, offset - cursor))
        cursor = max(cursor, offset + size)
    if cursor < total:
        spans.append((cursor, total - cursor))
    return spans


def _union_and_overlap(spans: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """Covered length and doubly-covered length of ``(offset, size)`` spans."""
    union = 0
    end = -1
    total = 0
    for offset, size in sorted(spans):
        total += size
        stop = offset + size
        if offset >= end:
            union += size
            end = stop
        elif stop > end:
            union += stop - end
            end = stop
    return union, total - union
