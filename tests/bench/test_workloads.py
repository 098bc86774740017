"""The benchmark workloads: registry, data, identical init, one short epoch, eval.

Each workload trains a short epoch (the first ``SHORT`` training samples) on
one thread and its ``eval_fn`` returns a score in range. Loading a workload's
split is paid once per module by the fixture.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from elche import workloads
from elche.core.errors import ConfigError

SHORT = 128  # samples in the "short epoch": 4 steps at batch 32
EVAL_CAP = 512  # test samples evaluated: all of the digits' and text-gru's
# tiny-gpt's step is ~100x the digits': its short epoch is 2 steps of 8, evaluated on 64 windows
SIZES = {"tiny-gpt": (16, 8, 64)}  # samples, batch size, test samples


@pytest.fixture(scope="module", params=workloads.names())
def loaded(
    request: pytest.FixtureRequest,
) -> tuple[workloads.Workload, TensorDataset, TensorDataset]:
    work = workloads.get(request.param)
    train, test = work.load_split(0)
    return work, train, test


def test_registry_names_and_alias() -> None:
    assert workloads.names() == (
        "digits-logreg", "digits-mlp", "digits-cnn", "digits-ae", "text-gru", "digits-wide",
        "tiny-gpt",
    )  # fmt: skip
    assert workloads.get("digits").name == "digits-mlp"


def test_the_ddp_baseline_takes_every_registered_workload() -> None:
    from elche.baselines.ddp import WORKLOADS

    assert set(workloads.names()) | {"digits"} == set(WORKLOADS)


def test_unknown_workload_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        workloads.get("mnist")
    assert info.value.field == "workload"


def test_split_is_deterministic_per_seed(
    loaded: tuple[workloads.Workload, TensorDataset, TensorDataset],
) -> None:
    work, train, test = loaded
    again_train, again_test = work.load_split(0)
    for a, b in zip(
        (*train.tensors, *test.tensors), (*again_train.tensors, *again_test.tensors), strict=True
    ):
        assert torch.equal(a, b)
    assert len(train) > len(test) > 0


def test_every_rank_builds_identical_weights_without_touching_the_rng(
    loaded: tuple[workloads.Workload, TensorDataset, TensorDataset],
) -> None:
    work = loaded[0]
    before = torch.random.get_rng_state()
    one, two = work.make_model("cpu"), work.make_model("cpu")
    assert torch.equal(torch.random.get_rng_state(), before)
    for a, b in zip(one.state_dict().values(), two.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_one_short_epoch_trains_and_eval_is_in_range(
    loaded: tuple[workloads.Workload, TensorDataset, TensorDataset],
) -> None:
    work, train, test = loaded
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = work.make_model("cpu")
        optimizer = work.make_optimizer(model.parameters())
        initial = [p.detach().clone() for p in model.parameters()]
        samples, batch_size, evaluated = SIZES.get(work.name, (SHORT, 32, EVAL_CAP))
        loader = DataLoader(Subset(train, range(samples)), batch_size=batch_size)
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = work.step_fn(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]  # torch stub
            optimizer.step()
            assert math.isfinite(float(loss.detach()))
        score = work.eval_fn(model, TensorDataset(*(t[:evaluated] for t in test.tensors)))
    finally:
        torch.set_num_threads(threads)
    assert any(not torch.equal(a, b) for a, b in zip(initial, model.parameters(), strict=True))
    assert model.training  # eval_fn leaves the model in train mode
    if work.higher_is_better:
        assert 0.0 <= score <= 1.0
    elif work.metric == "bits per char":
        assert 0.0 < score < 8.0  # uniform over the 97 symbols would be 6.6
    else:
        assert 0.0 <= score < 1.0  # pixel MSE of values in [0, 1]


def test_the_digits_split_is_cached_as_scikit_learn_makes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elche.workloads import digits

    monkeypatch.setenv(digits.CACHE_ENV, str(tmp_path / "cache"))
    made = digits.load_digits_split(seed=3)  # made by scikit-learn, then kept
    (kept,) = (tmp_path / "cache").glob("digits-split-3-*.npz")
    assert digits.load_digits_split(seed=3)[0].tensors[0].sum() == made[0].tensors[0].sum()
    kept.write_bytes(b"not an npz")  # a damaged cache is passed by, and made anew
    again = digits.load_digits_split(seed=3)
    for a, b in zip(made, again, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors, strict=True))
    assert digits.load_digits_split(seed=4)[0].tensors[0].sum() != made[0].tensors[0].sum()
    monkeypatch.setenv(digits.CACHE_ENV, str(tmp_path / "file"))
    (tmp_path / "file").write_text("a cache that cannot be a folder")
    assert torch.equal(digits.load_digits_split(seed=3)[0].tensors[1], made[0].tensors[1])


def test_a_cut_training_set_keeps_evenly_spaced_samples_and_the_whole_held_out_set() -> None:
    train, test = workloads.get("digits-mlp").load_split(3)
    cut, held_out = workloads.load_split("digits-mlp", 3, train_samples=100)
    assert len(cut) == 100
    n = len(train)
    spaced = [i * n // 100 for i in range(100)]
    assert torch.equal(cut.tensors[0], train.tensors[0][spaced])
    assert torch.equal(cut.tensors[1], train.tensors[1][spaced])
    assert torch.equal(held_out.tensors[0], test.tensors[0])
    whole, _ = workloads.load_split("digits-mlp", 3)
    assert len(whole) == n


@pytest.mark.parametrize("bad", [0, -1, 10**9, 2.5, True, "100"])
def test_a_bad_train_samples_is_a_config_error_naming_the_field(bad: object) -> None:
    with pytest.raises(ConfigError, match="train_samples") as caught:
        workloads.load_split("digits-mlp", 0, train_samples=bad)  # type: ignore[arg-type]
    assert caught.value.field == "train_samples"
