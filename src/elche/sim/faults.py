"""Fault schedules for the simulator.

Build them fluently::

    plan = FaultPlan().kill(rank=1, at_s=5.0).slow(rank=0, at_s=2.0, speed=0.5)

or draw a random one from a seed (``FaultPlan.random``) for fuzzing. A plan is
immutable; each builder call returns a new plan.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from elche.core.errors import ConfigError

__all__ = ["FailCheckpoint", "Fault", "FaultPlan", "Kill", "SlowDown", "Stall"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Kill:
    """SIGKILL ``rank`` at virtual time ``at_s``: it vanishes mid-whatever."""

    rank: int
    at_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Stall:
    """``rank`` stops working and heartbeating at ``at_s`` (a hung process)."""

    rank: int
    at_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowDown:
    """``rank`` runs at ``speed`` (fraction of the base speed) from ``at_s``."""

    rank: int
    at_s: float
    speed: float


@dataclass(frozen=True, slots=True, kw_only=True)
class FailCheckpoint:
    """``checkpoint_fn`` always fails on ``rank``."""

    rank: int


Fault = Kill | Stall | SlowDown | FailCheckpoint


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """An ordered, immutable list of faults."""

    faults: tuple[Fault, ...] = ()

    def kill(self, *, rank: int, at_s: float) -> FaultPlan:
        return self._with(Kill(rank=rank, at_s=_time(at_s)))

    def stall(self, *, rank: int, at_s: float) -> FaultPlan:
        return self._with(Stall(rank=rank, at_s=_time(at_s)))

    def slow(self, *, rank: int, at_s: float, speed: float) -> FaultPlan:
        if not 0 < speed <= 1:
            raise ConfigError("speed", f"must be in (0, 1], got {speed}")
        return self._with(SlowDown(rank=rank, at_s=_time(at_s), speed=speed))

    def fail_checkpoint(self, *, rank: int) -> FaultPlan:
        return self._with(FailCheckpoint(rank=rank))

    def check(self, world_size: int) -> None:
        """Raises ConfigError when a fault names a rank outside the world."""
        for fault in self.faults:
            if not 0 <= fault.rank < world_size:
                raise ConfigError(
                    "faults", f"{fault} names rank {fault.rank}; ranks are 0..{world_size - 1}"
                )

    @classmethod
    def random(
        cls, rng: random.Random, *, world_size: int, horizon_s: float, max_faults: int = 3
    ) -> FaultPlan:
        """A random plan: up to ``max_faults`` kills, stalls and slow-downs."""
        plan = cls()
        for _ in range(rng.randint(0, max_faults)):
            rank = rng.randrange(world_size)
            at_s = rng.uniform(0.0, horizon_s)
            kind = rng.choice(("kill", "stall", "slow", "fail"))
            if kind == "kill":
                plan = plan.kill(rank=rank, at_s=at_s)
            elif kind == "stall":
                plan = plan.stall(rank=rank, at_s=at_s)
            elif kind == "slow":
                plan = plan.slow(rank=rank, at_s=at_s, speed=rng.uniform(0.1, 1.0))
            else:
                plan = plan.fail_checkpoint(rank=rank)
        return plan

    def _with(self, fault: Fault) -> FaultPlan:
        return FaultPlan((*self.faults, fault))


def _time(at_s: float) -> float:
    if not at_s >= 0:
        raise ConfigError("at_s", f"must be a time >= 0 s, got {at_s}")
    return float(at_s)
