"""The balancer's lifecycle phase and its saved trajectory.

``Phase`` is where ElChe is in its life (it gates election and growth, and
the meta-controller reads it). ``ElCheState`` is what a checkpoint keeps of
the balancer so a resumed run continues its trajectory: the anchor, the
elected rank, each rank's smoothed pace, the phase and the calibration count,
plus the convergence guard's history, which the coordinator fills in. The
user's knobs and the transient state (a staged proposal, the growth latch,
slack, fill) are not saved: a resumed run takes its knobs from its own
configuration, and the transient state belongs to the window that was cut.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from elche.core.errors import ConfigError

__all__ = ["MAX_COUNT", "ElCheState", "Phase", "check_range"]


class Phase(enum.Enum):
    """Lifecycle of the balancer; ordered ``PROBE < WARMUP < STABLE < MATURE``."""

    PROBE = "probe"
    WARMUP = "warmup"
    STABLE = "stable"
    MATURE = "mature"

    @property
    def order(self) -> int:
        """Position in the lifecycle, 0 for ``PROBE``."""
        return _PHASE_ORDER[self]

    def __lt__(self, other: object) -> bool:
        return self.order < _order_of(other)

    def __le__(self, other: object) -> bool:
        return self.order <= _order_of(other)

    def __gt__(self, other: object) -> bool:
        return self.order > _order_of(other)

    def __ge__(self, other: object) -> bool:
        return self.order >= _order_of(other)


def _order_of(other: object) -> int:
    if not isinstance(other, Phase):
        raise TypeError(f"cannot order a Phase against {type(other).__name__}")
    return other.order


_PHASE_ORDER = {phase: i for i, phase in enumerate(Phase)}

# The largest count a checkpoint meta may carry: the largest integer a JSON
# number (an IEEE double) holds exactly, well inside the wire's 64-bit ints;
# a million steps a second would take 285 years to reach it. A count past it
# is a corrupt or hostile meta, not a run (10**30 steps overflowed the wire).
MAX_COUNT = 2**53


def check_range(field: str, value: int, low: int, high: int = MAX_COUNT) -> None:
    """Raise ``ConfigError`` naming ``field`` unless ``low <= value <= high``."""
    if not low <= value <= high:
        raise ConfigError(field, f"must be in [{low}, {high}], got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ElCheState:
    """The balancer's trajectory, saved so a resumed run balances on from it.

    Raises:
        ConfigError: a field is out of range (anchor outside [1, MAX_COUNT],
            a rank or count outside [0, MAX_COUNT], a negative or non-finite
            mean, a non-finite trend).
    """

    anchor: int
    anchor_rank: int | None
    smoothed_ms_per_batch: tuple[float, ...]
    phase: Phase
    calibration_count: int
    trend_history: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        check_range("anchor", self.anchor, 1)
        if self.anchor_rank is not None:
            check_range("anchor_rank", self.anchor_rank, 0)
        check_range("calibration_count", self.calibration_count, 0)
        if not all(math.isfinite(m) and m >= 0 for m in self.smoothed_ms_per_batch):
            raise ConfigError("smoothed_ms_per_batch", "entries must be finite and >= 0")
        if self.trend_history is not None and not all(map(math.isfinite, self.trend_history)):
            raise ConfigError("trend_history", "entries must be finite")

    def for_slots(self, num_slots: int) -> ElCheState:
        """This state for a run of ``num_slots`` rank ids (its ranks, then the
        joiners' slots): each entry is a rank id's, so a run resumed with other
        ``join_slots`` keeps its ranks' paces, and slots it adds start
        unmeasured (0). An anchor rank past them starts unelected."""
        paces = self.smoothed_ms_per_batch[:num_slots]
        paces += (0.0,) * (num_slots - len(paces))
        rank = (
            self.anchor_rank
            if self.anchor_rank is not None and self.anchor_rank < num_slots
            else None
        )
        return dataclasses.replace(self, smoothed_ms_per_batch=paces, anchor_rank=rank)

    def to_json(self) -> dict[str, object]:
        """A JSON-ready mapping; the phase is its lower-case name."""
        history = None if self.trend_history is None else list(self.trend_history)
        return {
            "anchor": self.anchor,
            "anchor_rank": self.anchor_rank,
            "smoothed_ms_per_batch": list(self.smoothed_ms_per_batch),
            "phase": self.phase.value,
            "calibration_count": self.calibration_count,
            "trend_history": history,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> ElCheState:
        """Parse ``to_json`` output.

        Raises:
            ConfigError: a field is missing, of the wrong type or out of range.
        """
        phase = d.get("phase")
        if not isinstance(phase, str) or phase not in _PHASES_BY_NAME:
            raise ConfigError("phase", f"must be one of {sorted(_PHASES_BY_NAME)}, got {phase!r}")
        rank = d.get("anchor_rank")
        history = d.get("trend_history")
        return cls(
            anchor=_json_int(d.get("anchor"), "anchor"),
            anchor_rank=None if rank is None else _json_int(rank, "anchor_rank"),
            smoothed_ms_per_batch=_json_floats(
                d.get("smoothed_ms_per_batch"), "smoothed_ms_per_batch"
            ),
            phase=_PHASES_BY_NAME[phase],
            calibration_count=_json_int(d.get("calibration_count"), "calibration_count"),
            trend_history=None if history is None else _json_floats(history, "trend_history"),
        )


_PHASES_BY_NAME = {phase.value: phase for phase in Phase}


def _json_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"must be an integer, got {value!r}")
    return value


def _json_floats(value: object, field: str) -> tuple[float, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value
    ):
        raise ConfigError(field, f"must be a list of numbers, got {value!r}")
    return tuple(float(v) for v in value)
