"""``text-gru``: a character-level GRU on Python standard-library sources.

The text is the first ``TEXT_BYTES`` of a fixed list of the standard
library's own modules (``SOURCES``, read from ``Path(os.__file__).parent``),
so it is offline, and deterministic for a given Python version (a missing
module is skipped; 3.11's list gives the full 256 KiB). Characters map to a
97-symbol vocabulary: newline, the 95 printable ASCII characters, and one
symbol for anything else. The text is cut into non-overlapping windows of
``SEQ_LEN + 1`` characters; ``load_split(seed)`` holds out a seeded 10 % of
the windows (about 400) for evaluation.

The model embeds characters (32 numbers), runs a one-layer GRU (64 hidden
units) and predicts the next character at every position: 28,225
parameters, about 15 ms a training step at batch 32 on one core of the
2-core development machine (a step runs 64 sequential GRU cells). The metric
is next-character accuracy on the held-out windows (higher is better).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from elche.workloads.common import VOCAB, accuracy, adam, char_codes, device_of, seeded

__all__ = [
    "HIGHER_IS_BETTER",
    "METRIC",
    "VOCAB",
    "eval_fn",
    "load_split",
    "load_text",
    "make_model",
    "make_optimizer",
    "step_fn",
]

METRIC = "next-char accuracy"
HIGHER_IS_BETTER = True
# Read in this order; well-kept, plain-Python modules that exist in every 3.x.
SOURCES = (
    "argparse.py", "dataclasses.py", "functools.py", "textwrap.py",
    "contextlib.py", "heapq.py", "fractions.py", "random.py",
)  # fmt: skip
TEXT_BYTES = 256 * 1024  # ~4,000 windows: an epoch is ~110 steps at batch 32
MIN_TEXT_BYTES = 64 * 1024  # refuse to train on a stub of a standard library
SEQ_LEN = 64  # characters of context per window
TEST_FRACTION = 0.1
EMBED, HIDDEN = 32, 64  # HIDDEN 128 doubles the step time for little accuracy here
LEARNING_RATE = 3e-3


def load_text(limit: int = TEXT_BYTES) -> bytes:
    """The corpus: ``SOURCES`` from the running Python's library, concatenated.

    Args:
        limit: the most bytes to return.

    Returns:
        Up to ``limit`` bytes of Python source.

    Raises:
        RuntimeError: fewer than ``MIN_TEXT_BYTES`` (or ``limit``, if
            smaller) could be read.
    """
    root = Path(os.__file__).parent
    parts = [(root / name).read_bytes() for name in SOURCES if (root / name).is_file()]
    text = b"".join(parts)[:limit]
    if len(text) < min(limit, MIN_TEXT_BYTES):
        raise RuntimeError(f"text-gru: only {len(text)} bytes of sources found under {root}")
    return text


def load_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Windows of the corpus, split by a seeded permutation.

    Args:
        seed: the split's seed; the same seed gives the same split.

    Returns:
        ``(train, test)``, each a ``TensorDataset`` of inputs ``int64 [n, 64]``
        and next-character targets ``int64 [n, 64]``.
    """
    codes = char_codes(load_text())  # int64 [TEXT_BYTES]
    count = (len(codes) - 1) // (SEQ_LEN + 1)
    windows = codes[: count * (SEQ_LEN + 1)].view(count, SEQ_LEN + 1)  # [n, 65]
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    held = max(1, int(count * TEST_FRACTION))
    test, train = windows[order[:held]], windows[order[held:]]
    return _pairs(train), _pairs(test)


def make_model(device: torch.device | str) -> nn.Module:
    """Build the GRU language model with the same initial weights on every call.

    Args:
        device: where the parameters live.

    Returns:
        The model, taking ``int64 [batch, T]`` to logits ``[batch, T, 97]``.
    """
    return seeded(_CharGru, device)


make_optimizer = adam(LEARNING_RATE)  # a fresh Adam over the given parameters


def step_fn(model: nn.Module, batch: Sequence[Tensor]) -> Tensor:
    """Mean next-character cross-entropy over every position of the batch.

    Args:
        model: the GRU model, or a wrapper of it (DDP).
        batch: ``[x, y]``, both int64 ``[b, 64]``.

    Returns:
        The loss in nats per character, a scalar.
    """
    x, y = batch
    device = device_of(model)
    logits = model(x.to(device))  # [b, T, VOCAB]
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.to(device).reshape(-1))


eval_fn = accuracy  # share of targets predicted (the argmax of the logits)


class _CharGru(nn.Module):
    """Embedding → GRU → linear read-out at every position."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.gru = nn.GRU(EMBED, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        states, _ = self.gru(self.embed(x))  # [b, T, HIDDEN]
        out: Tensor = self.head(states)  # [b, T, VOCAB]
        return out


def _pairs(windows: Tensor) -> TensorDataset:
    """``[n, T + 1]`` windows to (input, next-character target) pairs."""
    return TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())
