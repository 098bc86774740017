"""``elche.Session``: elche's training for a script that owns its loop.

Theory of operation. A ``Session`` is ``elche.train`` with the loop turned
inside out: ``__enter__`` starts ``train`` on a thread of its own, with the
session's model and optimizer as what ``model_fn`` and ``optimizer_fn``
return and a ``step_fn`` that hands each batch to the script's loop and waits
for its loss (``elche.runtime.handoff``). So there is one implementation: the
rank protocol, the balancer's assignments, the loader, the stepper
(accumulation, precision, ``lr_schedule``, clipping), the averages, the
callbacks, the faults, saving and resuming are ``train``'s own, and every
keyword of ``train`` means the same here.

One process is one rank: under ``elche run``, ``torchrun`` or ``elche join``
(``RANK`` and ``WORLD_SIZE`` set) this process trains its rank; without a
launcher it trains a run of one rank. A local multi-rank run (``ranks=``,
``speeds=`` or ``devices=`` for several ranks without a launcher) needs
``model_fn`` in each rank process and is ``elche.train``'s alone: a
``ConfigError`` says so.

The loop and the rank never run at once: ``session.step(loss)`` returns once
the rank has stepped (and averaged, and run any callback) and wants the next
loss. Under ``precision="bf16"``/``"fp16"`` the session enters
``torch.autocast`` in the loop's thread from each batch to its ``step``
(autocast is per thread, and the forward runs in the loop).
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Literal

from elche.core.errors import ConfigError
from elche.runtime.handoff import Handoff
from elche.runtime.lifetimes import relay_stop_signals
from elche.runtime.plan import TrainResult

__all__ = ["Session"]

# ``train``'s keywords that a session sets itself (its model, optimizer and loop).
OWN_KEYWORDS = frozenset({"model_fn", "optimizer_fn", "step_fn", "dataset"})


class Session:
    """Train this process's rank from the script's own loop; see the module docstring.

    Args:
        model: the rank's model (built the same on every rank: seed before).
        optimizer: its optimizer.
        dataset: a map-style dataset or an ``elche.Shards``, as for ``elche.train``.
        batch_size: samples per micro-batch (per rank), as for ``elche.train``.
        epochs: passes over the dataset.
        **options: any other keyword of ``elche.train`` (``mode``,
            ``max_grad_norm``, ``lr_schedule``, ``accumulate``,
            ``collate_fn``, ``eval_fn``, ``save_path``, ``faults``, ...).

    Raises:
        ConfigError: a keyword ``elche.train`` does not take, or several
            ranks asked for without a launcher. ``train``'s own checks raise
            from the loop's first batch.
    """

    def __init__(
        self, model: Any, optimizer: Any, dataset: Any, *, batch_size: int, epochs: int,
        **options: Any,
    ) -> None:  # fmt: skip
        _check_options(options)
        self.model = model
        self.optimizer = optimizer
        self._train_args = (dataset, batch_size, epochs, options)
        self._precision = options.get("precision", "fp32")
        self._handoff = Handoff()
        self._thread: threading.Thread | None = None
        self._autocast: Any = None  # the loop's torch.autocast, from a batch to its step
        self._result: TrainResult | None = None
        self._relay: Any = None  # the main thread's stop signals, for the rank

    @property
    def result(self) -> TrainResult:
        """The run's ``TrainResult``, once the ``with`` block ended it.

        Raises:
            RuntimeError: the run has not ended, or ended with an error.
        """
        if self._result is None:
            raise RuntimeError("session.result is known once the run completed (after `with`)")
        return self._result

    def __enter__(self) -> Session:
        if self._thread is not None:
            raise RuntimeError("a Session trains once; make a new one for another run")
        # The rank (launched, or a run of one) stops on SIGINT/SIGTERM/SIGHUP as elche.train does.
        self._relay = relay_stop_signals()
        self._relay.__enter__()
        self._thread = threading.Thread(target=self._train, name="elche-session", daemon=True)
        self._thread.start()
        return self

    def __iter__(self) -> Iterator[Any]:
        if self._thread is None:
            raise RuntimeError("iterate a Session inside `with elche.Session(...) as session:`")
        return self

    def __next__(self) -> Any:
        batch = self._handoff.next_batch()  # StopIteration at the run's end
        self._enter_autocast()
        return batch

    def step(self, loss: Any) -> None:
        """Backward ``loss``, clip, step; averages when the window closes.

        Returns once the rank wants the next batch's loss (or the run ended).

        Raises:
            RuntimeError: no batch is out (``step`` twice, or before the loop).
        """
        self._leave_autocast()
        self._handoff.give_loss(loss)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        try:
            return self._end(exc)
        finally:
            if self._relay is not None:
                relay, self._relay = self._relay, None
                relay.__exit__(None, None, None)

    def _end(self, exc: BaseException | None) -> Literal[False]:
        self._leave_autocast()
        handoff = self._handoff
        if handoff.ended is not None and handoff.ended[1] is exc:
            return False  # the run's own error, raised from the loop: as it is
        if handoff.ended is None:
            handoff.abandon(_loop_error(exc))
        kind, value = handoff.wait_ended()
        if kind == "result":
            self._result = value
            return False  # the loop's own error (after the run's end), if any, goes on
        if exc is not None and not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: stop as asked, the run ended
        raise value from exc

    # -- the training thread -------------------------------------------------------

    def _train(self) -> None:
        from elche.api import train

        dataset, batch_size, epochs, options = self._train_args
        try:
            result = train(
                self._model_fn, self._optimizer_fn, self._handoff.step_fn, dataset,
                batch_size=batch_size, epochs=epochs, **options,
            )  # fmt: skip
        except BaseException as exc:  # the loop raises it from its next batch
            self._handoff.fail(exc)
        else:
            self._handoff.finish(result)

    def _model_fn(self, device: Any) -> Any:
        return self.model.to(device)

    def _optimizer_fn(self, params: Any) -> Any:
        del params  # the session's optimizer holds them already
        return self.optimizer

    # -- autocast in the loop's thread -------------------------------------------

    def _enter_autocast(self) -> None:
        if self._precision not in ("bf16", "fp16"):
            return
        import torch

        dtype = torch.bfloat16 if self._precision == "bf16" else torch.float16
        device_type = next(self.model.parameters()).device.type
        self._autocast = torch.autocast(device_type=device_type, dtype=dtype)
        self._autocast.__enter__()

    def _leave_autocast(self) -> None:
        if self._autocast is not None:
            autocast, self._autocast = self._autocast, None
            autocast.__exit__(None, None, None)


def _loop_error(exc: BaseException | None) -> Exception:
    """What the rank reports for a loop that ended before the run did."""
    if exc is None:
        return RuntimeError(
            "the loop left the session before the run's last batch (a break, or no loop): "
            "every batch the session gives must be trained to the end"
        )
    if isinstance(exc, Exception):
        return exc
    return RuntimeError(f"the loop was stopped by {type(exc).__name__}")


def _check_options(options: dict[str, Any]) -> None:
    """Every keyword is one of ``elche.train``'s, and not one the session sets."""
    from elche.api import train

    accepted = set(inspect.signature(train).parameters) - OWN_KEYWORDS - {"batch_size", "epochs"}
    for name in options:
        if name not in accepted:
            raise ConfigError(
                name,
                "is not a keyword of elche.Session; accepted: model, optimizer, dataset, "
                f"batch_size, epochs and elche.train's {', '.join(sorted(accepted))}",
            )
    _check_one_rank(options)


def _launched() -> bool:
    """Whether a launcher started this process as one rank (``elche run``, ``torchrun``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _check_one_rank(options: dict[str, Any]) -> None:
    """Without a launcher a session trains one rank (``train`` checks the rest)."""
    if _launched():
        return
    sizes = {
        "ranks": options.get("ranks"),
        "speeds": _len(options.get("speeds")),
        "devices": _len(options.get("devices")),
    }
    for name, size in sizes.items():
        if isinstance(size, int) and size > 1:
            raise ConfigError(
                name,
                f"asks for {size} ranks; a Session trains one rank per process: start the "
                "script under `elche run --nproc N` or `torchrun --nproc-per-node N` "
                "(accepted without a launcher: one rank)",
            )


def _len(value: Any) -> int | None:
    try:
        return len(value)
    except TypeError:
        return None
