"""Fault schedules: one vocabulary for real runs and the simulator.

A ``FaultPlan`` is an ordered, immutable list of faults, each on one rank::

    plan = FaultPlan().kill(rank=1, at_epoch=0.5).slow(rank=0, at_s=2.0, speed=0.5)

The same plan drives a simulation (``SimConfig(faults=plan)``) and a real run
(``elche.train(..., faults=plan)``, a testing hook), and it prints to and
reads from JSON (``to_json``/``from_json``), so a schedule that broke
something can be replayed in the other driver.

Triggers. A fault fires at the first of its triggers that is reached:

- ``at_epoch``: training progress, the epoch.fraction of the first sample
  position of the batch the faulty rank is about to train (``position``);
  it fires at that batch boundary, before the batch. Both drivers agree on
  it exactly.
- ``at_s``: seconds since the run started: virtual seconds in the simulator
  (fired at that instant), wall seconds since a real rank entered its
  training loop (fired at its next batch boundary).

Kinds. ``Kill`` (SIGKILL: the rank vanishes), ``Stall`` (no work, no
heartbeat: a hung process), ``SlowDown`` (the rank runs at ``speed`` of its
base speed from then on) and ``FailCheckpoint`` (its checkpoint callbacks
report an error from then on; without a trigger, from the start), and
``KillCoordinator`` (the coordinator process is SIGKILLed when ``rank``
reaches the trigger: it is restarted from its journal, see
``elche.core.journal``), ``Join`` (a new process joins the running run
as rank ``rank``, a join slot past the run's ranks, at ``speed``: in the
simulator only; a real rank joins with ``elche join``), ``StopLauncher``
(SIGTERM to the run's launching process when ``rank`` reaches the trigger:
the run saves a bundle and stops, as for Ctrl-C) and ``FillSavePath`` (the
save path's file system is filled up when ``rank`` reaches the trigger; a
real rank fills only a small tmpfs, see ``elche.runtime.worker``). A new kind
goes here, into ``Fault`` and ``_KINDS``; then each driver's ``match`` over
``Fault`` (``assert_never``) says where it still needs handling.

Pure: no clock, no IO. Each builder call returns a new plan.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, fields
from typing import ClassVar

from elche.core.errors import ConfigError

__all__ = [
    "FailCheckpoint",
    "Fault",
    "FaultPlan",
    "FillSavePath",
    "Join",
    "Kill",
    "KillCoordinator",
    "SlowDown",
    "Stall",
    "StopLauncher",
    "position",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Triggered:
    """What every fault has: its rank and when it fires (see the module docstring)."""

    needs_trigger: ClassVar[bool] = True

    rank: int
    at_s: float | None = None
    at_epoch: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError("rank", f"must be an integer >= 0, got {self.rank!r}")
        for name in ("at_s", "at_epoch"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _point(name, value))
        if self.needs_trigger and self.at_s is None and self.at_epoch is None:
            raise ConfigError(
                "at_s",
                f"{type(self).__name__} needs at_s (seconds) or at_epoch (epoch.fraction), or both",
            )

    @property
    def from_start(self) -> bool:
        """No trigger: in force from the start (only ``FailCheckpoint`` allows it)."""
        return self.at_s is None and self.at_epoch is None

    def due(self, *, epoch: float, elapsed_s: float | None = None) -> bool:
        """Whether a trigger is reached at a batch boundary.

        Args:
            epoch: ``position`` of the batch the rank is about to train.
            elapsed_s: seconds since the run started; None checks ``at_epoch`` only
                (a driver that fires ``at_s`` itself, like the simulator).

        Returns:
            True when ``at_epoch <= epoch`` or ``at_s <= elapsed_s``.
        """
        if self.at_epoch is not None and epoch >= self.at_epoch:
            return True
        return self.at_s is not None and elapsed_s is not None and elapsed_s >= self.at_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Kill(_Triggered):
    """SIGKILL ``rank``: it vanishes mid-whatever."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Stall(_Triggered):
    """``rank`` stops working and heartbeating (a hung process)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowDown(_Triggered):
    """``rank`` runs at ``speed`` (fraction of the base speed, in (0, 1]) from then on."""

    speed: float

    def __post_init__(self) -> None:
        _Triggered.__post_init__(self)
        speed = self.speed
        if isinstance(speed, bool) or not isinstance(speed, int | float) or not 0 < speed <= 1:
            raise ConfigError("speed", f"must be in (0, 1], got {speed!r}")
        object.__setattr__(self, "speed", float(speed))


@dataclass(frozen=True, slots=True, kw_only=True)
class FailCheckpoint(_Triggered):
    """``checkpoint_fn`` fails on ``rank`` from the trigger on (no trigger: always)."""

    needs_trigger: ClassVar[bool] = False


@dataclass(frozen=True, slots=True, kw_only=True)
class KillCoordinator(_Triggered):
    """SIGKILL the run's coordinator once ``rank`` reaches the trigger."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Join(_Triggered):
    """A new rank joins the running run as rank ``rank`` (a join slot) at ``at_s``.

    ``speed`` is its speed (fraction of the base speed, in (0, 1]). Its
    trigger is a time only: the rank has no progress before it joins.
    """

    speed: float = 1.0

    def __post_init__(self) -> None:
        _Triggered.__post_init__(self)
        if self.at_epoch is not None or self.at_s is None:
            raise ConfigError("at_s", f"a Join fires at a time (at_s) only, got {self}")
        speed = self.speed
        if isinstance(speed, bool) or not isinstance(speed, int | float) or not 0 < speed <= 1:
            raise ConfigError("speed", f"must be in (0, 1], got {speed!r}")
        object.__setattr__(self, "speed", float(speed))


@dataclass(frozen=True, slots=True, kw_only=True)
class StopLauncher(_Triggered):
    """SIGTERM the run's launching process once ``rank`` reaches the trigger."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FillSavePath(_Triggered):
    """Fill the save path's file system once ``rank`` reaches the trigger."""


Fault = (
    Kill | Stall | SlowDown | FailCheckpoint | KillCoordinator | Join | StopLauncher | FillSavePath
)

# The JSON name of each kind (the builder method's name).
_KINDS: dict[str, type[Fault]] = {
    "kill": Kill,
    "stall": Stall,
    "slow": SlowDown,
    "fail_checkpoint": FailCheckpoint,
    "kill_coordinator": KillCoordinator,
    "join": Join,
    "stop_launcher": StopLauncher,
    "fill_save_path": FillSavePath,
}


def position(*, epoch: int, offset: int, num_samples: int) -> float:
    """The epoch.fraction of sample position ``offset`` of ``epoch`` (what ``at_epoch`` means)."""
    return epoch + offset / max(num_samples, 1)


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """An ordered, immutable list of faults (see the module docstring)."""

    faults: tuple[Fault, ...] = ()

    def kill(
        self, *, rank: int, at_s: float | None = None, at_epoch: float | None = None
    ) -> FaultPlan:
        """Add a ``Kill``. Raises ConfigError on a bad field (this plan unchanged)."""
        return self._with(Kill(rank=rank, at_s=at_s, at_epoch=at_epoch))

    def stall(
        self, *, rank: int, at_s: float | None = None, at_epoch: float | None = None
    ) -> FaultPlan:
        """Add a ``Stall``. Raises ConfigError on a bad field (this plan unchanged)."""
        return self._with(Stall(rank=rank, at_s=at_s, at_epoch=at_epoch))

    def slow(
        self, *, rank: int, speed: float, at_s: float | None = None, at_epoch: float | None = None
    ) -> FaultPlan:
        """Add a ``SlowDown``. Raises ConfigError on a bad field (this plan unchanged)."""
        return self._with(SlowDown(rank=rank, at_s=at_s, at_epoch=at_epoch, speed=speed))

    def fail_checkpoint(
        self, *, rank: int, at_s: float | None = None, at_epoch: float | None = None
    ) -> FaultPlan:
        """Add a ``FailCheckpoint``. Raises ConfigError on a bad field (this plan unchanged)."""
        return self._with(FailCheckpoint(rank=rank, at_s=at_s, at_epoch=at_epoch))

    def kill_coordinator(
        self, *, rank: int = 0, at_s: float | None = None, at_epoch: float | None = None
    ) -> FaultPlan:
        """Add a ``KillCoordinator``. Raises ConfigError on a bad field (this plan unchanged)."""
        return self._with(KillCoordinator(rank=rank, at_s=at_s, at_epoch=at_epoch))

    def join(self, *, rank: int, at_s: float, speed: float = 1.0) -> FaultPlan:
        """Add a ``Join``. Raises ConfigError on a bad field (this plan unchanged)."""
        return self._with(Join(rank=rank, at_s=at_s, speed=speed))

    def join_slots(self, world_size: int) -> int:
        """The join slots a run of ``world_size`` ranks needs for this plan's joins."""
        joined = [f.rank for f in self.faults if isinstance(f, Join)]
        return max(joined) + 1 - world_size if joined else 0

    def stop_launcher(
        self, *, rank: int = 0, at_s: float | None = None, at_epoch: float | None = None
    ) -> FaultPlan:
        """Add a ``StopLauncher``. Raises ConfigError on a bad field (this plan unchanged)."""
        return self._with(StopLauncher(rank=rank, at_s=at_s, at_epoch=at_epoch))

    def fill_save_path(
        self, *, rank: int = 0, at_s: float | None = None, at_epoch: float | None = None
    ) -> FaultPlan:
        """Add a ``FillSavePath``. Raises ConfigError on a bad field (this plan unchanged)."""
        return self._with(FillSavePath(rank=rank, at_s=at_s, at_epoch=at_epoch))

    def for_rank(self, rank: int) -> tuple[Fault, ...]:
        """The faults of ``rank``, in plan order."""
        return tuple(fault for fault in self.faults if fault.rank == rank)

    def check(self, world_size: int, *, joins: bool = False) -> None:
        """Check every fault names a rank of a world of ``world_size``.

        Args:
            world_size: the ranks the run starts with.
            joins: whether the driver runs ``Join`` faults (the simulator):
                each must name a rank past the world; other faults may name
                a joining rank too (they fire once it has joined).

        Raises:
            ConfigError: (field ``"faults"``) a fault names a rank outside
                ``0..world_size - 1`` (a ``Join``: one inside it, or any
                ``Join`` where ``joins`` is false, or two joins of one rank).
        """
        joined = [f.rank for f in self.faults if isinstance(f, Join)]
        if len(set(joined)) != len(joined):
            raise ConfigError("faults", f"two joins of one rank in {joined}")
        for fault in self.faults:
            if isinstance(fault, Join):
                if not joins or fault.rank < world_size:
                    raise ConfigError(
                        "faults",
                        f"{fault}: a rank joins as a rank past 0..{world_size - 1}, in a "
                        "simulation only (a real rank joins with elche join)",
                    )
                continue
            if fault.rank in joined:
                continue
            if not 0 <= fault.rank < world_size:
                raise ConfigError(
                    "faults", f"{fault} names rank {fault.rank}; ranks are 0..{world_size - 1}"
                )

    def to_json(self) -> str:
        """The plan as one JSON object; ``from_json`` reads it back to an equal plan."""
        items: list[dict[str, object]] = []
        for fault in self.faults:
            item: dict[str, object] = {"kind": _kind(fault)}
            for f in fields(fault):
                value = getattr(fault, f.name)
                if value is not None:
                    item[f.name] = value
            items.append(item)
        return json.dumps({"faults": items})

    @classmethod
    def from_json(cls, text: str) -> FaultPlan:
        """Read a plan written by ``to_json``.

        Args:
            text: ``{"faults": [{"kind": "kill", "rank": 1, "at_epoch": 0.5}, ...]}``;
                kinds are ``kill``, ``stall``, ``slow`` (with ``speed``),
                ``fail_checkpoint``, ``kill_coordinator``, ``stop_launcher``
                and ``fill_save_path``.

        Raises:
            ConfigError: (field ``"faults"``) not JSON of that shape, an
                unknown kind or key; or the field a fault's value breaks
                (``rank``, ``at_s``, ``at_epoch``, ``speed``). Nothing is built.
        """
        try:
            doc: object = json.loads(text)
        except ValueError as exc:
            raise ConfigError("faults", f"not JSON: {exc}") from None
        if (
            not isinstance(doc, dict)
            or set(doc) != {"faults"}
            or not isinstance(doc["faults"], list)
        ):
            raise ConfigError("faults", 'expected {"faults": [...]}')
        return cls(tuple(_fault_from(item) for item in doc["faults"]))

    @classmethod
    def random(
        cls,
        rng: random.Random,
        *,
        world_size: int,
        horizon_s: float,
        max_faults: int = 3,
        joins: bool = False,
    ) -> FaultPlan:
        """A random plan: up to ``max_faults`` kills, stalls, slow-downs, failing checkpoints
        and coordinator kills, and with ``joins`` ranks that join (ranks
        ``world_size``, ``world_size + 1``, ... in the order they are drawn).

        Every trigger is ``at_s`` in ``[0, horizon_s]`` (a failing checkpoint
        has none: it fails from the start). Without ``joins`` the plans are
        those of earlier versions, seed for seed.
        """
        plan = cls()
        kinds = ("kill", "stall", "slow", "fail", "coordinator") + (("join",) if joins else ())
        next_join = world_size
        for _ in range(rng.randint(0, max_faults)):
            rank = rng.randrange(world_size)
            at_s = rng.uniform(0.0, horizon_s)
            kind = rng.choice(kinds)
            if kind == "join":
                plan = plan.join(rank=next_join, at_s=at_s, speed=rng.uniform(0.1, 1.0))
                next_join += 1
            elif kind == "coordinator":
                plan = plan.kill_coordinator(rank=rank, at_s=at_s)
            elif kind == "kill":
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


def _point(name: str, value: object) -> float:
    """Validate a trigger: a finite number >= 0 (seconds or epoch.fraction)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        unit = "seconds" if name == "at_s" else "an epoch.fraction"
        raise ConfigError(name, f"must be a finite number >= 0 ({unit}), got {value!r}")
    return float(value)


def _kind(fault: Fault) -> str:
    return next(name for name, kind in _KINDS.items() if isinstance(fault, kind))


def _fault_from(item: object) -> Fault:
    if not isinstance(item, dict) or item.get("kind") not in _KINDS:
        raise ConfigError("faults", f"each fault needs a kind in {sorted(_KINDS)}, got {item!r}")
    kind = _KINDS[item["kind"]]
    keys = {f.name for f in fields(kind)}
    unknown = set(item) - keys - {"kind"}
    if unknown:
        raise ConfigError(
            "faults", f"unknown keys {sorted(unknown)} for {item['kind']}; expected {sorted(keys)}"
        )
    try:
        return kind(**{k: v for k, v in item.items() if k != "kind"})
    except TypeError as exc:  # a required key is missing
        raise ConfigError("faults", f"{item!r}: {exc}") from None
