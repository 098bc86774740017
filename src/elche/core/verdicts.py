"""Verdicts: what a convergence guard (or the meta-controller) tells ElChe.

One seam, three answers. ``ElChe.apply_verdict`` acts on them (the planner's
async overshoot allowance follows them too, ``Planner.note_verdict``):

- ``Stable`` commits a staged anchor-growth proposal (and may relax the
  anchor up by one under the async policy);
- ``SuppressGrowth`` vetoes the proposal and latches growth off;
- ``NudgeDown`` discards the proposal, then shrinks the anchor by ``factor``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NudgeDown", "Stable", "SuppressGrowth", "Verdict"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Stable:
    """Parameters are converging; growth may proceed."""

    relax_up: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class SuppressGrowth:
    """Divergence is rising: do not grow the window."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NudgeDown:
    """Shrink the anchor to ``ceil(anchor * factor)`` (factor in (0, 1])."""

    factor: float


Verdict = Stable | SuppressGrowth | NudgeDown
