"""Data dispatch: which samples of an epoch each rank trains on.

Units are **samples**: positions ``0..total`` in the epoch's shuffled order
(:func:`epoch_permutation`), never batches, except in the final-window helpers,
which reshape the scheduler's per-rank batch counts. elche keeps the sub-batch
tail that floDl drops: ``n`` samples are ``batches_in(n, batch_size)`` batches.

Theory of operation:

A :class:`ChunkPool` serves one epoch (floDl ``chunk_pool.rs``). It cuts
``[0, total)`` into contiguous reservations, one per rank in rank order, sized
by the scheduler's speed weights. The owner eats its *residue* ``[cursor, end)``
from the front; a rank whose residue is empty steals from the back of the
largest other residue, so owner and thief meet but never cross. Served spans
wait in the taker's *outstanding* FIFO until their samples are in the consensus
model (``commit``). A dead rank's outstanding spans go to the *reclaimed* queue
(``forfeit``), which every ``take`` serves first; a span whose send failed is
undone (``rollback``). Each position is in exactly one place::

                take                   commit
    residue ------------> outstanding -------> committed
       ^  rollback at cursor  |    ^
       +----------------------+    | take (served first)
        forfeit, rollback     v    |
                            reclaimed

``uncovered()`` (residue + outstanding + reclaimed) is the resume record, and
:meth:`ChunkPool.from_uncovered` rebuilds a pool serving only those holes.
:func:`final_window_alloc` reshapes an epoch's last, ragged window so no rank
runs a lone single batch (floDl ``cluster_coordinator/epoch_dispatch.rs``).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from fractions import Fraction
from typing import Final, TypeAlias

from elche.core.errors import ConfigError

__all__ = [
    "DEFAULT_SEED",
    "ChunkPool",
    "Span",
    "batches_in",
    "coalesce",
    "epoch_permutation",
    "equal_split",
    "final_window_alloc",
    "needs_final_window",
    "proportional_split",
]

Span: TypeAlias = tuple[int, int]
"""``(offset, size)`` in samples: the positions ``offset .. offset + size - 1``."""

DEFAULT_SEED = 42
"""Base shuffle seed: floDl's default, kept so runs of the two compare."""


def _at_least(field: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(field, f"must be >= {low}, got {value}")


def _span_total(spans: Iterable[Span]) -> int:
    return sum(size for _, size in spans)


def epoch_permutation(num_samples: int, *, seed: int, epoch: int) -> list[int]:
    """Shuffle ``range(num_samples)`` with ``random.Random(seed + epoch)``.

    The same ``(seed, epoch)`` gives the same order on every rank and every run,
    so only offsets into it ever cross the wire.

    Raises:
        ConfigError: ``num_samples`` or ``epoch`` is negative.
    """
    _at_least("num_samples", num_samples, 0)
    _at_least("epoch", epoch, 0)
    order = list(range(num_samples))
    random.Random(seed + epoch).shuffle(order)
    return order


def batches_in(size: int, batch_size: int) -> int:
    """Return how many batches ``size`` samples make, counting a short tail.

    Raises:
        ConfigError: ``size`` is negative or ``batch_size`` is below 1.
    """
    _at_least("size", size, 0)
    _at_least("batch_size", batch_size, 1)
    return -(-size // batch_size)


def equal_split(total: int, num_ranks: int) -> list[int]:
    """Split ``total`` into ``num_ranks`` near-equal parts, extras to the first.

    Raises:
        ConfigError: ``total`` is negative or ``num_ranks`` is below 1.
    """
    _at_least("total", total, 0)
    _at_least("num_ranks", num_ranks, 1)
    base, extra = divmod(total, num_ranks)
    return [base + (1 if r < extra else 0) for r in range(num_ranks)]


def proportional_split(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` by ``weights``: floor shares, then +1 to the heaviest.

    Exact arithmetic; ties go to the lower index. Weights <= 0 get 0, unless
    every weight is <= 0, in which case the split is equal.

    Raises:
        ValueError: ``weights`` is empty.
        ConfigError: ``total`` is negative or a weight is not finite.
    """
    _at_least("total", total, 0)
    if not weights:
        raise ValueError("weights must not be empty")
    if not all(math.isfinite(w) for w in weights):
        raise ConfigError("weights", f"must be finite, got {list(weights)}")
    exact = [Fraction(w) if w > 0 else Fraction(0) for w in weights]
    weight_sum = sum(exact)
    if weight_sum == 0:
        return equal_split(total, len(weights))
    shares = [math.floor(total * w / weight_sum) for w in exact]
    heaviest = sorted((r for r, w in enumerate(exact) if w > 0), key=lambda r: -exact[r])
    for r in heaviest[: total - sum(shares)]:  # fewer left over than positive weights
        shares[r] += 1
    return shares


def coalesce(spans: Iterable[Span]) -> list[Span]:
    """Sort spans by offset, merge overlapping or touching ones, drop empty ones.

    Raises:
        ValueError: a span has a negative offset or size.
    """
    merged: list[Span] = []
    for offset, size in sorted(spans):
        if offset < 0 or size < 0:
            raise ValueError(f"span ({offset}, {size}) must have offset, size >= 0")
        if size and merged and offset <= sum(merged[-1]):
            start, old_size = merged[-1]
            merged[-1] = (start, max(old_size, offset + size - start))
        elif size:
            merged.append((offset, size))
    return merged


class ChunkPool:
    """One epoch's samples, reserved per rank and handed out in spans.

    Every method taking a ``rank`` raises ``ValueError`` unless it is in
    ``range(num_ranks)``. A method that raises leaves the pool unchanged.

    Args:
        total: samples in the epoch.
        shares: reservation size of each rank, in rank order; sums to ``total``.
        batch_size: samples per batch, kept for callers converting units.

    Raises:
        ValueError: ``shares`` is empty.
        ConfigError: ``total`` or a share is negative, the shares do not sum to
            ``total``, or ``batch_size`` is below 1.
    """

    def __init__(self, total: int, shares: Sequence[int], *, batch_size: int) -> None:
        _at_least("total", total, 0)
        _at_least("batch_size", batch_size, 1)
        if not shares:
            raise ValueError("shares must name at least one rank")
        for share in shares:
            _at_least("shares", share, 0)
        if sum(shares) != total:
            raise ConfigError("shares", f"sum to {sum(shares)}, expected total {total}")
        self.total: Final = total
        self.batch_size: Final = batch_size
        self.num_ranks: Final = len(shares)
        self._end = list(itertools.accumulate(shares))  # moves down when a thief takes a tail
        self._cursor = [end - share for end, share in zip(self._end, shares, strict=True)]
        self._fresh = total  # samples of every residue: sum(end - cursor)
        self._outstanding: list[deque[Span]] = [deque() for _ in shares]
        self._reclaimed: deque[Span] = deque()
        self._committed = 0  # samples

    @classmethod
    def by_weights(cls, total: int, weights: Sequence[float], *, batch_size: int) -> ChunkPool:
        """Reserve whole batches by :func:`proportional_split` of ``weights``.

        The last non-empty reservation absorbs the short final batch.

        Raises:
            ValueError: ``weights`` is empty.
            ConfigError: as :func:`proportional_split` and the constructor.
        """
        batch_shares = proportional_split(batches_in(total, batch_size), weights)
        return cls(total, _to_samples(batch_shares, total, batch_size), batch_size=batch_size)

    @classmethod
    def equal(cls, total: int, num_ranks: int, *, batch_size: int) -> ChunkPool:
        """Reserve whole batches equally, the extra batches to the first ranks.

        Raises:
            ConfigError: as :func:`equal_split` and the constructor.
        """
        batch_shares = equal_split(batches_in(total, batch_size), num_ranks)
        return cls(total, _to_samples(batch_shares, total, batch_size), batch_size=batch_size)

    @classmethod
    def from_uncovered(
        cls, total: int, holes: Sequence[Span], *, batch_size: int, num_ranks: int
    ) -> ChunkPool:
        """Resume an epoch: serve only ``holes`` (from :meth:`uncovered`), once each.

        The merged holes are queued as reclaimed; everything else is committed.

        Raises:
            ValueError: a hole has a negative offset or size.
            ConfigError: a hole ends past ``total``, or as :meth:`equal`.
        """
        pool = cls.equal(total, num_ranks, batch_size=batch_size)
        merged = coalesce(holes)
        if merged and sum(merged[-1]) > total:
            raise ConfigError("holes", f"{merged[-1]} ends past total {total}")
        pool._cursor = list(pool._end)  # no fresh samples: every residue is empty
        pool._fresh = 0
        pool._reclaimed.extend(merged)
        pool._committed = total - _span_total(merged)
        return pool

    def residue(self, rank: int) -> int:
        """Samples of ``rank``'s reservation not handed out yet."""
        self._check_rank(rank)
        return self._end[rank] - self._cursor[rank]

    def remaining(self) -> int:
        """Samples not handed out yet: every residue plus the reclaimed queue."""
        return self._fresh + _span_total(self._reclaimed)

    def remaining_batches(self) -> int:
        """``remaining()`` in batches, a short last batch counting as one."""
        return batches_in(self.remaining(), self.batch_size)

    def outstanding(self, rank: int) -> int:
        """Samples handed to ``rank`` and neither committed nor handed back."""
        return _span_total(self.outstanding_spans(rank))

    def outstanding_spans(self, rank: int) -> list[Span]:
        """``rank``'s outstanding spans, oldest first."""
        self._check_rank(rank)
        return list(self._outstanding[rank])

    def reclaimed_spans(self) -> list[Span]:
        """Spans handed back and waiting to be served again, in serving order."""
        return list(self._reclaimed)

    def committed(self) -> int:
        """Samples already part of the consensus model."""
        return self._committed

    def is_done(self) -> bool:
        """True once nothing is left to hand out and nothing is outstanding."""
        return self.remaining() == 0 and not any(self._outstanding)

    def uncovered(self) -> list[Span]:
        """Every position not committed yet, coalesced: the resume record."""
        residues = [(cur, end - cur) for cur, end in zip(self._cursor, self._end, strict=True)]
        in_flight = [span for queue in self._outstanding for span in queue]
        return coalesce([*residues, *in_flight, *self._reclaimed])

    def take(self, rank: int, size: int) -> Span | None:
        """Hand ``rank`` up to ``size`` samples as one span, or None if none are left.

        Sources, in order: the front of the reclaimed queue; the front of the
        rank's own residue; the back of the largest other residue (ties: the
        highest rank). The span joins the rank's outstanding FIFO.

        Raises:
            ValueError: bad ``rank``, or ``size`` is below 1.
        """
        self._check_take(rank, size)
        span = self._pop_reclaimed(size) or self._take_own(rank, size) or self._steal(rank, size)
        return self._record(rank, span)

    def take_reclaimed(self, rank: int, size: int) -> Span | None:
        """Like :meth:`take`, but serve only from the reclaimed queue.

        Raises:
            ValueError: bad ``rank``, or ``size`` is below 1.
        """
        self._check_take(rank, size)
        return self._record(rank, self._pop_reclaimed(size))

    def rollback(self, rank: int, span: Span) -> bool:
        """Undo a take whose span never reached ``rank`` (the send failed).

        Removes the span from the rank's outstanding FIFO, then rewinds its
        cursor if the span ends at it, else queues it first in reclaimed.
        Returns False, changing nothing, if ``span`` is not outstanding.

        Raises:
            ValueError: bad ``rank``.
        """
        self._check_rank(rank)
        if span not in self._outstanding[rank]:
            return False
        self._outstanding[rank].remove(span)  # spans are disjoint: at most one match
        offset, size = span
        if offset + size == self._cursor[rank]:
            self._cursor[rank] = offset
            self._fresh += size
        else:
            self._reclaimed.appendleft(span)
        return True

    def claim(self, rank: int, span: Span) -> bool:
        """Give ``rank`` exactly ``span`` out of the reclaimed queue (a rank that
        rejoins a restarted coordinator holds it already).

        Returns False, changing nothing, unless one reclaimed span holds all of
        ``span``.

        Raises:
            ValueError: bad ``rank``.
        """
        self._check_rank(rank)
        offset, size = span
        for i, (start, length) in enumerate(self._reclaimed):
            if size > 0 and start <= offset and offset + size <= start + length:
                del self._reclaimed[i]
                after = (offset + size, start + length - offset - size)
                for part in ((start, offset - start), after)[::-1]:
                    if part[1] > 0:
                        self._reclaimed.insert(i, part)
                self._outstanding[rank].append(span)
                return True
        return False

    def forfeit(self, rank: int) -> int:
        """Rank died: move its outstanding spans to reclaimed; return the samples.

        Idempotent. The rank's residue stays put for the others to steal.

        Raises:
            ValueError: bad ``rank``.
        """
        lost = self.outstanding(rank)
        self._reclaimed.extend(self._outstanding[rank])
        self._outstanding[rank].clear()
        return lost

    def commit(self, rank: int, samples: int) -> int:
        """Mark ``rank``'s oldest ``samples`` as part of the consensus model.

        Consumes the outstanding FIFO front-first, shrinking the front span on
        a partial commit, and returns ``min(samples, outstanding(rank))``: a
        rank falsely declared dead that reports anyway is clamped.

        Raises:
            ValueError: bad ``rank``.
            ConfigError: ``samples`` is negative.
        """
        self._check_rank(rank)
        _at_least("samples", samples, 0)
        queue = self._outstanding[rank]
        left = samples
        while left and queue:
            offset, size = queue.popleft()
            if size > left:
                queue.appendleft((offset + left, size - left))
            left -= min(left, size)
        self._committed += samples - left
        return samples - left

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} not in range({self.num_ranks})")

    def _check_take(self, rank: int, size: int) -> None:
        self._check_rank(rank)
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")

    def _record(self, rank: int, span: Span | None) -> Span | None:
        if span is not None:
            self._outstanding[rank].append(span)
        return span

    def _pop_reclaimed(self, size: int) -> Span | None:
        if not self._reclaimed:
            return None
        offset, length = self._reclaimed.popleft()
        if length > size:
            self._reclaimed.appendleft((offset + size, length - size))
        return (offset, min(size, length))

    def _take_own(self, rank: int, size: int) -> Span | None:
        offset = self._cursor[rank]
        taken = min(size, self._end[rank] - offset)
        if taken == 0:
            return None
        self._cursor[rank] += taken
        self._fresh -= taken
        return (offset, taken)

    def _steal(self, rank: int, size: int) -> Span | None:
        donors = [r for r in range(self.num_ranks) if r != rank]
        donor = max(donors, key=lambda r: (self._end[r] - self._cursor[r], r), default=None)
        if donor is None or self._end[donor] == self._cursor[donor]:
            return None
        taken = min(size, self._end[donor] - self._cursor[donor])
        self._end[donor] -= taken
        self._fresh -= taken
        return (self._end[donor], taken)


def _to_samples(batch_shares: list[int], total: int, batch_size: int) -> list[int]:
    """Turn per-rank batch counts into sample counts summing to ``total``."""
    shares = [b * batch_size for b in batch_shares]
    shortfall = sum(shares) - total  # the short final batch: 0 <= shortfall < batch_size
    if shortfall:
        last = max(r for r, share in enumerate(shares) if share > 0)
        shares[last] -= shortfall
    return shares


def _alive_ranks(remaining: int, counts: Sequence[int], alive: Collection[int]) -> list[int]:
    """Validate the final-window arguments; return the alive ranks, sorted."""
    _at_least("remaining_batches", remaining, 0)
    for count in counts:
        _at_least("counts", count, 0)
    ranks = sorted(set(alive))
    if ranks and not 0 <= ranks[0] <= ranks[-1] < len(counts):
        raise ValueError(f"alive ranks {ranks} not all in range({len(counts)})")
    return ranks


def needs_final_window(
    remaining_batches: int, counts: Sequence[int], alive: Collection[int]
) -> bool:
    """True when ``0 < remaining_batches < sum(alive counts) + len(alive)``.

    Raises:
        ValueError: ``alive`` names a rank with no entry in ``counts``.
        ConfigError: ``remaining_batches`` or a count is negative.
    """
    ranks = _alive_ranks(remaining_batches, counts, alive)
    scheduled = sum(counts[r] for r in ranks)
    return remaining_batches > 0 and scheduled > 0 and remaining_batches < scheduled + len(ranks)


def final_window_alloc(
    remaining_batches: int, counts: Sequence[int], alive: Collection[int]
) -> list[int]:
    """Split an epoch's last ``remaining_batches`` over the alive ranks.

    Fold band (``remaining >= sum of alive counts``): alive ranks run their
    counts and the crumb goes one batch at a time to the rank that would
    finish it soonest (least ``(alloc + 1) / count``; ties: the larger count,
    then the lower index), so the window ends as early as it can: a count is
    proportional to its rank's speed, and one more batch on the slowest rank
    would lengthen the window by a whole slow step. Below it:
    largest-remainder apportionment by count, then each lone 1 moves onto the
    smallest alive peer holding >= 1. Returns batches per rank, 0 for dead
    ranks, summing to ``remaining_batches``.

    Raises:
        ValueError: ``alive`` names a rank with no entry in ``counts``, or
            batches remain but no alive rank has a positive count.
        ConfigError: ``remaining_batches`` or a count is negative.
    """
    ranks = _alive_ranks(remaining_batches, counts, alive)
    scheduled = sum(counts[r] for r in ranks)
    if remaining_batches == 0:
        return [0] * len(counts)
    if scheduled == 0:
        raise ValueError("no alive rank has a positive count to apportion by")
    if remaining_batches >= scheduled:
        return _fold_band(remaining_batches - scheduled, counts, ranks)
    alloc = _largest_remainder(remaining_batches, counts, ranks, scheduled)
    _consolidate_lone_ones(alloc, ranks)
    return alloc


def _fold_band(crumb: int, counts: Sequence[int], ranks: list[int]) -> list[int]:
    alloc = [counts[r] if r in ranks else 0 for r in range(len(counts))]
    # A rank's count is proportional to its speed, so alloc/count is when it
    # finishes, in windows. Each crumb batch goes where it ends soonest.
    movers = [r for r in ranks if counts[r] > 0]
    for _ in range(crumb):
        soonest = min(movers, key=lambda r: (Fraction(alloc[r] + 1, counts[r]), -counts[r], r))
        alloc[soonest] += 1
    return alloc


def _largest_remainder(
    remaining: int, counts: Sequence[int], ranks: list[int], scheduled: int
) -> list[int]:
    alloc = [remaining * counts[r] // scheduled if r in ranks else 0 for r in range(len(counts))]
    # Exact integer remainders; sorted() is stable, so ties keep rank order.
    by_remainder = sorted(ranks, key=lambda r: -(remaining * counts[r] % scheduled))
    for r in by_remainder[: remaining - sum(alloc)]:  # fewer left over than alive ranks
        alloc[r] += 1
    return alloc


def _consolidate_lone_ones(alloc: list[int], ranks: list[int]) -> None:
    """Move each lone 1 onto the smallest alive peer holding >= 1, in place."""
    while (orphan := next((r for r in ranks if alloc[r] == 1), None)) is not None:
        peers = [p for p in ranks if p != orphan and alloc[p] >= 1]
        if not peers:
            return  # the only batch left: irreducible
        peer = min(peers, key=lambda p: alloc[p])  # ties: lowest rank
        alloc[peer] += 1
        alloc[orphan] = 0
