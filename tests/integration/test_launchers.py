"""``elche run`` and ``torchrun`` start the same script as real ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = """
import json, os, sys
import elche
from elche.workloads import digits

if __name__ == "__main__":
    train_set, test_set = digits.load_digits_split(seed=0)
    result = elche.train(
        digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
        batch_size=32, epochs=3, mode=sys.argv[1], speeds=[1.0, 0.5],
        eval_fn=digits.eval_fn, eval_dataset=test_set, progress=False,
    )
    # What the README's example reads, on every rank.
    print("EVAL", os.environ["RANK"], result.summary["eval_accuracy"], result.summary["eval"])
    print("SUMMARY " + json.dumps(result.summary, sort_keys=True))
    print("EPOCHS " + json.dumps(result.epochs, sort_keys=True))
    assert result.state_dict
"""


def summary_of(output: str, ranks: int = 2) -> dict[str, object]:
    """The run's summary, which every rank returned alike (and its epochs too)."""
    for kind in ("SUMMARY ", "EPOCHS "):
        lines = [line for line in output.splitlines() if line.startswith(kind)]
        assert len(lines) == ranks, output  # one per rank
        assert len(set(lines)) == 1, output  # the same on every rank
    lines = [line for line in output.splitlines() if line.startswith("SUMMARY ")]
    return json.loads(lines[0].removeprefix("SUMMARY "))  # type: ignore[no-any-return]  # JSON


# elche run with cadence: the dashboard test below; with cpu-cadence and torchrun: the
# launcher tests of tests/promises (a rank killed, the coordinator killed), each a plain
# run's check too.
def assert_completed(summary: dict[str, object]) -> None:
    assert summary["outcome"] == "completed"
    assert summary["world_size"] == 2
    assert summary["epochs_completed"] == 3
    assert summary["lost_samples"] == 0


def test_elche_run_serves_one_dashboard_and_writes_one_report_from_rank_0(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "elche.cli", "run", "--nproc", "2", "--dashboard", "127.0.0.1:0",
         "--tensorboard", str(tmp_path / "tb"), str(script), "cadence"],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = summary_of(done.stdout)
    assert_completed(summary)
    lines = done.stderr.splitlines()
    served = [line for line in lines if line.startswith("elche: dashboard at http://127.0.0.1:")]
    assert len(served) == 1, done.stderr
    assert sum(line.startswith("elche: run directory ") for line in lines) == 1
    # elche run's run directory is kept whole; rank 0's process wrote the report there.
    report = Path(str(summary["report"]))
    assert report == Path(str(summary["run_dir"])) / "report.html" and report.is_file()
    assert lines.count(f"elche: report at {report}") == 1
    assert "window.ELCHE_STATE" in report.read_text(encoding="utf-8")
    assert [p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir()] == [True]
