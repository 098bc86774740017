"""What this machine can train with a rig's paced ranks running at once.

``elche bench`` measures the same capacity for every workload and rig it
runs (``elche.bench.capacity``) and divides each row by it
(``of_capacity``); this prints it alone:

    python scripts/concurrent_capacity.py --workload digits-cnn --speeds 1,0.5,0.25
"""

from __future__ import annotations

import argparse

from elche.bench.capacity import measure_capacity
from elche.bench.runner import measure_speed_base_s
from elche.workloads import get as get_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="digits-cnn")
    parser.add_argument("--speeds", default="1,0.5,0.25")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    speeds = [float(s) for s in args.speeds.split(",")]
    workload = get_workload(args.workload)
    base_s = measure_speed_base_s(workload, workload.load_split(0), args.batch_size)
    capacity = measure_capacity(
        args.workload, speeds, speed_base_s=base_s, batch_size=args.batch_size,
        seconds=args.seconds,
    )  # fmt: skip
    print(f"{args.workload}, solo step {1000 * base_s:.2f} ms, speeds {args.speeds}:")
    for speed, step_ms in zip(speeds, capacity.step_ms, strict=True):
        print(f"  speed {speed:g}: {step_ms:.2f} ms a step (alone: {1000 * base_s / speed:.2f})")
    print(
        f"capacity: {capacity.samples_per_s:.0f} of {capacity.nominal_samples_per_s:.0f} "
        f"samples/s = {capacity.fraction:.3f}"
    )


if __name__ == "__main__":
    main()
