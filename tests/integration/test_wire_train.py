"""A real run on the bf16 wire: it completes, stays light, and lands where fp32 does.

Two two-epoch sync runs on the digits (fp32, then bf16; sync averages every
few steps, ~40 rounds, so every round but the first must stay light), real
coordinator and rank processes on gloo. Which rank trains which batch
depends on timing, so two fp32 runs differ too (~0.1 relative distance
between their final models; over nine fp32 runs the accuracy spanned
0.833-0.883, over nine bf16 runs 0.831-0.858, so two runs of either wire
can land 0.05 apart by chance). The tolerances are set well past that noise
and far inside what a broken wire does (accuracy near chance, a distance
near 1); the exact arithmetic is tested in ``tests/runtime/test_wire.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import elche
from elche.workloads import digits

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run(wire: str, tmp_path: Path) -> elche.TrainResult:
    train_set, test_set = digits.load_digits_split(seed=0)
    return elche.train(
        digits.make_model, digits.make_optimizer, digits.step_fn, train_set, batch_size=32,
        epochs=2, mode="sync", speeds=[1.0, 1.0], eval_fn=digits.eval_fn,
        eval_dataset=test_set, progress=False, run_dir=str(tmp_path / wire), wire=wire,
    )  # fmt: skip


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    keys = [k for k, v in b.items() if v.is_floating_point()]
    diff = sum(float((a[k].double() - b[k].double()).square().sum()) for k in keys)
    norm = sum(float(b[k].double().square().sum()) for k in keys)
    return float((diff / norm) ** 0.5)


def test_a_bf16_wire_run_completes_light_and_near_the_fp32_one(tmp_path: Path) -> None:
    full, light = _run("fp32", tmp_path), _run("bf16", tmp_path)
    params = sum(p.numel() for p in digits.make_model("cpu").parameters())
    for result in (full, light):
        assert result.summary["outcome"] == "completed"
        assert result.summary["lost_samples"] == 0
    for rank in full.summary["per_rank"]:  # type: ignore[attr-defined]  # JSON-shaped
        assert rank["wire"] == "fp32"
        assert rank["wire_bytes"] == rank["wire_rounds"] * (params * 4 + 16)
    for rank in light.summary["per_rank"]:  # type: ignore[attr-defined]  # JSON-shaped
        assert rank["wire"] == "bf16" and rank["wire_rounds"] > 10
        # every round light but the first (the ranks agreed on their last consensus)
        assert rank["wire_bytes"] == rank["wire_rounds"] * (params * 2 + 48) + params * 4 + 16
    assert abs(light.summary["eval"] - full.summary["eval"]) <= 0.1  # type: ignore[operator]
    assert all(v.dtype != torch.bfloat16 for v in light.state_dict.values())  # the model: fp32
    assert _distance(light.state_dict, full.state_dict) < 0.25
