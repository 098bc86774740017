"""The hand-off between a script's own loop and the rank's training thread.

Theory of operation. ``elche.Session`` runs the rank's training (the same
``elche.train`` a script calls) on a thread of its own, with
``Handoff.step_fn`` as its ``step_fn``. Each call hands its batch to the
script's loop (``next_batch``) and waits for the loss the loop computes from
it (``give_loss``); ``step_fn`` returns that loss, and the rank goes on as with
any ``step_fn``: the backward, clipping, the optimizer step, the reports, the
averages and the callbacks.

Exactly one side runs at a time. While the loop computes a loss the training
thread waits in ``step_fn``; while the rank steps, averages or runs a
callback, the loop waits in ``give_loss`` (``session.step``), which returns
once the rank asks for its next loss or the run has ended. So the model is
never touched from both threads at once.

Endings. The training thread ends with ``finish(result)`` or
``fail(error)``; the loop then sees ``StopIteration`` or that error from
``next_batch``. A loop that raises, or leaves before the run's end, calls
``abandon(error)``: the rank's next ``step_fn`` (the one waiting now, or the
next one) raises ``error`` as the user's own exception, and the rank reports
it like any failure in ``step_fn``. This module never imports torch.
"""

from __future__ import annotations

import queue
from typing import Any

__all__ = ["Handoff", "is_handoff"]


class Handoff:
    """One rendezvous between the loop (one thread) and the rank (another)."""

    def __init__(self) -> None:
        self._to_loop: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._to_rank: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._next: tuple[str, Any] | None = None  # what the loop got while it waited
        self.outstanding = False  # the loop holds a batch whose loss is not back
        self.ended: tuple[str, Any] | None = None  # ("result", value) or ("error", exc)

    # -- the training thread's side --------------------------------------------

    def step_fn(self, model: Any, batch: Any) -> Any:
        """``step_fn(model, batch)``: the loss the loop computes from ``batch``.

        Raises:
            Exception: the loop's own exception (``abandon``).
        """
        del model  # the loop computes with its own model, which is this one
        self._to_loop.put(("batch", batch))
        kind, value = self._to_rank.get()
        if kind == "abandoned":
            self._to_rank.put((kind, value))  # every later step_fn raises it too
            raise value
        return value

    def finish(self, result: Any) -> None:
        """The run ended and returned ``result``."""
        self._to_loop.put(("result", result))

    def fail(self, error: BaseException) -> None:
        """The run ended with ``error``."""
        self._to_loop.put(("error", error))

    # -- the loop's side -------------------------------------------------------

    def next_batch(self) -> Any:
        """The next batch to compute a loss from; waits while the rank works.

        Raises:
            StopIteration: the run has ended (``ended`` holds its result).
            RuntimeError: the last batch's loss was not given (``give_loss``).
            BaseException: the run's own error (``ended`` holds it).
        """
        if self.outstanding:
            raise RuntimeError("call session.step(loss) once for every batch, before the next")
        if self.ended is not None:
            raise StopIteration
        kind, value = self._next if self._next is not None else self._to_loop.get()
        self._next = None
        if kind == "batch":
            self.outstanding = True
            return value
        self.ended = (kind, value)
        if kind == "error":
            raise value
        raise StopIteration

    def give_loss(self, loss: Any) -> None:
        """Hand the batch's loss to the rank; returns once it asks again or has ended.

        Raises:
            RuntimeError: no batch is out.
        """
        if not self.outstanding:
            raise RuntimeError("session.step(loss) comes once after each batch the session gave")
        self.outstanding = False
        self._to_rank.put(("loss", loss))
        self._next = self._to_loop.get()

    def abandon(self, error: Exception) -> None:
        """The loop stops early with ``error``: the rank's next ``step_fn`` raises it."""
        self.outstanding = False
        self._to_rank.put(("abandoned", error))

    def wait_ended(self) -> tuple[str, Any]:
        """Wait for the run to end (after ``abandon``, or after the last batch)."""
        while self.ended is None:
            kind, value = self._next if self._next is not None else self._to_loop.get()
            self._next = None
            if kind != "batch":
                self.ended = (kind, value)
        return self.ended


def is_handoff(step_fn: Any) -> bool:
    """``step_fn`` hands its batches to a loop in this process (``elche.Session``)."""
    return isinstance(getattr(step_fn, "__self__", None), Handoff)
