"""What this machine can train with a rig's paced ranks running at once.

Every rank trains its own copy of the workload's model on a fixed batch,
paced by elche's speed injection (one shared solo step, as ``elche bench``
does), with no communication and no coordinator, all started together and
stopped after the same number of seconds. Their summed steps per second,
against the rig's nominal Σ speed / solo step, is the share of the rig that
the machine itself delivers when the ranks compete for its cores: a ceiling
for the *efficiency* column of ``elche bench`` that no data-parallel system
(elche or torch DDP) can pass on this machine.

    python scripts/concurrent_capacity.py --workload digits-cnn --speeds 1,0.5,0.25
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from multiprocessing.synchronize import Barrier
from typing import Any

import torch

from elche.bench.runner import measure_speed_base_s
from elche.runtime.data import fetch
from elche.runtime.pacing import Pacer, warm_up
from elche.workloads import get as get_workload


def _rank(job: tuple[str, float, float, float], start: Barrier, out: Any) -> None:
    workload_name, speed, base_s, seconds = job
    torch.set_num_threads(1)
    workload = get_workload(workload_name)
    train_set, _ = workload.load_split(0)
    model = workload.make_model("cpu")
    optimizer = workload.make_optimizer(model.parameters())
    batch = fetch(train_set, range(32))
    warm_up(model, workload.step_fn, batch)
    pacer = Pacer(speed, base_s)
    start.wait()
    began, steps = time.perf_counter(), 0
    while time.perf_counter() - began < seconds:
        optimizer.zero_grad(set_to_none=True)
        workload.step_fn(model, batch).backward()  # type: ignore[no-untyped-call]  # torch stub
        optimizer.step()
        pacer.after_step()
        steps += 1
    out.put((speed, steps, time.perf_counter() - began))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="digits-cnn")
    parser.add_argument("--speeds", default="1,0.5,0.25")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    speeds = [float(s) for s in args.speeds.split(",")]
    workload = get_workload(args.workload)
    base_s = measure_speed_base_s(workload, workload.load_split(0), 32)
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(len(speeds)), ctx.Queue()
    ranks = [
        ctx.Process(target=_rank, args=((args.workload, s, base_s, args.seconds), start, out))
        for s in speeds
    ]
    for rank in ranks:
        rank.start()
    results = sorted((out.get() for _ in ranks), reverse=True)
    for rank in ranks:
        rank.join()
    print(f"{args.workload}, solo step {1000 * base_s:.2f} ms, speeds {args.speeds}:")
    for speed, steps, wall_s in results:
        print(f"  speed {speed:g}: {1000 * wall_s / steps:.2f} ms a step "
              f"(alone: {1000 * base_s / speed:.2f})")  # fmt: skip
    delivered = sum(steps / wall_s for _, steps, wall_s in results)
    nominal = sum(speeds) / base_s
    print(f"capacity: {delivered:.0f} of {nominal:.0f} steps/s = {delivered / nominal:.3f}")


if __name__ == "__main__":
    main()
