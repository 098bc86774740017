"""Bring your own training: a small transformer on variable-length sequences.

Written from the README alone: warm-up + cosine through ``lr_schedule``,
variable-length items through a padding ``collate_fn``, ``num_workers=2``,
``accumulate=2`` and ``precision="bf16"``, on three ranks at speeds 1, 0.5
and 0.25. ``plain`` trains the same model in a plain single-process loop on
the same samples (``LambdaLR`` over its own steps) for comparison.

    python examples/byo_transformer.py elche     # three ranks from a plain script
    elche run --nproc 3 examples/byo_transformer.py elche
    torchrun --nproc-per-node 3 examples/byo_transformer.py elche
    python examples/byo_transformer.py plain

The task: does a sequence of tokens 0..15 (length 4 to 24) hold more 1s than 2s?
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
from torch import nn

import elche

VOCAB, MAX_LEN, DIM = 16, 24, 32
BATCH, ACCUMULATE, EPOCHS = 32, 2, 4
LR, WARMUP = 3e-3, 0.1


class Sequences(torch.utils.data.Dataset):
    """``n`` items (tokens as a list, label): lengths 4..24, label 1 if more 1s than 2s."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(4, MAX_LEN + 1, (1,), generator=g))
            tokens = torch.randint(0, VOCAB, (length,), generator=g).tolist()
            self.items.append((tokens, int(tokens.count(1) > tokens.count(2))))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def pad(items):
    width = max(len(tokens) for tokens, _ in items)
    x = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.bool)
    for row, (tokens, _) in enumerate(items):
        x[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = True
    return x, mask, torch.tensor([label for _, label in items])


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAX_LEN, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, 2)

    def forward(self, x, mask):
        h = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        h = self.encoder(h, src_key_padding_mask=~mask)
        h = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return self.head(h)


def make_model(device):
    torch.manual_seed(0)
    return Classifier().to(device)


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def step(model, batch):
    x, mask, y = batch
    return nn.functional.cross_entropy(model(x, mask).float(), y)


def warmup_cosine(progress):
    f = progress.fraction
    if f < WARMUP:
        return f / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (f - WARMUP) / (1 - WARMUP)))


def accuracy(model, dataset):
    x, mask, y = pad([dataset[i] for i in range(len(dataset))])
    return (model(x, mask).argmax(1) == y).float().mean().item()


def plain(train, test):
    """The same model and samples in one process: LambdaLR over its own steps."""
    model = make_model("cpu")
    optimizer = make_optimizer(model.parameters())
    loader = torch.utils.data.DataLoader(
        train, batch_size=BATCH * ACCUMULATE, shuffle=True, collate_fn=pad,
        generator=torch.Generator().manual_seed(42),
    )
    total = EPOCHS * len(loader)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / (WARMUP * total) if s < WARMUP * total
        else 0.5 * (1 + math.cos(math.pi * (s / total - WARMUP) / (1 - WARMUP))),
    )
    for _ in range(EPOCHS):
        for batch in loader:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = step(model, batch)
            loss.backward()
            optimizer.step()
            schedule.step()
    model.eval()
    with torch.no_grad():
        return accuracy(model, test)


if __name__ == "__main__":
    torch.set_num_threads(1)
    train, test = Sequences(3000, seed=1), Sequences(1000, seed=2)
    if sys.argv[1:] == ["plain"]:
        print(json.dumps({"plain_eval": plain(train, test)}))
        sys.exit(0)
    result = elche.train(
        make_model, make_optimizer, step, train, batch_size=BATCH, epochs=EPOCHS,
        ranks=3, speeds=[1.0, 0.5, 0.25], lr_schedule=warmup_cosine, collate_fn=pad,
        num_workers=2, accumulate=ACCUMULATE, precision="bf16",
        eval_fn=accuracy, eval_dataset=test, progress=False,
    )
    summary = result.summary
    print(json.dumps({
        "rank": os.environ.get("RANK", "-"), "outcome": summary["outcome"],
        "eval": summary["eval"], "wall_s": summary["wall_s"],
        "samples": [r["samples"] for r in summary["per_rank"]],
        "lr": [r["lr"] for r in summary["per_rank"]],
    }))
