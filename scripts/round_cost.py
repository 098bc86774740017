"""What one averaging round costs a rank in CPU time, per workload's model.

A ``cadence`` rank that trains through its round pays, on its own thread:
the launch (a snapshot of its tensors, packed and weighted into the
all-reduce's buffer), the land (the consensus, the divergence of the
snapshot from it, the model set to it plus what the rank trained since) and
the kept consensus (``Consensus.keep``: a finite-checked host copy). On a
machine whose cores the ranks share, every millisecond of it is taken from
the steps. This times each part alone (one thread, a world of one, so no
peer's time is in it), the median of ``--repeats``:

    python scripts/round_cost.py digits-cnn digits-mlp tiny-gpt
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from elche.runtime.averaging import launch_average
from elche.runtime.consensus import Consensus
from elche.workloads import get as get_workload


def _median_ms(work: Callable[[], object], repeats: int) -> float:
    """The median thread CPU time of ``work``, in milliseconds."""
    times = []
    for _ in range(repeats):
        started = time.thread_time()
        work()
        times.append(time.thread_time() - started)
    return 1000.0 * statistics.median(times)


def _costs(name: str, repeats: int) -> str:
    """One workload's line: its model's size and each part's median CPU time."""
    model = get_workload(name).make_model("cpu")
    params = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    launch = _median_ms(lambda: launch_average(model, 10), repeats)
    flights = [launch_average(model, 10) for _ in range(repeats)]
    land = _median_ms(lambda: flights.pop().land(moved=True), repeats)
    kept = Consensus()
    keep = _median_ms(lambda: kept.keep(model), repeats)
    return (
        f"{name}: {params:,} parameters in {tensors} tensors: launch {launch:.2f} ms, "
        f"land {land:.2f} ms, keep {keep:.2f} ms a round"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="*", default=["digits-cnn", "digits-mlp", "tiny-gpt"])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as every rank process runs
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            for name in args.workloads:
                print(_costs(name, args.repeats))
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
