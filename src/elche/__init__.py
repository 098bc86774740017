"""elche: train one PyTorch model on unequal workers at the speed of their sum.

The supported import surface is what ``__all__`` lists. ``elche.core`` is the
sans-IO coordinator (events in, commands out); ``elche.sim`` drives it in
virtual time.
"""

from __future__ import annotations

from elche.core.checkpoint import CheckpointMeta, SaveReason
from elche.core.config import (
    Backend,
    CallbackPolicy,
    CoordinatorConfig,
    Mode,
    Policy,
    SchedulerConfig,
)
from elche.core.coordinator import Coordinator
from elche.core.errors import (
    ConfigError,
    Error,
    LocalProtocolError,
    ProtocolError,
    RankExcluded,
    RemoteProtocolError,
    TrainingError,
    TransportError,
)
from elche.core.faults import FaultPlan
from elche.core.progress import Progress
from elche.sim.engine import SimConfig, SimError, Simulation, simulate
from elche.sim.result import SimResult

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # ``train`` pulls in torch; import it only when asked, so the coordinator
    # process (which imports elche) starts in a fraction of a second.
    if name in ("train", "TrainResult"):
        from elche import api

        return getattr(api, name)
    if name == "Session":
        from elche.session import Session

        return Session
    if name == "Shards":
        from elche.runtime.shards import Shards

        return Shards
    if name == "progress":
        from elche.runtime.current import progress

        return progress
    if name == "Interrupted":
        from elche.runtime.lifetimes import Interrupted

        return Interrupted
    raise AttributeError(f"module 'elche' has no attribute {name!r}")


__all__ = [
    "Backend",
    "CallbackPolicy",
    "CheckpointMeta",
    "ConfigError",
    "Coordinator",
    "CoordinatorConfig",
    "Error",
    "FaultPlan",
    "Interrupted",
    "LocalProtocolError",
    "Mode",
    "Policy",
    "Progress",
    "ProtocolError",
    "RankExcluded",
    "RemoteProtocolError",
    "SaveReason",
    "SchedulerConfig",
    "Session",
    "Shards",
    "SimConfig",
    "SimError",
    "SimResult",
    "Simulation",
    "TrainResult",
    "TrainingError",
    "TransportError",
    "__version__",
    "progress",
    "simulate",
    "train",
]
