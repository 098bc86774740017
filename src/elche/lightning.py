"""``elche.lightning.ElcheStrategy``: a Lightning ``Trainer`` that trains one elche rank.

Theory of operation. ``Trainer(strategy="elche")`` (``import elche.lightning``
registers the name) or ``Trainer(strategy=ElcheStrategy(**options))`` trains
this process's rank of an elche run, as ``elche.Session`` does for a
script's own loop, and on top of it: one implementation. Each process is one
rank (``elche run``, ``torchrun`` or ``elche join`` start them); Lightning's own
loop runs the ``LightningModule``'s ``training_step`` and elche decides the
rest:

- **Which samples.** The train dataloader's dataset, batch size,
  ``collate_fn``, ``num_workers``, ``pin_memory`` and ``drop_last`` go to the
  session; elche's balancer hands this rank its samples in proportion to its
  speed, in place of a ``DistributedSampler``. The loader Lightning iterates
  yields placeholders, and ``batch_to_device`` swaps each for the batch the
  rank wants trained next: Lightning's fetcher reads one batch ahead, and a
  rank names its next batch only once the last one is stepped.
- **Epochs.** ``max_epochs`` are the run's epochs; a Lightning epoch ends
  where this rank's share of an elche epoch ends (elche's ``epoch_fn`` marks
  it), so epoch numbers agree with elche's everywhere.
- **Steps.** ``backward`` hands the loss to the rank, which does the
  backward, ``gradient_clip_val`` as ``max_grad_norm``, the optimizer step,
  ``lr_schedule`` and the averages; Lightning's own ``optimizer.step`` is not
  called again.
- **Results.** ``strategy.result`` is the rank's ``TrainResult`` after
  ``fit`` (the same ``summary`` on every rank). Only rank 0 is Lightning's
  global zero (loggers, checkpoints); ``barrier``/``reduce`` are this
  process's own (elche's ranks run at their own pace, never in lock-step).

Not carried over: ``accumulate_grad_batches`` (use elche's ``accumulate=``),
``16-mixed`` precision (use ``bf16-mixed``), manual optimization, several
optimizers, ``max_steps``, and what trains fewer batches than the rank is
handed (``limit_train_batches``, ``overfit_batches``, ``fast_dev_run``); each
raises a ``ConfigError`` naming it. A ``training_step`` that returns None
(Lightning's skip) raises a ``TypeError`` naming it: every batch is trained.
A run stopped by a signal raises ``Stopped`` (a ``SystemExit`` with the
signal's status, the run's ``Interrupted`` in it) out of ``fit``: Lightning
would take an ``Interrupted`` for its own Ctrl-C and exit 1.
Lightning validates at epoch ends it knows of in advance, which elche's
dynamic shares do not give: use ``val_check_interval=N`` (batches) or
elche's ``eval_fn``, which evaluates the consensus model.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, default_collate

from elche.core.errors import ConfigError
from elche.runtime.lifetimes import Interrupted
from elche.runtime.plan import TrainResult
from elche.session import Session

__all__ = ["ElcheStrategy", "Stopped"]

ACCEPTED_PRECISION = ("32-true", "bf16-mixed")


class ElcheStrategy(SingleDeviceStrategy):
    """Train this process's elche rank from a Lightning ``Trainer``; see the module docstring.

    Args:
        **options: keywords of ``elche.train`` (``mode``, ``speeds``,
            ``lr_schedule``, ``accumulate``, ``eval_fn``, ``save_path``, ...);
            the model, optimizer, dataset, batch size and epochs come from the
            ``Trainer`` and its ``LightningModule``.
    """

    strategy_name = "elche"

    def __init__(self, **options: Any) -> None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        super().__init__(device=device)
        self.global_rank = int(os.environ.get("RANK", "0"))
        self.local_rank = local_rank
        # One for Lightning: it would broadcast over elche's process group
        # every batch, and elche's ranks never step in lock-step.
        self.world_size = 1
        self._options = options
        self._session: Session | None = None
        self._feed: _Feed | None = None
        self._error: BaseException | None = None
        self.result: TrainResult | None = None

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def barrier(self, name: str | None = None) -> None:
        del name  # the ranks never wait for each other in lock-step

    @property
    def _trainer(self) -> pl.Trainer:
        module = self.lightning_module
        assert module is not None  # Lightning connects the module before its loops
        return module.trainer

    # -- data: the rank's own batches ---------------------------------------------

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self._trainer
        if trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise ConfigError(
                "train_dataloader", "must return a torch DataLoader (elche reads its dataset)"
            )
        if self._session is None:
            self._start(trainer, dataloader)
        assert self._feed is not None
        return self._feed

    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any:
        if isinstance(batch, _Placeholder):
            assert self._feed is not None
            with _stopped_out_of_fit():
                batch = self._feed.take(self._trainer)
        return super().batch_to_device(batch, device, dataloader_idx)

    # -- steps: the rank's own backward and optimizer step --------------------------

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        del optimizer, args, kwargs
        assert self._session is not None
        with _stopped_out_of_fit():
            self._session.step(closure_loss)  # backward, clip, step, averages
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        del optimizer, model, kwargs
        loss = closure()  # the forward and `backward` above, which stepped already
        if loss is None:  # Lightning ran no backward: the rank's batch is not stepped
            raise TypeError(
                "training_step returned None (Lightning's way to skip a batch); under "
                "strategy='elche' every batch the rank is handed is trained: return its loss"
            )
        return loss

    # -- endings -----------------------------------------------------------------

    def on_exception(self, exception: BaseException) -> None:
        self._error = exception.interrupted if isinstance(exception, Stopped) else exception

    def teardown(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            error = self._error
            session.__exit__(type(error) if error else None, error, None)
            if error is None:
                self.result = session.result
        super().teardown()

    # -- starting the rank ---------------------------------------------------------

    def _start(self, trainer: pl.Trainer, loader: DataLoader[Any]) -> None:
        options = dict(self._options)
        _check_trainer(trainer, self.optimizers, options)
        if trainer.gradient_clip_val:
            options.setdefault("max_grad_norm", float(trainer.gradient_clip_val))
        for name in ("num_workers", "pin_memory", "drop_last"):
            if getattr(loader, name):
                options.setdefault(name, getattr(loader, name))
        if loader.collate_fn is not default_collate:
            options.setdefault("collate_fn", loader.collate_fn)
        self._feed = _Feed(options.pop("epoch_fn", None))
        options["epoch_fn"] = self._feed.epoch_started
        options.setdefault("progress", False)  # Lightning draws its own bar
        if loader.batch_size is None:
            raise ConfigError("train_dataloader", "needs a batch_size (elche batches itself)")
        self._session = Session(
            self.lightning_module, self.optimizers[0], loader.dataset,
            batch_size=loader.batch_size, epochs=trainer.max_epochs or 0, **options,
        )  # fmt: skip
        self._feed.session = iter(self._session.__enter__())


def _check_trainer(trainer: pl.Trainer, optimizers: list[Any], options: dict[str, Any]) -> None:
    """Refuse what the strategy cannot honour, naming the setting."""
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise ConfigError("automatic_optimization", "must be True under strategy='elche'")
    if len(optimizers) != 1:
        raise ConfigError("configure_optimizers", "must return one optimizer under 'elche'")
    if trainer.accumulate_grad_batches != 1:
        raise ConfigError("accumulate_grad_batches", "must be 1; use ElcheStrategy(accumulate=K)")
    if trainer.precision not in ACCEPTED_PRECISION:
        raise ConfigError(
            "precision", f"is {trainer.precision!r}; accepted under 'elche': {ACCEPTED_PRECISION}"
        )
    _check_batches(trainer)
    if not trainer.max_epochs or trainer.max_epochs < 1 or trainer.max_steps != -1:
        raise ConfigError(
            "max_epochs", "must be set (≥ 1) and max_steps left unset: elche plans by epochs"
        )
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "norm":
        raise ConfigError("gradient_clip_algorithm", "accepted under 'elche': 'norm'")
    if "precision" in options:
        raise ConfigError("precision", "set it on the Trainer ('bf16-mixed'), not the strategy")


def _check_batches(trainer: pl.Trainer) -> None:
    """Refuse the settings that train fewer batches than elche hands the rank: each would
    leave the run before its last batch (an error, as leaving a ``Session``'s loop is).

    ``fast_dev_run`` and ``overfit_batches`` set ``limit_train_batches`` (and
    ``max_steps``) themselves, so they are named first.
    """
    # Set by the Trainer's constructor, not declared on its class: read with getattr.
    if getattr(trainer, "fast_dev_run", False):
        raise ConfigError(
            "fast_dev_run", "is not supported under 'elche' (it trains a few batches)"
        )
    if getattr(trainer, "overfit_batches", 0):
        raise ConfigError("overfit_batches", "is not supported under 'elche' (elche picks batches)")
    limit = trainer.limit_train_batches
    if not (isinstance(limit, float) and limit == 1.0):  # an int 1 is one batch an epoch
        raise ConfigError(
            "limit_train_batches",
            f"is {limit!r}; under 'elche' every epoch trains every sample (leave it unset)",
        )


class Stopped(SystemExit):
    """The run stopped on a signal (Ctrl-C, SIGTERM): ``elche.Interrupted``, out of
    ``Trainer.fit`` as a ``SystemExit`` with its exit status (130, 143, 129).

    Lightning takes any ``KeyboardInterrupt`` in ``fit`` for a Ctrl-C of its own:
    it ends the process with status 1, and every rank of a stopped run exited 1, as
    if it had failed. Uncaught, this ends it quietly with the signal's status.

    Attributes:
        interrupted: the run's ``Interrupted`` (its ``bundle``, its ``result``).
    """

    def __init__(self, interrupted: Interrupted) -> None:
        super().__init__(interrupted.code)
        self.interrupted = interrupted


@contextlib.contextmanager
def _stopped_out_of_fit() -> Iterator[None]:
    """Raise the run's ``Interrupted`` as ``Stopped``, which Lightning lets through."""
    try:
        yield
    except Interrupted as stop:
        raise Stopped(stop) from None


class _Placeholder:
    """What Lightning's loader yields; ``batch_to_device`` swaps in the rank's batch."""


class _Feed:
    """The loader Lightning iterates, one Lightning epoch per elche epoch of this rank."""

    def __init__(self, epoch_fn: Any) -> None:
        self.session: Any = None  # the session's batch iterator, once it started
        self._user_epoch_fn = epoch_fn
        self._epoch = 0  # elche's epoch of the batches the rank hands out now
        self._held: tuple[Any, int] | None = None  # a batch out, with its epoch
        self._ended = False

    def __iter__(self) -> _Feed:
        return self

    def __next__(self) -> _Placeholder:
        return _Placeholder()

    def epoch_started(self, epoch: int, model: Any, optimizer: Any) -> None:
        """elche's ``epoch_fn``: the rank's next batch is ``epoch``'s."""
        self._epoch = epoch
        if self._user_epoch_fn is not None:
            self._user_epoch_fn(epoch, model, optimizer)

    def take(self, trainer: pl.Trainer) -> Any:
        """The rank's next batch of Lightning's current epoch.

        Raises:
            StopIteration: this rank's share of the epoch is done (Lightning
                ends its epoch; the batch that showed it is kept for the
                next), or the run ended (Lightning stops).
        """
        if self._held is None and not self._ended:
            try:
                self._held = (next(self.session), self._epoch)  # epoch_fn ran before it
            except StopIteration:
                self._ended = True
        if self._held is not None and self._held[1] <= trainer.current_epoch:
            batch, self._held = self._held[0], None
            return batch
        if self._ended:
            trainer.should_stop = True
        raise StopIteration


def _register() -> None:
    if "elche" not in StrategyRegistry:
        StrategyRegistry.register(
            "elche", ElcheStrategy, description="elche: one rank of a heterogeneous run"
        )


_register()
