"""The ``elche.Session`` example on 2 real ranks under ``elche run``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = """
import json, os
import torch
import elche
from elche.workloads import digits

if __name__ == "__main__":
    train_set, _ = digits.load_digits_split(seed=0)
    model = digits.make_model("cpu")
    optimizer = digits.make_optimizer(model.parameters())
    batches = 0
    with elche.Session(
        model, optimizer, train_set, batch_size=32, epochs=2, speeds=[1.0, 0.25],
        speed_base_s=0.02, progress=False,
    ) as session:
        for batch in session:
            x, y = batch
            loss = torch.nn.functional.cross_entropy(model(x), y)
            session.step(loss)
            batches += 1
    print("RANK", os.environ["RANK"], batches)
    print("SUMMARY " + json.dumps(session.result.summary, sort_keys=True))
"""

RANKS = 2


def run_ranks_by_speed(
    script: Path, text: str, *, timeout_s: float
) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """``elche run --nproc 2`` of ``text`` (speeds 1 and 0.25, paced from a 20 ms step so
    that pacing, not a busy machine's share of CPU, orders them: two ranks are enough to
    be unequal, and a third costs the suite its start-up), checked by ``ranks_by_speed``.
    The finished process, and each rank's samples."""
    script.write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "elche.cli", "run", "--nproc", str(RANKS), str(script)],
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done, ranks_by_speed(done.stdout)


def ranks_by_speed(stdout: str) -> list[int]:
    """Every rank printed one ``SUMMARY`` line, the same on every rank, of a completed
    2-epoch run whose ranks' samples follow their speeds. Each rank's samples."""
    lines = [line for line in stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(lines) == RANKS and len(set(lines)) == 1, stdout  # every rank, alike
    summary = json.loads(lines[0].removeprefix("SUMMARY "))
    assert summary["outcome"] == "completed"
    assert summary["epochs_completed"] == 2 and summary["lost_samples"] == 0
    samples = [r["samples"] for r in summary["per_rank"]]
    assert samples[0] > samples[1]
    return samples


def test_the_session_example_trains_two_ranks_by_speed_under_elche_run(tmp_path: Path) -> None:
    done, samples = run_ranks_by_speed(tmp_path / "loop.py", SCRIPT, timeout_s=240)
    # Each rank's loop stepped every batch its rank trained (past its warm-up batches).
    counts = {int(w[1]): int(w[2]) for w in (ln.split() for ln in done.stdout.splitlines())
              if w and w[0] == "RANK"}  # fmt: skip
    assert sorted(counts) == list(range(RANKS))
    for rank, trained in enumerate(samples):
        assert counts[rank] >= -(-trained // 32)
