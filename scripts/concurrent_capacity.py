"""What this machine can train with a rig's paced ranks running at once.

``elche bench`` measures the same capacity for every workload and rig it
runs (``elche.bench.capacity``) and divides each row by it
(``of_capacity``); this prints it alone:

    python scripts/concurrent_capacity.py --workload digits-cnn --speeds 1,0.5,0.25

or, with ``--pairs N``, N probes alternating with runs of a system on the
quick suite's cut, each run over the probe just before it.
"""

from __future__ import annotations

import argparse

from elche.bench.capacity import measure_capacity
from elche.bench.metrics import spread
from elche.bench.runner import measure_speed_base_s, run_one
from elche.bench.suites import QUICK
from elche.workloads import get as get_workload
from elche.workloads import load_split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="digits-cnn")
    parser.add_argument("--speeds", default="1,0.5,0.25")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--batch-size", type=int, default=32, help="(pairs: the quick suite's)")
    parser.add_argument("--pairs", type=int, default=0, help="probe/run pairs instead")
    parser.add_argument("--system", default="cadence", help="what the pairs run")
    args = parser.parse_args()
    speeds = [float(s) for s in args.speeds.split(",")]
    if args.pairs:
        _pairs(args, speeds)
        return
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


def _pairs(args: argparse.Namespace, speeds: list[float]) -> None:
    """Alternate probes with runs of ``args.system``; each run over the probe before it.

    As ``elche bench`` does, on the quick suite's cut of the workload, with its
    batch size, and paced by a solo step measured on that cut and batch.
    """
    plans = {p.name: p for p in QUICK.workloads}
    if args.workload not in plans:
        raise SystemExit(f"--pairs runs the quick suite's workloads: {', '.join(plans)}")
    plan = plans[args.workload]
    split = load_split(plan.name, 0, train_samples=plan.train_samples)
    base_s = measure_speed_base_s(get_workload(plan.name), split, plan.batch_size)
    print(f"{plan.name}, the quick cut at batch {plan.batch_size}, solo step "
          f"{1000 * base_s:.2f} ms, speeds {args.speeds}:")  # fmt: skip
    ratios = []
    for pair in range(args.pairs):
        capacity = measure_capacity(
            args.workload, speeds, speed_base_s=base_s, batch_size=plan.batch_size,
            seconds=args.seconds,
        )  # fmt: skip
        run = run_one(args.system, plan, speeds, seed=0, split=split, speed_base_s=base_s)
        if run["error"] is not None:
            raise SystemExit(f"{args.system} failed: {run['error']}")
        ratios.append(run["samples_per_s"] / capacity.samples_per_s)
        print(
            f"pair {pair}: probe {capacity.samples_per_s:.0f} samples/s "
            f"(steps {', '.join(f'{ms:.2f}' for ms in capacity.step_ms)} ms), "
            f"{args.system} {run['wall_s']:.2f} s, {run['samples_per_s']:.0f} samples/s "
            f"= {ratios[-1]:.3f} of it"
        )
    summary = spread(ratios)
    assert summary is not None  # one ratio a pair, at least one pair
    print(f"{args.system} of the adjacent probe: median {summary['median']:.3f} "
          f"({summary['min']:.3f}-{summary['max']:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
