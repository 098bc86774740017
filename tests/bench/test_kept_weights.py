"""``bench.kept_weights``: elche's evals in the bench are copies, evaluated after the clock."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elche.bench.kept_weights import KeepWeights, evaluate_kept
from elche.bench.runner import _kept_evals
from elche.workloads import get as get_workload


def test_each_kept_copy_is_numbered_and_evaluated_after_the_clock(tmp_path: Path) -> None:
    work = get_workload("digits-ae")
    _, test_set = work.load_split(0)
    model = work.make_model("cpu")
    keep = KeepWeights(str(tmp_path))
    expected = []
    for number, scale in enumerate((1.0, 0.0)):  # the second copy differs: all-zero weights
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        assert keep(model, test_set) == number  # nothing evaluated in the clock
        expected.append(work.eval_fn(model, test_set))
    assert evaluate_kept("digits-ae", tmp_path, test_set) == pytest.approx(expected)
    assert expected[0] != expected[1]


def test_each_epoch_gets_the_eval_of_the_copy_it_names() -> None:
    rows = [{"epoch": 0, "eval": 1.0}, {"epoch": 1, "eval": None}, {"epoch": 2, "eval": 0.0}]
    assert [r["eval"] for r in _kept_evals(rows, [0.5, 0.9])] == [0.9, None, 0.5]
    with pytest.raises(ValueError, match="epoch 3: copy 2 of 2 kept"):
        _kept_evals([{"epoch": 3, "eval": 2.0}], [0.5, 0.9])
