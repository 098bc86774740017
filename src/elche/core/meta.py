"""The LR-aware meta-controller: reactive anchor nudges above ElChe.

Two watchers feed one actuator (``ElChe.apply_verdict(NudgeDown(f))``):

- the **LR cliff** watcher fires on a single-cycle learning-rate drop of more
  than 30 % (a step schedule's 5x/10x drop; cosine decay stays silent), ahead
  of the divergence such a drop causes;
- the **convergence** watcher fires when the last K guard verdicts were all
  ``NudgeDown`` or ``SuppressGrowth``, K shrinking as the phase matures.

The factor is softened while the anchor is already below its recent mean (it
is recovering from a nudge) and sharpened while it climbs. Behaviour follows
floDl 0.7.0 ``distributed/lr_event_meta.rs``, so the anchor answers an LR
schedule as the reference's does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from elche.core.elche_state import Phase
from elche.core.errors import ConfigError
from elche.core.verdicts import NudgeDown, SuppressGrowth, Verdict

__all__ = ["LrEventMeta", "MetaConfig", "effective_factor"]

LR_CLIFF_BASE_FACTOR = 0.5  # halve on a cliff, as the divergence nudge does
SETTLED_EPSILON = 0.10  # |trend| under 10 % ignores dead-zone chatter
# Per phase: the convergence watcher's base factor (gentler as trust grows)
# and sustain count K (less evidence needed as trust grows).
BASE_FACTOR = {Phase.PROBE: 0.3, Phase.WARMUP: 0.3, Phase.STABLE: 0.5, Phase.MATURE: 0.7}
SUSTAIN_K = {Phase.PROBE: 5, Phase.WARMUP: 5, Phase.STABLE: 3, Phase.MATURE: 2}
MIN_GUARD_WINDOW = SUSTAIN_K[Phase.WARMUP]  # the longest K must fit


@dataclass(frozen=True, slots=True, kw_only=True)
class MetaConfig:
    """Window sizes and clamps of the meta-controller (reference defaults).

    Raises:
        ConfigError: a negative window cap, a negative drop threshold, or a
            factor range outside 0 < min_factor <= max_factor <= 1.
    """

    lr_window_cap: int = 3  # the cliff needs only the newest two LRs
    anchor_window_cap: int = 5  # the trend's baseline: five cycles of anchor
    guard_window_cap: int = 5  # raised to >= 5 (Warmup's K) by LrEventMeta
    sharp_drop_threshold: float = 0.3  # catches 5x/10x steps, not cosine decay
    min_factor: float = 0.1  # never cut the anchor by more than 10x at once
    max_factor: float = 0.95  # a nudge always shrinks by at least 5 %

    def __post_init__(self) -> None:
        caps = {
            "lr_window_cap": self.lr_window_cap,
            "anchor_window_cap": self.anchor_window_cap,
            "guard_window_cap": self.guard_window_cap,
        }
        for field, cap in caps.items():
            if cap < 0:
                raise ConfigError(field, f"must be >= 0, got {cap}")
        if not self.sharp_drop_threshold >= 0:
            raise ConfigError(
                "sharp_drop_threshold", f"must be >= 0, got {self.sharp_drop_threshold}"
            )
        if not 0 < self.min_factor <= self.max_factor <= 1:
            raise ConfigError(
                "min_factor",
                f"need 0 < min_factor <= max_factor <= 1, got {self.min_factor}, {self.max_factor}",
            )


def effective_factor(base: float, trend: float, lo: float = 0.1, hi: float = 0.95) -> float:
    """``base − (1 − base)·trend`` clamped to ``[lo, hi]``.

    A falling anchor (``trend < 0``) moves the factor toward 1 (gentler); a
    climbing one moves it toward 0 (harsher).
    """
    return min(max(base - (1.0 - base) * trend, lo), hi)


class LrEventMeta:
    """Watches LR, anchor and verdicts once per averaging round.

    Args:
        config: window sizes and clamps.
    """

    def __init__(self, config: MetaConfig = MetaConfig()) -> None:  # frozen: safe to share
        self._config = config
        self._lrs: deque[float] = deque(maxlen=config.lr_window_cap)
        self._anchors: deque[int] = deque(maxlen=config.anchor_window_cap)
        guard_cap = max(config.guard_window_cap, MIN_GUARD_WINDOW)
        self._verdicts: deque[Verdict] = deque(maxlen=guard_cap)

    @property
    def lr_window(self) -> tuple[float, ...]:
        """Recent learning rates, oldest first."""
        return tuple(self._lrs)

    @property
    def anchor_window(self) -> tuple[int, ...]:
        """Recent anchors, oldest first."""
        return tuple(self._anchors)

    @property
    def guard_window(self) -> tuple[Verdict, ...]:
        """Recent guard verdicts, oldest first."""
        return tuple(self._verdicts)

    def observe(self, lr: float, anchor: int, verdict: Verdict, phase: Phase) -> NudgeDown | None:
        """Record one round and return a nudge when a watcher fires.

        Args:
            lr: the learning rate in force this round.
            anchor: ElChe's anchor before this round's verdict is applied.
            verdict: the guard's verdict this round.
            phase: ElChe's phase; ``PROBE`` never acts.

        Returns:
            ``NudgeDown(f)`` when one watcher fires, with the two factors
            multiplied (and clamped) when both do; otherwise ``None``.
        """
        self._lrs.append(lr)  # a window capped at 0 stays empty
        self._anchors.append(anchor)
        self._verdicts.append(verdict)
        if phase < Phase.WARMUP:
            return None
        trend = self.anchor_trend()
        lo, hi = self._config.min_factor, self._config.max_factor
        factors: list[float] = []
        if self._lr_cliff():
            factors.append(effective_factor(LR_CLIFF_BASE_FACTOR, trend, lo, hi))
        if self._sustained_divergence(phase):
            factors.append(effective_factor(BASE_FACTOR[phase], trend, lo, hi))
        if not factors:
            return None
        if len(factors) == 1:
            return NudgeDown(factor=factors[0])
        return NudgeDown(factor=min(max(factors[0] * factors[1], lo), hi))

    def anchor_trend(self) -> float:
        """``(newest − mean) / mean`` over the anchor window; 0 when short."""
        if len(self._anchors) < 2:
            return 0.0
        mean = sum(self._anchors) / len(self._anchors)
        if mean <= 0:
            return 0.0
        return (self._anchors[-1] - mean) / mean

    def is_settled(self) -> bool:
        """Whether the anchor sits within 10 % of its recent mean."""
        return abs(self.anchor_trend()) < SETTLED_EPSILON

    def _lr_cliff(self) -> bool:
        if len(self._lrs) < 2:
            return False
        prev, now = self._lrs[-2], self._lrs[-1]
        if not (prev > 0 and now < prev):
            return False
        return (prev - now) / prev > self._config.sharp_drop_threshold

    def _sustained_divergence(self, phase: Phase) -> bool:
        k = SUSTAIN_K[phase]
        if len(self._verdicts) < k:
            return False
        recent = list(self._verdicts)[-k:]
        return all(isinstance(v, NudgeDown | SuppressGrowth) for v in recent)
