"""Handwritten digits: the demo workload (scikit-learn's 8×8 digits, offline).

Registered as ``digits-mlp`` (alias ``digits``); the other digits workloads
(``digits_logreg``, ``digits_cnn``, ``digits_ae``) reuse its split, and the
classifiers its ``step_fn`` and ``eval_fn``.

1,797 grayscale 8×8 images of the digits 0–9 ship inside scikit-learn, so
the demo, the integration tests and the quick benchmark need no download. A
stratified 80/20 split gives 1,437 training and 360 test samples; it is kept
in ``$ELCHE_CACHE_DIR`` (default ``~/.cache/elche``) once made, so only the
first process that loads it pays scikit-learn's import. The model
is a 64→128→64→10 MLP (17,226 parameters): one training step at batch 32
costs well under a millisecond of CPU, so start-up and communication — the
costs elche is about — dominate, and a whole run fits in seconds on two
cores.

Every function is top-level (picklable for ``spawn``) and deterministic:
identical seeds give identical splits and every rank builds identical initial
weights, without touching the global RNG streams.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from elche.workloads.common import accuracy, adam, device_of, seeded

__all__ = [
    "HIGHER_IS_BETTER",
    "METRIC",
    "NUM_CLASSES",
    "NUM_FEATURES",
    "eval_fn",
    "load_digits_split",
    "load_split",
    "make_model",
    "make_optimizer",
    "step_fn",
]

NUM_FEATURES = 64  # 8×8 pixels, flattened
NUM_CLASSES = 10
PIXEL_MAX = 16.0  # the dataset's pixels are integers in [0, 16]
HIDDEN = (128, 64)  # wide enough for ≥ 0.96 test accuracy, small enough to be ~free
# Adam, not SGD: the effective batch is batch_size × world_size under DDP, and
# Adam's per-parameter step size is far less sensitive to it than SGD's LR.
# Measured on one process, batch 32: 0.933–0.95 test accuracy after 3 epochs,
# 0.967–0.978 after 10 (split seeds 0–3); SGD(0.05, momentum 0.9) at batch 64
# was still at 0.85–0.90 after 3 epochs, against Adam's 0.87–0.93.
LEARNING_RATE = 3e-3
METRIC = "accuracy"  # what eval_fn returns (the workload registry's contract)
HIGHER_IS_BETTER = True


def load_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The registry's loader: ``load_digits_split(seed=seed)``, 80/20 stratified.

    Args:
        seed: the split's random state.

    Returns:
        ``(train, test)``: 1,437 and 360 samples, features ``float32 [n, 64]``
        in [0, 1], labels ``int64 [n]``.
    """
    return load_digits_split(seed=seed)


def load_digits_split(
    *, seed: int = 0, test_fraction: float = 0.2
) -> tuple[TensorDataset, TensorDataset]:
    """Load the digits and split them, stratified by class.

    Args:
        seed: the split's random state; the same seed gives the same split.
        test_fraction: the share of samples held out for evaluation, in (0, 1).

    Returns:
        ``(train, test)``, each a ``TensorDataset`` of features
        ``float32 [n, 64]`` scaled to [0, 1] and labels ``int64 [n]``.

    Raises:
        ValueError: ``test_fraction`` outside (0, 1), or too small or large
            to keep every class on both sides.
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    x_train, x_test, y_train, y_test = _split(seed, test_fraction)
    return _dataset(x_train, y_train), _dataset(x_test, y_test)


def make_model(device: torch.device | str) -> nn.Module:
    """Build the MLP with the same initial weights on every call.

    The global RNG is forked, seeded with ``common.INIT_SEED`` for the build, and
    restored, so building a model never shifts anyone's random stream.

    Args:
        device: where the parameters live.

    Returns:
        ``Sequential(Linear 64→128, ReLU, Linear 128→64, ReLU, Linear 64→10)``,
        in train mode, taking ``float32 [batch, 64]`` to logits ``[batch, 10]``.
    """
    return seeded(
        lambda: nn.Sequential(
            nn.Linear(NUM_FEATURES, HIDDEN[0]),
            nn.ReLU(),
            nn.Linear(HIDDEN[0], HIDDEN[1]),
            nn.ReLU(),
            nn.Linear(HIDDEN[1], NUM_CLASSES),
        ),
        device,
    )


make_optimizer = adam(LEARNING_RATE)  # a fresh Adam over the given parameters


def step_fn(model: nn.Module, batch: Sequence[Tensor]) -> Tensor:
    """The training loss of one batch (forward only; the caller backpropagates).

    Args:
        model: the MLP, or a wrapper of it (DDP).
        batch: ``[x, y]`` as ``default_collate`` builds it from the dataset:
            ``x`` float32 ``[b, 64]``, ``y`` int64 ``[b]``; moved to the
            model's device here.

    Returns:
        The mean cross-entropy over the batch, a scalar.
    """
    x, y = batch
    device = device_of(model)
    logits = model(x.to(device))  # [b, 10]
    return nn.functional.cross_entropy(logits, y.to(device))


eval_fn = accuracy  # share of targets predicted (the argmax of the logits)


CACHE_ENV = "ELCHE_CACHE_DIR"  # where splits are kept (default: ~/.cache/elche)
_SPLIT_KEYS = ("x_train", "x_test", "y_train", "y_test")


def _split(seed: int, test_fraction: float) -> tuple[npt.NDArray[Any], ...]:
    """scikit-learn's stratified split, kept in the cache once made.

    Importing ``sklearn.datasets`` and ``sklearn.model_selection`` costs 2–4 s
    of CPU, paid by every rank, benchmark worker and demo process that loads
    the digits; a cached split (keyed by seed, fraction and scikit-learn's
    version, so it is the split scikit-learn would make) costs milliseconds.
    A cache that cannot be read or written is passed by.
    """
    cached = _cache_file(seed, test_fraction)
    if cached is not None:
        with contextlib.suppress(OSError, KeyError, ValueError), np.load(cached) as arrays:
            return tuple(arrays[key] for key in _SPLIT_KEYS)
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]  # no stubs
    from sklearn.model_selection import train_test_split  # type: ignore[import-untyped]  # no stubs

    features, labels = load_digits(return_X_y=True)
    parts = train_test_split(
        features, labels, test_size=test_fraction, stratify=labels, random_state=seed
    )
    arrays = tuple(np.asarray(p) for p in parts)
    if cached is not None:
        with contextlib.suppress(OSError):  # a read-only or full cache: next time again
            cached.parent.mkdir(parents=True, exist_ok=True)
            fd, part = tempfile.mkstemp(dir=cached.parent, suffix=".part")
            try:
                with os.fdopen(fd, "wb") as out:
                    np.savez(out, **dict(zip(_SPLIT_KEYS, arrays, strict=True)))
                os.replace(part, cached)  # whole or absent, for concurrent readers
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)
    return arrays


def _cache_file(seed: int, test_fraction: float) -> Path | None:
    """Where the split of ``seed`` and ``test_fraction`` is cached (None: nowhere)."""
    try:
        version = importlib.metadata.version("scikit-learn")
    except importlib.metadata.PackageNotFoundError:
        return None  # the import below says what is missing
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "elche"
    )
    return Path(root) / f"digits-split-{seed}-{test_fraction!r}-sklearn{version}.npz"


def _dataset(features: npt.NDArray[Any], labels: npt.NDArray[Any]) -> TensorDataset:
    """Features scaled to [0, 1] as float32, labels as int64."""
    x = torch.from_numpy((features / PIXEL_MAX).astype(np.float32))  # [n, 64]
    y = torch.from_numpy(labels.astype(np.int64))  # [n]
    return TensorDataset(x, y)
