"""Run configuration: frozen, validated dataclasses.

Every field is checked at construction; a bad value raises
``ConfigError(field, message)`` naming the field and what is accepted.
Defaults carry their reason; most come from the reference balancer (floDl
0.7.0, "ElChe"), whose thresholds we keep until a benchmark shows better.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from elche.core.errors import ConfigError
from elche.core.guards import GuardKind

__all__ = [
    "MIN_RANK_PATIENCE_S",
    "NONFINITE_POLICIES",
    "NUMPY_PERMUTATION",
    "ORDERS",
    "RANDOM_SHUFFLE",
    "SHARD_ORDER",
    "Backend",
    "CallbackPolicy",
    "CoordinatorConfig",
    "Mode",
    "Policy",
    "SchedulerConfig",
    "check_order",
]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_int(field: str, value: object, *, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(field, f"must be an integer >= {minimum}, got {value!r}")


class Policy(enum.Enum):
    """*When* parameters are averaged."""

    SYNC = "sync"  # every live rank made >= 1 step since the last average
    CADENCE = "cadence"  # every live rank finished its ElChe window
    ASYNC = "async"  # cadence plus bounded overshoot; training overlaps the average


class Backend(enum.Enum):
    """*How* parameters are averaged."""

    COLLECTIVE = "collective"  # torch.distributed all-reduce among the ranks
    COORDINATOR = "coordinator"  # snapshots averaged by the coordinator process


class Mode(enum.Enum):
    """A (policy, backend) pair under its user-facing name."""

    SYNC = "sync"
    CADENCE = "cadence"
    CPU_SYNC = "cpu-sync"
    CPU_CADENCE = "cpu-cadence"
    CPU_ASYNC = "cpu-async"

    @property
    def policy(self) -> Policy:
        return _MODE_TABLE[self][0]

    @property
    def backend(self) -> Backend:
        return _MODE_TABLE[self][1]

    @classmethod
    def parse(cls, name: object) -> Mode:
        """Look a mode up by name; ``async`` is accepted for ``cpu-async``.

        Raises:
            ConfigError: the name is not a mode (or not a string).
        """
        key = name.strip().lower() if isinstance(name, str) else None
        if key == "async":
            return cls.CPU_ASYNC
        for mode in cls:
            if mode.value == key:
                return mode
        accepted = ", ".join([m.value for m in cls] + ["async"])
        raise ConfigError("mode", f"unknown mode {name!r}; accepted: {accepted}")


# There is no collective async mode: async needs the average to round-trip
# while ranks keep training, which only the coordinator backend can do.
_MODE_TABLE: dict[Mode, tuple[Policy, Backend]] = {
    Mode.SYNC: (Policy.SYNC, Backend.COLLECTIVE),
    Mode.CADENCE: (Policy.CADENCE, Backend.COLLECTIVE),
    Mode.CPU_SYNC: (Policy.SYNC, Backend.COORDINATOR),
    Mode.CPU_CADENCE: (Policy.CADENCE, Backend.COORDINATOR),
    Mode.CPU_ASYNC: (Policy.ASYNC, Backend.COORDINATOR),
}


class CallbackPolicy(enum.Enum):
    """Who runs epoch_fn / eval_fn / checkpoint_fn."""

    FASTEST = "fastest"  # lowest smoothed ms/batch, sticky until it dies
    PINNED = "pinned"  # a fixed rank (see ``CoordinatorConfig.callback_rank``)


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Knobs of the ElChe balancer.

    ``anchor=None`` picks the mode's default: 1 for sync (a reduce after every
    slow-rank step, as classic data parallelism does) and 10 otherwise (the
    reference default: long enough to amortise the reduce, short enough to
    keep replicas close).
    """

    anchor: int | None = None
    min_anchor: int | None = None
    max_anchor: int = 1000  # reference cap: beyond it replicas drift too far
    overhead_target: float = 0.05  # grow the window while sync costs > 5 %
    max_batch_diff: int | None = None  # None: counts may move freely
    relax_up: bool = False  # async only: creep the anchor up on Stable
    guard: GuardKind = GuardKind.TREND
    divergence_threshold: float | None = None  # None: 0.05, or 0.3 with EASGD
    meta_controller: bool = True  # reference default since 0.7.0
    max_overshoot: int | None = None  # None: auto, 3 growing to 15 (async)
    gamma: float = 1.0  # parameter mass = steps ** gamma
    # cadence: a rank out of budget mid-epoch trains on while its peers are
    # expected to finish theirs (``elche.core.planner``); False: it holds,
    # and every window is exactly its ElChe counts.
    fill_wait: bool = True

    def __post_init__(self) -> None:
        _check_int("anchor", self.anchor, minimum=1, optional=True)
        _check_int("min_anchor", self.min_anchor, minimum=1, optional=True)
        _check_int("max_anchor", self.max_anchor, minimum=1)
        _check_int("max_batch_diff", self.max_batch_diff, minimum=0, optional=True)
        _check_int("max_overshoot", self.max_overshoot, minimum=0, optional=True)
        for name in ("anchor", "min_anchor"):
            value = getattr(self, name)
            if value is not None and value > self.max_anchor:
                raise ConfigError(
                    name, f"must not exceed max_anchor ({self.max_anchor}), got {value}"
                )
        if not _is_number(self.overhead_target) or not 0.01 <= self.overhead_target <= 0.5:
            raise ConfigError(
                "overhead_target", f"must be in [0.01, 0.5], got {self.overhead_target}"
            )
        if self.divergence_threshold is not None and not self.divergence_threshold > 0:
            raise ConfigError(
                "divergence_threshold", f"must be > 0, got {self.divergence_threshold}"
            )
        if not isinstance(self.fill_wait, bool):
            raise ConfigError("fill_wait", f"must be True or False, got {self.fill_wait!r}")
        if not math.isfinite(self.gamma):
            raise ConfigError("gamma", f"must be finite, got {self.gamma}")

    def anchor_for(self, policy: Policy) -> int:
        """The initial anchor for ``policy``."""
        if self.anchor is not None:
            return self.anchor
        return 1 if policy is Policy.SYNC else 10


# What a non-finite loss does (``CoordinatorConfig.nonfinite``).
NONFINITE_POLICIES = ("stop", "skip")

# How each epoch's order of the samples is drawn from the seed
# (``CoordinatorConfig.order``; ``elche.runtime.shards.epoch_order``):
# ``numpy-permutation``, NumPy's legacy ``RandomState`` (its stream frozen by
# NumPy's compatibility policy, so every rank and every NumPy version draws
# the same order), 0.09 s for a million samples; ``random-shuffle``, the
# standard library's ``random.Random(seed + epoch).shuffle``, 0.66 s for a
# million, on every rank at every epoch's start: every run's order before
# checkpoint metas of schema 4, which a resumed run of such a bundle keeps;
# ``shards``, an ``elche.Shards`` dataset's own (``elche.core.shard_order``:
# the shards shuffled, their items in order), whatever the run was asked.
NUMPY_PERMUTATION = "numpy-permutation"
RANDOM_SHUFFLE = "random-shuffle"
SHARD_ORDER = "shards"
ORDERS = (NUMPY_PERMUTATION, RANDOM_SHUFFLE, SHARD_ORDER)
# The largest seed a run takes: each rank seeds torch with ``seed + rank``.
MAX_RUN_SEED = 2**63 - 1
# A rank gives its coordinator up after no word for this long at least
# (``CoordinatorConfig.rank_patience_s``).
MIN_RANK_PATIENCE_S = 10.0


def check_order(value: object) -> str:
    """``value`` as an epoch order (``ORDERS``).

    Raises:
        ConfigError: it is none of them.
    """
    if value not in ORDERS:
        raise ConfigError("order", f"must be one of {ORDERS}, got {value!r}")
    return str(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorConfig:
    """Everything the coordinator core needs to run one training job.

    Args:
        mode: what to average when, and how.
        world_size: number of ranks.
        num_samples: samples per epoch (the dataset length).
        batch_size: samples per optimizer step.
        epochs: epochs to train.
        seed: base of the per-epoch shuffle (reference default 42).
        order: how each epoch's order is drawn from the seed (``ORDERS``); a
            resumed run takes its bundle's.
    """

    mode: Mode
    world_size: int
    num_samples: int
    batch_size: int
    epochs: int
    seed: int = 42
    order: str = NUMPY_PERMUTATION
    scheduler: SchedulerConfig = SchedulerConfig()
    # Liveness: reference defaults (1 s beacons, 30 s silence = dead).
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    formation_timeout_s: float = 60.0
    # The stall watchdog: this long without progress while ranks are live
    # dumps what each rank does (reference: 120 s; ``elche.core.stall``).
    stall_dump_s: float = 120.0
    # None: no limit beyond the backend floor (collective needs 2 ranks).
    max_failures: int | None = None
    callback_policy: CallbackPolicy = CallbackPolicy.FASTEST
    callback_rank: int = 0
    has_epoch_fn: bool = False
    has_eval_fn: bool = False
    eval_every: int = 1
    checkpoint_every: int | None = None
    save_path: str | None = None
    easgd_alpha: float | None = None  # None: 0.5 on cpu-async, off elsewhere
    # DiLoCo outer optimizer (Nesterov momentum on the pseudo-gradient), applied
    # by the coordinator to each average; None: plain averaging. Suggested
    # lr 0.7, momentum 0.9 (the reference's documented values).
    outer_lr: float | None = None
    outer_momentum: float = 0.9
    # A non-finite loss: "stop" saves the last finite consensus and stops the
    # run; "skip" skips that step and goes on. A non-finite average always stops.
    nonfinite: str = "stop"
    # A lost coordinator is restarted from the journal this many times at most
    # (by the process that started it); past that the run stops.
    max_coordinator_restarts: int = 3
    # Rank ids a running run keeps for ranks that join it (``elche join``):
    # ranks ``world_size .. world_size + join_slots - 1``. Each costs a few
    # numbers per collaborator; collective modes only (the joiner takes the
    # consensus in its first average, at weight 0).
    join_slots: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.mode, Mode):
            raise ConfigError("mode", f"must be a Mode, got {self.mode!r}")
        if not isinstance(self.scheduler, SchedulerConfig):  # a dict's knobs would go unread
            raise ConfigError(
                "scheduler",
                "must be an elche.SchedulerConfig, e.g. scheduler=elche.SchedulerConfig(anchor=2), "
                f"or None; got {self.scheduler!r}",
            )
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(
                "nonfinite", f"must be one of {NONFINITE_POLICIES}, got {self.nonfinite!r}"
            )
        _check_int("world_size", self.world_size, minimum=1)
        _check_int("num_samples", self.num_samples, minimum=1)
        _check_int("batch_size", self.batch_size, minimum=1)
        _check_int("epochs", self.epochs, minimum=1)
        _check_int("seed", self.seed, minimum=0)
        if self.seed > MAX_RUN_SEED:  # each rank seeds torch with seed + rank (64 bits)
            raise ConfigError("seed", f"must be an integer in [0, 2**63 - 1], got {self.seed}")
        check_order(self.order)
        _check_int("max_failures", self.max_failures, minimum=1, optional=True)
        _check_int("max_coordinator_restarts", self.max_coordinator_restarts, minimum=0)
        _check_int("join_slots", self.join_slots, minimum=0)
        if self.join_slots and self.mode.backend is not Backend.COLLECTIVE:
            raise ConfigError(
                "join_slots",
                "ranks join collective runs only (sync, cadence), not "
                f"{self.mode.value}; got join_slots={self.join_slots}",
            )
        _check_int("eval_every", self.eval_every, minimum=1)
        _check_int("checkpoint_every", self.checkpoint_every, minimum=1, optional=True)
        _check_int("callback_rank", self.callback_rank, minimum=0)
        if self.callback_rank >= self.world_size:
            raise ConfigError(
                "callback_rank",
                f"must be a rank in [0, {self.world_size - 1}], got {self.callback_rank}",
            )
        for field in (
            "heartbeat_interval_s", "heartbeat_timeout_s", "formation_timeout_s", "stall_dump_s",
        ):  # fmt: skip
            value = getattr(self, field)
            if not (_is_number(value) and value > 0):
                raise ConfigError(field, f"must be a positive number of seconds, got {value!r}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                "heartbeat_timeout_s",
                f"must exceed heartbeat_interval_s ({self.heartbeat_interval_s}), "
                f"got {self.heartbeat_timeout_s}",
            )
        alpha = self.easgd_alpha
        if alpha is not None and not (_is_number(alpha) and 0 < alpha <= 1):
            raise ConfigError("easgd_alpha", f"must be in (0, 1], got {self.easgd_alpha}")

        if self.outer_lr is not None:
            if not (_is_number(self.outer_lr) and self.outer_lr > 0):
                raise ConfigError("outer_lr", f"must be a number > 0, got {self.outer_lr!r}")
            if self.mode.backend is not Backend.COORDINATOR:
                raise ConfigError(
                    "outer_lr",
                    "the outer optimizer runs in the coordinator; use cpu-sync, cpu-cadence "
                    f"or cpu-async, not {self.mode.value}",
                )
        if not (_is_number(self.outer_momentum) and 0 <= self.outer_momentum < 1):
            raise ConfigError("outer_momentum", f"must be in [0, 1), got {self.outer_momentum!r}")

    @property
    def num_slots(self) -> int:
        """Rank ids of the run: the ranks it starts with and the slots for joiners."""
        return self.world_size + self.join_slots

    def slotted(self) -> CoordinatorConfig:
        """This config over every rank id (``num_slots`` ranks, no slots left).

        The coordinator's collaborators size their per-rank state with it.
        """
        if not self.join_slots:
            return self
        return dataclasses.replace(self, world_size=self.num_slots, join_slots=0)

    @property
    def policy(self) -> Policy:
        return self.mode.policy

    @property
    def backend(self) -> Backend:
        return self.mode.backend

    @property
    def blend_alpha(self) -> float | None:
        """EASGD blend weight in effect (async averaging only)."""
        if self.policy is not Policy.ASYNC:
            return None
        return 0.5 if self.easgd_alpha is None else self.easgd_alpha

    @property
    def rank_patience_s(self) -> float:
        """How long a rank hears nothing from the coordinator before it gives it up
        (and keeps what it holds): the heartbeat timeout, and at least
        ``MIN_RANK_PATIENCE_S`` (a successor of a lost one needs a moment to come up)."""
        return max(self.heartbeat_timeout_s, MIN_RANK_PATIENCE_S)

    @property
    def min_live_ranks(self) -> int:
        """Below this many survivors the run cannot continue (backend floor).

        A collective needs a peer to average with; a single survivor of a
        collective run saves and stops so it can be resumed on a fresh group.
        The coordinator backend averages as long as anybody is left.
        """
        return 2 if self.backend is Backend.COLLECTIVE and self.world_size >= 2 else 1
