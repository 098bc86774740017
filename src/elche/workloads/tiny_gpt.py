"""``tiny-gpt``: a small decoder-only transformer, character-level, on standard-library sources.

The corpus is offline and fixed: the running Python's own top-level modules
(``Path(os.__file__).parent``, ``*.py`` not starting with ``_``), read in
sorted name order. Every ``HELD_OUT_EVERY``-th file goes to the held-out
text, the others to the training text, each cut where its budget
(``TRAIN_CHARS``, ``HELD_OUT_CHARS``) runs out: the held-out characters come
from modules the model never trains on. For a given Python version the split
is the same on every call and for every seed (the seed shuffles the training
windows in elche, not the split). Characters map to text-gru's 97-symbol
vocabulary (``elche.workloads.common.char_codes``).

Both texts are cut into windows of ``SEQ_LEN`` inputs and their next
characters (stride ``SEQ_LEN``: each character is a target once). The
held-out split is 800 windows, 51,200 predicted characters.

The model: token and position embeddings (``WIDTH`` 128), ``LAYERS`` 5
pre-LayerNorm blocks of causal self-attention (``HEADS`` 4, through
``scaled_dot_product_attention``) and a GELU MLP (4 × width), a final
LayerNorm and a linear read-out: 1,024,737 parameters. A training step at
``BATCH`` 8 windows of 64 took 106–168 ms on one core of the busy 2-core
development machine (``docs/benchmarks.md``). The metric is the held-out
loss in bits per character (lower is better).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from elche.workloads.common import VOCAB, adam, char_codes, device_of, seeded, summed_over_batches

__all__ = [
    "BATCH",
    "HIGHER_IS_BETTER",
    "METRIC",
    "eval_fn",
    "load_split",
    "load_texts",
    "make_model",
    "make_optimizer",
    "source_files",
    "step_fn",
]

METRIC = "bits per char"
HIGHER_IS_BETTER = False
SEQ_LEN = 64  # characters of context
TRAIN_CHARS = 256 * SEQ_LEN * 16 + 1  # 4,096 training windows: an epoch is 512 steps at batch 8
HELD_OUT_CHARS = 800 * SEQ_LEN + 1  # 800 windows: 51,200 predicted characters
HELD_OUT_EVERY = 8  # files 7, 15, 23, ... of the sorted list are held out
WIDTH, LAYERS, HEADS = 128, 5, 4
BATCH = 8  # windows per step (the bench's per-rank batch for this workload)
LEARNING_RATE = 1e-3


def source_files() -> list[Path]:
    """The corpus's files, in reading order: the library's public top-level modules, sorted."""
    root = Path(os.__file__).parent
    return sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))


def load_texts() -> tuple[bytes, bytes]:
    """The training and held-out texts (see the module docstring).

    Raises:
        RuntimeError: the library's sources do not fill both budgets.
    """
    train, held = bytearray(), bytearray()
    for i, path in enumerate(source_files()):
        target, budget = (
            (held, HELD_OUT_CHARS)
            if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
            else (train, TRAIN_CHARS)
        )
        room = budget - len(target)
        if room > 0:
            target += path.read_bytes()[:room]
        if len(train) >= TRAIN_CHARS and len(held) >= HELD_OUT_CHARS:
            return bytes(train), bytes(held)
    root = Path(os.__file__).parent
    raise RuntimeError(
        f"tiny-gpt: {len(train)} training and {len(held)} held-out characters under {root}, "
        f"expected {TRAIN_CHARS} and {HELD_OUT_CHARS}"
    )


def load_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """``(train, held_out)`` windows: inputs and next-character targets, int64 ``[n, 64]``.

    Args:
        seed: unused: the split is fixed (the module docstring says why).
    """
    del seed
    train, held = load_texts()
    return _windows(char_codes(train)), _windows(char_codes(held))


def make_model(device: torch.device | str) -> nn.Module:
    """The transformer with the same initial weights on every call.

    Returns:
        A model taking ``int64 [batch, T <= 64]`` to logits ``[batch, T, 97]``.
    """
    return seeded(TinyGpt, device)


make_optimizer = adam(LEARNING_RATE)


def step_fn(model: nn.Module, batch: Sequence[Tensor]) -> Tensor:
    """Mean next-character cross-entropy over every position, in nats."""
    x, y = batch
    device = device_of(model)
    logits = model(x.to(device))
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.to(device).reshape(-1))


def eval_fn(model: nn.Module, dataset: TensorDataset) -> float:
    """The held-out loss in bits per character (summed cross-entropy ÷ targets ÷ ln 2)."""
    inputs, targets = dataset.tensors
    nats = summed_over_batches(model, (inputs, targets), _summed_nats)
    return nats / max(targets.numel(), 1) / math.log(2)


def _summed_nats(model: nn.Module, batch: Sequence[Tensor]) -> float:
    x, y = batch
    logits = model(x)
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum")
    return float(loss.item())


def _windows(codes: Tensor) -> TensorDataset:
    count = (len(codes) - 1) // SEQ_LEN
    x = codes[: count * SEQ_LEN].view(count, SEQ_LEN)
    y = codes[1 : count * SEQ_LEN + 1].view(count, SEQ_LEN)
    return TensorDataset(x.contiguous(), y.contiguous())


class _Block(nn.Module):
    """Pre-LayerNorm causal self-attention, then a GELU MLP, each residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).unbind(dim=2)
        heads = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # [b, HEADS, t, WIDTH // HEADS]
        x = x + self.proj(heads.transpose(1, 2).reshape(b, t, WIDTH))
        out: Tensor = x + self.mlp(self.norm2(x))
        return out


class TinyGpt(nn.Module):
    """Embeddings → ``LAYERS`` blocks → LayerNorm → read-out at every position."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(SEQ_LEN, WIDTH)
        self.blocks = nn.Sequential(*(_Block() for _ in range(LAYERS)))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        where = torch.arange(x.shape[1], device=x.device)
        h = self.blocks(self.tokens(x) + self.positions(where))
        out: Tensor = self.head(self.norm(h))
        return out
