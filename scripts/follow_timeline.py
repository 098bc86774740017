"""How live the timeline is: `tail -f RUN_DIR/timeline.jsonl` while a run goes on.

Starts ``tail -f`` on the timeline of a 3-rank digits-cnn run (speeds 1, 0.5,
0.25, 6 epochs), notes when each record reaches it, and prints the largest
lag between a record being written (its ``t``) and ``tail`` showing it.

    python scripts/follow_timeline.py [RUN_DIR]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import elche
from elche.workloads import get

if __name__ == "__main__":
    run_dir = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="elche-follow-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "timeline.jsonl").touch()
    tail = subprocess.Popen(
        ["tail", "-n", "+1", "-f", str(run_dir / "timeline.jsonl")],
        stdout=subprocess.PIPE,
        text=True,
    )
    seen: list[tuple[float, dict[str, object]]] = []

    def read() -> None:
        assert tail.stdout is not None
        for line in tail.stdout:
            seen.append((time.monotonic(), json.loads(line)))

    threading.Thread(target=read, daemon=True).start()
    workload = get("digits-cnn")
    train_set, _ = workload.load_split(0)
    elche.train(
        workload.make_model, workload.make_optimizer, workload.step_fn, train_set,
        batch_size=32, epochs=6, speeds=[1, 0.5, 0.25], run_dir=str(run_dir), progress=False,
    )  # fmt: skip
    time.sleep(1.0)  # let tail deliver the last lines
    tail.kill()
    first_seen, first = seen[0]
    lags = [(at - first_seen) - (float(r["t"]) - float(first["t"])) for at, r in seen]
    print(f"{len(seen)} records in {run_dir}; largest lag behind the writer: {max(lags):.3f} s")
