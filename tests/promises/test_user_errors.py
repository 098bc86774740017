"""Issue 12's user-error items: a new user's mistakes fail at once, by name.

Each check runs in the calling process before any coordinator or rank starts
(``elche.train`` raises ``ConfigError`` naming the argument), so nothing is
left running and no time is spent.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elche
from elche.core.errors import ConfigError
from tests.promises.tiny import make_model, make_optimizer, score, step

DATA = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))


def train(**overrides: object) -> elche.TrainResult:
    args: dict[str, object] = {
        "model_fn": make_model, "optimizer_fn": make_optimizer, "step_fn": step,
        "dataset": DATA, "batch_size": 8, "epochs": 1, "ranks": 2, "progress": False,
    }  # fmt: skip
    args.update(overrides)
    return elche.train(**args)  # type: ignore[arg-type]


def refused(field: str, **overrides: object) -> str:
    with pytest.raises(ConfigError) as info:
        train(**overrides)
    assert info.value.field == field, info.value
    return str(info.value)


def test_issue12_item16_a_device_that_does_not_exist_is_refused_at_once() -> None:
    assert "CUDA device" in refused("devices", devices=["cpu", "cuda:7"])
    assert "accepted" in refused("devices", devices=["cpu", "mps"])
    assert "is not a device" in refused("devices", devices=["cpu", "gpu0"])


def test_issue12_item16_eval_fn_without_eval_dataset_is_refused() -> None:
    refused("eval_dataset", eval_fn=score)


def test_issue12_item16_a_model_instead_of_model_fn_is_refused() -> None:
    assert "pass the function that builds it" in refused("model_fn", model_fn=nn.Linear(4, 2))


def test_issue12_item16_an_empty_dataset_is_reported_as_the_dataset() -> None:
    assert "empty" in refused("dataset", dataset=TensorDataset(torch.empty(0, 4)))


def test_issue12_item13_an_unpicklable_function_is_refused_by_name_before_anything_starts(
    tmp_path: Path,
) -> None:
    text = refused(
        "step_fn", step_fn=lambda model, batch: model(batch[0]).sum(), run_dir=str(tmp_path)
    )
    assert "top level" in text
    assert list(tmp_path.iterdir()) == []  # no coordinator was started


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a read-only directory bite")
def test_issue12_item10_an_unwritable_save_path_is_refused_before_training(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    mount = subprocess.run(["mount", "--bind", "-o", "ro", str(ro), str(ro)], check=False)
    if mount.returncode != 0:
        pytest.skip("cannot bind-mount read-only here")
    try:
        assert "cannot write" in refused("save_path", save_path=str(ro / "bundle"))
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_issue12_item10_a_save_path_in_a_missing_folder_is_made(tmp_path: Path) -> None:
    from elche._files import check_writable

    check_writable(tmp_path / "new", "save_path")  # not an error: made, as a writer would
    assert (tmp_path / "new").is_dir()
    assert list((tmp_path / "new").iterdir()) == []  # the probe is gone
