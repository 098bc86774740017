"""Small, offline training workloads for elche's demo, tests and benchmarks.

A workload is a module of plain top-level functions (picklable for the
``spawn`` start method), so every system under comparison — elche's modes and
the torch DDP baseline — trains exactly the same model on exactly the same
data. Each module provides:

- ``load_split(seed)`` → ``(train, test)`` ``TensorDataset``\\ s, deterministic
  per seed;
- ``make_model(device)`` → the model, with identical initial weights on every
  rank (the global RNG is forked, never shifted);
- ``make_optimizer(params)`` → the optimizer;
- ``step_fn(model, batch)`` → the loss to backpropagate;
- ``eval_fn(model, dataset)`` → the score named by the module's ``METRIC``
  (``HIGHER_IS_BETTER`` says which way is good).

The registry (``get(name)``, ``names()``) is how the benchmark runner and the
torch DDP baseline find them by name:

- ``digits-logreg`` — logistic regression on scikit-learn's 8×8 digits;
- ``digits-mlp`` (alias ``digits``) — the demo's MLP on the same digits;
- ``digits-cnn`` — a small convolutional classifier on the digits;
- ``digits-ae`` — a small convolutional autoencoder (metric: reconstruction
  MSE, lower is better);
- ``text-gru`` — a character-level GRU on Python standard-library sources;
- ``digits-wide`` — a 1.1 M-parameter MLP on the digits (the several-hosts
  benchmark's model: large enough that links cost, small enough to step fast).
- ``tiny-gpt`` — a 1 M-parameter decoder-only transformer, character-level on
  standard-library sources (metric: held-out bits per character, lower is
  better).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elche.core.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn
    from torch.utils.data import TensorDataset

__all__ = ["ALIASES", "Workload", "get", "load_split", "names"]

# name -> module under elche.workloads; the order is the order of reports.
_MODULES = {
    "digits-logreg": "digits_logreg",
    "digits-mlp": "digits",
    "digits-cnn": "digits_cnn",
    "digits-ae": "digits_ae",
    "text-gru": "text_gru",
    "digits-wide": "digits_wide",
    "tiny-gpt": "tiny_gpt",
}
ALIASES = {"digits": "digits-mlp"}  # the name the demo and the DDP CLI always used


@dataclass(frozen=True, slots=True)
class Workload:
    """The callables and facts of one workload (see the module docstring)."""

    name: str
    metric: str  # what eval_fn returns, e.g. "accuracy"
    higher_is_better: bool
    load_split: Callable[[int], tuple[TensorDataset, TensorDataset]]
    make_model: Callable[[torch.device | str], nn.Module]
    make_optimizer: Callable[[Iterable[Tensor]], torch.optim.Optimizer]
    step_fn: Callable[[nn.Module, Sequence[Tensor]], Tensor]
    eval_fn: Callable[[nn.Module, TensorDataset], float]


def names() -> tuple[str, ...]:
    """The registered workload names, in report order (aliases excluded)."""
    return tuple(_MODULES)


def get(name: str) -> Workload:
    """The workload called ``name`` (or one of its ``ALIASES``).

    Imports the workload's module on first use (its data loader may import
    scikit-learn, which costs about a second).

    Args:
        name: a name from ``names()`` or a key of ``ALIASES``.

    Returns:
        The workload's callables; the functions are module-level, so they
        pickle by reference into spawned ranks.

    Raises:
        ConfigError: (field ``"workload"``) ``name`` is not registered.
    """
    canonical = ALIASES.get(name, name)
    if canonical not in _MODULES:
        accepted = ", ".join((*_MODULES, *ALIASES))
        raise ConfigError("workload", f"must be one of {accepted}; got {name!r}")
    module = importlib.import_module(f"elche.workloads.{_MODULES[canonical]}")
    return Workload(
        name=canonical,
        metric=module.METRIC,
        higher_is_better=module.HIGHER_IS_BETTER,
        load_split=module.load_split,
        make_model=module.make_model,
        make_optimizer=module.make_optimizer,
        step_fn=module.step_fn,
        eval_fn=module.eval_fn,
    )


def load_split(
    name: str, seed: int, *, train_samples: int | None = None
) -> tuple[TensorDataset, TensorDataset]:
    """``get(name).load_split(seed)``, its training set cut to ``train_samples`` if given.

    The cut keeps ``train_samples`` samples evenly spaced over the training
    set (sample ``i * n // train_samples`` for ``i`` in order): the same
    samples for every seed and every system, drawn from all of the data, not
    only its beginning. The held-out set is kept whole.

    Raises:
        ConfigError: (field ``"train_samples"``) not an integer from 1 to the
            training set's size; (field ``"workload"``) ``name`` is not registered.
    """
    from torch.utils.data import TensorDataset

    train, held_out = get(name).load_split(seed)
    if train_samples is None:
        return train, held_out
    n = len(train)
    whole = isinstance(train_samples, int) and not isinstance(train_samples, bool)
    if not whole or not 1 <= train_samples <= n:
        raise ConfigError(
            "train_samples", f"must be an integer from 1 to {n} for {name}, got {train_samples!r}"
        )
    keep = [i * n // train_samples for i in range(train_samples)]
    return TensorDataset(*(t[keep] for t in train.tensors)), held_out
