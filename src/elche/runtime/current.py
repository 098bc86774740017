"""``elche.progress()``: the run's global progress, inside the user's functions.

The rank's training loop (and the single-rank path) installs its progress
tracker here while it trains; ``progress()`` reads it from ``step_fn``,
``epoch_fn``, ``eval_fn``, ``lr_schedule`` or ``collate_fn``. This module
never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from elche.core.progress import Progress

__all__ = ["progress", "providing"]

_SOURCES: list[Callable[[], Progress]] = []  # innermost last


def progress() -> Progress:
    """The run's global progress now, the same units on every rank.

    ``samples`` (trained cluster-wide into the consensus), ``step`` (optimizer
    steps at the reference batch ``batch_size × accumulate``) and
    ``fraction`` (of ``epochs × len(dataset)``): exact at every average, and
    estimated between averages from the ranks' measured speeds.

    Raises:
        RuntimeError: called outside a training run's user functions.
    """
    if not _SOURCES:
        raise RuntimeError(
            "elche.progress() is only known inside a run: call it from step_fn, "
            "epoch_fn, eval_fn, lr_schedule or a hook elche.train runs"
        )
    return _SOURCES[-1]()


@contextmanager
def providing(source: Callable[[], Progress]) -> Iterator[None]:
    """``progress()`` answers from ``source`` inside the block."""
    _SOURCES.append(source)
    try:
        yield
    finally:
        _SOURCES.pop()
