"""The script of the join test: digits on three paced ranks; ``elche join`` adds a fourth.

``python join_script.py EPOCHS``: ``elche.train(ranks=3)`` in ``cadence``
mode, every rank paced to a tenth of its speed. Under ``elche join`` the
same file, unchanged, is the joining rank (its ``ranks=`` and ``speeds=`` are
ignored). With ``JOIN_SCRIPT_RUN_DIR`` set (the run's directory), every rank
that starts epoch 2 first waits, at most two minutes, for the run's timeline
to say that rank 3 joined: the test's condition, so the joiner is in the run
however long it takes to start. Each process prints its result in one line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import elche
from elche.workloads import digits

RUN_DIR = os.environ.get("JOIN_SCRIPT_RUN_DIR")
JOINED = '"kind":"RankJoined","rank":3,'


def wait_for_the_joiner(epoch: int, model: Any, optimizer: Any) -> None:
    if epoch != 2 or RUN_DIR is None:
        return
    timeline = Path(RUN_DIR) / "timeline.jsonl"
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        if timeline.exists() and JOINED in timeline.read_text(encoding="utf-8"):
            return
        time.sleep(0.05)  # polling the timeline, bounded by the deadline


if __name__ == "__main__":
    train_set, test_set = digits.load_digits_split(seed=0)
    result = elche.train(
        digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
        batch_size=32, epochs=int(sys.argv[1]), mode="cadence", heartbeat_timeout_s=5.0,
        ranks=3, speeds=[0.1, 0.1, 0.1], speed_base_s=0.004, epoch_fn=wait_for_the_joiner,
        eval_fn=digits.eval_fn, eval_dataset=test_set, progress=False, run_dir=RUN_DIR,
    )  # fmt: skip
    print("RESULT " + json.dumps(result.summary), flush=True)
