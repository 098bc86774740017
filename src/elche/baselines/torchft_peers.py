"""Peers: torchft's ``LocalSGD`` and ``DiLoCo`` on the same workload.

torchft (``pip install 'elche[peers]'``) is what users pick instead of elche
for unreliable or unequal machines, so ``elche bench`` runs it side by side
with the same rules as the DDP baseline (``elche.baselines.ddp``): the same
workload, split, seed, epochs, per-rank batch size, ``DistributedSampler``
shard and speed injection (``Pacer.after_step`` after every optimizer step,
by the bench's shared ``base_step_s``), one spawned process per rank, one
thread each, gloo on loopback.

How torchft is set up
---------------------
- The lighthouse (torchft's quorum server, ``LighthouseServer``) runs in the
  calling process on ``[::]:0``; ``min_replicas`` is the number of ranks, so
  every quorum holds every rank (nobody is lost in a benchmark).
- Each rank is one torchft *replica group* of one process: it starts its own
  ``TCPStore`` on port 0, a ``ProcessGroupGloo`` and a ``Manager``
  (``use_async_quorum=False``, which DiLoCo requires and LocalSGD accepts;
  ``init_sync=False`` because every rank builds identical weights from the
  workload's seed). Ports are all chosen by the OS.
- ``torchft-localsgd``: ``LocalSGD(manager, model, optimizer, sync_every)``
  averages the weights every ``sync_every`` optimizer steps; the remaining
  steps of the last window are averaged by one last ``sync()``.
- ``torchft-diloco``: ``DiLoCo(manager, [model], inner, outer, sync_every)``
  with the workload's optimizer as the inner one and the DiLoCo paper's
  outer optimizer, SGD(lr 0.7, momentum 0.9, Nesterov). DiLoCo has no public
  call to average a partial window, so the last ``steps mod sync_every``
  local steps of each rank stay local and rank 0's model is evaluated.

The sync interval: ``SYNC_EVERY = 10`` optimizer steps per rank between
averages, the number of steps cadence's slowest rank makes per window at
its default anchor (``SchedulerConfig.anchor_for``: 10). torchft is
lock-step at every sync — each rank makes the same number of steps per
window — so the slow rank sets the pace between syncs, as in DDP, but it
pays for an averaging round ten times less often.

Clocks match the DDP baseline: ``wall_s`` is rank 0's, from a barrier
(a quorum and an all-reduce of one number through the manager, before the
first batch) to the same barrier after the last step and the last sync;
``per_epoch`` has rank 0's epoch ends, the loss over every rank, and the
eval of rank 0's weights at each epoch end, evaluated after the clock.

``available()`` tells whether torchft can be imported, and why not.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from elche.baselines import ddp
from elche.core.errors import ConfigError
from elche.runtime.pacing import Pacer, check_speed_base_s, warm_up
from elche.workloads import get as get_workload
from elche.workloads import load_split

__all__ = [
    "ALGORITHMS",
    "DEFAULT_TIMEOUT_S",
    "DILOCO",
    "LOCALSGD",
    "OUTER_LR",
    "SYNC_EVERY",
    "available",
    "run_torchft",
]

LOCALSGD = "torchft-localsgd"
DILOCO = "torchft-diloco"
ALGORITHMS = (LOCALSGD, DILOCO)  # the ``system`` names in benchmark rows
SYNC_EVERY = 10  # optimizer steps per rank between averages: cadence's default anchor
OUTER_LR = 0.7  # DiLoCo's outer SGD (the paper's): lr 0.7, momentum 0.9, Nesterov
OUTER_MOMENTUM = 0.9
DEFAULT_TIMEOUT_S = 300.0
INSTALL_HINT = "pip install 'elche[peers]'"
RUST_LOG_ENV = "RUST_LOG"  # torchft's lighthouse and managers log through Rust's ``log``

JsonDict = dict[str, object]


def available() -> tuple[bool, str]:
    """Whether torchft can run here: ``(True, "")`` or ``(False, reason)``."""
    if importlib.util.find_spec("torchft") is None:
        return False, f"torchft is not installed ({INSTALL_HINT})"
    return True, ""


@dataclass(frozen=True, slots=True)
class _FtPlan:
    """What a torchft rank needs on top of the DDP baseline's plan."""

    base: ddp._Plan
    algorithm: str
    lighthouse: str
    sync_every: int


def run_torchft(
    algorithm: str,
    *,
    speeds: Sequence[float],
    epochs: int,
    batch_size: int = 32,
    seed: int = 0,
    workload: str = "digits",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    base_step_s: float | None = None,
    sync_every: int = SYNC_EVERY,
    train_samples: int | None = None,
) -> JsonDict:
    """Train ``workload`` with torchft's ``algorithm``, one local process per speed.

    Args:
        algorithm: ``torchft-localsgd`` or ``torchft-diloco``.
        speeds, epochs, batch_size, seed, workload, timeout_s, train_samples:
            as ``run_ddp``.
        base_step_s: the solo step time every rank paces by, in seconds;
            required (torchft ranks do not time their own step).
        sync_every: optimizer steps per rank between averages, ≥ 1.

    Returns:
        ``run_ddp``'s result shape with ``system`` = ``algorithm``, plus
        ``syncs`` (averaging rounds) and ``sync_every``.

    Raises:
        ConfigError: a bad argument (field named); nothing started.
        RuntimeError: torchft is missing, a rank failed or the run timed out;
            every rank has been stopped.
    """
    if algorithm not in ALGORITHMS:
        raise ConfigError("algorithm", f"must be one of {ALGORITHMS}, got {algorithm!r}")
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ConfigError("sync_every", f"must be an integer >= 1, got {sync_every!r}")
    plan_speeds = ddp._check_args(speeds, epochs, batch_size, workload, timeout_s)
    base = check_speed_base_s(base_step_s)
    if base is None:
        raise ConfigError("speed_base_s", "torchft ranks need the shared solo step time, got None")
    ok, reason = available()
    if not ok:
        raise RuntimeError(f"{algorithm}: {reason}")
    os.environ.setdefault(RUST_LOG_ENV, "warn")  # torchft's quorum log: one line a sync
    from torchft._torchft import LighthouseServer

    train_set, test_set = load_split(workload, seed, train_samples=train_samples)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=len(plan_speeds))
    try:
        with tempfile.TemporaryDirectory(prefix="elche-torchft-") as run_dir:
            base_plan = ddp._Plan(
                plan_speeds, epochs, batch_size, seed, workload, train_set, test_set, run_dir,
                timeout_s, base,
            )  # fmt: skip
            plan = _FtPlan(base_plan, algorithm, lighthouse.address(), sync_every)
            launched_at = time.time()
            ddp._spawn_ranks(
                _rank_main, plan, nprocs=len(plan_speeds), timeout_s=timeout_s, system=algorithm
            )
            reports = [
                ddp._read_report(Path(run_dir), r, system=algorithm)
                for r in range(len(plan_speeds))
            ]
    finally:
        lighthouse.shutdown()
    result = ddp._summarize(base_plan, reports, launched_at)
    result["system"] = algorithm
    result["syncs"] = reports[0]["syncs"]
    result["sync_every"] = sync_every
    return result


def _rank_main(rank: int, plan: _FtPlan) -> None:
    """One torchft replica: its store, process group and manager; train; report."""
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    torch.set_num_threads(1)
    logging.getLogger("torchft.manager").setLevel(logging.ERROR)  # no per-step chatter
    if sys.platform.startswith("linux"):
        os.environ.setdefault(ddp.GLOO_SOCKET_IFNAME_ENV, "lo")
    timeout = timedelta(seconds=plan.base.timeout_s)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]  # not re-exported in stubs
    work = get_workload(plan.base.workload)
    model = work.make_model("cpu")
    optimizer = work.make_optimizer(model.parameters())
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        min_replica_size=len(plan.base.speeds),
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=plan.lighthouse,
        replica_id=f"elche_bench_{rank}",
        hostname="localhost",
        init_sync=False,
    )
    try:
        report = _train(rank, plan, work=work, model=model, optimizer=optimizer, manager=manager)
    finally:
        manager.shutdown(wait=False)
    path = Path(plan.base.run_dir) / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(report))
    path.with_suffix(".tmp").replace(path)
    # torchft's background threads (heartbeats, the checkpoint server) take
    # seconds to wind down after the report is safe; nothing is left to keep.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _barrier(manager: Any) -> None:
    """Every replica here: a quorum and an all-reduce of one number."""
    manager.start_quorum()
    manager.allreduce(torch.zeros(1)).wait()
    if not manager.should_commit():
        raise RuntimeError("torchft: a barrier's all-reduce did not commit")


def _wrap(plan: _FtPlan, manager: Any, model: Any, optimizer: Any) -> Any:
    """The algorithm's context manager around ``model`` and ``optimizer``."""
    from torchft.local_sgd import DiLoCo, LocalSGD

    if plan.algorithm == LOCALSGD:
        return LocalSGD(manager, model, optimizer, sync_every=plan.sync_every)
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    return DiLoCo(manager, [model], optimizer, outer, sync_every=plan.sync_every)


def _train(
    rank: int, plan: _FtPlan, *, work: Any, model: Any, optimizer: Any, manager: Any
) -> JsonDict:
    """Pace, train and (on rank 0) evaluate; the DDP baseline's report, plus syncs."""
    base = plan.base
    sampler: DistributedSampler[int] = DistributedSampler(
        base.train_set, num_replicas=len(base.speeds), rank=rank, shuffle=True, seed=base.seed
    )
    loader = DataLoader(base.train_set, batch_size=base.batch_size, sampler=sampler)
    sampler.set_epoch(0)
    warm_up(model, work.step_fn, next(iter(loader)))
    base_s = float(base.base_step_s or 0.0)
    pacer = Pacer(base.speeds[rank], base_s)
    samples = steps = 0
    loss_sum, epoch_samples = 0.0, 0
    epochs: list[tuple[float, float, int]] = []
    snapshots: list[dict[str, torch.Tensor]] = []
    with _wrap(plan, manager, model, optimizer) as algorithm:
        _barrier(manager)
        started_at = time.time()
        start_s = time.perf_counter()
        for epoch in range(base.epochs):
            sampler.set_epoch(epoch)
            loss_sum, epoch_samples = 0.0, 0
            for batch in loader:
                optimizer.zero_grad(set_to_none=True)
                loss = work.step_fn(model, batch)
                loss.backward()
                optimizer.step()  # LocalSGD / DiLoCo average inside, every sync_every steps
                pacer.after_step()
                loss_sum += float(loss.item()) * len(batch[1])
                epoch_samples += len(batch[1])
                steps += 1
            samples += epoch_samples
            epochs.append((time.perf_counter() - start_s, loss_sum, epoch_samples))
            if rank == 0:
                snapshots.append(ddp.snapshot(model))
        if plan.algorithm == LOCALSGD and steps % plan.sync_every:
            algorithm.sync()  # the last, partial window
        _barrier(manager)
        wall_s = time.perf_counter() - start_s
    syncs = steps // plan.sync_every
    if plan.algorithm == LOCALSGD and steps % plan.sync_every:
        syncs += 1
    if rank == 0:
        snapshots[-1] = ddp.snapshot(model)  # after the last average
    report = ddp.rank_report(
        rank, base.speeds[rank], pacer, steps=steps, samples=samples, wall_s=wall_s,
        started_at=started_at, last_epoch=(loss_sum, epoch_samples), epochs=epochs,
        **ddp.final_and_epoch_evals(base.workload, model, snapshots, base.test_set, rank),
    )  # fmt: skip
    return {**report, "syncs": syncs}
