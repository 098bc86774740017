"""Fault schedules for the simulator: the core's, re-exported.

The fault types and ``FaultPlan`` live in ``elche.core.faults``, so that one
plan drives both a simulation and a real run; this module keeps the old
import path working.
"""

from __future__ import annotations

from elche.core.faults import FailCheckpoint, Fault, FaultPlan, Kill, SlowDown, Stall

__all__ = ["FailCheckpoint", "Fault", "FaultPlan", "Kill", "SlowDown", "Stall"]
