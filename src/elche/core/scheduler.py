"""ElChe: the cadence balancer that sizes each rank's share of a reduce window.

The slowest rank (the *anchor rank*) runs ``anchor`` batches per window; every
faster rank runs proportionally more, so all ranks reach the reduce together.
Behaviour follows floDl 0.7.0 ``distributed/el_che.rs``, so elche's windows
compare with the reference's.

Rules:
    - Timing enters once per window (``report_window`` / ``report_timing``);
      each valid rank reading (``wall / batches``) lands in a 5-deep per-rank
      trust window whose mean is the rank's smoothed ms per batch.
    - The anchor rank is elected from the slow cohort (within 15 % of the
      slowest) and only moves in ``Phase.STABLE`` or later, and only when a
      challenger is ≥ 10 % slower than it.
    - Growth is proposed, never applied, by a report: a guard ``Verdict`` must
      commit it (``Stable``), veto it (``SuppressGrowth``) or discard it
      (``NudgeDown``). The anchor only shrinks through ``NudgeDown``.
    - Every batch count stays ≥ 1; after each recompute the live counts' sum
      stays ≤ the window cap whenever the live ranks fit under it.

Theory of operation:
    ``Phase.PROBE`` --1st calibration--> ``WARMUP`` --5th--> ``STABLE``
    --20th--> ``MATURE``. A *calibration* is a report that reached the
    recompute step. Warmup proposals need twice the overhead target, so only
    an unambiguous signal acts before the trust windows fill. The arithmetic
    of a recompute (speed targets, the step clamp, the window cap) is in
    ``elche.core.counts``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import assert_never

from elche.core.config import CoordinatorConfig, Policy
from elche.core.counts import (
    cap_window,
    non_negative,
    round_half_away,
    slack_batches,
    speed_target,
    step_toward,
)
from elche.core.elche_state import ElCheState, Phase
from elche.core.errors import ConfigError
from elche.core.ledger import WindowReport
from elche.core.verdicts import NudgeDown, Stable, SuppressGrowth, Verdict

__all__ = ["ElChe"]

COHORT_BAND = 0.15  # election-eligible within 15 % of the slowest (el_che.rs)
DOMINANCE_MARGIN = 0.10  # a challenger must be 10 % slower to unseat the anchor
TRUST_WINDOW_CAP = 5  # samples per rank; also the misses that clear a window
BATCH_COUNTS_WINDOW_CAP = 10  # snapshots behind recent_batch_share
GROWTH_REARM_STABLE = 5  # clean verdicts before growth re-arms after a veto
GROWTH_STEP_CAP = 2.0  # at most x2 per proposal: climb fast, never overshoot
WARMUP_GROWTH_MARGIN = GROWTH_STEP_CAP  # warmup acts only when already capped
DEAD_ZONE = 0.05  # ignore count changes within 5 % (1-batch chatter)
STABLE_AT = 5  # calibrations to reach Phase.STABLE
MATURE_AT = 20  # calibrations to reach Phase.MATURE


class ElChe:
    """The cadence balancer: batch counts that give every rank's window one wall time.

    Args:
        world_size: ranks in the run (>= 1; one survivor keeps balancing).
        anchor: the anchor rank's batches per window (>= 1).
        overhead_target: per-window fixed cost tolerated as a fraction of the
            anchor's window wall; clamped to [0.01, 0.50].
        max_anchor: staleness ceiling for the anchor (floored at 1).
        min_anchor: floor for growth proposals (default: ``anchor``).
        max_batch_diff: largest step a calibrated count may move per update.
        window_growth_applicable: ``False`` under the sync policy (no window).

    Raises:
        ConfigError: ``world_size`` or ``anchor`` < 1, a non-finite
            ``overhead_target`` or a negative ``max_batch_diff``.
    """

    def __init__(
        self,
        world_size: int,
        anchor: int = 10,  # reference default: amortises a reduce, keeps replicas close
        *,
        overhead_target: float = 0.05,  # reference default: reduce+fill <= 5 % of window
        max_anchor: int = 1000,  # reference safety net against runaway growth
        min_anchor: int | None = None,
        max_batch_diff: int | None = None,
        window_growth_applicable: bool = True,
    ) -> None:
        if world_size < 1:
            raise ConfigError("world_size", f"must be >= 1, got {world_size}")
        if anchor < 1:
            raise ConfigError("anchor", f"must be >= 1, got {anchor}")
        if not math.isfinite(overhead_target):
            raise ConfigError("overhead_target", f"must be finite, got {overhead_target}")
        if max_batch_diff is not None and max_batch_diff < 0:
            raise ConfigError("max_batch_diff", f"must be >= 0, got {max_batch_diff}")
        self._ws = world_size
        self._anchor = anchor
        self._target = min(max(overhead_target, 0.01), 0.50)
        self._max_anchor = max(max_anchor, 1)
        self._min_anchor = min(anchor, self._max_anchor)
        self._anchor = min(self._anchor, self._max_anchor)
        if min_anchor is not None:
            self._min_anchor = min(max(min_anchor, 1), self._max_anchor)
            self._anchor = max(self._anchor, self._min_anchor)
        self._max_batch_diff = max_batch_diff
        self._growth_applicable = window_growth_applicable
        self._counts = [self._anchor] * world_size
        self._windows: list[deque[float]] = [
            deque(maxlen=TRUST_WINDOW_CAP) for _ in range(world_size)
        ]
        self._means: tuple[float, ...] | None = None  # ms_per_batch, until a window changes
        self._zero_reports = [0] * world_size
        self._snapshots: deque[tuple[int, ...]] = deque(maxlen=BATCH_COUNTS_WINDOW_CAP)
        self._slack_ms = [0.0] * world_size
        self._fill_ms = [0.0] * world_size
        self._retired: set[int] = set()
        self._calibrated = False
        self._calibration_count = 0
        self._phase = Phase.PROBE
        self._anchor_rank: int | None = None
        self._max_total: int | None = None
        self._cap_binding = False
        self._proposal: int | None = None
        self._growth_enabled = True
        self._consecutive_stable = 0

    @classmethod
    def for_run(cls, config: CoordinatorConfig) -> ElChe:
        """The balancer of a run, its knobs from ``config.scheduler``.

        Its window is capped at one epoch of batches, so a window never
        spans two epochs; under ``sync`` there is no window to grow.

        Raises:
            ConfigError: as the constructor.
        """
        sched = config.scheduler
        elche = cls(
            config.world_size,
            sched.anchor_for(config.policy),
            overhead_target=sched.overhead_target,
            max_anchor=sched.max_anchor,
            min_anchor=sched.min_anchor,
            max_batch_diff=sched.max_batch_diff,
            window_growth_applicable=config.policy is not Policy.SYNC,
        )
        elche.set_max_total_batches(config.num_samples // config.batch_size)
        return elche

    # -- read side ---------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Ranks the balancer was built for (retired ones included)."""
        return self._ws

    @property
    def anchor(self) -> int:
        """Batches per window of the anchor rank."""
        return self._anchor

    @property
    def anchor_rank(self) -> int | None:
        """The elected slow rank; ``None`` before the first election."""
        return self._anchor_rank

    @property
    def batch_counts(self) -> tuple[int, ...]:
        """Scheduled batches per rank for the next window."""
        return tuple(self._counts)

    @property
    def phase(self) -> Phase:
        """Current lifecycle phase."""
        return self._phase

    @property
    def is_calibrated(self) -> bool:
        """Whether a report (or a restore with data) has set the counts."""
        return self._calibrated

    @property
    def calibration_count(self) -> int:
        """Reports that reached the recompute step."""
        return self._calibration_count

    @property
    def proposed_anchor(self) -> int | None:
        """The staged ``Grow(n)`` awaiting a verdict, as ``n``."""
        return self._proposal

    @property
    def growth_enabled(self) -> bool:
        """The growth latch: off after a veto until 5 straight ``Stable``."""
        return self._growth_enabled

    @property
    def window_cap_binding(self) -> bool:
        """Whether the last recompute had to scale counts under the cap."""
        return self._cap_binding

    @property
    def max_batch_diff(self) -> int | None:
        """The per-update step clamp for calibrated counts."""
        return self._max_batch_diff

    @property
    def overhead_target(self) -> float:
        """The clamped overhead target."""
        return self._target

    @property
    def min_anchor(self) -> int:
        """Floor for growth proposals (``NudgeDown`` ignores it)."""
        return self._min_anchor

    @property
    def max_anchor(self) -> int:
        """Ceiling for the anchor."""
        return self._max_anchor

    @property
    def retired(self) -> frozenset[int]:
        """Ranks marked dead by ``retire``."""
        return frozenset(self._retired)

    @property
    def pending_callback_slack_ms(self) -> tuple[float, ...]:
        """Slack staged for the next recompute (all zero when none)."""
        return tuple(self._slack_ms)

    def smoothed_ms_per_batch(self, rank: int) -> float | None:
        """Mean of ``rank``'s trust window; ``None`` without data."""
        if not 0 <= rank < self._ws or not self._windows[rank]:
            return None
        return self._mean(rank)

    def ms_per_batch(self) -> tuple[float, ...]:
        """Every rank's smoothed ms per batch, 0.0 where there is no data."""
        if self._means is None:
            self._means = tuple(self._mean(r) for r in range(self._ws))
        return self._means

    def anchor_wall_ms(self) -> float:
        """Target window wall: ``anchor`` x the anchor rank's ms (0 uncalibrated)."""
        return self._anchor * self._slow_ms() if self._calibrated else 0.0

    def recent_batch_share(self) -> tuple[float, ...]:
        """Each rank's share of the last (<= 10) snapshots' batches."""
        rows = list(self._snapshots) or [tuple(self._counts)]
        sums = [float(sum(row[r] for row in rows)) for r in range(self._ws)]
        total = sum(sums)
        if total <= 0:
            return tuple(1.0 / self._ws for _ in range(self._ws))
        return tuple(s / total for s in sums)

    def clamp_total(self, max_total: int) -> tuple[int, ...]:
        """The counts scaled to sum to ``max_total`` (a pure utility).

        Raises:
            ValueError: ``max_total`` is negative.
        """
        if max_total < 0:
            raise ValueError(f"max_total must be >= 0, got {max_total}")
        total = sum(self._counts)
        if total <= max_total:
            return tuple(self._counts)
        out = [max(1, math.floor(c * (max_total / total))) for c in self._counts]
        for r in range(max(0, max_total - sum(out))):
            out[r % self._ws] += 1
        return tuple(out)

    def to_state(self) -> ElCheState:
        """Snapshot for a checkpoint; ``trend_history`` is the guard's to fill."""
        return ElCheState(
            anchor=self._anchor,
            anchor_rank=self._anchor_rank,
            smoothed_ms_per_batch=self.ms_per_batch(),
            phase=self._phase,
            calibration_count=self._calibration_count,
        )

    # -- write side --------------------------------------------------------

    def set_max_total_batches(self, n: int) -> None:
        """Cap a window's live batch total (``0`` removes the cap).

        Raises:
            ConfigError: ``n`` is negative; the cap is unchanged.
        """
        if n < 0:
            raise ConfigError("max_total_batches", f"must be >= 0, got {n}")
        self._max_total = n or None

    def apply_callback_slack(self, ms_per_rank: Sequence[float]) -> None:
        """Stage callback wall time to carve out of the next recompute.

        A length mismatch is ignored (reference: a misconfiguration must not
        crash a running cluster).
        """
        if len(ms_per_rank) == self._ws:
            self._slack_ms = [float(v) for v in ms_per_rank]

    def set_window_fill_ms(self, ms: Sequence[float]) -> None:
        """Stage the per-rank first-batch fill for the next proposal.

        A length mismatch is ignored, as for ``apply_callback_slack``.
        """
        if len(ms) == self._ws:
            self._fill_ms = [float(v) for v in ms]

    def report_window(self, report: WindowReport) -> None:
        """Ingest one window: stage its fill, pick the scale, report it.

        A window where every selected ms is zero reports nothing at all.

        Raises:
            ValueError: a per-rank field other than ``fill_ms`` is not of
                length ``world_size``; nothing changes.
        """
        fields = (report.wall_ms, report.steps, report.delivered_ms, report.delivered_batches)
        if any(len(f) != self._ws for f in fields):
            raise ValueError(f"window report fields must have {self._ws} entries")
        self.set_window_fill_ms(report.fill_ms)
        ms, batches = report.select_feed()
        if any(m > 0 for m in ms):
            self.report_timing(ms, batches, report.sync_ms)

    def report_timing(
        self, wall_ms: Sequence[float], batches: Sequence[int], sync_ms: float
    ) -> None:
        """Fold one window's timing in and recompute the counts.

        The steps run in the reference's order: which ones a report reaches
        decides whether it elects, proposes growth or counts as a calibration.

        Raises:
            ValueError: ``wall_ms`` or ``batches`` is not of length
                ``world_size``; nothing changes.
        """
        if len(wall_ms) != self._ws or len(batches) != self._ws:
            raise ValueError(f"wall_ms and batches must have {self._ws} entries")
        self._ingest(wall_ms, batches)
        if self._anchor_rank is None or self._phase >= Phase.STABLE:
            elected = self._elect()
            if elected is not None:
                self._anchor_rank = elected
        if self._anchor_rank is None:
            return
        slow_ms = self._escape_dead_anchor(self._anchor_rank)
        if slow_ms <= 0:
            return  # the fill and any stale proposal survive, as in the reference
        self._proposal = None
        if self._phase >= Phase.STABLE or (
            self._phase is Phase.WARMUP and self._calibration_count >= 1
        ):
            self._proposal = self._propose(sync_ms)
        self._fill_ms = [0.0] * self._ws
        self._recompute(slow_ms)
        self._snapshots.append(tuple(self._counts))
        self._calibrated = True
        self._calibration_count += 1
        self._advance_phase()

    # -- the verdict seam: verdicts move the anchor only through here -------

    def apply_verdict(self, v: Verdict) -> None:
        """Apply a guard's (or the meta-controller's) verdict."""
        match v:
            case Stable(relax_up=relax_up):
                self.commit_proposed_anchor()
                if relax_up:
                    self.relax_anchor_up()
            case SuppressGrowth():
                self.veto_proposed_growth()
            case NudgeDown(factor=factor):
                self.discard_proposed_anchor()
                self.nudge_anchor_down(factor)
            case _:
                assert_never(v)

    def commit_proposed_anchor(self) -> None:
        """Count a clean verdict toward re-arming growth; land any ``Grow(n)``."""
        self._consecutive_stable += 1
        if self._consecutive_stable >= GROWTH_REARM_STABLE:
            self._growth_enabled = True
        proposal, self._proposal = self._proposal, None
        if proposal is not None:
            self._anchor = proposal
            self._recompute_if_timed()

    def veto_proposed_growth(self) -> None:
        """Drop the proposal and latch growth off."""
        self._proposal = None
        self._consecutive_stable = 0
        self._growth_enabled = False

    def discard_proposed_anchor(self) -> None:
        """Drop the proposal (it predates a nudge) and latch growth off."""
        self.veto_proposed_growth()

    def nudge_anchor_down(self, factor: float) -> None:
        """Shrink the anchor to ``ceil(anchor * factor)``, factor in [0.1, 1].

        Never increases the anchor, bypasses ``min_anchor`` and ignores a
        non-finite factor.
        """
        if not math.isfinite(factor):
            return
        shrunk = math.ceil(self._anchor * min(max(factor, 0.1), 1.0))
        self._anchor = max(1, min(shrunk, self._anchor))
        self._recompute_if_timed()

    def relax_anchor_up(self) -> None:
        """Grow the anchor by one (the async ``Stable(relax_up=True)`` drift).

        A no-op at ``max_anchor``, or when the fastest rank's projected count
        would lead the new anchor by more than ``max_batch_diff``.
        """
        if self._anchor >= self._max_anchor:
            return
        means = [m for m in self.ms_per_batch() if m > 0]
        if self._max_batch_diff is not None and means:
            ratio = max(means) / min(means)
            if not math.isfinite(ratio):
                return
            projected_fast = max(1, round_half_away((self._anchor + 1) * ratio))
            if projected_fast - (self._anchor + 1) > self._max_batch_diff:
                return
        self._anchor += 1
        self._recompute_if_timed()

    # -- membership and persistence ----------------------------------------

    def retire(self, rank: int) -> None:
        """Mark ``rank`` dead for good (elche addition).

        Its timing is forgotten and ignored from now on, it is never elected,
        and its count leaves the window-cap sum. A retired anchor rank is
        replaced at the next report; a proposal derived from its timing is
        dropped (the growth latch is untouched).

        Raises:
            ValueError: ``rank`` is out of range; nothing changes.
        """
        if not 0 <= rank < self._ws:
            raise ValueError(f"rank must be in [0, {self._ws}), got {rank}")
        self._retired.add(rank)
        self._windows[rank].clear()
        self._means = None
        self._slack_ms[rank] = 0.0
        self._fill_ms[rank] = 0.0
        if self._anchor_rank == rank:
            self._anchor_rank = None
            self._proposal = None

    def readmit(self, rank: int) -> None:
        """Take a retired ``rank`` back (elche addition: a rank joined in its slot).

        It starts without timing, at the anchor's count, until its first
        window's timing calibrates it like any other rank.

        Raises:
            ValueError: ``rank`` is out of range; nothing changes.
        """
        if not 0 <= rank < self._ws:
            raise ValueError(f"rank must be in [0, {self._ws}), got {rank}")
        self._retired.discard(rank)
        self._windows[rank].clear()
        self._means = None
        self._counts[rank] = self._anchor

    def restore_from_state(self, state: ElCheState) -> None:
        """Resume a saved trajectory; knobs and transient state are kept.

        Each trust window is re-seeded with one sample, the saved mean. A saved
        anchor above this run's ``max_anchor`` (resumed with a lower one) is
        brought down to it.

        Raises:
            ConfigError: the state is for another world size or names an
                anchor rank out of range; nothing changes.
        """
        if len(state.smoothed_ms_per_batch) != self._ws:
            raise ConfigError(
                "smoothed_ms_per_batch",
                f"saved for {len(state.smoothed_ms_per_batch)} ranks, this run has {self._ws}",
            )
        if state.anchor_rank is not None and state.anchor_rank >= self._ws:
            raise ConfigError("anchor_rank", f"must be < {self._ws}, got {state.anchor_rank}")
        self._anchor = min(max(state.anchor, 1), self._max_anchor)
        rank = state.anchor_rank
        self._anchor_rank = None if rank in self._retired else rank
        self._phase = state.phase
        self._calibration_count = state.calibration_count
        for r, mean in enumerate(state.smoothed_ms_per_batch):
            self._windows[r].clear()
            if mean > 0 and r not in self._retired:
                self._windows[r].append(mean)
        self._means = None
        self._calibrated = any(m > 0 for m in state.smoothed_ms_per_batch)

    # -- internals ---------------------------------------------------------

    def _mean(self, rank: int) -> float:
        window = self._windows[rank]
        return sum(window) / len(window) if window else 0.0

    def _slow_ms(self) -> float:
        return 0.0 if self._anchor_rank is None else self._mean(self._anchor_rank)

    def _recompute_if_timed(self) -> None:
        slow_ms = self._slow_ms()
        if slow_ms > 0:
            self._recompute(slow_ms)

    def _ingest(self, wall_ms: Sequence[float], batches: Sequence[int]) -> None:
        self._means = None
        for r, (wall, n) in enumerate(zip(wall_ms, batches, strict=True)):
            if r not in self._retired and n > 0 and wall > 0 and math.isfinite(wall):
                self._windows[r].append(wall / n)
                self._zero_reports[r] = 0
                continue
            self._zero_reports[r] += 1
            if self._zero_reports[r] >= TRUST_WINDOW_CAP:
                self._windows[r].clear()

    def _elect(self) -> int | None:
        means = self.ms_per_batch()
        max_ms = max(means)
        if max_ms <= 0:
            return None
        cohort = [r for r, m in enumerate(means) if m >= (1.0 - COHORT_BAND) * max_ms]
        current = self._anchor_rank
        if len(cohort) == 1 or current not in cohort:
            return cohort[0]  # no sitting anchor in the cohort: lowest index
        # Ties among challengers go to the highest index (Rust max_by).
        challenger = max((r for r in cohort if r != current), key=lambda r: (means[r], r))
        if means[challenger] > means[current] * (1.0 + DOMINANCE_MARGIN):
            return challenger
        return current

    def _escape_dead_anchor(self, rank: int) -> float:
        slow_ms = self._mean(rank)
        if slow_ms <= 0 and self._zero_reports[rank] >= TRUST_WINDOW_CAP:
            elected = self._elect()
            if elected is not None:
                self._anchor_rank = elected
                slow_ms = self._mean(elected)
        return slow_ms

    def _propose(self, sync_ms: float) -> int | None:
        rank = self._anchor_rank
        if rank is None or not (self._growth_applicable and self._growth_enabled):
            return None
        if self._cap_binding:  # a bigger anchor would only detach from the capped counts
            return None
        marginal_ms = self._mean(rank)
        fixed_ms = non_negative(sync_ms) + non_negative(self._fill_ms[rank])
        if marginal_ms <= 0 or fixed_ms <= 0:
            return None
        overhead = fixed_ms / (self._anchor * marginal_ms + fixed_ms)  # NaN if fixed is inf
        fire_at = self._target * (1.0 if self._phase >= Phase.STABLE else WARMUP_GROWTH_MARGIN)
        if overhead <= fire_at:
            return None
        if math.isnan(overhead):  # infinite sync: NaN passes the bar, grows by the cap
            scale = GROWTH_STEP_CAP
        else:
            scale = min(overhead / self._target, GROWTH_STEP_CAP)
        grown = min(max(math.ceil(self._anchor * scale), self._min_anchor), self._max_anchor)
        return grown if grown > self._anchor else None

    def _recompute(self, slow_ms: float) -> None:
        for r in range(self._ws):
            ms = self._mean(r)
            slack = slack_batches(self._slack_ms[r], ms)
            target = max(1, speed_target(self._anchor, ms, slow_ms) - slack)
            current = self._counts[r]
            if abs(target - current) > DEAD_ZONE * current or not self._calibrated or slack:
                step = self._max_batch_diff if self._calibrated else None
                self._counts[r] = step_toward(current, target, step)
        self._apply_window_cap()
        self._slack_ms = [0.0] * self._ws  # slack is consumed exactly once

    def _apply_window_cap(self) -> None:
        live = [r for r in range(self._ws) if r not in self._retired]
        self._cap_binding = cap_window(self._counts, live, self._max_total)

    def _advance_phase(self) -> None:
        # One step per calibration at most, as the reference's match.
        if self._phase is Phase.PROBE:
            self._phase = Phase.WARMUP
        elif self._phase is Phase.WARMUP and self._calibration_count >= STABLE_AT:
            self._phase = Phase.STABLE
        elif self._phase is Phase.STABLE and self._calibration_count >= MATURE_AT:
            self._phase = Phase.MATURE
