"""The work book: who holds which samples, and which are safely averaged.

Theory of operation. Each epoch has a ``ChunkPool`` over its sample positions.
A rank receives chunks (spans of positions) and reports every batch it trains
(``BatchDone``). A trained batch is *uncommitted* until an averaging round
that includes it completes; only then is it *committed* to the pool. When a
rank dies, everything it held that is not committed, queued or already
trained, goes back to its pool and is re-issued to survivors. An epoch is
done when its pool has nothing left to hand out and nothing outstanding;
``finished_epochs`` then books it and drops its pool, keeping only the count
of its samples no average holds, so the book is bounded by the epochs open
at once (at most two), not by the epochs trained.

So "every sample trained exactly once per epoch" means: exactly once *into
the consensus model*. Work a dead rank did after the last average died with
it and is done again; nothing is counted twice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from elche.core.checkpoint import EpochCoverage
from elche.core.dispatch import ChunkPool, Span
from elche.core.errors import RemoteProtocolError

__all__ = ["Chunk", "WorkBook"]


@dataclass(slots=True)
class Chunk:
    """A span handed to a rank; ``cursor`` is the next position to train."""

    epoch: int
    offset: int
    size: int
    cursor: int

    @property
    def left(self) -> int:
        return self.offset + self.size - self.cursor


class WorkBook:
    """Per-epoch pools plus each rank's queue and uncommitted batches.

    Args:
        world_size: number of ranks.
        num_samples: samples per epoch.
        batch_size: samples per step.
        epochs: epochs planned.
    """

    def __init__(self, world_size: int, num_samples: int, batch_size: int, epochs: int) -> None:
        self.world_size = world_size
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.epochs = epochs
        self.pools: dict[int, ChunkPool] = {}  # open epochs only
        self._next_open = 0  # every epoch below it was opened (or resumed past)
        self._missing_finished = 0  # samples of finished epochs no average holds
        self._queue: list[deque[Chunk]] = [deque() for _ in range(world_size)]
        self._busy = [0] * world_size  # samples queued and not trained, per rank
        # (epoch, samples) of each trained batch not yet in a completed average.
        self._uncommitted: list[deque[tuple[int, int]]] = [deque() for _ in range(world_size)]
        self.steps_trained = [0] * world_size
        self.steps_synced = [0] * world_size
        self.samples_committed = [0] * world_size

    # -- epochs ------------------------------------------------------------

    def open_epoch(self, epoch: int, weights: Sequence[float]) -> ChunkPool:
        """Create the pool of ``epoch``, reserving spans in proportion to ``weights``."""
        pool = ChunkPool.by_weights(self.num_samples, weights, batch_size=self.batch_size)
        self.pools[epoch] = pool
        self._next_open = max(self._next_open, epoch + 1)
        return pool

    def resume(self, first_open: int, coverage: Sequence[EpochCoverage]) -> None:
        """Continue from a checkpoint: epochs before ``first_open`` are done.

        Each started epoch of ``coverage`` within the plan is recreated with
        only its holes left to serve; one past the plan is not resumed.
        """
        self._next_open = max(self._next_open, first_open)
        for started in coverage:
            if started.epoch >= self.epochs:
                continue
            self.pools[started.epoch] = ChunkPool.from_uncovered(
                started.total_samples,
                list(started.uncovered),
                batch_size=self.batch_size,
                num_ranks=self.world_size,
            )
            self._next_open = max(self._next_open, started.epoch + 1)

    def finished_epochs(self) -> list[int]:
        """Epochs whose pool just became done, in ascending order; their pools go."""
        newly = self.finishing_epochs()
        for epoch in newly:
            pool = self.pools.pop(epoch)
            self._missing_finished += pool.total - pool.committed()
        return newly

    def finishing_epochs(self) -> list[int]:
        """Open epochs whose pool is done but not yet booked by ``finished_epochs``."""
        return [e for e in self.open_epochs() if self.pools[e].is_done()]

    def samples_missing(self, before_epoch: int) -> int:
        """Samples of the epochs before ``before_epoch`` that no completed average holds.

        Every finished epoch counts (each is before the epochs completed).
        """
        open_missing = sum(
            p.total - p.committed() for e, p in self.pools.items() if e < before_epoch
        )
        return self._missing_finished + open_missing

    def samples_averaged(self) -> int:
        """Samples of the plan that are behind the run: every finished (or resumed
        past) epoch in full, and what the open epochs' averages hold."""
        finished = sum(1 for epoch in range(self._next_open) if epoch not in self.pools)
        return finished * self.num_samples + sum(p.committed() for p in self.pools.values())

    def samples_reported(self) -> int:
        """What ``samples_averaged`` will be once every batch reported so far is averaged."""
        return self.samples_averaged() + sum(
            size for pending in self._uncommitted for _, size in pending
        )

    def trained_epochs(self) -> list[int]:
        """Open epochs every sample of which is trained: an average of every batch
        reported so far would end them."""
        reported: dict[int, int] = {}
        for pending in self._uncommitted:
            for epoch, size in pending:
                reported[epoch] = reported.get(epoch, 0) + size
        return [
            e for e, pool in sorted(self.pools.items())
            if pool.committed() + reported.get(e, 0) >= pool.total
        ]  # fmt: skip

    def open_epochs(self) -> list[int]:
        """Epochs opened and not finished, in ascending order."""
        return sorted(self.pools)

    def coverage(self) -> tuple[EpochCoverage, ...]:
        """Uncovered spans of every started, unfinished epoch."""
        return tuple(
            EpochCoverage(
                epoch=e, total_samples=self.num_samples, uncovered=tuple(self.pools[e].uncovered())
            )
            for e in self.open_epochs()
        )

    # -- ranks -------------------------------------------------------------

    def assign(self, rank: int, epoch: int, span: Span) -> Chunk:
        chunk = Chunk(epoch=epoch, offset=span[0], size=span[1], cursor=span[0])
        self._queue[rank].append(chunk)
        self._busy[rank] += span[1]
        return chunk

    def busy_samples(self, rank: int) -> int:
        """Samples queued on ``rank`` and not trained yet."""
        return self._busy[rank]

    def steps_since_sync(self, rank: int) -> int:
        return self.steps_trained[rank] - self.steps_synced[rank]

    def record_batch(self, rank: int, epoch: int, offset: int, size: int) -> None:
        """Book one trained batch; it must continue the rank's front chunk.

        Raises:
            RemoteProtocolError: the batch is not the next one the rank holds.
        """
        queue = self._queue[rank]
        if not queue:
            raise RemoteProtocolError("reported a batch but holds no work", rank=rank)
        chunk = queue[0]
        if epoch != chunk.epoch or offset != chunk.cursor or not 0 < size <= chunk.left:
            raise RemoteProtocolError(
                f"reported batch (epoch {epoch}, offset {offset}, size {size}) but its next "
                f"work is epoch {chunk.epoch} offset {chunk.cursor} ({chunk.left} left)",
                rank=rank,
            )
        chunk.cursor += size
        self._busy[rank] -= size
        if chunk.left == 0:
            queue.popleft()
        self._uncommitted[rank].append((epoch, size))
        self.steps_trained[rank] += 1

    def claim(self, rank: int, epoch: int, offset: int, size: int) -> None:
        """Book a batch ``rank`` trained before this book existed as trained by it
        and uncommitted (a rank rejoining a restarted coordinator).

        Raises:
            RemoteProtocolError: no average holds the batch, but it is not free.
        """
        pool = self.pools.get(epoch)
        if pool is None or not pool.claim(rank, (offset, size)):
            raise RemoteProtocolError(
                f"holds batch (epoch {epoch}, offset {offset}, size {size}) that is "
                "averaged already or not of an open epoch",
                rank=rank,
            )
        self._queue[rank].appendleft(Chunk(epoch=epoch, offset=offset, size=size, cursor=offset))
        self._busy[rank] += size
        self.record_batch(rank, epoch, offset, size)

    def commit(self, rank: int, steps: int) -> int:
        """The first ``steps`` uncommitted batches of ``rank`` are in the consensus.

        Returns:
            The number of steps actually committed (clamped to what is held).
        """
        pending = self._uncommitted[rank]
        steps = max(0, min(steps, len(pending)))
        per_epoch: dict[int, int] = {}
        for _ in range(steps):
            epoch, size = pending.popleft()
            per_epoch[epoch] = per_epoch.get(epoch, 0) + size
        for epoch, samples in per_epoch.items():
            pool = self.pools.get(epoch)
            if pool is not None:
                self.samples_committed[rank] += pool.commit(rank, samples)
        self.steps_synced[rank] += steps
        return steps

    def forfeit(self, rank: int) -> int:
        """``rank`` is gone: everything it held but never committed is re-issued.

        Returns:
            Samples handed back to the pools.
        """
        self._queue[rank].clear()
        self._busy[rank] = 0
        self._uncommitted[rank].clear()
        self.steps_synced[rank] = self.steps_trained[rank]
        return sum(pool.forfeit(rank) for pool in self.pools.values())

    # -- serving -----------------------------------------------------------

    def serving_epoch(self) -> int | None:
        """The epoch new work comes from: the lowest open epoch with work left."""
        for epoch in self.open_epochs():
            if self.pools[epoch].remaining() > 0:
                return epoch
        return None

    def all_done(self) -> bool:
        """Every planned epoch is open and done: nothing is left to train."""
        return self.next_epoch_to_open() is None and all(
            pool.is_done() for pool in self.pools.values()
        )

    def next_epoch_to_open(self) -> int | None:
        return self._next_open if self._next_open < self.epochs else None
