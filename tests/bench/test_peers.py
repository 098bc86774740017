"""torchft's LocalSGD and DiLoCo as ``elche bench`` systems.

The unit tests need nothing; the real run (LocalSGD, 2 ranks,
digits-logreg, 1 epoch) needs ``elche[peers]`` and says so when torchft is
missing. DiLoCo runs for real in ``elche bench`` (docs/benchmarks.md).
"""

from __future__ import annotations

import os

import pytest

from elche.baselines import torchft_peers
from elche.bench.runner import available_suite, run_one
from elche.bench.suites import QUICK, TORCHFT_SYSTEMS, WorkloadPlan
from elche.core.errors import ConfigError


def test_without_torchft_its_systems_are_skipped_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torchft_peers, "available", lambda: (False, "torchft is not installed"))
    said: list[str] = []

    suite = available_suite(QUICK, said.append)

    assert not set(TORCHFT_SYSTEMS) & set(suite.systems)
    assert {"torch-ddp", "cadence"} <= set(suite.systems)
    assert said == [
        "elche bench: torchft-localsgd, torchft-diloco skipped: torchft is not installed"
    ]
    assert suite.notes[-1] == said[0].removeprefix("elche bench: ")


def test_with_torchft_the_suite_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchft_peers, "available", lambda: (True, ""))
    said: list[str] = []
    assert available_suite(QUICK, said.append) is QUICK
    assert said == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"algorithm": "torchft-ddp"}, "algorithm"),
        ({"sync_every": 0}, "sync_every"),
        ({"base_step_s": None}, "speed_base_s"),
        ({"speeds": []}, "speeds"),
    ],
)
def test_bad_arguments_are_config_errors_naming_the_field(
    kwargs: dict[str, object], field: str
) -> None:
    args: dict[str, object] = {
        "algorithm": "torchft-localsgd", "speeds": [1.0, 0.5], "epochs": 1,
        "workload": "digits-logreg", "base_step_s": 0.001,
    }  # fmt: skip
    args.update(kwargs)
    algorithm = str(args.pop("algorithm"))
    with pytest.raises(ConfigError) as caught:
        torchft_peers.run_torchft(algorithm, **args)  # type: ignore[arg-type]  # bad on purpose
    assert caught.value.field == field


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(240)
def test_localsgd_trains_two_ranks_under_the_bench_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'elche[peers]')")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    plan = WorkloadPlan("digits-logreg", epochs=1)
    base_s = 0.0005

    run = run_one("torchft-localsgd", plan, (1.0, 0.5), seed=0, speed_base_s=base_s)

    assert run["error"] is None, run["error"]
    assert run["system"] == "torchft-localsgd" and run["ranks"] == 2
    assert run["speed_base_s"] == base_s
    # 1,437 samples, padded to 719 a rank by the DistributedSampler: 23 steps a rank,
    # two windows of 10 and the last 3 steps averaged by a final sync
    assert [r["samples"] for r in run["per_rank"]] == [719, 719]
    assert run["samples"] == 1438
    assert run["syncs"] == 3
    assert run["wall_s"] > 0 and run["samples_per_s"] > 0
    assert run["per_rank"][1]["busy_s"] > run["per_rank"][0]["busy_s"]  # the paced rank
    (epoch,) = run["per_epoch"]
    assert 0.0 < epoch["t"] <= run["wall_s"]
    assert 0.5 < run["eval"] <= 1.0  # one epoch of logistic regression on digits
    assert epoch["eval"] == pytest.approx(run["eval"])  # rank 0's weights after the last average
