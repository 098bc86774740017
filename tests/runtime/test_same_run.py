"""Launched ranks whose scripts plan different runs are refused before anything trains.

Under ``elche run`` each rank's process builds its own plan and dataset and
reads the samples at the positions it is handed through them: a rank with
another dataset length or seed trained other samples under the same
positions, and the run completed with ``lost_samples`` 0.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import elche
from elche.core.config import NUMPY_PERMUTATION, SHARD_ORDER, CoordinatorConfig, Mode
from elche.runtime.joined import _check_same_run
from elche.runtime.same_run import check_same_plans, plan_of

SCRIPT = """
import os
import torch
import elche
from elche.workloads import digits

if __name__ == "__main__":
    train_set, _ = digits.load_digits_split(seed=0)
    rank = int(os.environ["RANK"])
    # The length differs by rank: what a script reading its host's copy of the data may see.
    train_set = torch.utils.data.Subset(train_set, range(len(train_set) - 10 * rank))
    elche.train(
        digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
        batch_size=32, epochs=1, progress=False,
    )
    print("TRAINED", rank)
"""


def _config(seed: int = 42) -> CoordinatorConfig:
    return CoordinatorConfig(
        mode=Mode.CADENCE, world_size=2, num_samples=100, batch_size=8, epochs=2, seed=seed
    )


def test_plans_alike_pass_and_the_first_difference_is_named() -> None:
    shards = elche.Shards([[1, 2, 3], [4, 5]])
    check_same_plans([plan_of(_config(), shards)] * 3)
    with pytest.raises(elche.ConfigError, match=r"seed: .* rank 0 has seed=42, rank 2 seed=7"):
        check_same_plans([plan_of(_config(), None)] * 2 + [plan_of(_config(seed=7), None)])
    other = elche.Shards([[1, 2], [3, 4, 5]])
    with pytest.raises(
        elche.ConfigError, match=r"lengths: .* shard 0 has 3 items on rank 0, 2 on rank 1"
    ):
        check_same_plans([plan_of(_config(), shards), plan_of(_config(), other)])
    # The same length, as Shards on one rank and map-style on the other: other orders.
    with pytest.raises(
        elche.ConfigError,
        match=r"lengths: .* rank 0 trains a map-style dataset, rank 1 an elche.Shards",
    ):
        check_same_plans([plan_of(_config(), list(range(5))), plan_of(_config(), shards)])


@pytest.mark.parametrize(("run", "joiner"), [(NUMPY_PERMUTATION, SHARD_ORDER),
                                               (SHARD_ORDER, NUMPY_PERMUTATION)])  # fmt: skip
def test_a_joiner_with_the_other_kind_of_dataset_is_refused(run: str, joiner: str) -> None:
    # Its fields agreed, and it read other samples at the positions it was handed.
    theirs = {"mode": "cadence", "num_samples": 100, "batch_size": 8, "epochs": 2, "seed": 42,
              "order": run}  # fmt: skip
    with pytest.raises(elche.ConfigError, match=r"^dataset: the run trains an? "):
        _check_same_run(dataclasses.replace(_config(), order=joiner), theirs)
    _check_same_run(dataclasses.replace(_config(), order=run), theirs)


@pytest.mark.integration
@pytest.mark.slow
def test_elche_run_refuses_ranks_with_datasets_of_other_lengths(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "elche.cli", "run", "--nproc", "2", str(script)],
        capture_output=True, text=True, timeout=180, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0, done.stdout
    assert "TRAINED" not in done.stdout
    said = "num_samples: the ranks' scripts plan different runs: rank 0 has num_samples=1437, "
    assert said + "rank 1 num_samples=1427" in done.stderr, done.stderr
