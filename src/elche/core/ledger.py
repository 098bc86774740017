"""The per-window timing ledger: what each rank did since the last reduce.

The coordinator records every batch a rank reports and, at the reduce, turns
the ledger into the ``WindowReport`` ElChe schedules on. Behaviour follows
floDl 0.7.0 ``cluster_coordinator/window_ledger.rs``: ElChe's rules were
tuned on these two timing scales.

A window's first batch per rank carries the per-window *fill* (control
transit, plan pickup, prefetch spin-up) and is kept apart; batches 2..n form
the *marginal* delivered rate, so the fixed fill never inflates the per-batch
cost. Writes for an out-of-range rank are ignored (a malformed frame); reads
for one return the empty value.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from elche.core.errors import ConfigError

__all__ = ["WindowLedger", "WindowReport"]


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowReport:
    """One reduce window's timing, per rank (built by ``WindowLedger``).

    ``wall_ms``/``steps`` is the compute-only scale; ``delivered_ms``/
    ``delivered_batches`` the marginal delivered scale (first batch excluded);
    ``fill_ms`` the first-batch excess; ``sync_ms`` the last reduce's cost.
    """

    wall_ms: tuple[float, ...]
    steps: tuple[int, ...]
    delivered_ms: tuple[float, ...]
    delivered_batches: tuple[int, ...]
    fill_ms: tuple[float, ...]
    delivered_coherent: bool
    sync_ms: float

    def select_feed(self) -> tuple[tuple[float, ...], tuple[int, ...]]:
        """The ``(ms, batches)`` pair to schedule on: one scale for all ranks.

        Incoherent windows use the compute scale everywhere; coherent ones use
        each rank's delivered pair when it has one (``> 0`` batches and ms).
        """
        if not self.delivered_coherent:
            return self.wall_ms, self.steps
        pairs = [
            (d_ms, d_n) if d_n > 0 and d_ms > 0 else (w_ms, n)
            for w_ms, n, d_ms, d_n in zip(
                self.wall_ms, self.steps, self.delivered_ms, self.delivered_batches, strict=True
            )
        ]
        return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)

    def ms_per_batch(self, rank: int) -> float | None:
        """``rank``'s ms per batch in this window, on ``select_feed``'s scale
        (None: no timed batch of it)."""
        ms, batches = self.select_feed()
        if not 0 <= rank < len(batches) or batches[rank] <= 0 or ms[rank] <= 0:
            return None
        return ms[rank] / batches[rank]


class WindowLedger:
    """Per-rank accumulators for the current reduce window.

    Args:
        world_size: ranks tracked (>= 1).

    Raises:
        ConfigError: ``world_size`` < 1.
    """

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ConfigError("world_size", f"must be >= 1, got {world_size}")
        self._ws = world_size
        self._steps = [0] * world_size
        self._wall_ms = [0.0] * world_size  # compute only: sum of batch_ms
        self._delivered_ms = [0.0] * world_size  # batch_ms + data_ms, batches 2..n
        self._delivered_batches = [0] * world_size
        self._first_batch_ms = [0.0] * world_size  # batch_ms + data_ms of batch 1
        self._loss_sum = [0.0] * world_size
        self._loss_count = [0] * world_size

    # -- write side --------------------------------------------------------

    def record_batch(self, rank: int, batch_ms: float, data_ms: float) -> None:
        """Count one batch: the first of the window fills, the rest are marginal."""
        if not self._valid(rank):
            return
        self._steps[rank] += 1
        self._wall_ms[rank] += batch_ms
        if self._steps[rank] > 1:
            self._delivered_ms[rank] += batch_ms + data_ms
            self._delivered_batches[rank] += 1
        else:
            self._first_batch_ms[rank] = batch_ms + data_ms

    def record_batch_loss(self, rank: int, loss: float) -> None:
        """Add one batch's training loss; a non-finite loss is dropped."""
        if self._valid(rank) and math.isfinite(loss):
            self._loss_sum[rank] += loss
            self._loss_count[rank] += 1

    def absorb_callback_cost(self, rank: int, elapsed_ms: float) -> None:
        """Take a callback's wall time out of both timing scales (floored at 0).

        Checkpoint, eval and epoch callbacks run on a rank's clock; without
        this ElChe would read their cost as the rank being slow.
        """
        if self._valid(rank):
            self._wall_ms[rank] = max(0.0, self._wall_ms[rank] - elapsed_ms)
            self._delivered_ms[rank] = max(0.0, self._delivered_ms[rank] - elapsed_ms)

    def reset_timing(self) -> None:
        """Start a new window's timing and loss; step counts are kept."""
        for acc in (self._wall_ms, self._delivered_ms, self._first_batch_ms, self._loss_sum):
            acc[:] = [0.0] * self._ws
        self._delivered_batches[:] = [0] * self._ws
        self._loss_count[:] = [0] * self._ws

    def reset_steps(self) -> None:
        """Zero the step counts.

        Apart from ``reset_timing`` because where a window's steps end depends
        on the backend; elche's tuner zeroes both when a round closes.
        """
        self._steps[:] = [0] * self._ws

    # -- read side ---------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Ranks tracked."""
        return self._ws

    def steps(self, rank: int) -> int:
        """Batches ``rank`` completed this window."""
        return self._steps[rank] if self._valid(rank) else 0

    def all_steps(self) -> tuple[int, ...]:
        """Every rank's step count."""
        return tuple(self._steps)

    def min_steps(self) -> int:
        """The fewest steps of any rank."""
        return min(self._steps)

    def max_steps(self) -> int:
        """The most steps of any rank."""
        return max(self._steps)

    def total_steps(self) -> int:
        """Steps summed over ranks."""
        return sum(self._steps)

    def wall_ms(self, rank: int) -> float:
        """Compute-only wall ``rank`` accumulated this window."""
        return self._wall_ms[rank] if self._valid(rank) else 0.0

    def delivered_ms(self, rank: int) -> float:
        """Marginal delivered wall (batches 2..n) of ``rank``."""
        return self._delivered_ms[rank] if self._valid(rank) else 0.0

    def delivered_batches(self, rank: int) -> int:
        """Marginal delivered batches (batches 2..n) of ``rank``."""
        return self._delivered_batches[rank] if self._valid(rank) else 0

    def has_delivered_sample(self, rank: int) -> bool:
        """Whether ``rank`` has a marginal sample (never in a 1-batch window)."""
        return self.delivered_batches(rank) > 0 and self.delivered_ms(rank) > 0

    def fill_excess_ms(self, rank: int) -> float:
        """First batch's cost above the marginal rate (0 without a sample)."""
        if not self.has_delivered_sample(rank):
            return 0.0
        marginal_ms = self._delivered_ms[rank] / self._delivered_batches[rank]
        return max(0.0, self._first_batch_ms[rank] - marginal_ms)

    def per_batch_wall_ms(self, rank: int) -> float:
        """Compute ms per batch; ``inf`` without steps, so it sorts last."""
        steps = self.steps(rank)
        return self._wall_ms[rank] / steps if steps else math.inf

    def mean_loss(self, rank: int) -> float | None:
        """Mean finite loss ``rank`` reported; ``None`` (absent, not 0) if none."""
        if not self._valid(rank) or self._loss_count[rank] == 0:
            return None
        return self._loss_sum[rank] / self._loss_count[rank]

    def build_window_report(
        self, *, dead: Collection[int], delivered_capable: bool, sync_ms: float
    ) -> WindowReport:
        """The window's ``WindowReport``: what ElChe sizes the next window on.

        The delivered scale is coherent only if the mode can deliver it AND
        every live rank that moved has a delivered sample: one mover without a
        sample sends the whole cohort to the compute scale for this window.

        Args:
            dead: ranks to leave out of the coherence test.
            delivered_capable: whether the mode feeds the delivered scale
                (CPU cadence/async, NCCL cadence).
            sync_ms: the last measured reduce time.
        """
        movers = (r for r in range(self._ws) if r not in dead and self._steps[r] > 0)
        complete = all(self.has_delivered_sample(r) for r in movers)
        return WindowReport(
            wall_ms=tuple(self._wall_ms),
            steps=tuple(self._steps),
            delivered_ms=tuple(self._delivered_ms),
            delivered_batches=tuple(self._delivered_batches),
            fill_ms=tuple(self.fill_excess_ms(r) for r in range(self._ws)),
            delivered_coherent=delivered_capable and complete,
            sync_ms=sync_ms,
        )

    def _valid(self, rank: int) -> bool:
        return 0 <= rank < self._ws
