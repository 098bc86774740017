"""The sharded epoch order: every item once per epoch, spans of few shards."""

from __future__ import annotations

import collections
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elche.core.dispatch import ChunkPool
from elche.core.errors import ConfigError
from elche.core.shard_order import ShardOrder, shard_of, shard_starts

lengths_st = st.lists(st.integers(0, 12), min_size=1, max_size=10).filter(lambda ls: sum(ls) > 0)


def test_an_epoch_lays_the_shuffled_shards_end_to_end_items_in_order() -> None:
    order = ShardOrder([3, 0, 2], seed=42, epoch=0)
    starts = shard_starts([3, 0, 2])
    expected = [starts[s] + k for s in order.shards for k in range([3, 0, 2][s])]
    assert list(order) == expected == [order[p] for p in range(len(order))]
    assert order[-1] == expected[-1] and order[1:3] == expected[1:3]
    with pytest.raises(IndexError):
        order[5]


def test_epochs_shuffle_the_shards_differently_and_reproducibly() -> None:
    lengths = [1] * 8
    orders = [ShardOrder(lengths, seed=7, epoch=e).shards for e in range(4)]
    assert len({tuple(o) for o in orders}) > 1
    assert orders[2] == ShardOrder(lengths, seed=7, epoch=2).shards


def test_a_negative_length_or_epoch_is_refused() -> None:
    with pytest.raises(ConfigError, match="lengths"):
        ShardOrder([2, -1], seed=0, epoch=0)
    with pytest.raises(ConfigError, match="epoch"):
        ShardOrder([2], seed=0, epoch=-1)


@settings(max_examples=120, deadline=None)
@given(
    lengths=lengths_st,
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 5),
    cuts=st.lists(st.floats(0, 1), max_size=12),
)
def test_any_span_cut_trains_every_item_of_every_shard_once(
    lengths: list[int], seed: int, epoch: int, cuts: list[float]
) -> None:
    order = ShardOrder(lengths, seed=seed, epoch=epoch)
    total = sum(lengths)
    bounds = sorted({0, total, *(int(c * total) for c in cuts)})
    starts = shard_starts(lengths)
    seen: collections.Counter[tuple[int, int]] = collections.Counter()
    for lo, hi in itertools.pairwise(bounds):
        items = [shard_of(order[p], starts, lengths) for p in range(lo, hi)]
        seen.update(items)
        # A span is consecutive items of each shard it touches, one shard after another.
        shards = [s for s, _ in items]
        runs = [s for i, s in enumerate(shards) if i == 0 or shards[i - 1] != s]
        assert len(runs) == len(set(runs))
        for a, b in itertools.pairwise(items):
            assert a[0] != b[0] or b[1] == a[1] + 1
    assert seen == {(s, k): 1 for s, n in enumerate(lengths) for k in range(n)}


@settings(max_examples=60, deadline=None)
@given(
    lengths=lengths_st,
    weights=st.lists(st.floats(0.1, 4), min_size=3, max_size=3),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=40),
    dead=st.integers(0, 2),
    resume_at=st.integers(1, 60),
)
def test_the_pool_s_spans_with_a_death_and_a_resume_cover_each_item_once(
    lengths: list[int], weights: list[float], sizes: list[int], dead: int, resume_at: int
) -> None:
    """The coordinator's own bookkeeping over the sharded order: served spans,
    a rank dying with its work re-issued, a resume from the coverage (what no
    average holds is served again), every item committed exactly once."""
    order = ShardOrder(lengths, seed=3, epoch=1)
    starts = shard_starts(lengths)
    pool = ChunkPool.by_weights(len(order), weights, batch_size=4)
    committed: collections.Counter[tuple[int, int]] = collections.Counter()
    held: dict[int, list[tuple[int, int]]] = {0: [], 1: [], 2: []}
    live = [0, 1, 2]
    step = 0
    while not pool.is_done():
        rank = live[step % len(live)]
        size = sizes[step % len(sizes)]
        step += 1
        if step == resume_at:  # a new run from the coverage: held work is not averaged
            pool = ChunkPool.from_uncovered(len(order), pool.uncovered(), batch_size=4, num_ranks=3)
            held = {0: [], 1: [], 2: []}
        if step == len(sizes) and dead in live and len(live) > 1:
            pool.forfeit(dead)  # its held spans are trained again by the others
            held[dead].clear()
            live.remove(dead)
            continue
        span = pool.take(rank, size)
        if span is None:
            for r in live:  # the rest is outstanding: average it
                for offset, n in held[r]:
                    committed.update(
                        shard_of(order[p], starts, lengths) for p in range(offset, offset + n)
                    )
                pool.commit(r, sum(n for _, n in held[r]))
                held[r].clear()
            continue
        held[rank].append(span)
    assert committed == {(s, k): 1 for s, n in enumerate(lengths) for k in range(n)}


def test_shard_of_skips_empty_shards() -> None:
    lengths = [0, 2, 0, 1, 0]
    starts = shard_starts(lengths)
    assert [shard_of(i, starts, lengths) for i in range(3)] == [(1, 0), (1, 1), (3, 0)]
    with pytest.raises(IndexError):
        shard_of(3, starts, lengths)
