"""One rank of a several-hosts benchmark run: what torchrun starts on each host.

``python -m elche.bench.on_host SYSTEM WORKLOAD EPOCHS BATCH SEED SPEEDS BASE_S RUN_DIR
SAMPLES`` under ``torchrun`` (one process per host; ``elche.bench.hosts`` starts it in
each namespace host of a ``Rig``). Every rank loads the workload's split
itself (deterministic per seed: every host holds the same data, no host
reads another's files) and runs at ``SPEEDS[RANK]``, paced by the shared
solo step ``BASE_S``; ``SAMPLES`` is the plan's ``train_samples`` (``all``:
the whole training set).

- ``torch-ddp``: the DDP baseline's own training loop
  (``elche.baselines.ddp``), in a gloo group that torchrun's environment
  rendezvous forms over the hosts' links; each rank prints its report as one
  ``REPORT <json>`` line.
- an elche mode: ``elche.train`` exactly as a user's script under torchrun
  calls it, its run directory ``RUN_DIR`` on every host's own ``/tmp``;
  rank 0 prints ``SUMMARY <json>``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.utils.data import TensorDataset

__all__ = ["COLLECTIVE_TIMEOUT_S", "REPORT_PREFIX", "SUMMARY_PREFIX", "HostRun", "main"]

REPORT_PREFIX = "REPORT "  # a DDP rank's report line
SUMMARY_PREFIX = "SUMMARY "  # elche rank 0's summary line
COLLECTIVE_TIMEOUT_S = 600.0  # a DDP collective that waits longer has lost its peer
ALL_SAMPLES = "all"  # HostRun.train_samples None on the command line
OVERLAP, WAIT = "overlap", "wait"  # HostRun.overlap on the command line


@dataclass(frozen=True, slots=True)
class HostRun:
    """What every host's rank trains: the command line's arguments."""

    system: str
    workload: str
    epochs: int
    batch_size: int
    seed: int
    speeds: tuple[float, ...]
    speed_base_s: float
    run_dir: str
    train_samples: int | None = None  # ``elche.workloads.load_split``'s; None: all
    wire: str = "fp32"  # an elche mode's averaging wire
    overlap: bool = True  # an elche mode's collective rounds overlap training

    def argv(self) -> list[str]:
        """The command line's arguments that ``parse`` reads back."""
        return [self.system, self.workload, str(self.epochs), str(self.batch_size),
                str(self.seed), ",".join(repr(float(s)) for s in self.speeds),
                repr(self.speed_base_s), self.run_dir,
                ALL_SAMPLES if self.train_samples is None else str(self.train_samples),
                self.wire, OVERLAP if self.overlap else WAIT]  # fmt: skip

    @classmethod
    def parse(cls, argv: Sequence[str]) -> HostRun:
        """The run ``argv`` (as ``argv()`` wrote it) describes."""
        system, workload, epochs, batch, seed, speeds, base_s, run_dir, samples, wire, overlap = (
            argv
        )
        return cls(system, workload, int(epochs), int(batch), int(seed),
                   tuple(float(s) for s in speeds.split(",")), float(base_s), run_dir,
                   None if samples == ALL_SAMPLES else int(samples), wire,
                   overlap == OVERLAP)  # fmt: skip

    def split(self) -> tuple[TensorDataset, TensorDataset]:
        """The workload's split this run trains and evaluates on."""
        from elche.workloads import load_split

        return load_split(self.workload, self.seed, train_samples=self.train_samples)


def main(argv: Sequence[str]) -> int:
    """Run this host's rank; print what the parent collects. Returns the exit status."""
    run = HostRun.parse(argv)
    if run.system == "torch-ddp":
        print(REPORT_PREFIX + json.dumps(_ddp(run)), flush=True)
        return 0
    summary = _elche(run)
    if summary is not None:
        print(SUMMARY_PREFIX + json.dumps(summary), flush=True)
    return 0


def _ddp(run: HostRun) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    from elche.baselines.ddp import _Plan, _train

    torch.set_num_threads(1)  # as every rank of every system runs
    train_set, test_set = run.split()
    plan = _Plan(run.speeds, run.epochs, run.batch_size, run.seed, run.workload, train_set,
                 test_set, run_dir="", timeout_s=COLLECTIVE_TIMEOUT_S,
                 base_step_s=run.speed_base_s)  # fmt: skip
    dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        return _train(dist.get_rank(), plan)
    finally:
        dist.destroy_process_group()


def _elche(run: HostRun) -> dict[str, object] | None:
    from elche.api import train
    from elche.runtime.lifetimes import RESUME_HINT
    from elche.workloads import get

    work = get(run.workload)
    train_set, test_set = run.split()
    RESUME_HINT.set(None)  # a stopped cell says where it is saved: the bench resumes none
    result = train(
        work.make_model, work.make_optimizer, work.step_fn, train_set,
        batch_size=run.batch_size, epochs=run.epochs, mode=run.system, speeds=list(run.speeds),
        speed_base_s=run.speed_base_s, eval_fn=work.eval_fn, eval_dataset=test_set,
        eval_every=1, seed=run.seed, progress=False, run_dir=run.run_dir, wire=run.wire,
        overlap=run.overlap,
    )  # fmt: skip
    return dict(result.summary) if os.environ.get("RANK") == "0" else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
