"""Divergence measurement and the convergence guards that judge it.

After every reduce each rank reports how far its parameters were from the
consensus (``divergence``). A guard turns the per-window ``DivergenceReport``
into a ``Verdict`` for ``ElChe.apply_verdict``. Behaviour follows floDl 0.7.0
``ddp_run/convergence.rs`` and ``divergence.rs``, so the same divergences get
the reference's verdicts.

- ``NoGuard``: always ``Stable``; the control baseline.
- ``TrendGuard``: the production default. ``SuppressGrowth`` when the last
  three worst-rank divergences rise strictly and the newest exceeds the
  threshold. Never nudges.
- ``MsfGuard``: a rate detector on ``λ = ln(D_t / D_{t-1}) / k_max``;
  sustained growth suppresses, steeper sustained growth nudges.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, assert_never

from elche.core.errors import ConfigError
from elche.core.verdicts import NudgeDown, Stable, SuppressGrowth, Verdict

__all__ = [
    "DivergenceReport",
    "Guard",
    "GuardKind",
    "LambdaEstimator",
    "LambdaSample",
    "MsfGuard",
    "NoGuard",
    "TrendGuard",
    "build_guard",
    "divergence",
]

NORM_EPS = 1e-10  # below this a norm is zero: no direction, no ratio
TREND_HISTORY_CAP = 5  # ring of recent worst-rank divergences (reference)
TREND_RISES = 3  # strictly rising samples that count as a trend
DEFAULT_TREND_THRESHOLD = 0.05  # without EASGD: what the reference's run builder picks
EASGD_TREND_THRESHOLD = 0.3  # EASGD's elastic pull keeps replicas further apart


@dataclass(frozen=True, slots=True, kw_only=True)
class DivergenceReport:
    """One window's divergence, per rank.

    Args:
        deltas: ``‖P − Q‖ / ‖Q‖`` per rank; 0.0 for a rank that sent none.
        pre_norms: ``‖P‖`` per rank, or ``None`` unless every rank sent one.
        post_norm: ``‖Q‖``, the consensus norm.

    Raises:
        ValueError: ``pre_norms`` is not as long as ``deltas``.
    """

    deltas: tuple[float, ...]
    pre_norms: tuple[float, ...] | None = None
    post_norm: float | None = None

    def __post_init__(self) -> None:
        if self.pre_norms is not None and len(self.pre_norms) != len(self.deltas):
            raise ValueError("pre_norms and deltas must have one entry per rank")

    def max_relative_delta(self) -> float:
        """The worst rank's divergence, floored at 0 (0 when empty)."""
        return max((0.0, *self.deltas))

    def cosine(self, rank: int) -> float | None:
        """Cosine between ``rank``'s pre-sync parameters and the consensus.

        ``None`` without norms (or for an unknown rank, or a zero consensus);
        0.0 when the rank's own parameters are zero.
        """
        pre = self._pre_norm(rank)
        post = self.post_norm
        if pre is None or post is None or post < NORM_EPS:
            return None
        if pre < NORM_EPS:
            return 0.0
        diff = self.deltas[rank] * post
        return min(max((pre * pre + post * post - diff * diff) / (2.0 * pre * post), -1.0), 1.0)

    def magnitude_shift(self, rank: int) -> float | None:
        """``‖P‖ − ‖Q‖`` for ``rank``; ``None`` without norms."""
        pre = self._pre_norm(rank)
        if pre is None or self.post_norm is None:
            return None
        return pre - self.post_norm

    def _pre_norm(self, rank: int) -> float | None:
        if self.pre_norms is None or not 0 <= rank < len(self.pre_norms):
            return None
        return self.pre_norms[rank]


def divergence(pre: Sequence[float], post: Sequence[float]) -> tuple[float, float, float]:
    """The divergence triple over flat values: one definition, so every backend compares.

    Returns:
        ``(‖pre − post‖ / ‖post‖, ‖pre‖, ‖post‖)``; the ratio is 0 when
        ``‖post‖ <= 1e-10``, and everything is 0 for empty input.

    Raises:
        ValueError: ``pre`` and ``post`` differ in length.
    """
    if len(pre) != len(post):
        raise ValueError(f"pre has {len(pre)} values, post has {len(post)}")
    pre_norm = math.sqrt(math.fsum(p * p for p in pre))
    post_norm = math.sqrt(math.fsum(q * q for q in post))
    diff_norm = math.sqrt(math.fsum((p - q) * (p - q) for p, q in zip(pre, post, strict=True)))
    ratio = diff_norm / post_norm if post_norm > NORM_EPS else 0.0
    return ratio, pre_norm, post_norm


class Guard(Protocol):
    """What the coordinator asks of a convergence guard."""

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> Verdict:
        """Judge one window: ``k_used`` total steps, ``k_max`` the most by one rank."""
        ...

    def telemetry(self) -> tuple[tuple[str, float], ...]:
        """Named diagnostics of the last judgement."""
        ...

    def reset(self) -> None:
        """Forget all history."""
        ...

    def trend_history(self) -> tuple[float, ...] | None:
        """State worth checkpointing, or ``None``."""
        ...


class NoGuard:
    """Always ``Stable``: lets the overhead tuning run unconditioned."""

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> Verdict:
        """Always ``Stable()``."""
        return Stable()

    def telemetry(self) -> tuple[tuple[str, float], ...]:
        """Nothing to report."""
        return ()

    def reset(self) -> None:
        """Nothing to forget."""

    def trend_history(self) -> tuple[float, ...] | None:
        """Nothing to save."""
        return None


class TrendGuard:
    """Suppress growth on three strict rises of the worst-rank divergence.

    Args:
        threshold: the newest divergence must exceed this to count (default
            0.01, the reference's ``TrendGuard::default``; production builds
            use ``build_guard``'s 0.05 / 0.3).
        history: a checkpointed ring to resume from; the last 5 are kept.

    Raises:
        ConfigError: ``threshold`` is NaN.
    """

    def __init__(self, threshold: float = 0.01, history: Sequence[float] | None = None) -> None:
        if math.isnan(threshold):
            raise ConfigError("divergence_threshold", "must be a number, got NaN")
        self._threshold = threshold
        self._history: deque[float] = deque(history or (), maxlen=TREND_HISTORY_CAP)

    @property
    def threshold(self) -> float:
        """The divergence a rising trend must exceed."""
        return self._threshold

    @property
    def history(self) -> tuple[float, ...]:
        """The ring, oldest first."""
        return tuple(self._history)

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> Verdict:
        """Push the worst divergence; ``SuppressGrowth`` on a rising trend."""
        self._history.append(report.max_relative_delta())
        if len(self._history) < TREND_RISES:
            return Stable()
        older, old, new = list(self._history)[-TREND_RISES:]
        if new > old > older and new > self._threshold:
            return SuppressGrowth()
        return Stable()

    def telemetry(self) -> tuple[tuple[str, float], ...]:
        """``d_history_last``: the newest divergence, once there is one."""
        return (("d_history_last", self._history[-1]),) if self._history else ()

    def reset(self) -> None:
        """Clear the ring."""
        self._history.clear()

    def trend_history(self) -> tuple[float, ...] | None:
        """The ring, or ``None`` when empty."""
        return tuple(self._history) or None


@dataclass(frozen=True, slots=True, kw_only=True)
class LambdaSample:
    """One ``LambdaEstimator.observe`` result.

    ``lambda_raw`` is ``None`` when there was no previous divergence to pair
    with; ``lambda_ema`` is ``None`` until the first ``lambda_raw``.
    """

    d_raw: float
    lambda_raw: float | None
    lambda_ema: float | None
    k_used: int
    k_max: int


class LambdaEstimator:
    """EMA of ``λ = ln(D_t / D_{t−1}) / k_max``, bias-corrected: early ones lean to 0.

    Args:
        alpha: EMA coefficient, clamped to [ε, 1]; a non-finite value falls
            back to 0.9 (the reference default: ~10-event memory).
        noise_floor: divergences at or below it break the pairing (the
            reference's 1e-8: below float32 parameter noise).
    """

    def __init__(self, alpha: float = 0.9, noise_floor: float = 1e-8) -> None:
        self._alpha = min(max(alpha, 2.0**-52), 1.0) if math.isfinite(alpha) else 0.9
        self._noise_floor = noise_floor
        self._prev: float | None = None  # the last above-floor divergence
        self._ema = 0.0  # uncorrected EMA of λ
        self._t = 0  # λ values folded in since the last reset

    @property
    def alpha(self) -> float:
        """The (clamped) EMA coefficient."""
        return self._alpha

    @property
    def raw_ema(self) -> float:
        """The EMA before bias correction (0.0 before any ``λ``)."""
        return self._ema

    def observe(self, d_raw: float, k_used: int, k_max: int) -> LambdaSample:
        """Fold in one window's worst divergence ``d_raw``."""
        floor = self._noise_floor
        lam: float | None = None
        if self._prev is not None and self._prev > floor and d_raw > floor and k_max > 0:
            lam = math.log(d_raw / self._prev) / k_max
            self._ema = self._alpha * self._ema + (1.0 - self._alpha) * lam
            self._t += 1
        # A sub-floor reading breaks the pairing only; the EMA and t survive.
        self._prev = d_raw if d_raw > floor else None
        return LambdaSample(
            d_raw=d_raw, lambda_raw=lam, lambda_ema=self._corrected(), k_used=k_used, k_max=k_max
        )

    def reset(self) -> None:
        """Forget the previous divergence and the EMA."""
        self._prev = None
        self._ema = 0.0
        self._t = 0

    def _corrected(self) -> float | None:
        if self._t == 0:
            return None
        denom = 1.0 - self._alpha**self._t
        return self._ema / denom if denom > 0 else self._ema


class MsfGuard:
    """Escalate on a sustained positive divergence growth rate ``λ_ema``.

    Args:
        suppress_threshold: ``λ_ema`` above which growth is suppressed.
        suppress_sustain: consecutive reports above it before suppressing.
        nudge_threshold: ``λ_ema`` above which the anchor is nudged down
            (``inf`` disables nudging).
        nudge_sustain: consecutive reports above it before nudging.
        nudge_factor: the ``NudgeDown`` factor, in (0, 1].
        alpha: the estimator's EMA coefficient.

    Defaults are the reference's: suppress at 1e-3 (divergence doubling in
    ~700 steps), nudge at 1e-2 (~70 steps), three reports each, halve.

    Raises:
        ConfigError: a sustain < 1, a NaN threshold or a factor outside (0, 1].
    """

    def __init__(
        self,
        suppress_threshold: float = 1e-3,
        suppress_sustain: int = 3,
        nudge_threshold: float = 1e-2,
        nudge_sustain: int = 3,
        nudge_factor: float = 0.5,
        *,
        alpha: float = 0.9,
    ) -> None:
        for field, sustain in (
            ("suppress_sustain", suppress_sustain),
            ("nudge_sustain", nudge_sustain),
        ):
            if sustain < 1:
                raise ConfigError(field, f"must be >= 1, got {sustain}")
        if math.isnan(suppress_threshold) or math.isnan(nudge_threshold):
            raise ConfigError("msf_threshold", "thresholds must be numbers, got NaN")
        if not 0 < nudge_factor <= 1:
            raise ConfigError("nudge_factor", f"must be in (0, 1], got {nudge_factor}")
        self._suppress = (suppress_threshold, suppress_sustain)
        self._nudge = (nudge_threshold, nudge_sustain, nudge_factor)
        self._estimator = LambdaEstimator(alpha)
        self._suppress_streak = 0
        self._nudge_streak = 0
        self._last: LambdaSample | None = None

    def without_nudge(self) -> MsfGuard:
        """This guard with nudging disabled (nudge threshold +inf); chainable."""
        _, sustain, factor = self._nudge
        self._nudge = (math.inf, sustain, factor)
        return self

    @property
    def last_sample(self) -> LambdaSample | None:
        """The estimator's last output."""
        return self._last

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> Verdict:
        """Update ``λ_ema`` and the two streaks; nudge wins over suppress."""
        sample = self._estimator.observe(report.max_relative_delta(), k_used, k_max)
        self._last = sample
        lam = -math.inf if sample.lambda_ema is None else sample.lambda_ema
        suppress_at, suppress_sustain = self._suppress
        nudge_at, nudge_sustain, factor = self._nudge
        self._suppress_streak = self._suppress_streak + 1 if lam > suppress_at else 0
        self._nudge_streak = self._nudge_streak + 1 if lam > nudge_at else 0
        if self._nudge_streak >= nudge_sustain and math.isfinite(nudge_at):
            self._nudge_streak = 0
            return NudgeDown(factor=factor)
        if self._suppress_streak >= suppress_sustain:
            self._suppress_streak = 0
            return SuppressGrowth()
        return Stable()

    def telemetry(self) -> tuple[tuple[str, float], ...]:
        """``lambda_raw`` and ``lambda_ema``, each once it exists."""
        s = self._last
        if s is None:
            return ()
        pairs = (("lambda_raw", s.lambda_raw), ("lambda_ema", s.lambda_ema))
        return tuple((name, value) for name, value in pairs if value is not None)

    def reset(self) -> None:
        """Forget the estimator, the streaks and the last sample."""
        self._estimator.reset()
        self._suppress_streak = 0
        self._nudge_streak = 0
        self._last = None

    def trend_history(self) -> tuple[float, ...] | None:
        """Always ``None``: the EMA re-warms after a resume."""
        return None


class GuardKind(enum.Enum):
    """Which guard a run uses."""

    NONE = "none"
    TREND = "trend"
    MSF = "msf"


def build_guard(
    kind: GuardKind,
    *,
    divergence_threshold: float | None,
    easgd: bool,
    history: Sequence[float] | None,
) -> Guard:
    """Build the guard a run asked for, with the thresholds the reference's run builder sets.

    Args:
        kind: which guard.
        divergence_threshold: the trend threshold; ``None`` picks 0.05, or
            0.3 when EASGD is on.
        easgd: whether elastic averaging is on.
        history: a checkpointed trend ring (trend guard only).

    Raises:
        ConfigError: ``divergence_threshold`` is NaN.
    """
    match kind:
        case GuardKind.NONE:
            return NoGuard()
        case GuardKind.TREND:
            default = EASGD_TREND_THRESHOLD if easgd else DEFAULT_TREND_THRESHOLD
            threshold = default if divergence_threshold is None else divergence_threshold
            return TrendGuard(threshold, history)
        case GuardKind.MSF:
            return MsfGuard()
        case _:
            assert_never(kind)
