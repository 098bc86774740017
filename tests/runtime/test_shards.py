"""``elche.Shards``: reading spans of a sharded stream, and its refusals."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

import elche
from elche.runtime.loading import Loader
from elche.runtime.options import TrainOptions
from elche.runtime.shards import Shards, epoch_order
from tests.runtime import byo_fns as fx

OPENED: list[int] = []


def numbers(shard: int, n: int) -> Iterator[tuple[int, int]]:
    """Shard ``shard``'s ``n`` items, ``(shard, k)``; records each pass it starts."""
    OPENED.append(shard)
    for k in range(n):
        yield (shard, k)


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(5))


def streamed(lengths: list[int]) -> Shards:
    return Shards([functools.partial(numbers, s, n) for s, n in enumerate(lengths)])


def test_lengths_come_from_len_or_one_counting_pass() -> None:
    OPENED.clear()
    shards = Shards(
        [[1, 2], functools.partial(numbers, 1, 3), Stream(), TensorDataset(torch.zeros(4))]
    )
    assert shards.lengths == [2, 3, 5, 4] and len(shards) == 14
    assert OPENED == [1]  # only the function's shard was counted by a pass
    given = Shards([functools.partial(numbers, 0, 3)], lengths=[3])
    assert given.lengths == [3] and OPENED == [1]


def test_spans_read_in_order_open_each_shard_once() -> None:
    shards = streamed([5, 0, 7, 3])
    order = shards.order(seed=42, epoch=2)
    OPENED.clear()
    items = [shards[order[p]] for p in range(len(order))]
    assert [s for s in order.shards if shards.lengths[s]] == sorted(set(OPENED), key=OPENED.index)
    assert len(OPENED) == 3  # one pass per non-empty shard
    assert sorted(items) == [(s, k) for s, n in enumerate([5, 0, 7, 3]) for k in range(n)]


def test_a_span_behind_the_open_iterator_reopens_its_shard_and_skips() -> None:
    shards = streamed([6])
    OPENED.clear()
    assert [shards[i] for i in (4, 5, 1, 2)] == [(0, 4), (0, 5), (0, 1), (0, 2)]
    assert OPENED == [0, 0]  # item 5 ended the first pass; item 1 started a second


def test_a_batch_out_of_order_reads_its_stream_once() -> None:
    shards = streamed([6])
    OPENED.clear()
    assert shards.__getitems__([3, 1, 2, 1]) == [(0, 3), (0, 1), (0, 2), (0, 1)]
    assert OPENED == [0]


def test_a_shard_that_ends_early_or_runs_long_is_a_config_error() -> None:
    short = Shards([functools.partial(numbers, 0, 3)], lengths=[4])
    with pytest.raises(elche.ConfigError, match="shard 0 ended after 3 items, but its length is 4"):
        short[3]
    long = Shards([functools.partial(numbers, 0, 3)], lengths=[2])
    assert long[0] == (0, 0)
    with pytest.raises(
        elche.ConfigError, match="shard 0 yields at least 3 items, but its length is 2"
    ):
        long[1]


def test_a_stream_said_empty_that_yields_items_is_refused_when_built() -> None:
    # No rank reads a shard of length 0: its items were left out of every epoch, unseen.
    OPENED.clear()
    with pytest.raises(elche.ConfigError, match="lengths: shard 1 yields items, lengths says 0"):
        Shards([functools.partial(numbers, 0, 2), functools.partial(numbers, 1, 3)], lengths=[2, 0])
    assert OPENED == [1]  # only the shard said empty was opened
    empty = Shards(
        [functools.partial(numbers, 0, 2), functools.partial(numbers, 1, 0)], lengths=[2, 0]
    )
    assert len(empty) == 2


@pytest.mark.parametrize(
    ("shards", "lengths", "match"),
    [
        ([], None, "is empty"),
        ([iter([1, 2])], None, "iterator"),
        (["data/part-0.txt"], None, "path"),
        ([42], None, "not iterable"),
        ([[1, 2]], [3], "shard 0 has 2 items"),
        ([[1, 2]], [2, 1], "one integer"),
    ],
)
def test_bad_shards_are_refused_naming_the_field(
    shards: list[object], lengths: list[int] | None, match: str
) -> None:
    with pytest.raises(elche.ConfigError, match=match):
        Shards(shards, lengths=lengths)


def test_a_plain_iterable_dataset_is_refused_with_the_way_out() -> None:
    with pytest.raises(
        elche.ConfigError, match=r"dataset: Stream is an IterableDataset.*elche\.Shards"
    ):
        elche.train(
            fx.linear_model, fx.linear_optimizer, fx.mse_step, Stream(), batch_size=2, epochs=1
        )


def test_a_lambda_shard_cannot_reach_the_ranks() -> None:
    shards = Shards([lambda: iter(range(4))])  # fine in this process
    with pytest.raises(elche.ConfigError, match=r"shard 0 .* cannot be sent"):
        shards.check_sendable()


def test_loader_workers_read_the_same_batches_as_the_training_thread() -> None:
    lengths = [5, 9, 2, 6]
    shards = Shards([functools.partial(numbers, s, n) for s, n in enumerate(lengths)])

    def perm(epoch: int) -> Sequence[int]:
        return epoch_order(shards, seed=1, epoch=epoch)

    shards[0]  # an iterator open before the workers fork is not theirs to continue
    batches = {}
    for workers in (0, 2):
        loader = Loader(
            shards, TrainOptions(num_workers=workers, collate_fn=list), micro_size=4,
            step_size=8, perm=perm, device=torch.device("cpu"),
        )  # fmt: skip
        steps = [(0, 0, 8), (0, 8, 8), (0, 16, 6)]
        batches[workers] = [
            mb.batch for at, step in enumerate(steps)
            for mb in loader.step(*step, functools.partial(steps.__getitem__, slice(at, None)))
        ]  # fmt: skip
        loader.close()
    assert batches[0] == batches[2]
    assert sorted(i for b in batches[0] for i in b) == sorted(
        (s, k) for s, n in enumerate(lengths) for k in range(n)
    )
