"""A rank's batches: the sample positions elche assigns, loaded like a DataLoader.

Theory of operation. A step trains positions ``[offset, offset + size)`` of
an epoch's seeded permutation; they map to dataset indices, which
``batch_sampler`` (default: consecutive slices of ``batch_size``) splits into
the step's micro-batches. ``batch_sampler(indices)`` must use every index of
the step exactly once, so the coverage bookkeeping stays exact; e.g. it may
group items of similar length.

Without ``num_workers`` and ``pin_memory`` a micro-batch is fetched in the
training thread (``elche.runtime.data.fetch``, with its fast paths). With
them, one ``torch.utils.data.DataLoader`` (persistent workers, pinned memory
as asked) loads a *stream*: the micro-batches of every step the rank holds
queued, in training order, prefetched by its workers while the rank trains
and while it waits for an average. A step that is not the stream's next
(new work arrived after the stream was planned) starts a new stream.

``drop_last``: a step shorter than ``batch_size × accumulate`` (an epoch's
tail, or a short re-issued span) trains nothing; its samples are counted as
covered, as ``DataLoader(drop_last=True)`` leaves an epoch's last batch out.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

from elche.runtime.data import fetch, to_device
from elche.runtime.options import TrainOptions
from elche.runtime.stepping import MicroBatch

__all__ = ["Loader", "StepPlan"]

StepPlan = tuple[int, int, int]  # (epoch, offset, size) of one optimizer step


class _Feed:
    """The DataLoader's batch sampler: the current stream's micro-batch index lists."""

    def __init__(self) -> None:
        self.lists: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.lists)

    def __len__(self) -> int:
        return len(self.lists)


class Loader:
    """Loads the micro-batches of a rank's steps (see the module docstring).

    Args:
        dataset: the map-style dataset.
        options: the loader options (``collate_fn``, workers, ...).
        micro_size: samples per micro-batch (``batch_size``).
        step_size: samples per optimizer step (``batch_size × accumulate``).
        perm: ``perm(epoch)`` -> dataset index at each position of the epoch.
        device: where the batches go.
    """

    def __init__(
        self,
        dataset: Any,
        options: TrainOptions,
        *,
        micro_size: int,
        step_size: int,
        perm: Callable[[int], Sequence[int]],
        device: torch.device,
    ) -> None:
        self.dataset = dataset
        self.options = options
        self.micro_size = micro_size
        self.step_size = step_size
        self.perm = perm
        self.device = device
        self.num_dropped = 0  # samples drop_last left out
        self._feed = _Feed()
        self._loader: DataLoader[Any] | None = None
        self._stream: Iterator[Any] | None = None
        self._expect: deque[tuple[StepPlan, list[int]]] = deque()  # (step, micro sizes)

    def drops(self, size: int) -> bool:
        """``drop_last`` leaves a step of ``size`` samples out."""
        return self.options.drop_last and size < self.step_size

    def split(self, indices: list[int]) -> list[list[int]]:
        """The micro-batches of one step's dataset ``indices``.

        Raises:
            ValueError: ``batch_sampler`` did not use every index exactly once.
        """
        sampler = self.options.batch_sampler
        if sampler is None:
            size = self.micro_size
            return [indices[i : i + size] for i in range(0, len(indices), size)]
        parts = [list(part) for part in sampler(list(indices))]
        if sorted(i for part in parts for i in part) != sorted(indices) or not all(parts):
            raise ValueError(
                "batch_sampler must split the step's indices into non-empty batches that "
                f"use each index exactly once; got {parts} for {indices}"
            )
        return parts

    def step(
        self, epoch: int, offset: int, size: int, upcoming: Callable[[], list[StepPlan]]
    ) -> list[MicroBatch]:
        """The micro-batches of step ``(epoch, offset, size)`` on the device.

        ``upcoming()`` lists the steps from this one on, in training order
        (called only when a new stream starts). Empty: ``drop_last`` drops it.
        """
        if self.drops(size):
            self.num_dropped += size
            return []
        if not self.options.uses_loader:
            return self.direct(epoch, offset, size)
        if not self._expect or self._expect[0][0] != (epoch, offset, size):
            self._restart(upcoming())
        _, sizes = self._expect.popleft()
        assert self._stream is not None  # _restart opened it with this step first
        return [MicroBatch(to_device(next(self._stream), self.device), n) for n in sizes]

    def direct(self, epoch: int, offset: int, size: int) -> list[MicroBatch]:
        """The step's micro-batches, fetched here and now (no workers)."""
        indices = [self.perm(epoch)[p] for p in range(offset, offset + size)]
        collate = self.options.collate_fn
        return [
            MicroBatch(to_device(fetch(self.dataset, part, collate), self.device), len(part))
            for part in self.split(indices)
        ]

    def _restart(self, steps: list[StepPlan]) -> None:
        lists: list[list[int]] = []
        self._expect.clear()
        for epoch, offset, size in steps:
            if self.drops(size):
                continue
            perm = self.perm(epoch)
            parts = self.split([perm[p] for p in range(offset, offset + size)])
            lists += parts
            self._expect.append(((epoch, offset, size), [len(part) for part in parts]))
        self._feed.lists = lists
        if self._loader is None:
            workers = self.options.num_workers
            self._loader = DataLoader(
                self.dataset, batch_sampler=self._feed,
                collate_fn=self.options.collate_fn or default_collate, num_workers=workers,
                pin_memory=self.options.pin_memory, persistent_workers=workers > 0,
                multiprocessing_context=_worker_context() if workers > 0 else None,
            )  # fmt: skip
        self._stream = iter(self._loader)

    def close(self) -> None:
        """Stop the loader's workers."""
        self._stream = None
        self._loader = None
        self._expect.clear()


def _worker_context() -> multiprocessing.context.BaseContext | None:
    """Loader workers fork from the rank, as ``DataLoader`` does by default on Linux.

    A rank itself may come from a fork server, whose context would pickle the
    dataset to every worker (each tensor in it as a file descriptor).
    """
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return None
