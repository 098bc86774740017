"""What the coordinator records for people watching: per-rank windows, throttles, roles.

Rules:

- Every reported batch adds to its rank's running record: batches, samples,
  compute ms, loss. At the close of the first round after each
  ``1 / REPORTS_PER_EPOCH`` of an epoch's batches (counted over all ranks),
  every rank that was live during the span gets a ``RankWindow`` record and
  the records start again. So a record spans whole rounds, and an epoch
  gives about ``REPORTS_PER_EPOCH`` of them whatever the number of rounds.
- An epoch's end records whatever the running records hold, due or not,
  before the epoch's ``EpochEnd``: every trained batch is in exactly one
  ``RankWindow``, none straddles an epoch's end, and the last epoch's tail
  is not dropped.
- A rank that has trained its whole budget, holds no work and waits for the
  round is *throttled*: one ``Throttle`` per rank per round (none under
  ``sync``, where every rank waits every step by design).
- Training's start records the callback roles' holders (``RolesMoved``);
  when they differ from the last ones recorded, another is emitted (at a
  round's close and after a death, where roles move).

Nothing here reads a clock: times come in as ``now_s``.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from elche.core import timeline as tl
from elche.core.commands import Command, Emit
from elche.core.config import CoordinatorConfig, Policy
from elche.core.roles import CallbackRoles, Role

__all__ = ["REPORTS_PER_EPOCH", "Telemetry"]

# Records per epoch and rank: enough to draw a rank's speed within an epoch,
# few enough that a long run's timeline stays small (the reference's
# ``reports_per_epoch`` is a user knob; 4 is a readable default).
REPORTS_PER_EPOCH = 4


@dataclass(slots=True)
class _Span:
    """One rank's running totals since its last record."""

    batches: int = 0
    samples: int = 0
    compute_ms: float = 0.0
    loss_sum: float = 0.0
    loss_count: int = 0


class Telemetry:
    """Builds the per-rank window records and the throttle and role events.

    Args:
        config: the run's configuration (world size, epoch length, policy).
        roles: the callback roles, read to notice when they move.
    """

    def __init__(self, config: CoordinatorConfig, roles: CallbackRoles) -> None:
        self.config = config
        self.roles = roles
        epoch_batches = math.ceil(config.num_samples / config.batch_size)
        self.every_batches = max(1, epoch_batches // REPORTS_PER_EPOCH)
        self._spans = [_Span() for _ in range(config.world_size)]
        self._since_s: float | None = None  # the span's start: the run start, then each record
        self._throttled: set[int] = set()
        self._holders = self._current_holders()

    def start(self, now_s: float) -> list[Command]:
        """Training began at ``now_s``: the first span starts here; the roles as they are."""
        self._since_s = now_s
        return [Emit(event=self._roles_event())]

    def on_batch(self, rank: int, size: int, batch_ms: float, loss: float | None) -> None:
        """``rank`` reported one batch of ``size`` samples."""
        span = self._spans[rank]
        span.batches += 1
        span.samples += size
        span.compute_ms += max(batch_ms, 0.0)
        if loss is not None and math.isfinite(loss):
            span.loss_sum += loss
            span.loss_count += 1

    def held(self, rank: int, steps: int) -> list[Command]:
        """``rank`` waits at its budget of ``steps``: a ``Throttle``, once per round."""
        if self.config.policy is Policy.SYNC or rank in self._throttled:
            return []
        self._throttled.add(rank)
        return [Emit(event=tl.Throttle(rank=rank, steps=steps))]

    def on_round(self, now_s: float, live: Collection[int], epoch: int) -> list[Command]:
        """A round closed at ``now_s``: window records when due, roles if they moved."""
        self._throttled.clear()
        out = self.roles_moved()
        if sum(s.batches for s in self._spans) < self.every_batches or self._since_s is None:
            return out
        return self._records(now_s, live, epoch) + out

    def epoch_ended(self, now_s: float, live: Collection[int], epoch: int) -> list[Command]:
        """``epoch`` ended at ``now_s``: the batches not yet in a record go into one, for it."""
        if self._since_s is None or not any(s.batches for s in self._spans):
            return []
        return self._records(now_s, live, epoch)

    def roles_moved(self) -> list[Command]:
        """A ``RolesMoved`` if the holders changed since the last one."""
        holders = self._current_holders()
        if holders == self._holders:
            return []
        self._holders = holders
        return [Emit(event=self._roles_event())]

    def _roles_event(self) -> tl.RolesMoved:
        epoch_rank, eval_rank, checkpoint_rank = self._holders
        return tl.RolesMoved(
            epoch_rank=epoch_rank, eval_rank=eval_rank, checkpoint_rank=checkpoint_rank
        )

    def _records(self, now_s: float, live: Collection[int], epoch: int) -> list[Command]:
        assert self._since_s is not None
        span_s = max(now_s - self._since_s, 1e-9)
        total = sum(s.batches for s in self._spans)
        out: list[Command] = []
        for rank, span in enumerate(self._spans):
            if rank in live or span.batches:
                out.append(Emit(event=_record(rank, span, span_s, total, epoch)))
        self._spans = [_Span() for _ in self._spans]
        self._since_s = now_s
        return out

    def _current_holders(self) -> tuple[int, int, int]:
        return (
            self.roles.holder(Role.EPOCH),
            self.roles.holder(Role.EVAL),
            self.roles.holder(Role.CHECKPOINT),
        )


def _record(rank: int, span: _Span, span_s: float, total: int, epoch: int) -> tl.RankWindow:
    compute_s = span.compute_ms / 1000.0
    return tl.RankWindow(
        rank=rank,
        epoch=epoch,
        span_s=round(span_s, 6),
        batches=span.batches,
        samples=span.samples,
        loss=span.loss_sum / span.loss_count if span.loss_count else None,
        samples_per_s=round(span.samples / span_s, 3),
        share=round(span.batches / total, 4) if total else 0.0,
        compute_ms_per_batch=round(span.compute_ms / span.batches, 4) if span.batches else None,
        idle_pct=round(max(0.0, 100.0 * (1.0 - compute_s / span_s)), 2),
    )
