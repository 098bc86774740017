"""A real run whose collective rounds overlap training, beside one that waits.

Two two-epoch cadence runs on the digits at speeds 1 and 0.5 (real
coordinator and rank processes on gloo): with ``overlap`` (the default) the
ranks train on through their rounds, without it they never do; both
complete, lose nothing and land near each other.

The window is held short (``max_anchor=2``, 11-18 rounds a run, 10-16 of
them trained through on rank 0): a round that ends an epoch is landed before
the next epoch starts, so it is never trained through, and with the default
window a run has two or three rounds, which on a loaded machine can all fall
at epoch ends (seen once in CI). Which rank trains which batch depends on
timing, so two runs differ anyway (over eight runs of each, 0.853-0.883
through and 0.836-0.889 waiting; see ``test_wire_train`` for how far two runs
can land apart), and the tolerance sits well past that noise and far inside
what a broken round does; the arithmetic of a landed round is tested exactly
in ``tests/runtime/test_overlap.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import elche
from elche.workloads import digits

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run(overlap: bool, tmp_path: Path) -> elche.TrainResult:
    train_set, test_set = digits.load_digits_split(seed=0)
    return elche.train(
        digits.make_model, digits.make_optimizer, digits.step_fn, train_set, batch_size=32,
        epochs=2, mode="cadence", speeds=[1.0, 0.5], eval_fn=digits.eval_fn,
        eval_dataset=test_set, progress=False, run_dir=str(tmp_path / str(overlap)),
        overlap=overlap, scheduler=elche.SchedulerConfig(max_anchor=2),
    )  # fmt: skip


def test_a_run_that_trains_through_its_rounds_lands_where_one_that_waits_does(
    tmp_path: Path,
) -> None:
    through, waiting = _run(True, tmp_path), _run(False, tmp_path)
    for result in (through, waiting):
        assert result.summary["outcome"] == "completed"
        assert result.summary["lost_samples"] == 0
    ranks = through.summary["per_rank"], waiting.summary["per_rank"]
    assert sum(r["overlapped_rounds"] for r in ranks[0]) > 0  # type: ignore[attr-defined]
    assert all(r["overlapped_rounds"] == 0 for r in ranks[1])  # type: ignore[attr-defined]
    assert abs(through.summary["eval"] - waiting.summary["eval"]) <= 0.1  # type: ignore[operator]
