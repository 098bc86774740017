"""Batch-count arithmetic of the ElChe balancer: pure functions, no state.

``ElChe`` (``elche.core.scheduler``) keeps the paces and decides when counts
are recomputed; these functions do the arithmetic of one recompute:

- a rank's *speed target* is the anchor scaled by how much faster it is than
  the anchor rank (at most ``MAX_SPEED_RATIO`` times), rounded half away
  from zero, never below 1;
- a calibrated count moves toward its target by at most ``max_batch_diff``
  per update, never below 1;
- the *window cap* scales the live counts down to fit the cap, floors of 1
  included whenever the live ranks fit under it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "MAX_SPEED_RATIO",
    "cap_window",
    "non_negative",
    "round_half_away",
    "slack_batches",
    "speed_target",
    "step_toward",
]

MAX_SPEED_RATIO = 64.0  # no real rig is 64x apart; caps degenerate samples
_SAME_MS = 1e-6  # ms readings closer than this are the anchor's own speed
_SATURATED = 2**63 - 1  # an infinite slack saturates like the reference's usize


def speed_target(anchor: int, ms: float, slow_ms: float) -> int:
    """Batches for a rank at ``ms`` per batch while the anchor rank (``slow_ms``) runs ``anchor``.

    A rank without a pace, or at the anchor rank's own, runs ``anchor``.
    """
    if ms <= 0 or abs(ms - slow_ms) < _SAME_MS:
        return anchor
    return max(1, round_half_away(anchor * min(slow_ms / ms, MAX_SPEED_RATIO)))


def step_toward(current: int, target: int, max_step: int | None) -> int:
    """``current`` moved toward ``target`` by at most ``max_step`` (None: all the way)."""
    if max_step is None:
        return target
    if target > current:
        return min(current + max_step, target)
    return max(current - max_step, target, 1)


def cap_window(counts: list[int], live: Sequence[int], cap: int | None) -> bool:
    """Scale the ``live`` entries of ``counts`` (in place) to sum to at most ``cap``.

    Each is floored at 1; a remainder goes to the largest count (ties: the
    highest index). When floors of 1 overshoot, the largest counts above 1
    give one back each, as long as the live ranks fit under the cap at all.

    Returns:
        Whether the cap was binding (the counts were scaled).
    """
    total = sum(counts[r] for r in live)
    if cap is None or total <= cap:
        return False
    for r in live:
        counts[r] = max(1, math.floor(counts[r] * (cap / total)))
    used = sum(counts[r] for r in live)
    if used < cap:  # the remainder goes to the largest count, ties -> highest index
        counts[max(live, key=lambda r: (counts[r], r))] += cap - used
    while used > cap and len(live) <= cap:  # elche: floors of 1 must not break the cap
        r = max((r for r in live if counts[r] > 1), key=lambda r: (counts[r], r))
        counts[r] -= 1
        used -= 1
    return True


def round_half_away(x: float) -> int:
    """Round a non-negative float half away from zero, as Rust's ``round``."""
    whole = math.floor(x)
    return whole + 1 if x - whole >= 0.5 else whole


def non_negative(ms: float) -> float:
    """``ms`` floored at 0; NaN reads as 0 (Rust ``f64::max`` semantics)."""
    return ms if ms > 0 else 0.0


def slack_batches(slack_ms: float, ms: float) -> int:
    """Whole batches of ``ms`` that ``slack_ms`` of callback time displaces."""
    if not (slack_ms > 0 and ms > 0):
        return 0
    batches = slack_ms / ms
    return math.ceil(batches) if math.isfinite(batches) else _SATURATED
