"""A local run's processes write where the launcher's streams go at its launch.

Ranks and, in a local run, the coordinator fork from one fork server, which
keeps the streams the launching process had at its first run. A program
that sends its stdout and stderr elsewhere between two runs (a log file per
run, a test's capture) must find the second run's rank output and
coordinator messages there: this script trains once, points fd 1 and 2 at
files, and trains again with checkpoints that fail on cue (the
coordinator says so on its stderr).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_SCRIPT = """
import os, sys

import elche
from elche import FaultPlan
from elche.workloads import digits
from tests.integration.loud_fns import loud_step, no_checkpoint


def run(where, mode, faults=None):
    train_set, _ = digits.load_digits_split(seed=0)
    elche.train(
        digits.make_model, digits.make_optimizer, loud_step, train_set, batch_size=32,
        epochs=2, mode=mode, speeds=[1.0, 1.0], progress=False, run_dir=where, faults=faults,
        checkpoint_fn=no_checkpoint, checkpoint_every=1,
    )


if __name__ == "__main__":
    out = sys.argv[1]
    os.environ["ELCHE_LOUD_MARK"] = "first"
    run(os.path.join(out, "first"), "cpu-cadence")  # the fork server starts here
    os.environ["ELCHE_LOUD_MARK"] = "second"
    for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
        os.dup2(os.open(os.path.join(out, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    fails = FaultPlan().fail_checkpoint(rank=0, at_s=0.0).fail_checkpoint(rank=1, at_s=0.0)
    run(os.path.join(out, "second"), "cadence", fails)
"""


def test_a_second_run_writes_where_the_launcher_points_its_streams_then(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    first = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)],
        cwd=root, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    out = (tmp_path / "stdout.log").read_text()
    err = (tmp_path / "stderr.log").read_text()
    for rank in (0, 1):
        assert f"LOUD second rank {rank}" in out
        assert f"LOUD second rank {rank}" in err
        assert f"LOUD first rank {rank}" in first.stdout
    assert "FailCheckpoint fault" in err  # the coordinator's message about the failed save
    assert "LOUD second" not in first.stdout + first.stderr
