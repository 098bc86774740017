"""``elche.Shards``: a streamed dataset, split into shards elche can hand out.

Theory of operation. elche hands out *positions* of an epoch's order
(``elche.core.dispatch``); a plain stream cannot be read at a position, but
a list of shards can: item ``k`` of shard ``s`` is read by opening ``s`` and
skipping ``k`` items. ``Shards`` lays its shards end to end into one index
space (``len`` is the total), and its epoch order
(``elche.core.shard_order.ShardOrder``) shuffles the shards, not the items,
so every span elche assigns is consecutive items of few shards. The
coordinator's bookkeeping (shares by speed, exactly once per epoch, re-issue
of a dead rank's work, resume from coverage) is the one every dataset gets.

A shard is one of:

- a *sized, indexable* object (a list, a map-style ``Dataset``): read by
  index, in any order, at no cost to skip;
- a re-iterable object (an ``IterableDataset``, any object whose ``iter()``
  starts a new pass): streamed;
- a function taking no arguments that returns an iterable (a generator
  function that reads a file or URL; ``functools.partial`` binds its path):
  called for every pass, streamed.

A streamed shard is read forwards: the reader keeps the last few shards'
iterators open (``OPEN_STREAMS``), so a span that continues where the last
one stopped costs nothing extra; one that starts earlier reopens the shard
and skips (``itertools.islice``) to its offset.

Lengths: given (``lengths=``), or taken from ``len()`` of the indexable
shards and counted with one full pass over each streamed shard when
``Shards`` is built (in the process that builds it). A stream that ends
before its length, or yields more than it, raises ``ConfigError`` when it
is read (the reader of its last item reads one more): the epoch's
positions would no longer name the same items. A stream given length 0 has
no item to read, so ``Shards`` opens it when built and refuses it if it
yields one: its items would be left out of every epoch, unseen.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final

import numpy

from elche.core.config import NUMPY_PERMUTATION, RANDOM_SHUFFLE
from elche.core.dispatch import epoch_permutation
from elche.core.errors import ConfigError
from elche.core.shard_order import ShardOrder, shard_of, shard_starts
from elche.runtime.sending import SEND_ERRORS, to_ranks

__all__ = [
    "OPEN_STREAMS",
    "Shards",
    "check_dataset",
    "epoch_order",
    "numpy_permutation",
]

# Streamed shards whose iterators a reader keeps open: a rank reads its own
# reservation forwards, and now and then a stolen or re-issued span elsewhere.
OPEN_STREAMS = 4

_INDEXED: Final = "indexed"
_STREAM: Final = "stream"
_FACTORY: Final = "factory"
_END: Final = object()
_WORD: Final = 2**32 - 1  # numpy_permutation seeds RandomState with 32-bit words


class Shards:
    """A dataset of shards, each an iterable; see the module docstring.

    Args:
        shards: the shards, in order: indexable datasets, re-iterable
            objects, or functions returning an iterable.
        lengths: items per shard; default: ``len()`` of indexable shards,
            one counting pass over every other shard.

    Raises:
        ConfigError: ``shards`` is empty, a shard is a one-pass iterator, a
            path or not iterable, or ``lengths`` does not fit the shards.
    """

    def __init__(self, shards: Iterable[Any], *, lengths: Sequence[int] | None = None) -> None:
        if isinstance(shards, str | bytes | os.PathLike) or not isinstance(shards, Iterable):
            raise ConfigError("shards", f"must be a list of shards, got {shards!r}")
        self.shards: list[Any] = list(shards)
        if not self.shards:
            raise ConfigError("shards", "is empty: give at least one shard")
        self._kinds = [_kind(i, shard) for i, shard in enumerate(self.shards)]
        self.lengths = self._lengths(lengths)
        self._starts = shard_starts(self.lengths)
        self._total = sum(self.lengths)
        self._open: dict[int, tuple[Iterator[Any], int]] = {}  # shard -> (iterator, next item)
        self._pid = os.getpid()  # whose iterators ``_open`` holds (a fork starts afresh)

    def __len__(self) -> int:
        return self._total

    def __repr__(self) -> str:
        return f"Shards({len(self.shards)} shards, {len(self)} items)"

    def order(self, *, seed: int, epoch: int) -> ShardOrder:
        """Epoch ``epoch``'s order: shards shuffled by ``seed + epoch``, items in order."""
        return ShardOrder(self.lengths, seed=seed, epoch=epoch)

    def locate(self, index: int) -> tuple[int, int]:
        """``(shard, item)`` of ``index``."""
        return shard_of(index, self._starts, self.lengths)

    def __getitem__(self, index: int) -> Any:
        shard, item = self.locate(index)
        if self._kinds[shard] == _INDEXED:
            try:
                return self.shards[shard][item]
            except IndexError:
                raise _changed(shard, f"has no item {item}", self.lengths[shard]) from None
        return self._read(shard, item)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The items at ``indices`` (a batch), read in index order so that a
        batch in another order (a ``batch_sampler``'s) reads each stream once."""
        by_index = {index: self[index] for index in sorted(set(indices))}
        return [by_index[index] for index in indices]

    def check_sendable(self) -> None:
        """The streamed shards can be sent to rank processes (they are pickled).

        Raises:
            ConfigError: naming the first shard that cannot be pickled.
        """
        for i, (shard, kind) in enumerate(zip(self.shards, self._kinds, strict=True)):
            if kind == _INDEXED:
                continue
            try:
                to_ranks(shard)
            except SEND_ERRORS as exc:
                raise ConfigError(
                    "shards",
                    f"shard {i} ({shard!r}) cannot be sent to the rank processes ({exc}); "
                    "use a function defined with def at the top level of a module, or "
                    "functools.partial of one (not a lambda or a nested function)",
                ) from None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_open"] = {}  # open iterators stay in their process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()

    # -- reading -------------------------------------------------------------

    def _read(self, shard: int, item: int) -> Any:
        if self._pid != os.getpid():  # forked (a loader worker): the parent's are not ours
            self._open, self._pid = {}, os.getpid()
        length = self.lengths[shard]
        iterator, at = self._open.pop(shard, (None, 0))
        if iterator is None or at > item:
            _close(iterator)
            iterator, at = self._iterate(shard), 0
        skipped = sum(1 for _ in itertools.islice(iterator, item - at))
        value = next(iterator, _END) if skipped == item - at else _END
        if value is _END:
            raise _changed(shard, f"ended after {at + skipped} items", length)
        if item + 1 < length:
            self._open[shard] = (iterator, item + 1)
            while len(self._open) > OPEN_STREAMS:
                _close(self._open.pop(next(iter(self._open)))[0])
        else:
            extra = next(iterator, _END)
            _close(iterator)
            if extra is not _END:
                raise _changed(shard, f"yields at least {length + 1} items", length)
        return value

    def _iterate(self, shard: int) -> Iterator[Any]:
        source = self.shards[shard]
        if self._kinds[shard] == _FACTORY:
            source = source()
            if not isinstance(source, Iterable):
                raise ConfigError(
                    "shards", f"shard {shard}'s function returned {source!r}, not an iterable"
                )
        return iter(source)

    def _lengths(self, given: Sequence[int] | None) -> list[int]:
        if given is None:
            return [self._count(i) for i in range(len(self.shards))]
        lengths = list(given)
        if len(lengths) != len(self.shards) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths
        ):
            raise ConfigError(
                "lengths",
                f"must be one integer >= 0 per shard ({len(self.shards)}), got {list(given)}",
            )
        for i, n in enumerate(lengths):
            if self._kinds[i] == _INDEXED and len(self.shards[i]) != n:
                raise ConfigError(
                    "lengths", f"shard {i} has {len(self.shards[i])} items, lengths says {n}"
                )
            if self._kinds[i] != _INDEXED and n == 0 and not self._empty(i):
                raise ConfigError(
                    "lengths",
                    f"shard {i} yields items, lengths says 0: no rank would ever read them "
                    "(give its length, or leave lengths out to have it counted)",
                )
        return lengths

    def _empty(self, shard: int) -> bool:
        """Whether streamed ``shard`` yields nothing (one item read at most)."""
        iterator = self._iterate(shard)
        try:
            return next(iterator, _END) is _END
        finally:
            _close(iterator)

    def _count(self, shard: int) -> int:
        if self._kinds[shard] == _INDEXED:
            return len(self.shards[shard])
        iterator = self._iterate(shard)
        try:
            return sum(1 for _ in iterator)
        finally:
            _close(iterator)


def epoch_order(
    dataset: Any,
    *,
    seed: int,
    epoch: int,
    order: str = NUMPY_PERMUTATION,
    num_samples: int | None = None,
) -> Sequence[int]:
    """The dataset index at each position of ``epoch``.

    ``Shards``: its shards shuffled. Any other dataset: every item shuffled,
    as ``order`` says (``elche.core.config.ORDERS``): ``numpy-permutation``
    (``numpy_permutation``) or ``random-shuffle`` (``epoch_permutation``).

    Raises:
        ConfigError: ``dataset`` no longer has the run's ``num_samples`` items
            (``_check_length``), when given.
    """
    if num_samples is not None:
        _check_length(dataset, num_samples, epoch=epoch)
    if isinstance(dataset, Shards):
        return dataset.order(seed=seed, epoch=epoch)
    if order == RANDOM_SHUFFLE:
        return epoch_permutation(len(dataset), seed=seed, epoch=epoch)
    return numpy_permutation(len(dataset), seed=seed, epoch=epoch)


def numpy_permutation(num_samples: int, *, seed: int, epoch: int) -> list[int]:
    """``range(num_samples)`` permuted by NumPy's legacy ``RandomState``.

    Seeded with the 32-bit words of ``seed`` and ``epoch`` (a seed may take
    64 bits), so each ``(seed, epoch)`` has its own order. ``RandomState``'s
    stream is frozen by NumPy's compatibility policy: every rank, on any
    NumPy, draws the same order.
    """
    words = [seed & _WORD, seed >> 32 & _WORD, epoch & _WORD, epoch >> 32 & _WORD]
    order: list[int] = numpy.random.RandomState(words).permutation(num_samples).tolist()
    return order


def check_dataset(dataset: Any) -> None:
    """A stream without shards is refused before anything starts.

    Raises:
        ConfigError: ``dataset`` is a ``torch.utils.data.IterableDataset``.
    """
    if _is_iterable_dataset(dataset):
        raise ConfigError(
            "dataset",
            f"{type(dataset).__name__} is an IterableDataset: elche hands each rank positions "
            "of the epoch, and a single stream cannot be read at a position. Split it into "
            "shards and pass elche.Shards([...]) (each shard an iterable or a function "
            "returning one; see docs/training.md)",
        )


def _check_length(dataset: Any, num_samples: int, *, epoch: int) -> None:
    """``dataset`` still has the run's ``num_samples`` items as ``epoch``'s order is drawn.

    Each rank draws the order from its own ``len(dataset)``: one whose
    dataset has another length (it lists files still being written, or its
    length depends on the process) reads other samples at the positions it
    is handed, which the coordinator's exactly-once bookkeeping cannot see.

    Raises:
        ConfigError: ``len(dataset)`` is not ``num_samples``.
    """
    if len(dataset) != num_samples:
        raise ConfigError(
            "dataset",
            f"has {len(dataset)} items as epoch {epoch} starts on this rank, but the run "
            f"planned {num_samples} (its length when the run started): a dataset must keep "
            "its length, the same on every rank, while training",
        )


def _kind(i: int, shard: Any) -> str:
    """How shard ``i`` is read (the module docstring's three kinds).

    Raises:
        ConfigError: ``shard`` is a path, a one-pass iterator or not iterable.
    """
    if isinstance(shard, str | bytes | os.PathLike):
        raise ConfigError(
            "shards",
            f"shard {i} is the path {shard!r}; pass a function that opens it and yields its "
            "items, e.g. functools.partial(read_file, path)",
        )
    if isinstance(shard, Iterator):
        raise ConfigError(
            "shards",
            f"shard {i} is an iterator ({type(shard).__name__}), which can be read only once; "
            "pass the function that makes it (e.g. the generator function) instead",
        )
    sized = hasattr(shard, "__len__") and hasattr(shard, "__getitem__")
    if sized and not _is_iterable_dataset(shard):
        return _INDEXED
    if isinstance(shard, Iterable):
        return _STREAM
    if callable(shard):
        return _FACTORY
    raise ConfigError(
        "shards",
        f"shard {i} ({shard!r}) is not iterable; accepted: a dataset or list, an iterable, "
        "or a function returning an iterable",
    )


def _is_iterable_dataset(obj: Any) -> bool:
    data = sys.modules.get("torch.utils.data")  # only set if torch is in use
    return data is not None and isinstance(obj, data.IterableDataset)


def _changed(shard: int, what: str, length: int) -> ConfigError:
    return ConfigError(
        "dataset",
        f"shard {shard} {what}, but its length is {length}: a shard must yield its length's "
        "items, the same on every pass (check Shards' lengths=, and keep the shards fixed "
        "while training)",
    )


def _close(iterator: Iterator[Any] | None) -> None:
    close: Callable[[], object] | None = getattr(iterator, "close", None)
    if close is not None:
        close()
