"""Tests for ``elche.core.dispatch``: splits, the chunk pool, the final window.

Ports the behaviour pinned by floDl's ``chunk_pool.rs``, ``epoch_dispatch.rs``
(final window) and ``rng.rs`` tests (spec section 12), restated in samples,
plus Hypothesis properties for exact coverage and the final-window invariants.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elche.core.dispatch import (
    DEFAULT_SEED,
    ChunkPool,
    Span,
    batches_in,
    coalesce,
    epoch_permutation,
    equal_split,
    final_window_alloc,
    needs_final_window,
    proportional_split,
)
from elche.core.errors import ConfigError

ALL3 = {0, 1, 2}
RIG = [71, 18, 15]  # floDl's observed three-rank schedule


def drain(pool: ChunkPool, rank: int, size: int) -> list[Span]:
    """Take until the pool runs dry, committing each span as it is served."""
    served: list[Span] = []
    while (span := pool.take(rank, size)) is not None:
        served.append(span)
        assert pool.commit(rank, span[1]) == span[1]
    return served


def positions(spans: list[Span]) -> list[int]:
    return sorted(p for offset, size in spans for p in range(offset, offset + size))


# ------------------------------------------------------------ permutation, splits


def test_permutation_is_deterministic_and_differs_per_epoch() -> None:
    first = epoch_permutation(100, seed=DEFAULT_SEED, epoch=0)
    assert first == epoch_permutation(100, seed=DEFAULT_SEED, epoch=0)
    assert sorted(first) == list(range(100))
    assert first != list(range(100))
    assert first != epoch_permutation(100, seed=DEFAULT_SEED, epoch=1)
    assert epoch_permutation(100, seed=DEFAULT_SEED + 1, epoch=0) == epoch_permutation(
        100, seed=DEFAULT_SEED, epoch=1
    )
    assert DEFAULT_SEED == 42


def test_permutation_slices_are_balanced_and_concatenate_to_the_pass() -> None:
    # rng.rs: split sizes balanced, splits concatenate to the pass.
    order = epoch_permutation(103, seed=DEFAULT_SEED, epoch=3)
    sizes = equal_split(len(order), 4)
    assert sizes == [26, 26, 26, 25]
    starts = [sum(sizes[:s]) for s in range(4)]
    slices = [order[start : start + size] for start, size in zip(starts, sizes, strict=True)]
    assert [p for part in slices for p in part] == order


@pytest.mark.parametrize(
    ("size", "batch_size", "expected"),
    [(0, 8, 0), (1, 8, 1), (8, 8, 1), (9, 8, 2), (95, 10, 10), (100, 10, 10)],
)
def test_batches_in_counts_the_short_tail(size: int, batch_size: int, expected: int) -> None:
    assert batches_in(size, batch_size) == expected


@pytest.mark.parametrize(
    ("total", "num_ranks", "expected"),
    [(10, 3, [4, 3, 3]), (11, 3, [4, 4, 3]), (2, 3, [1, 1, 0]), (0, 2, [0, 0]), (7, 1, [7])],
)
def test_equal_split_gives_extras_to_first_ranks(
    total: int, num_ranks: int, expected: list[int]
) -> None:
    assert equal_split(total, num_ranks) == expected


@pytest.mark.parametrize(
    ("total", "weights", "expected"),
    [
        (12, [1.0, 3.0], [3, 9]),  # epoch_dispatch.rs: explicit ratios [1, 3] -> 3/9
        (10, [1.0, 1.0, 2.0], [2, 2, 6]),  # leftover to the heaviest
        (5, [1.0, 1.0], [3, 2]),  # tie: lower index first
        (10, [2.0, 1.0, 2.0], [4, 2, 4]),
        (11, [2.0, 1.0, 2.0], [5, 2, 4]),  # tie among the heaviest: rank 0
        (7, [0.0, 1.0, -1.0], [0, 7, 0]),  # non-positive weights get nothing
        (7, [0.0, -2.0, 0.0], [3, 2, 2]),  # all non-positive: equal split
        (3, [0.1, 0.2, 0.7], [0, 0, 3]),  # leftover to the heaviest, not the largest remainder
    ],
)
def test_proportional_split(total: int, weights: list[float], expected: list[int]) -> None:
    assert proportional_split(total, weights) == expected


def test_splits_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="empty"):
        proportional_split(5, [])
    with pytest.raises(ConfigError) as info:
        proportional_split(5, [1.0, float("nan")])
    assert info.value.field == "weights"
    with pytest.raises(ConfigError, match="num_ranks"):
        equal_split(5, 0)
    with pytest.raises(ConfigError, match="batch_size"):
        batches_in(5, 0)
    with pytest.raises(ConfigError, match="num_samples"):
        epoch_permutation(-1, seed=1, epoch=0)


@pytest.mark.parametrize(
    ("spans", "expected"),
    [
        ([], []),
        ([(5, 5), (0, 5), (20, 0), (12, 3)], [(0, 10), (12, 3)]),
        ([(0, 10), (4, 2), (8, 5)], [(0, 13)]),  # contained and overlapping
        ([(3, 0)], []),
    ],
)
def test_coalesce(spans: list[Span], expected: list[Span]) -> None:
    assert coalesce(spans) == expected


def test_coalesce_rejects_negative_spans() -> None:
    with pytest.raises(ValueError, match="offset, size"):
        coalesce([(0, -1)])


# ------------------------------------------------------------ chunk pool: serving


def test_pool_reserves_contiguous_spans_in_rank_order() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    assert pool.remaining() == 100
    assert pool.take(0, 30) == (0, 30)
    assert pool.take(1, 20) == (50, 20)
    assert (pool.residue(0), pool.residue(1), pool.remaining()) == (20, 30, 50)
    assert pool.outstanding_spans(0) == [(0, 30)]
    assert not pool.is_done()


def test_by_weights_reserves_whole_batches_and_trims_the_last_span() -> None:
    # 95 samples = 10 batches (the last has 5); [3, 1] -> 8 and 2 batches.
    pool = ChunkPool.by_weights(95, [3.0, 1.0], batch_size=10)
    assert (pool.residue(0), pool.residue(1)) == (80, 15)
    assert pool.take(1, 100) == (80, 15)


def test_by_weights_trims_the_last_non_empty_span() -> None:
    pool = ChunkPool.by_weights(25, [1.0, 0.0], batch_size=10)
    assert (pool.residue(0), pool.residue(1)) == (25, 0)


def test_remaining_batches_counts_the_short_tail() -> None:
    pool = ChunkPool(95, [50, 45], batch_size=10)
    assert pool.remaining_batches() == 10
    pool.take(0, 50)
    assert pool.remaining_batches() == 5  # 45 samples: four whole batches and a short one
    pool.take(1, 45)
    assert pool.remaining_batches() == 0


def test_equal_reserves_whole_batches_extras_first() -> None:
    pool = ChunkPool.equal(95, 3, batch_size=10)
    assert [pool.residue(r) for r in range(3)] == [40, 30, 25]


def test_exhaustion_clamps_to_the_span_then_returns_none() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    assert pool.take(0, 80) == (0, 50)
    assert pool.take(1, 50) == (50, 50)
    assert pool.take(0, 10) is None
    assert pool.take(1, 10) is None
    assert pool.remaining() == 0


def test_steal_peels_the_tail_of_the_largest_residue() -> None:
    pool = ChunkPool(100, [10, 60, 30], batch_size=10)
    assert pool.take(0, 10) == (0, 10)
    assert pool.take(0, 15) == (55, 15)  # rank 1 has the largest residue
    assert (pool.residue(1), pool.residue(2)) == (45, 30)
    assert pool.take(1, 100) == (10, 45)  # the owner still eats front-first
    assert pool.take(1, 100) == (70, 30)  # then steals rank 2's tail whole
    assert pool.take(2, 10) is None


def test_steal_ties_go_to_the_highest_rank() -> None:
    pool = ChunkPool(60, [0, 30, 30], batch_size=10)
    assert pool.take(0, 10) == (50, 10)
    assert pool.take(0, 10) == (20, 10)  # now rank 1 has more


def test_is_done_needs_everything_committed() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    pool.take(0, 50)
    pool.take(1, 50)
    assert pool.take(0, 1) is None
    assert not pool.is_done()
    pool.commit(0, 50)
    assert not pool.is_done()
    pool.commit(1, 50)
    assert pool.is_done()
    assert pool.committed() == 100


def test_incremental_commit_shrinks_the_front_span() -> None:
    pool = ChunkPool(200, [100, 100], batch_size=10)
    assert pool.take(0, 50) == (0, 50)
    assert pool.take(0, 50) == (50, 50)
    assert pool.commit(0, 30) == 30
    assert pool.outstanding_spans(0) == [(30, 20), (50, 50)]
    assert pool.commit(0, 40) == 40
    assert pool.outstanding_spans(0) == [(70, 30)]
    assert (pool.outstanding(0), pool.committed()) == (30, 70)
    assert pool.commit(0, 0) == 0


def test_round_robin_serving_has_no_overlap_and_full_coverage() -> None:
    pool = ChunkPool.equal(500, 3, batch_size=7)
    served: list[Span] = []
    while pool.remaining():
        for rank in range(3):
            if (span := pool.take(rank, 60)) is not None:
                served.append(span)
    assert positions(served) == list(range(500))


def test_zero_total_is_done_at_once() -> None:
    pool = ChunkPool(0, [0, 0], batch_size=10)
    assert pool.remaining() == 0
    assert pool.take(0, 10) is None
    assert pool.is_done()
    assert pool.uncovered() == []


def test_single_rank_serves_everything() -> None:
    pool = ChunkPool.equal(50, 1, batch_size=10)
    assert pool.take(0, 50) == (0, 50)
    assert pool.take(0, 1) is None
    assert not pool.is_done()
    assert pool.commit(0, 50) == 50
    assert pool.is_done()


@pytest.mark.parametrize("size", [0, -3])
def test_take_rejects_empty_sizes_and_keeps_state(size: int) -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    with pytest.raises(ValueError, match="size"):
        pool.take(0, size)
    with pytest.raises(ValueError, match="size"):
        pool.take_reclaimed(0, size)
    assert (pool.remaining(), pool.outstanding(0)) == (100, 0)


@pytest.mark.parametrize("rank", [-1, 2])
def test_bad_rank_is_rejected(rank: int) -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    for call in (
        lambda: pool.take(rank, 1),
        lambda: pool.commit(rank, 1),
        lambda: pool.forfeit(rank),
        lambda: pool.rollback(rank, (0, 1)),
        lambda: pool.residue(rank),
    ):
        with pytest.raises(ValueError, match="rank"):
            call()
    assert pool.remaining() == 100


@pytest.mark.parametrize(
    ("total", "shares", "batch_size", "field"),
    [(100, [50, 40], 10, "shares"), (10, [11, -1], 10, "shares"), (10, [10], 0, "batch_size")],
)
def test_constructor_rejects_bad_config(
    total: int, shares: list[int], batch_size: int, field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        ChunkPool(total, shares, batch_size=batch_size)
    assert info.value.field == field


def test_constructor_needs_a_rank() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        ChunkPool(0, [], batch_size=1)


# ------------------------------------------------------ chunk pool: death, rollback


def test_forfeit_reclaims_in_flight_work_first() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    pool.take(0, 50)
    pool.take(1, 50)
    pool.commit(1, 50)
    assert pool.forfeit(1) == 0
    assert pool.forfeit(0) == 50
    assert pool.forfeit(0) == 0  # idempotent
    assert (pool.remaining(), pool.outstanding(0)) == (50, 0)
    assert pool.reclaimed_spans() == [(0, 50)]
    assert not pool.is_done()
    assert pool.take(1, 50) == (0, 50)
    pool.commit(1, 50)
    assert pool.is_done()


def test_forfeit_reclaim_is_split_by_smaller_takes() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    pool.take(0, 50)
    pool.forfeit(0)
    assert pool.take(1, 20) == (0, 20)
    assert pool.take(1, 29) == (20, 29)
    assert pool.take(1, 20) == (49, 1)
    assert pool.take(1, 20) == (50, 20)  # then fresh work from its own span
    assert pool.remaining() == 30


def test_forfeit_returns_multiple_outstanding_spans_in_order() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    pool.take(0, 30)
    pool.take(0, 20)
    assert pool.outstanding(0) == 50
    assert pool.forfeit(0) == 50
    assert pool.reclaimed_spans() == [(0, 30), (30, 20)]
    assert pool.remaining() == 100
    assert pool.take(1, 30) == (0, 30)
    assert pool.take(1, 30) == (30, 20)


def test_take_reclaimed_serves_only_lost_work() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    assert pool.take_reclaimed(1, 10) is None
    pool.take(0, 30)
    pool.forfeit(0)
    assert pool.take_reclaimed(1, 10) == (0, 10)
    assert pool.take_reclaimed(1, 50) == (10, 20)
    assert pool.take_reclaimed(1, 10) is None
    assert pool.outstanding_spans(1) == [(0, 10), (10, 20)]
    assert pool.residue(1) == 50


def test_rollback_rewinds_the_cursor() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    span = pool.take(0, 40)
    assert span == (0, 40)
    assert pool.rollback(0, span)
    assert (pool.remaining(), pool.outstanding(0), pool.reclaimed_spans()) == (100, 0, [])
    assert pool.take(0, 40) == (0, 40)


def test_rollback_after_a_later_take_reclaims() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    first = pool.take(0, 20)
    pool.take(0, 20)
    assert first is not None and pool.rollback(0, first)
    assert pool.remaining() == 100 - 40 + 20
    assert pool.reclaimed_spans() == [(0, 20)]
    assert pool.take(1, 20) == (0, 20)


def test_rollback_of_a_non_newest_span_removes_exactly_it() -> None:
    pool = ChunkPool(200, [100, 100], batch_size=10)
    pool.take(0, 40)
    pool.take(0, 30)
    assert pool.rollback(0, (0, 40))
    assert pool.outstanding_spans(0) == [(40, 30)]
    assert pool.take(1, 40) == (0, 40)


def test_rollback_of_a_steal_reclaims() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    pool.take(0, 50)
    stolen = pool.take(0, 10)
    assert stolen == (90, 10)
    assert pool.rollback(0, stolen)
    assert pool.reclaimed_spans() == [(90, 10)]


def test_rollback_of_an_unknown_span_changes_nothing() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    pool.take(0, 40)
    assert not pool.rollback(0, (50, 10))
    assert not pool.rollback(1, (0, 40))  # outstanding, but for another rank
    assert (pool.outstanding(0), pool.remaining(), pool.reclaimed_spans()) == (40, 60, [])


def test_death_after_take_is_served_exactly_once() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    assert pool.take(0, 40) == (0, 40)
    assert pool.forfeit(0) == 40
    served = drain(pool, 1, 40)
    assert positions(served) == list(range(100))
    assert (pool.outstanding(0), pool.outstanding(1)) == (0, 0)
    assert pool.is_done()


def test_commit_after_forfeit_clamps() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    pool.take(0, 40)
    pool.forfeit(0)
    assert pool.commit(0, 40) == 0  # falsely declared dead, reports anyway
    assert (pool.outstanding(0), pool.committed()) == (0, 0)
    assert pool.take(1, 40) == (0, 40)
    assert pool.take(1, 60) == (50, 50)
    assert pool.take(1, 60) == (40, 10)  # the dead rank's residue, stolen
    assert pool.commit(1, 1000) == 100
    assert pool.is_done()


# ------------------------------------------------------------ chunk pool: coverage


def test_uncovered_of_a_fresh_pool_is_everything() -> None:
    assert ChunkPool.equal(100, 3, batch_size=10).uncovered() == [(0, 100)]


def test_uncovered_coalesces_in_flight_and_residues() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    pool.take(0, 20)
    pool.commit(0, 10)
    assert pool.uncovered() == [(10, 90)]
    pool.take(1, 50)
    pool.commit(1, 50)
    assert pool.uncovered() == [(10, 40)]


def test_uncovered_includes_reclaimed_spans() -> None:
    pool = ChunkPool(100, [50, 50], batch_size=10)
    pool.take(0, 50)
    pool.take(1, 50)
    pool.commit(1, 20)
    pool.forfeit(0)
    assert pool.uncovered() == [(0, 50), (70, 30)]
    assert pool.committed() == 20


def test_from_uncovered_serves_each_hole_once() -> None:
    pool = ChunkPool.from_uncovered(100, [(40, 10), (10, 5), (15, 5)], batch_size=10, num_ranks=2)
    assert (pool.remaining(), pool.committed(), pool.uncovered()) == (20, 80, [(10, 10), (40, 10)])
    assert pool.take(1, 6) == (10, 6)
    assert pool.take(0, 100) == (16, 4)
    assert pool.take(0, 100) == (40, 10)
    assert pool.take(1, 100) is None
    assert not pool.is_done()
    pool.commit(0, 14)
    pool.commit(1, 6)
    assert pool.is_done()
    assert pool.committed() == 100


def test_from_uncovered_without_holes_is_done() -> None:
    pool = ChunkPool.from_uncovered(100, [(3, 0)], batch_size=10, num_ranks=2)
    assert pool.is_done()
    assert pool.take(0, 10) is None


def test_from_uncovered_rejects_holes_past_the_end() -> None:
    with pytest.raises(ConfigError) as info:
        ChunkPool.from_uncovered(100, [(95, 10)], batch_size=10, num_ranks=2)
    assert info.value.field == "holes"


def test_uncovered_round_trips_through_from_uncovered() -> None:
    pool = ChunkPool.by_weights(97, [2.0, 1.0], batch_size=8)
    pool.take(0, 24)
    pool.take(1, 8)
    pool.commit(0, 16)
    resumed = ChunkPool.from_uncovered(97, pool.uncovered(), batch_size=8, num_ranks=2)
    assert resumed.uncovered() == pool.uncovered()
    assert resumed.committed() == pool.committed() == 16


# ------------------------------------------------------------------ final window


def test_final_window_proportional_split_has_no_lone_one() -> None:
    alloc = final_window_alloc(72, RIG, ALL3)
    assert alloc == [49, 13, 10]  # floors [49, 12, 10]; the leftover to the .46 remainder
    assert 1 not in alloc
    assert alloc[0] > max(alloc[1:])


@pytest.mark.parametrize("remaining", range(3, 21))
def test_final_window_tiny_windows_consolidate(remaining: int) -> None:
    alloc = final_window_alloc(remaining, RIG, ALL3)
    assert sum(alloc) == remaining
    assert 1 not in alloc


def test_final_window_fold_band_gives_each_crumb_where_it_ends_soonest() -> None:
    # sum(RIG) + 2: one more batch on the fastest rank ends at 72/71 of the
    # window, on the others at 19/18 or 16/15; the second crumb likewise.
    assert final_window_alloc(106, RIG, ALL3) == [73, 18, 15]
    # Crumbs spread once the fastest rank's extra time catches up: 6/4 ties
    # 3/2 (the larger count wins the tie), then 7/4 > 3/2.
    assert final_window_alloc(10, [4, 2, 1], ALL3) == [6, 3, 1]


def test_final_window_dead_rank_gets_nothing() -> None:
    alloc = final_window_alloc(40, RIG, {0, 2})
    assert alloc == [33, 0, 7]


def test_final_window_fastest_skips_dead_ranks() -> None:
    assert final_window_alloc(105, RIG, ALL3) == [72, 18, 15]
    assert final_window_alloc(34, RIG, {1, 2}) == [0, 19, 15]  # rank 1 is now fastest


def test_final_window_irreducible_lone_one_is_kept() -> None:
    assert final_window_alloc(1, RIG, ALL3) == [1, 0, 0]


@pytest.mark.parametrize(
    ("remaining", "counts", "expected"),
    [
        (2, [1, 1, 1], [0, 2, 0]),  # raw [1, 1, 0]: rank 0's 1 joins rank 1
        (4, [4, 2, 2], [2, 0, 2]),  # raw [2, 1, 1]: onto the smallest peer
    ],
)
def test_final_window_consolidate_examples(
    remaining: int, counts: list[int], expected: list[int]
) -> None:
    assert final_window_alloc(remaining, counts, ALL3) == expected


@pytest.mark.parametrize(
    ("remaining", "counts", "alive", "expected"),
    [
        (50, [10, 20], {1}, [0, 50]),  # a single alive rank takes everything
        (5, [10, 20], {1}, [0, 5]),
        (18, [10, 5, 5, 5], {0, 1}, [12, 6, 0, 0]),  # 11/10, 12/10 (tie), then 6/5
        (0, RIG, ALL3, [0, 0, 0]),
    ],
)
def test_final_window_edges(
    remaining: int, counts: list[int], alive: set[int], expected: list[int]
) -> None:
    assert final_window_alloc(remaining, counts, alive) == expected


def test_final_window_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="positive count"):
        final_window_alloc(5, [0, 0], {0, 1})
    with pytest.raises(ValueError, match="range"):
        final_window_alloc(5, [1, 1], {2})
    with pytest.raises(ConfigError, match="counts"):
        final_window_alloc(5, [1, -1], {0})


@pytest.mark.parametrize(
    ("remaining", "counts", "alive", "expected"),
    [
        (0, RIG, ALL3, False),
        (72, RIG, ALL3, True),
        (106, RIG, ALL3, True),
        (107, RIG, ALL3, False),  # a full window plus a full crumb row: plain dispatch
        (40, RIG, {0, 2}, True),
        (88, RIG, {0, 2}, False),
        (5, [0, 0, 0], ALL3, False),
        (5, RIG, set(), False),
    ],
)
def test_needs_final_window(
    remaining: int, counts: list[int], alive: set[int], expected: bool
) -> None:
    assert needs_final_window(remaining, counts, alive) is expected


# ------------------------------------------------------------------ properties


@st.composite
def pools(draw: st.DrawFn) -> ChunkPool:
    """A pool of 1-4 ranks with arbitrary (possibly empty) reservations."""
    num_ranks = draw(st.integers(1, 4))
    cuts = draw(st.lists(st.integers(0, 60), min_size=num_ranks - 1, max_size=num_ranks - 1))
    total = draw(st.integers(max(cuts, default=0), 60))
    edges = [0, *sorted(cuts), total]
    shares = [end - start for start, end in itertools.pairwise(edges)]
    return ChunkPool(total, shares, batch_size=draw(st.integers(1, 16)))


OP_NAMES = ["take", "take_reclaimed", "forfeit", "commit", "rollback"]
OPS = st.lists(st.tuples(st.sampled_from(OP_NAMES), st.integers(0, 3), st.integers(1, 12)))


def fifo_consume(spans: list[Span], samples: int) -> tuple[list[Span], list[Span]]:
    """Model of commit: split ``spans`` into (consumed pieces, what is left)."""
    consumed: list[Span] = []
    rest: list[Span] = []
    for offset, size in spans:
        piece = min(samples, size)
        samples -= piece
        if piece:
            consumed.append((offset, piece))
        if piece < size:
            rest.append((offset + piece, size - piece))
    return consumed, rest


class Ledger:
    """What the test believes: who holds each position, and what is committed."""

    def __init__(self, pool: ChunkPool) -> None:
        self.pool = pool
        self.held: dict[int, int] = {}  # position -> rank holding it
        self.committed: list[Span] = []

    def served(self, rank: int, span: Span | None) -> None:
        done = set(positions(self.committed))
        for p in positions([span] if span else []):
            assert p not in self.held and p not in done, f"position {p} handed out twice"
            self.held[p] = rank

    def released(self, spans: list[Span]) -> None:
        for p in positions(spans):
            del self.held[p]

    def commit(self, rank: int, samples: int) -> None:
        consumed, rest = fifo_consume(self.pool.outstanding_spans(rank), samples)
        assert self.pool.commit(rank, samples) == sum(size for _, size in consumed)
        assert self.pool.outstanding_spans(rank) == rest
        self.committed.extend(consumed)
        self.released(consumed)

    def apply(self, name: str, rank: int, size: int) -> None:
        pool = self.pool
        spans = pool.outstanding_spans(rank)
        if name == "take":
            self.served(rank, pool.take(rank, size))
        elif name == "take_reclaimed":
            self.served(rank, pool.take_reclaimed(rank, size))
        elif name == "forfeit":
            assert pool.forfeit(rank) == sum(size for _, size in spans)
            self.released(spans)
        elif name == "commit":
            self.commit(rank, size)
        elif spans:
            victim = spans[size % len(spans)]
            assert pool.rollback(rank, victim)
            self.released([victim])

    def check(self) -> None:
        pool = self.pool
        outstanding = [s for r in range(pool.num_ranks) for s in pool.outstanding_spans(r)]
        assert positions(outstanding) == sorted(self.held)
        assert pool.committed() + pool.remaining() + len(self.held) == pool.total
        assert sum(size for _, size in pool.uncovered()) == pool.total - pool.committed()


@settings(max_examples=150, deadline=None)
@given(pool=pools(), ops=OPS, drain_size=st.integers(1, 9))
def test_every_sample_is_committed_exactly_once(
    pool: ChunkPool, ops: list[tuple[str, int, int]], drain_size: int
) -> None:
    ledger = Ledger(pool)
    for name, rank, size in ops:
        ledger.apply(name, rank % pool.num_ranks, size)
        ledger.check()
    for rank in range(pool.num_ranks):
        ledger.commit(rank, pool.total)
    for rank in itertools.cycle(range(pool.num_ranks)):
        if (span := pool.take(rank, drain_size)) is None:
            break
        ledger.served(rank, span)
        ledger.commit(rank, span[1])
    assert positions(ledger.committed) == list(range(pool.total))
    assert pool.is_done() and pool.uncovered() == []
    assert pool.committed() == pool.total


@settings(max_examples=200, deadline=None)
@given(
    remaining=st.integers(0, 400),
    counts=st.lists(st.integers(0, 100), min_size=1, max_size=6),
    data=st.data(),
)
def test_final_window_invariants(remaining: int, counts: list[int], data: st.DataObject) -> None:
    alive = data.draw(st.sets(st.integers(0, len(counts) - 1)))
    scheduled = sum(counts[r] for r in alive)
    if remaining and not scheduled:
        with pytest.raises(ValueError):
            final_window_alloc(remaining, counts, alive)
        return
    alloc = final_window_alloc(remaining, counts, alive)
    assert sum(alloc) == remaining
    assert all(a == 0 for r, a in enumerate(alloc) if r not in alive)
    assert min(alloc) >= 0
    fold_band = remaining >= scheduled
    if remaining >= 2 and (not fold_band or all(counts[r] >= 2 for r in alive)):
        assert 1 not in alloc, "avoidable lone 1"
    if fold_band and remaining and len(alive) > 1:
        assert all(alloc[r] >= counts[r] for r in alive)
        # No crumb could have ended sooner on another rank than where it went.
        movers = [r for r in alive if counts[r] > 0]
        for r in movers:
            if alloc[r] > counts[r]:
                ends = Fraction(alloc[r], counts[r])
                assert all(ends <= Fraction(alloc[s] + 1, counts[s]) for s in movers)
