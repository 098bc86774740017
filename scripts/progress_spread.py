"""How far apart the ranks' global progress gets in test_global_progress's run.

Trains the integration test's run (digits, speeds 1, 0.5, 0.25, four epochs,
warm-up + cosine through ``lr_schedule``), traces every step's
``elche.progress()`` on every rank, and prints one JSON line: the worst gap
between a rank's progress and a peer's latest, over the test's bound (one
averaging window plus one step: ``ratio`` above 1 fails the test), with the
two records (rank, fraction, exact samples) and the confirmed counts.

    PYTHONPATH=. GLOO_SOCKET_IFNAME=lo python scripts/progress_spread.py

Under load (two busy loops beside it on two cores) the ratio spreads most.
"""

from __future__ import annotations

import functools
import itertools
import json
import tempfile
from pathlib import Path

from tests.integration import lr_trace as lt

import elche
from elche.workloads import digits


def _latest_before(trace: list[dict[str, float]], t: float) -> dict[str, float] | None:
    earlier = [rec for rec in trace if rec["t"] <= t]
    return earlier[-1] if earlier else None


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="elche-spread-") as tmp:
        traces_dir = Path(tmp)
        train_set, _ = digits.load_digits_split(seed=0)
        planned = 4 * len(train_set)
        result = elche.train(
            digits.make_model, lt.traced_optimizer,
            functools.partial(lt.traced_step, str(traces_dir)), train_set, batch_size=32,
            epochs=4, speeds=[1.0, 0.5, 0.25], lr_schedule=lt.warmup_cosine, progress=False,
            run_dir=str(traces_dir / "run"),
        )  # fmt: skip
        traces = lt.read_traces(traces_dir)
    exact = sorted({rec["exact"] for trace in traces for rec in trace} | {planned})
    window = max(b - a for a, b in itertools.pairwise(exact)) / planned
    step = max(
        b["fraction"] - a["fraction"] for trace in traces for a, b in itertools.pairwise(trace)
    )
    worst = 0.0
    pair: tuple[int, dict[str, float], int, dict[str, float]] | None = None
    for i, trace in enumerate(traces):
        for rec in trace:
            for j, other in enumerate(traces):
                peer = _latest_before(other, rec["t"]) if j != i else None
                if peer is not None and abs(rec["fraction"] - peer["fraction"]) > worst:
                    worst = abs(rec["fraction"] - peer["fraction"])
                    pair = (i, rec, j, peer)
    out: dict[str, object] = {
        "ratio": round(worst / (window + step), 3),
        "spread": round(worst, 3),
        "window": window,
        "step": round(step, 3),
        "exacts": exact,
        "outcome": result.summary["outcome"],
    }
    if pair is not None:
        i, rec, j, peer = pair
        out["a"] = [i, round(rec["fraction"], 3), rec["exact"]]
        out["b"] = [j, round(peer["fraction"], 3), peer["exact"]]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
