"""tiny-gpt: its size, its fixed held-out split from other files, its causal model.

The model runs on one thread, as a rank does (two threads on a busy 2-core
machine made one step ~8x slower).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import TensorDataset

from elche.workloads import tiny_gpt

SplitPair = tuple[TensorDataset, TensorDataset]


@pytest.fixture(scope="module")
def split() -> SplitPair:
    return tiny_gpt.load_split(0)


def test_the_model_has_at_least_a_million_parameters() -> None:
    model = tiny_gpt.make_model("cpu")
    assert sum(p.numel() for p in model.parameters()) >= 1_000_000


def test_the_split_is_fixed_and_holds_out_50k_characters(split: SplitPair) -> None:
    train, held = split
    again_train, again_held = tiny_gpt.load_split(7)  # the seed shuffles in elche, not here
    for a, b in zip((*train.tensors, *held.tensors), (*again_train.tensors, *again_held.tensors),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)
    assert held.tensors[1].numel() >= 50_000
    assert train.tensors[0].shape == (4096, tiny_gpt.SEQ_LEN)
    x, y = train.tensors
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next characters
    assert torch.equal(y[:-1, -1], x[1:, 0])  # windows follow each other: no character skipped


def test_held_out_text_comes_from_files_never_trained_on() -> None:
    train_text, held_text = tiny_gpt.load_texts()
    files = tiny_gpt.source_files()
    held_files = files[tiny_gpt.HELD_OUT_EVERY - 1 :: tiny_gpt.HELD_OUT_EVERY]
    first_held = held_files[0].read_bytes()
    assert held_text.startswith(first_held[: len(held_text)])
    assert first_held[:2000] not in train_text


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_the_model_is_causal_and_one_step_runs(split: SplitPair, one_thread: None) -> None:
    model = tiny_gpt.make_model("cpu")
    x = split[0].tensors[0][:1].clone()
    with torch.no_grad():
        before = model(x)
        x[:, 40] = (x[:, 40] + 1) % 97
        after = model(x)
    assert torch.equal(before[:, :40], after[:, :40])  # earlier positions never see later ones
    assert not torch.equal(before[:, 40:], after[:, 40:])
    optimizer = tiny_gpt.make_optimizer(model.parameters())
    batch = [t[:2] for t in split[0].tensors]  # a step, kept small: the model is 1 M
    loss = tiny_gpt.step_fn(model, batch)
    assert abs(float(loss.detach()) - math.log(97)) < 1.0  # about uniform at the start
    loss.backward()  # type: ignore[no-untyped-call]  # torch stub
    optimizer.step()
    small = TensorDataset(*(t[:2] for t in split[1].tensors))
    assert 0.0 < tiny_gpt.eval_fn(model, small) < 8.0  # bits per character
