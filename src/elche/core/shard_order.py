"""The epoch order of a sharded dataset: shards shuffled, items in order.

Theory of operation. A sharded dataset (``elche.Shards``) has one index
space: item ``k`` of shard ``s`` is index ``start[s] + k``, the shards laid
end to end in the order given. An epoch does not shuffle items (a stream can
only be read forwards) but shards: ``random.Random(seed + epoch)`` permutes
the shard order, and position ``p`` of the epoch is the ``p``-th item of the
shards laid end to end in that order.

The coordinator's bookkeeping is unchanged: it hands out spans of positions
``[offset, offset + size)`` (``elche.core.dispatch``), never knowing what a
position holds. Under this order a span is a run of consecutive items of
few shards (one more shard per shard boundary it crosses), so a rank reads
it by opening each shard once and skipping to the offset; the next span of
the same reservation continues where it stopped.

``ShardOrder`` is a lazy ``Sequence[int]`` (position -> index): memory in
the number of shards, not items, so an epoch of millions of streamed items
costs nothing to lay out. ``shard_of`` is the inverse split of an index into
``(shard, item)``.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator, Sequence
from typing import TypeAlias, overload

from elche.core.errors import ConfigError

_Slice: TypeAlias = "slice[int | None, int | None, int | None]"

__all__ = ["ShardOrder", "shard_of", "shard_starts"]


def shard_starts(lengths: Sequence[int]) -> list[int]:
    """The index of each shard's first item, shards in the order given.

    Raises:
        ConfigError: a length is negative.
    """
    for length in lengths:
        if length < 0:
            raise ConfigError("lengths", f"each shard length must be >= 0, got {list(lengths)}")
    return [0, *itertools.accumulate(lengths)][:-1]


def shard_of(index: int, starts: Sequence[int], lengths: Sequence[int]) -> tuple[int, int]:
    """``(shard, item)`` of ``index`` in the shards' index space.

    Raises:
        IndexError: ``index`` is outside ``[0, sum(lengths))``.
    """
    total = starts[-1] + lengths[-1] if starts else 0
    if not 0 <= index < total:
        raise IndexError(f"index {index} outside the {total} items of the shards")
    # An empty shard starts where the next one does: the last of equal starts holds it.
    shard = bisect.bisect_right(starts, index) - 1
    return shard, index - starts[shard]


class ShardOrder(Sequence[int]):
    """Epoch ``epoch``'s order: position -> index, shards shuffled by ``seed + epoch``.

    Args:
        lengths: items per shard, in the order the shards were given.
        seed: the run's shuffle seed.
        epoch: the epoch (>= 0).

    Raises:
        ConfigError: a length or ``epoch`` is negative.
    """

    def __init__(self, lengths: Sequence[int], *, seed: int, epoch: int) -> None:
        if epoch < 0:
            raise ConfigError("epoch", f"must be >= 0, got {epoch}")
        starts = shard_starts(lengths)
        self.shards = list(range(len(lengths)))
        random.Random(seed + epoch).shuffle(self.shards)
        self._first = [starts[s] for s in self.shards]  # index of each shard's item 0
        self._ends = list(itertools.accumulate(lengths[s] for s in self.shards))  # positions

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @overload
    def __getitem__(self, position: int) -> int: ...

    @overload
    def __getitem__(self, position: _Slice) -> list[int]: ...

    def __getitem__(
        self, position: int | slice[int | None, int | None, int | None]
    ) -> int | list[int]:
        if isinstance(position, slice):
            return [self[p] for p in range(*position.indices(len(self)))]
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError(f"position {position} outside the epoch's {len(self)} items")
        i = bisect.bisect_right(self._ends, position)  # empty shards end where they start
        before = self._ends[i - 1] if i else 0
        return self._first[i] + position - before

    def __iter__(self) -> Iterator[int]:
        before = 0
        for first, end in zip(self._first, self._ends, strict=True):
            yield from range(first, first + end - before)
            before = end
