"""Every rank's script must plan the same run.

Under ``elche run`` or ``torchrun`` each rank's process calls ``elche.train``
with its own arguments and builds its own dataset, and each rank turns the
positions it is handed into samples on its own: its seed and its dataset's
length (a ``Shards``' lengths too) draw the epoch's order
(``elche.runtime.shards.epoch_order``), its batch size cuts its steps. A
rank whose script differs trains other samples under the same positions,
which the coordinator's exactly-once bookkeeping cannot see. So the
launched ranks compare their plans before anything starts
(``elche.runtime.launched``), and a joiner its plan against the run's
(``elche.runtime.joined``). A rank whose own checks refused the run (its
bundle to resume from is not on its host, its run directory is not
writable) says so in its plan, and every rank raises that refusal: its
peers on other hosts, whose checks passed, waited in the launcher's
rendezvous for it until torch's timeout (half an hour).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from elche.core.config import CoordinatorConfig
from elche.core.errors import ConfigError
from elche.runtime.shards import Shards

__all__ = [
    "REFUSED",
    "SAME_RUN_FIELDS",
    "check_refusals",
    "check_same_plans",
    "plan_of",
    "refusal",
]

# Fields of the coordinator config every rank's script must agree on.
SAME_RUN_FIELDS = ("mode", "num_samples", "batch_size", "epochs", "seed")


def plan_of(config: CoordinatorConfig, dataset: Any) -> dict[str, object]:
    """What this rank's script plans: ``SAME_RUN_FIELDS``, and a ``Shards``' lengths
    (None for a map-style dataset, whose epochs are drawn in another order)."""
    plan: dict[str, object] = {name: getattr(config, name) for name in SAME_RUN_FIELDS}
    plan["mode"] = config.mode.value
    plan["lengths"] = list(dataset.lengths) if isinstance(dataset, Shards) else None
    return plan


# In a rank's plan: why its own checks refused the run ([field, message, host]), or None.
REFUSED = "refused"


def refusal(exc: ConfigError | None) -> list[str] | None:
    """What a rank says of its own checks' refusal ``exc`` in its plan (``REFUSED``)."""
    return None if exc is None else [exc.field, exc.message, os.uname().nodename]


def check_refusals(plans: Sequence[Mapping[str, object]], own: ConfigError | None) -> None:
    """Raise this rank's own refusal ``own``, else the first other rank's (``REFUSED``
    in the ranks' plans, rank 0's first), naming that rank and its host.

    Raises:
        ConfigError: a rank's checks refused the run before it started (a bundle
            not on its host, a run directory it cannot write, a save path held).
    """
    if own is not None:
        raise own
    for rank, plan in enumerate(plans):
        said = plan.get(REFUSED)
        if isinstance(said, list):
            field, message, host = said
            raise ConfigError(field, f"rank {rank}, on {host}, refused the run: {message}")


def check_same_plans(plans: Sequence[Mapping[str, object]]) -> None:
    """The ranks' plans (``plan_of``, rank 0's first) are alike.

    Raises:
        ConfigError: naming the first field that differs, rank 0's value and
            the first other rank's.
    """
    for name, ours in plans[0].items():
        differ = [(r, plan.get(name)) for r, plan in enumerate(plans) if plan.get(name) != ours]
        if not differ:
            continue
        rank, theirs = differ[0]
        more = f" (and {len(differ) - 1} more rank(s))" if len(differ) > 1 else ""
        raise ConfigError(
            name,
            f"the ranks' scripts plan different runs: {_values(name, ours, theirs, rank)}{more}; "
            "every rank must train the same run (each reads the samples at the positions "
            "it is handed through its own seed, dataset and batch size)",
        )


def _values(name: str, ours: object, theirs: object, rank: int) -> str:
    if name == "lengths" and (ours is None or theirs is None):
        kinds = [_kind(lengths) for lengths in (ours, theirs)]
        return f"rank 0 trains {kinds[0]}, rank {rank} {kinds[1]}"
    if name == "lengths" and isinstance(ours, list) and isinstance(theirs, list):
        if len(ours) != len(theirs):
            return f"rank 0 has {len(ours)} shards, rank {rank} {len(theirs)}"
        shard = next(s for s, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        return f"shard {shard} has {ours[shard]} items on rank 0, {theirs[shard]} on rank {rank}"
    return f"rank 0 has {name}={ours!r}, rank {rank} {name}={theirs!r}"


def _kind(lengths: object) -> str:
    return "a map-style dataset" if lengths is None else "an elche.Shards"
