"""``Trainer(strategy="elche")``: a Lightning loop training one elche rank per process."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from elche import ConfigError, TrainingError
from tests.integration.test_session_launched import RANKS, ranks_by_speed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None,
    reason="the elche[lightning] extra is not installed",
)

NUM_SAMPLES = 48
BATCH = 8


@pytest.fixture(scope="module")
def pl() -> Any:
    """``lightning.pytorch``, imported by the tests that fit in this process only: its
    import costs about 8 s of CPU, which every pytest worker would pay at collection."""
    import lightning.pytorch

    import elche.lightning  # noqa: F401  # registers strategy="elche"

    return lightning.pytorch


def recorder(pl: Any) -> Any:
    """A linear model that records the sample ids each Lightning epoch trained."""

    class Recorder(pl.LightningModule):  # type: ignore[misc]  # Lightning is untyped here
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.net = nn.Linear(4, 2)
            self.seen: dict[int, list[int]] = {}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            del batch_idx
            ids, x, y = batch
            self.seen.setdefault(self.current_epoch, []).extend(ids.tolist())
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Recorder()


def loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 4, generator=g)
    data = TensorDataset(torch.arange(NUM_SAMPLES), x, (x.sum(1) > 0).long())
    return DataLoader(data, batch_size=BATCH, shuffle=True)


def trainer(pl: Any, strategy: Any = "elche", **settings: Any) -> Any:
    settings = {"max_epochs": 2, **settings}
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **settings,
    )  # fmt: skip


def test_a_trainer_with_strategy_elche_trains_each_sample_once_per_epoch(pl: Any) -> None:
    module = recorder(pl)
    fit = trainer(pl)
    fit.fit(module, loader())
    assert sorted(module.seen) == [0, 1]  # Lightning's epochs are elche's
    assert sorted(module.seen[1]) == list(range(NUM_SAMPLES))
    # The first epoch opens with the rank's two warm-up batches (timed, then undone).
    assert sorted(set(module.seen[0])) == list(range(NUM_SAMPLES))
    assert len(module.seen[0]) == NUM_SAMPLES + 2 * BATCH
    result = fit.strategy.result
    assert result.summary["outcome"] == "completed"
    assert result.summary["epochs_completed"] == 2
    assert result.summary["lost_samples"] == 0


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"accumulate_grad_batches": 2}, "accumulate_grad_batches"),
        ({"max_steps": 3}, "max_epochs"),
        # Each of these trains fewer batches than the rank is handed: it left the run
        # before its last batch, an error for the rank after it had trained a while.
        ({"limit_train_batches": 2}, "limit_train_batches"),
        ({"limit_train_batches": 1}, "limit_train_batches"),  # an int: one batch
        ({"limit_train_batches": 0.5}, "limit_train_batches"),
        ({"overfit_batches": 2}, "overfit_batches"),
        ({"fast_dev_run": True}, "fast_dev_run"),
        ({"precision": "64-true"}, "precision"),
        ({"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"}, "gradient_clip_algorithm"),
    ],
)
def test_settings_elche_cannot_honour_are_refused_by_name(
    pl: Any, settings: dict[str, Any], field: str
) -> None:
    module = recorder(pl)
    with pytest.raises(ConfigError, match=field):
        trainer(pl, **settings).fit(module, loader())
    assert module.seen == {}  # refused before the first batch


def test_a_training_step_that_returns_none_is_named(pl: Any) -> None:
    module = recorder(pl)
    step = module.training_step

    def skipping_step(batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = step(batch, batch_idx)
        return None if batch_idx == 3 else loss  # Lightning's way to skip a batch

    module.training_step = skipping_step
    with pytest.raises(TrainingError) as info:
        trainer(pl).fit(module, loader())
    assert info.value.error_type == "TypeError"
    assert "training_step returned None" in info.value.message


SCRIPT = """
import json, os
import torch
import lightning.pytorch as pl
import elche.lightning
from elche.workloads import digits


class Digits(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = digits.make_model("cpu")
        self.batches = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.batches[self.current_epoch] = self.batches.get(self.current_epoch, 0) + 1
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return digits.make_optimizer(self.net.parameters())


def fit(train_set, max_epochs, **options):
    strategy = elche.lightning.ElcheStrategy(speeds=[1.0, 0.25], speed_base_s=0.02, **options)
    trainer = pl.Trainer(
        strategy=strategy, max_epochs=max_epochs, accelerator="cpu", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    module = Digits()
    trainer.fit(module, torch.utils.data.DataLoader(train_set, batch_size=32, shuffle=True))
    return module, strategy


if __name__ == "__main__":
    train_set, _ = digits.load_digits_split(seed=0)
    module, strategy = fit(train_set, 2)
    lines = ["RANK " + json.dumps([int(os.environ["RANK"]), module.batches]),
             "SUMMARY " + json.dumps(strategy.result.summary, sort_keys=True)]
    os.write(1, ("\\n".join(lines) + "\\n").encode())  # one write: the ranks share the pipe
    fit(train_set, 200, run_dir=os.environ["RUN_DIR"])  # the test stops this one
"""


@pytest.mark.slow
@pytest.mark.integration
def test_a_trainer_script_trains_two_ranks_by_speed_then_stopped_saves_and_exits_143(
    tmp_path: Path,
) -> None:
    # One launch (each costs its ranks' start-up) fits twice: a 2-epoch run that completes
    # and prints each rank's batches and summary, then a 200-epoch one that the test stops
    # with SIGTERM mid-run. Lightning takes any KeyboardInterrupt in fit for its own Ctrl-C
    # and exits 1: every rank of a run stopped (and saved) by SIGTERM exited 1, and elche
    # run with it, as if the run had failed.
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "elche.cli", "run", "--nproc", str(RANKS), str(script)],
        env=dict(os.environ, RUN_DIR=str(run_dir)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        timeline = run_dir / "timeline.jsonl"
        deadline = time.monotonic() + 240
        while not (timeline.exists() and '"EpochEnd"' in timeline.read_text()):  # mid-run
            assert time.monotonic() < deadline and launcher.poll() is None, launcher.poll()
            time.sleep(0.05)  # polling the second run's timeline, with a deadline
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 143, err[-3000:]
    assert f"elche: interrupted by SIGTERM; the run is saved under {run_dir}/checkpoint;" in err
    assert "KeyboardInterrupt" not in err and "exited with code" not in err, err[-3000:]

    # The first, completed run.
    samples = ranks_by_speed(out)
    ranks = [json.loads(ln.removeprefix("RANK ")) for ln in out.splitlines()
             if ln.startswith("RANK ")]  # fmt: skip
    assert sorted(rank for rank, _ in ranks) == list(range(RANKS))
    for rank, batches in ranks:
        # Lightning's epochs are elche's. A rank the epoch tail's list scheduling gave
        # no batch of an epoch (the slow one, its pace inflated on a loaded machine)
        # trains none in it: once seen in CI, and no promise is broken by it.
        assert batches and set(batches) <= {"0", "1"}
        assert sum(batches.values()) >= -(-samples[rank] // 32)
    assert set().union(*(batches for _, batches in ranks)) == {"0", "1"}
