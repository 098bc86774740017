"""The planner: how much each rank may train before the next average, and on what.

Rules:

- A rank's *window* is its ElChe batch count, or ``PROBE_STEPS`` before the
  first calibration. Its *budget* (the steps it may take since the last
  average before it must hold) is the window, plus the overshoot allowance
  under ``async``, or its epoch-tail allocation when that is larger.
- Under ``cadence`` the probe does not idle: before the first calibration a
  rank past its probe steps keeps streaming one-batch chunks, its budget
  raised by one each. Once every live rank has trained its probe steps the
  coordinator calibrates and the probe *continues* as the first window
  (``open_window(continuing=True)``): each rank's window and budget count
  from the steps it has already taken.
- The automatic overshoot allowance (``async`` without a configured one)
  starts at ``OVERSHOOT_INITIAL``, grows by one per ``Stable`` verdict up to
  ``OVERSHOOT_CEILING`` and falls back to the start on a ``NudgeDown``.
- An epoch's pool reserves each live rank a share in proportion to its
  ElChe count, so each mostly trains its own span; shares are equal under
  ``sync`` and before the first calibration.
- One chunk in flight per rank. A chunk never runs past the budget.
- ``sync`` hands each rank its whole equal partition at once and spreads a
  dead rank's partition evenly over the survivors.
- ``cadence`` and ``async`` hand out chunks of the remaining budget. When the
  epoch's remaining batches no longer fill a whole window, or would leave a
  last window under half a full one (``TAIL_FOLD_WINDOWS``), the rest of the
  epoch is one tail window: its batches go by list scheduling on the ranks'
  paces (each to whoever would end it soonest, a chunk in flight counted
  first), or by their counts (``final_window_alloc``) while a pace is
  missing, so the last window of the epoch is as short as possible.
- Of that tail, ``TAIL_RESERVE_SLOW_STEPS`` of the slowest rank's steps
  (counted in the fastest rank's batches) are held back from the batches
  planned to end last. A rank that finishes its share takes from this
  *reserve* as many batches as list scheduling gives it: each held batch goes
  to whoever would end it soonest, a busy rank being free when its queued
  and planned batches are done at its smoothed pace (counted from its last
  report), a rank already idle in the tail being free now. Whenever a rank
  turns idle, the ranks idle before it are offered the reserve again: a
  batch that list scheduling once left to a busy rank goes to an idle one
  if that busy rank ran late. A fixed split cannot follow a step that runs
  long or short; the reserve is spent by whoever is actually ahead, so the
  ranks end the epoch closer together.
- Under ``cadence``, a rank that trained its budget mid-epoch while a peer
  still has steps left trains on instead of holding (``fill_wait``, on by
  default): as many of its own steps as end before the last such peer is
  expected to end its budget (each at its smoothed pace, from its last
  report), at most one more window. A step's time varies on a shared
  machine, so budgets sized by the paces end apart; the fast ranks fill the
  gap and the round fires when it would have. (``elche sim`` with 10 % step
  jitter: efficiency 0.966 -> 0.985 on speeds 1, 0.5, 0.25.) The epoch
  tail has its reserve instead.
- The averaging gate waits for each rank's window (``cadence``: its budget,
  so the epoch tail is averaged in one round; ``sync``: one step). A rank
  with nothing it may take is *quiesced*: the gate does not wait for it.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from fractions import Fraction
from typing import assert_never

from elche.core import messages as m
from elche.core.config import CoordinatorConfig, Policy
from elche.core.dispatch import Span, batches_in, final_window_alloc, needs_final_window
from elche.core.scheduler import ElChe
from elche.core.verdicts import NudgeDown, Stable, SuppressGrowth, Verdict
from elche.core.work import WorkBook

__all__ = [
    "OVERSHOOT_CEILING",
    "OVERSHOOT_INITIAL",
    "PROBE_STEPS",
    "TAIL_RESERVE_SLOW_STEPS",
    "Planner",
]

# Before the first calibration every rank runs this many steps: one batch
# fills the pipeline, the second gives a marginal timing sample. A full
# uncalibrated window would make the fast ranks idle through most of it.
PROBE_STEPS = 2

# The epoch tail's reserve, in steps of the slowest live rank: enough to
# cover the jitter of one window on a shared machine, small enough that most
# of the tail is still planned (see ``Planner._hold_back``).
TAIL_RESERVE_SLOW_STEPS = 2

# An epoch whose remaining batches would leave a last window under half a
# full one (fewer than 1.5 windows' worth) is planned as one tail: a short
# window costs an average and a whole-batch rounding of its own. (At 2 the
# longer tails lost more to jitter than the saved averages won back.)
TAIL_FOLD_WINDOWS = 1.5

# Async overshoot: start at 3 steps past the window, grow by one per Stable
# round up to 15 (reference defaults).
OVERSHOOT_INITIAL = 3
OVERSHOOT_CEILING = 15


class Planner:
    """Per-rank budgets, the epoch-tail plan and chunk sizing.

    Args:
        config: the run's configuration.
        elche: the balancer whose batch counts size the windows.
        work: the work book the chunks are taken from.
    """

    def __init__(self, config: CoordinatorConfig, elche: ElChe, work: WorkBook) -> None:
        self.config = config
        self.elche = elche
        self.work = work
        configured = config.scheduler.max_overshoot
        self._overshoot_auto = configured is None and config.policy is Policy.ASYNC
        self.max_overshoot = OVERSHOOT_INITIAL if configured is None else configured
        self.budget = [0] * config.world_size
        self.quiesced = [False] * config.world_size
        self.tail_plan: dict[int, int] | None = None
        self.tail_reserve = 0  # tail batches held back for whoever frees up first
        self._progress_s = [0.0] * config.world_size  # last assignment or report
        self._base = [0] * config.world_size  # steps the current window counts from
        # A window planned ahead (``open_window(ahead=True)``): the steps of the
        # round in flight that each rank's window counts from until the round
        # commits them, and the plan the window replaced (``undo_ahead``).
        self._pending = [0] * config.world_size
        self._before_ahead: tuple[list[int], list[int]] | None = None
        self.planned_ahead = False  # the window now open was planned as its round started

    def open_epoch(self, epoch: int, live: Collection[int]) -> None:
        """Open ``epoch``'s pool with a reservation for each ``live`` rank."""
        ws = self.config.world_size
        if self.config.policy is Policy.SYNC or not self.elche.is_calibrated:
            weights = [1.0 if r in live else 0.0 for r in range(ws)]
        else:
            counts = self.elche.batch_counts
            weights = [float(counts[r]) if r in live else 0.0 for r in range(ws)]
        self.work.open_epoch(epoch, weights)

    @property
    def probing(self) -> bool:
        """Whether the ranks stream the probe, waiting for the first calibration."""
        return self.config.policy is Policy.CADENCE and not self.elche.is_calibrated

    def window_steps(self, rank: int) -> int:
        """Steps since the last average that complete ``rank``'s window."""
        return self._base[rank] + self._count(rank)

    def _count(self, rank: int) -> int:
        count = self.elche.batch_counts[rank]
        return count if self.elche.is_calibrated else min(count, PROBE_STEPS)

    def window_counts(self, live: Sequence[int]) -> dict[int, int]:
        """The steps each live rank trains in the window now planned (ElChe
        counts; a window planned ahead without the steps its round commits):
        its share of the cluster's samples is its count over their sum."""
        if self.config.policy is Policy.SYNC:  # one step each per window
            return {rank: 1 for rank in live}
        if self.config.policy is Policy.CADENCE:  # each trains its budget (tail included)
            return {
                rank: max(max(self.budget[rank], self.window_steps(rank)) - self._pending[rank], 1)
                for rank in live
            }
        return {rank: max(self.window_steps(rank) - self._pending[rank], 1) for rank in live}

    def satisfied(self, rank: int) -> bool:
        """Whether the averaging gate may fire as far as ``rank`` is concerned.

        Under ``cadence`` the target is the budget: in an epoch's last window
        that is the tail allocation, so the round waits for the whole tail
        instead of averaging without a rank's last batches and then running
        a second, nearly empty round for them.
        """
        match self.config.policy:
            case Policy.SYNC:
                target = 1
            case Policy.CADENCE:
                target = self.window_steps(rank) if self.probing else self.budget[rank]
            case Policy.ASYNC:
                target = self.window_steps(rank)
            case _:
                assert_never(self.config.policy)
        return self.work.steps_since_sync(rank) >= target or self.quiesced[rank]

    def open_window(
        self,
        live: Sequence[int],
        *,
        continuing: bool = False,
        ahead: bool = False,
        now_s: float = 0.0,
    ) -> list[m.CoordMessage | None]:
        """Plan a new window; returns a ``SetBudget`` (or None) per live rank.

        Only ranks that still hold work need to hear a changed budget; others
        get it with their next chunk. ``continuing``: no average came between
        (the probe goes on as the first window), so each rank's window and
        budget count from the steps it has taken since the last one.
        ``ahead``: the window after the round now in flight, planned as it
        starts; each rank's counts from the steps that round will commit
        (``averaged`` moves it to count from zero, ``undo_ahead`` takes it
        back if the round is abandoned), and its chunks and ``SetBudget``
        carry the budget as the rank will count it, after that average (a
        rank holding work hears it whether or not it changed: the count it
        had ends with the round).
        """
        self._before_ahead = (list(self.budget), list(self._base)) if ahead else None
        self.planned_ahead = ahead
        for rank in live:
            steps = self.work.steps_since_sync(rank)
            self._base[rank] = steps if continuing or ahead else 0
            self._pending[rank] = steps if ahead else 0
        self._plan_tail(live, now_s)
        updates: list[m.CoordMessage | None] = []
        for rank in live:
            budget = self._budget_of(rank)
            changed = ahead or budget != self.budget[rank]
            window = self.window_steps(rank)
            pending = self._pending[rank]
            updates.append(
                m.SetBudget(budget=budget - pending, window=window - pending)
                if changed and self.work.busy_samples(rank) > 0
                else None
            )
            self.budget[rank] = budget
            self.quiesced[rank] = False
        return updates

    def averaged(self, rank: int, steps: int, now_s: float) -> None:
        """A round committed ``steps`` of ``rank``'s at ``now_s``: a window planned
        ahead of it now counts from zero, as the rank does, and starts now."""
        if not self._pending[rank]:
            return
        shift = min(steps, self._pending[rank])
        self._base[rank] -= shift
        self.budget[rank] -= shift
        self._pending[rank] = 0
        self._progress_s[rank] = now_s  # its work waited for its average
        self._before_ahead = None  # a round that committed is not abandoned

    def round_failed(self, rank: int, now_s: float) -> None:
        """``rank``'s collective broke (``SyncAck.failed``): nothing of it was
        committed, and a window planned ahead counts for it from its last
        average, its steps in the round included, as the rank now counts.
        The round may still be abandoned (``undo_ahead``): a member's failed
        answer commits nothing, so it does not end the plan's undo."""
        self._pending[rank] = 0
        self._progress_s[rank] = now_s

    def undo_ahead(self, live: Sequence[int]) -> list[m.CoordMessage | None]:
        """The round a window was planned ahead of was abandoned: back to the plan before it.

        What was handed out ahead stays with its ranks, to train after the
        round that is tried next. Its budget does not: it counted after an
        average that never came, so each live rank holding work is told the
        budget before it again (a rank whose unaveraged steps had reached
        the ahead budget would hold while the coordinator waits for it).

        Returns:
            A ``SetBudget`` (or None) per live rank, in ``live``'s order.
        """
        if self._before_ahead is None:
            return [None] * len(live)
        self.budget, self._base = self._before_ahead
        self._before_ahead = None
        self._pending = [0] * self.config.world_size
        self.planned_ahead = False
        return [
            m.SetBudget(budget=self.budget[rank], window=self.window_steps(rank))
            if self.work.busy_samples(rank) > 0
            else None
            for rank in live
        ]

    def plan_afresh(self) -> None:
        """A death or a joiner changed who trains: the window planned ahead does
        not stand; the round's close plans the next one (what was handed out
        stays with its ranks)."""
        self.planned_ahead = False

    def note_verdict(self, verdict: Verdict) -> None:
        """The guard judged the last round: the automatic overshoot follows it."""
        if not self._overshoot_auto:
            return
        match verdict:
            case Stable():
                self.max_overshoot = min(self.max_overshoot + 1, OVERSHOOT_CEILING)
            case NudgeDown():
                self.max_overshoot = OVERSHOOT_INITIAL
            case SuppressGrowth():
                pass
            case _:
                assert_never(verdict)

    def note_rank_lost(self, rank: int) -> None:
        """``rank`` died: whatever it was waiting for, it is not quiesced."""
        self.quiesced[rank] = False

    def note_work_returned(self, rank: int) -> None:
        """A death put work back in the pools: the gate waits for ``rank`` again.

        It stays unquiesced until it is next planned (``next_chunk``).
        """
        self.quiesced[rank] = False

    def forget_tail_plan(self) -> None:
        """A rank died mid-window: the tail allocation no longer adds up.

        The reserve's batches stay in the pool, open to every budget.
        """
        self.tail_plan = None
        self.tail_reserve = 0

    def note_progress(self, rank: int, now_s: float) -> None:
        """``rank`` reported a batch at ``now_s``: its queue is counted from here."""
        self._progress_s[rank] = now_s

    def needs_next_epoch(self, rank: int) -> bool:
        """Async: ``rank`` is idle with budget left, but no open epoch has work.

        The coordinator then opens the next epoch early, so fast ranks keep
        streaming, before it asks ``next_chunk``. (Async plans no epoch
        tail, so there is no reserve to serve instead.)
        """
        return (
            self.config.policy is Policy.ASYNC
            and self.work.busy_samples(rank) == 0
            and self.budget[rank] > self.work.steps_since_sync(rank)
            and self.work.serving_epoch() is None
        )

    def next_chunk(
        self, rank: int, live: Sequence[int], now_s: float = 0.0
    ) -> m.AssignChunk | None:
        """The chunk ``rank`` should train next, if it is idle and may take one.

        Args:
            rank: a live rank.
            live: the live ranks (to split reclaimed work, to time the gate).
            now_s: the coordinator's clock, to time the epoch tail's reserve
                and the gate a rank's budget ran out before.
        """
        if self.work.busy_samples(rank) > 0:
            return None  # one chunk in flight per rank
        if self.tail_plan is not None and self.tail_plan.get(rank, 0) <= 0:
            return self._from_reserve(rank, now_s)
        left = self.budget[rank] - self.work.steps_since_sync(rank)
        if left <= 0 and self.probing:
            self.budget[rank] += 1 - left  # streams on until the calibration
            left = 1
        if left <= 0 and (fill := self._fill(rank, live, now_s)) > 0:
            self.budget[rank] += fill - left
            left = fill
        if left <= 0:
            return None  # holds for the next average
        epoch = self.work.serving_epoch()
        span = None if epoch is None else self._take(rank, epoch, left, len(live))
        self.quiesced[rank] = span is None
        if epoch is None or span is None:
            return None
        return self._assign(rank, epoch, span, now_s)

    def _fill(self, rank: int, live: Sequence[int], now_s: float) -> int:
        """Steps ``rank``, out of budget mid-epoch, may train while the gate waits (0: it holds).

        The gate fires once every live rank trained its budget; each peer with
        steps left is expected to end them at its smoothed pace, counted from
        its last report. ``rank`` gets the whole steps of its own pace that
        fit before the last of those ends, at most one more window.
        """
        if (
            not self.config.scheduler.fill_wait
            or self.config.policy is not Policy.CADENCE
            or self.planned_ahead  # out of the next window's work while its round flies
        ):
            return 0
        ms = self.elche.ms_per_batch()
        if ms[rank] <= 0:
            return 0
        gate_ms = now_ms = now_s * 1000.0
        for q in live:
            if q == rank or self.satisfied(q):
                continue
            if ms[q] <= 0:
                return 0
            left = self.budget[q] - self.work.steps_since_sync(q)
            gate_ms = max(gate_ms, self._ends_ms(q, left, ms))
        return min(int((gate_ms - now_ms) // ms[rank]), self.window_steps(rank))

    def _ends_ms(self, rank: int, batches: int, ms: Sequence[float]) -> float:
        """When ``rank`` ends ``batches`` more at its pace ``ms``, counted from its last report."""
        return self._progress_s[rank] * 1000.0 + batches * ms[rank]

    def _assign(self, rank: int, epoch: int, span: Span, now_s: float) -> m.AssignChunk:
        self.work.assign(rank, epoch, span)
        self._progress_s[rank] = now_s
        pending = self._pending[rank]  # the rank counts after that round's average
        return m.AssignChunk(
            epoch=epoch,
            offset=span[0],
            size=span[1],
            budget=self.budget[rank] - pending,
            window=self.window_steps(rank) - pending,
        )

    def _from_reserve(self, rank: int, now_s: float) -> m.AssignChunk | None:
        """``rank`` trained its tail share: its part of the reserve, if any."""
        epoch = self.work.serving_epoch()
        share = self._reserve_share(rank, now_s) if epoch is not None else 0
        span = None
        if epoch is not None and share > 0:
            span = self.work.pools[epoch].take(rank, share * self.config.batch_size)
        self.quiesced[rank] = span is None
        if epoch is None or span is None:
            return None
        batches = batches_in(span[1], self.config.batch_size)
        self.tail_reserve = max(0, self.tail_reserve - batches)
        steps = self.work.steps_since_sync(rank) + batches
        self.budget[rank] = max(self.budget[rank], steps)
        return self._assign(rank, epoch, span, now_s)

    def reserve_takers(self) -> list[int]:
        """Ranks idle in the epoch tail while the reserve still holds batches.

        The coordinator offers each of them the reserve (``next_chunk``)
        whenever another rank turns idle: list scheduling may have left a
        batch to a rank that has since run late.
        """
        if self.tail_plan is None or self.tail_reserve <= 0:
            return []
        return [
            r for r, left in self.tail_plan.items() if left <= 0 and self.work.busy_samples(r) == 0
        ]

    def _reserve_share(self, rank: int, now_s: float) -> int:
        """Reserve batches that list scheduling gives ``rank``, free at ``now_s``.

        Each held batch goes to whoever would end it soonest: ``rank`` and
        every rank idle in the tail now, a busy rank once its queued and
        planned batches are done (ties: ``rank``). Batches another rank would
        get stay held until it asks or is offered them. Without a pace for
        every rank involved, first come is first served: one batch.
        """
        if self.tail_reserve <= 0:
            return 0
        bs = self.config.batch_size
        ms = self.elche.ms_per_batch()
        plan = self.tail_plan or {}
        now_ms = now_s * 1000.0
        if ms[rank] <= 0:
            return 1
        # Heap entries: (end of the next batch, not rank, order of asking). The
        # soonest end wins; ties go to rank, then to the earlier in the plan.
        ends = [(now_ms + ms[rank], False, 0, rank)]
        last_mine = now_ms  # when rank would end its last reserve batch alone
        for _ in range(self.tail_reserve):
            last_mine += ms[rank]
        busy = self.work.busy_samples
        for i, (q, planned) in enumerate(plan.items(), start=1):  # the tail's live ranks
            if q == rank:
                continue
            if ms[q] <= 0:
                return 1
            ahead = -(-busy(q) // bs) + planned  # queued batches (a short one counts)
            free_ms = self._ends_ms(q, ahead, ms) if ahead > 0 else now_ms
            if free_ms + ms[q] <= last_mine:  # a later one can win none of these batches
                ends.append((free_ms + ms[q], True, i, q))
        heapq.heapify(ends)
        share = 0
        for _ in range(self.tail_reserve):
            end, other, i, q = ends[0]
            share += not other
            heapq.heapreplace(ends, (end + ms[q], other, i, q))
        return share

    def _plan_tail(self, live: Sequence[int], now_s: float) -> None:
        self.tail_plan = None
        self.tail_reserve = 0
        if self.config.policy is not Policy.CADENCE:
            return
        epoch = self.work.serving_epoch()
        if epoch is None:
            return
        remaining = self.work.pools[epoch].remaining_batches()
        counts = [self._count(r) for r in range(self.config.world_size)]
        scheduled = sum(counts[r] for r in live)
        folds = self.elche.is_calibrated and remaining < TAIL_FOLD_WINDOWS * scheduled
        if folds or needs_final_window(remaining, counts, live):
            alloc = self._timed_alloc(remaining, live, now_s)
            if alloc is None:
                alloc = final_window_alloc(remaining, counts, live)
            self.tail_reserve = _hold_back(alloc, counts, live)
            self.tail_plan = {r: alloc[r] for r in live}

    def _timed_alloc(self, remaining: int, live: Sequence[int], now_s: float) -> list[int] | None:
        """The tail's batches by list scheduling on the ranks' paces (None: a pace missing).

        Each batch goes to the rank that would end it soonest, a rank's
        chunk in flight counted first: whole batches, yet the shares end as
        close together as whole batches allow.
        """
        ms = self.elche.ms_per_batch()
        if any(ms[r] <= 0 for r in live):
            return None
        bs = self.config.batch_size
        now_ms = now_s * 1000.0
        ends = []
        for r in live:
            ahead = -(-self.work.busy_samples(r) // bs)
            free_ms = max(now_ms, self._ends_ms(r, ahead, ms)) if ahead else now_ms
            ends.append((free_ms + ms[r], r))
        heapq.heapify(ends)
        alloc = [0] * self.config.world_size
        for _ in range(remaining):
            end, r = ends[0]
            alloc[r] += 1
            heapq.heapreplace(ends, (end + ms[r], r))
        return alloc

    def _budget_of(self, rank: int) -> int:
        window = self.window_steps(rank)
        if self.config.policy is Policy.ASYNC:
            return window + self.max_overshoot
        if self.tail_plan is not None:
            ahead = -(-self.work.busy_samples(rank) // self.config.batch_size)
            planned = self.tail_plan.get(rank, 0) + ahead
            return self._base[rank] + max(self._count(rank), planned)
        return window

    def _take(self, rank: int, epoch: int, left: int, live_count: int) -> Span | None:
        bs = self.config.batch_size
        pool = self.work.pools[epoch]
        if self.config.policy is Policy.SYNC:
            if pool.residue(rank) > 0:
                return pool.take(rank, pool.residue(rank))
            reclaimed = sum(size for _, size in pool.reclaimed_spans())
            share = batches_in(-(-reclaimed // max(live_count, 1)), bs)
            return pool.take_reclaimed(rank, share * bs) if share > 0 else None
        batches = left
        if self.tail_plan is not None:
            batches = min(batches, self.tail_plan.get(rank, 0))
            if batches <= 0:
                return None
        span = pool.take(rank, batches * bs)
        if span is not None and self.tail_plan is not None:
            self.tail_plan[rank] -= batches_in(span[1], bs)
        return span


def _hold_back(alloc: list[int], counts: Sequence[int], live: Sequence[int]) -> int:
    """Take the tail's reserve out of ``alloc`` (in place); returns its size.

    The reserve is ``TAIL_RESERVE_SLOW_STEPS`` of the slowest planned rank's
    steps in the fastest one's batches, at most half the tail, and nothing
    with fewer than two ranks planned. Batches leave the plan from its end:
    each from the rank whose share ends last (``alloc / count``, counts being
    proportional to speed; ties: the slower rank, then the higher index).
    """
    planned = [r for r in live if alloc[r] > 0 and counts[r] > 0]
    if len(planned) < 2:
        return 0
    fastest = max(counts[r] for r in planned)
    slowest = min(counts[r] for r in planned)
    size = min(-(-TAIL_RESERVE_SLOW_STEPS * fastest // slowest), sum(alloc) // 2)
    for _ in range(size):
        last = max(
            (r for r in planned if alloc[r] > 0),
            key=lambda r: (Fraction(alloc[r], counts[r]), -counts[r], r),
        )
        alloc[last] -= 1
    return size
