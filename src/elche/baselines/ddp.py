"""The competitor: torch ``DistributedDataParallel`` on the same workload.

Every elche claim is a ratio against this baseline, run on the same machine,
on the same workload, with the same speed injection (design §1.4, §4). It is
plain, textbook DDP — nothing here tries to make it slow:

- one spawned process per entry of ``speeds`` (``torch.multiprocessing``,
  ``spawn``), rendezvous through a ``FileStore`` in a temporary directory (no
  ports), the gloo backend, one thread per rank;
- ``DistributedDataParallel`` over the workload's model, a
  ``DistributedSampler(shuffle=True, seed=seed)`` with ``set_epoch`` every
  epoch, ``batch_size`` samples **per rank** per step (the DDP convention: the
  global batch is ``batch_size × world_size``);
- a rank at speed s measures its solo step once on its first batch
  (``measure_base_step_s``, before DDP wraps the model) and calls
  ``Pacer.after_step`` after every optimizer step — exactly elche's rule.
  As in elche's worker, the paced ranks (s < 1) time their step after the
  process-group rendezvous, when every peer has started, and together; ranks
  at full speed (whose wait is 0 whatever they measure) time theirs after a
  barrier, so they never crowd the paced ranks' measurement on a small
  machine. Their ``base`` only feeds the ``idle_s`` estimate. Given
  ``base_step_s`` (``elche bench`` measures it once per workload and hands
  the same value to every system), no rank times anything: each runs two
  untraced warm-up passes (``warm_up``, as elche's ranks do) and paces by it.

Clocks and the reported numbers
-------------------------------
- The parent loads the workload's split once and hands it to every rank
  (as ``elche.train`` receives datasets), so no rank imports scikit-learn.
- ``startup_s``: from the parent launching the ranks (after loading the data)
  to rank 0 starting the training clock — process start, imports, process
  group, model build, base-step measurement. Two processes are involved, so it is
  read off ``time.time()``; everything else uses ``time.perf_counter``.
- ``wall_s``: on rank 0, from a barrier just before the first batch to a
  barrier just after every rank's last step (and its last injected wait), so
  the slowest rank's tail counts, as it does for elche's final average.
- ``idle_s`` of a rank: ``wall − steps × base_s − injected_s``, floored at 0:
  the time it neither computed (at its solo pace) nor was held back on
  purpose — waiting in DDP's all-reduce for slower peers, plus communication
  and data-loading overhead. A rank's compute is taken from its solo step
  time because under DDP the gradient all-reduce overlaps the backward pass
  and cannot be timed apart from it.
- ``final_loss``: the sample-weighted mean training loss of the last epoch
  over every rank; ``eval``: rank 0's ``eval_fn`` on the test split after
  training, outside ``wall_s`` (the workload's ``metric``; also under the
  older name ``eval_accuracy``).
- ``per_epoch``: per epoch, ``t`` — rank 0's ``wall_s`` clock when its last
  step of the epoch (and its injected wait) finished; lock-step DDP keeps the
  ranks within one step of each other — and ``loss``, the sample-weighted
  mean training loss of that epoch over every rank — and ``eval``, rank 0's
  ``eval_fn`` on its model as it was at that epoch end (a copy of the weights
  taken inside the clock, evaluated after it, so time to a target eval costs
  the baseline nothing).

Workloads come from the registry (``elche.workloads.get``), by name.

Failures: a rank that raises makes the parent terminate the others and raise
``RuntimeError`` carrying that rank's traceback; a run that exceeds
``timeout_s`` is terminated and raises ``RuntimeError`` too. Nothing hangs.

CLI: ``python -m elche.baselines.ddp --speeds 1,0.5,0.25 --epochs 5 --json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessContext, ProcessException, start_processes
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elche.core.errors import ConfigError
from elche.runtime.pacing import (
    Pacer,
    check_speed,
    check_speed_base_s,
    measure_base_step_s,
    warm_up,
)
from elche.workloads import ALIASES, load_split
from elche.workloads import get as get_workload
from elche.workloads import names as workload_names

__all__ = [
    "GLOO_SOCKET_IFNAME_ENV",
    "SYSTEM",
    "WORKLOADS",
    "eval_snapshots",
    "final_and_epoch_evals",
    "main",
    "run_ddp",
    "snapshot",
]

SYSTEM = "torch-ddp"  # the ``system`` name in benchmark rows (design §6)
WORKLOADS = (*workload_names(), *ALIASES)  # the registry's names, plus "digits"
GLOO_SOCKET_IFNAME_ENV = "GLOO_SOCKET_IFNAME"  # gloo can hang without it locally (design §4)
DEFAULT_TIMEOUT_S = 300.0  # the whole run; also the process group's collective timeout
GRACE_S = 1.0  # after a rank fails, the others get this long before SIGTERM: they are
# usually blocked in a collective that will never complete, so waiting longer buys nothing

JsonDict = dict[str, object]
P = TypeVar("P")  # what a spawned rank receives


@dataclass(frozen=True, slots=True)
class _Plan:
    """Everything a rank needs, pickled once into every spawned process."""

    speeds: tuple[float, ...]
    epochs: int
    batch_size: int
    seed: int
    workload: str
    train_set: TensorDataset
    test_set: TensorDataset
    run_dir: str
    timeout_s: float
    base_step_s: float | None = None


def run_ddp(
    *,
    speeds: Sequence[float],
    epochs: int,
    batch_size: int = 32,
    seed: int = 0,
    workload: str = "digits",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    base_step_s: float | None = None,
    train_samples: int | None = None,
) -> JsonDict:
    """Train ``workload`` with torch DDP, one local process per speed.

    Args:
        speeds: one entry per rank, each in (0, 1]; rank r runs at speeds[r].
        epochs: full passes over the training split, ≥ 1.
        batch_size: samples per rank per step, ≥ 1.
        seed: the split's and the sampler's seed.
        workload: a name in ``WORKLOADS``.
        timeout_s: the most the whole run may take, and the collective timeout.
        base_step_s: the solo step time every rank paces by; None: each
            rank measures its own.
        train_samples: train on this many of the training set's samples
            (``elche.workloads.load_split``); None: all of them.

    Returns:
        ``{"system", "workload", "speeds", "world_size", "epochs",
        "batch_size", "wall_s", "startup_s", "samples_per_s", "final_loss",
        "eval", "metric", "eval_accuracy", "per_epoch": [{"epoch", "t", "loss", "eval"}],
        "per_rank": [{"rank", "speed", "samples", "steps", "base_step_s",
        "injected_s", "idle_s"}]}``; the module docstring defines each clock.

    Raises:
        ConfigError: a bad ``speeds`` (field ``"speeds"``), ``epochs``,
            ``batch_size``, ``workload``, ``timeout_s``, ``base_step_s``
            (field ``"speed_base_s"``) or ``train_samples``; nothing started.
        RuntimeError: a rank failed (its traceback is in the message) or the
            run exceeded ``timeout_s``; every rank has been stopped.
    """
    plan_speeds = _check_args(speeds, epochs, batch_size, workload, timeout_s)
    base = check_speed_base_s(base_step_s)
    train_set, test_set = load_split(workload, seed, train_samples=train_samples)
    with tempfile.TemporaryDirectory(prefix="elche-ddp-") as run_dir:
        plan = _Plan(
            plan_speeds, epochs, batch_size, seed, workload, train_set, test_set, run_dir,
            timeout_s, base,
        )  # fmt: skip
        launched_at = time.time()  # wall clock: compared with rank 0's in another process
        _spawn_ranks(_rank_main, plan, nprocs=len(plan_speeds), timeout_s=timeout_s)
        reports = [_read_report(Path(run_dir), rank) for rank in range(len(plan_speeds))]
    return _summarize(plan, reports, launched_at)


def _check_args(
    speeds: Sequence[float], epochs: int, batch_size: int, workload: str, timeout_s: float
) -> tuple[float, ...]:
    """Validate ``run_ddp``'s arguments; return the speeds as floats."""
    if isinstance(speeds, str) or len(speeds) < 1:
        raise ConfigError("speeds", f"need one speed per rank, got {speeds!r}")
    for name, value in (("epochs", epochs), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
    if workload not in WORKLOADS:
        raise ConfigError("workload", f"must be one of {WORKLOADS}, got {workload!r}")
    if isinstance(timeout_s, bool) or not 0 < timeout_s < math.inf:
        raise ConfigError("timeout_s", f"must be finite and > 0 seconds, got {timeout_s!r}")
    return tuple(check_speed(s) for s in speeds)


def _spawn_ranks(
    fn: Callable[[int, P], None], plan: P, *, nprocs: int, timeout_s: float, system: str = SYSTEM
) -> None:
    """Run ``fn(rank, plan)`` in ``nprocs`` processes; wait for all.

    The ranks fork from elche's fork server (``runtime.launch.rank_context``:
    torch preloaded), as elche's own local ranks do, so neither system pays
    for importing torch in every rank of every run; and as theirs, each takes
    this process's environment, stdout and stderr as they are now, not the
    fork server's. Each rank ends as soon as this process is gone (a killed
    bench): it has nothing to save, and the fork server's ranks are not this
    process's children, so nothing else would end them.

    Raises:
        RuntimeError: a process raised or died (the others are terminated
            after ``GRACE_S``), or they were not all done within
            ``timeout_s`` (all are terminated).
    """
    from elche.runtime.launch import rank_context  # the launcher's side only
    from elche.runtime.lifetimes import held_stop_signals, launcher_streams

    method = rank_context().get_start_method()  # elche's warm fork server, where there is one
    context: ProcessContext | None = None
    before = set(multiprocessing.active_children())
    deadline_s = time.monotonic() + timeout_s
    try:
        # A stop while they start comes once all are known, so the cleanup below
        # stops them: raised in between, it left the ranks started so far running.
        with held_stop_signals(), launcher_streams(method) as streams:
            context = start_processes(  # type: ignore[no-untyped-call]  # untyped
                _in_environment,
                args=(fn, _Launcher(dict(os.environ), streams, os.getpid()), plan),
                nprocs=nprocs,
                join=False,
                start_method=method,
            )
        while not context.join(
            timeout=max(deadline_s - time.monotonic(), 0.0), grace_period=GRACE_S
        ):
            if time.monotonic() >= deadline_s:
                raise RuntimeError(f"{system}: the run exceeded its {timeout_s:g} s timeout")
    except ProcessException as exc:
        raise RuntimeError(f"{system}: rank {exc.error_index} failed: {exc}") from exc
    finally:
        if context is not None:
            _stop_all(context.processes)
            _remove_error_files(context)
        else:  # a second Ctrl-C cut the start short: the ranks started by then are ours
            _stop_all(
                [process for process in multiprocessing.active_children() if process not in before]
            )


class _Launcher(NamedTuple):
    """The spawning process, as its ranks take it: its environment, its stdout
    and stderr (when forked: ``lifetimes.launcher_streams``), its pid."""

    env: dict[str, str]
    streams: Sequence[Connection]
    pid: int


def _in_environment(rank: int, fn: Callable[[int, P], None], launcher: _Launcher, plan: P) -> None:
    """A rank: the launcher's environment and streams, an end once the launcher
    is gone, then ``fn(rank, plan)``."""
    from elche.runtime.lifetimes import take_environment, take_streams, watch_launcher

    take_environment(launcher.env)
    take_streams(launcher.streams)
    watch_launcher(launcher.pid, grace_s=0.0)
    fn(rank, plan)


def _remove_error_files(context: ProcessContext) -> None:
    """Remove the ``/tmp/pytorch-errorfile-*.pickle`` files ``start_processes`` named
    for this run's ranks: torch never does, and a rank that raised (one whose peer
    was stopped, say) wrote its traceback there; ``join`` has read it by now."""
    for path in context.error_files:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _stop_all(processes: Sequence[BaseProcess]) -> None:
    """Terminate whatever is still alive, give them ``GRACE_S`` together, then kill
    the rest at once; reap everything.

    Ranks forked from elche's fork server ignore SIGTERM (``runtime.forkserved``),
    so the kill is what ends them. Killed one grace apart, each rank's peers
    outlived it by a second and said so: an interrupted bench's torchft ranks
    printed a traceback for every connection closed under them.
    """
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline_s = time.monotonic() + GRACE_S
    for process in processes:
        process.join(max(deadline_s - time.monotonic(), 0.0))
    survivors = [process for process in processes if process.is_alive()]
    for process in survivors:
        process.kill()
    for process in survivors:
        process.join()


def _rank_main(rank: int, plan: _Plan) -> None:
    """One DDP rank: join the group, train, write ``rank<r>.json``."""
    torch.set_num_threads(1)  # ranks share a few cores; oversubscription distorts timing
    if sys.platform.startswith("linux"):
        os.environ.setdefault(GLOO_SOCKET_IFNAME_ENV, "lo")  # all ranks are local
    world_size = len(plan.speeds)
    store = dist.FileStore(str(Path(plan.run_dir) / "store"), world_size)  # type: ignore[attr-defined]  # not re-exported in stubs
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=plan.timeout_s),
    )
    try:
        report = _train(rank, plan)
    finally:
        dist.destroy_process_group()
    path = Path(plan.run_dir) / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(report))
    path.with_suffix(".tmp").replace(path)  # atomic: the parent never reads half a file


def _train(rank: int, plan: _Plan) -> JsonDict:
    """Pace, train and (on rank 0) evaluate; return this rank's report."""
    work = get_workload(plan.workload)
    train_set, test_set = plan.train_set, plan.test_set
    model = work.make_model("cpu")
    optimizer = work.make_optimizer(model.parameters())
    sampler: DistributedSampler[int] = DistributedSampler(
        train_set, num_replicas=len(plan.speeds), rank=rank, shuffle=True, seed=plan.seed
    )
    loader = DataLoader(train_set, batch_size=plan.batch_size, sampler=sampler)
    sampler.set_epoch(0)
    first = next(iter(loader))
    if plan.base_step_s is not None:
        warm_up(model, work.step_fn, first)
        base_s = plan.base_step_s
    else:
        paced = plan.speeds[rank] < 1.0
        base_s = measure_base_step_s(model, optimizer, work.step_fn, first) if paced else 0.0
        dist.barrier()  # full-speed ranks time their step once the paced ranks are done
        if not paced:
            base_s = measure_base_step_s(model, optimizer, work.step_fn, first)
    pacer = Pacer(plan.speeds[rank], base_s)
    ddp_model = DistributedDataParallel(model)  # broadcasts rank 0's (identical) weights

    dist.barrier()
    started_at = time.time()
    start_s = time.perf_counter()
    samples = steps = 0
    loss_sum = 0.0  # of the current epoch, weighted by batch size
    epochs: list[tuple[float, float, int]] = []  # (t since start, loss sum, samples)
    snapshots: list[dict[str, torch.Tensor]] = []  # rank 0's model at each epoch end
    for epoch in range(plan.epochs):
        sampler.set_epoch(epoch)
        loss_sum, epoch_samples = 0.0, 0
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = work.step_fn(ddp_model, batch)
            loss.backward()  # type: ignore[no-untyped-call]  # torch stub; all-reduce inside
            optimizer.step()
            pacer.after_step()
            num = len(batch[1])
            loss_sum += float(loss.item()) * num
            epoch_samples += num
            steps += 1
        samples += epoch_samples
        epochs.append((time.perf_counter() - start_s, loss_sum, epoch_samples))
        if rank == 0:
            snapshots.append(snapshot(model))
    dist.barrier()
    wall_s = time.perf_counter() - start_s

    return rank_report(
        rank, plan.speeds[rank], pacer, steps=steps, samples=samples, wall_s=wall_s,
        started_at=started_at, last_epoch=(loss_sum, epoch_samples), epochs=epochs,
        **final_and_epoch_evals(plan.workload, model, snapshots, test_set, rank),
    )  # fmt: skip


def rank_report(
    rank: int,
    speed: float,
    pacer: Pacer,
    *,
    steps: int,
    samples: int,
    wall_s: float,
    started_at: float,
    last_epoch: tuple[float, int],
    epochs: list[tuple[float, float, int]],
    eval_accuracy: float | None,
    epoch_evals: list[float],
) -> JsonDict:
    """One baseline rank's report: its work, its clock, its pacing and its evals.

    ``idle_s`` is the wall outside steps: the wall less the steps at the solo
    step time and the injected wait (the gradient all-reduce or averaging
    runs inside, so it counts as busy for DDP).
    """
    return {
        "rank": rank,
        "speed": speed,
        "samples": samples,
        "steps": steps,
        "base_step_s": pacer.base_s,
        "injected_s": pacer.injected_s,
        "idle_s": max(wall_s - steps * pacer.base_s - pacer.injected_s, 0.0),
        "wall_s": wall_s,
        "started_at": started_at,
        "last_epoch_loss_sum": last_epoch[0],
        "last_epoch_samples": last_epoch[1],
        "eval_accuracy": eval_accuracy,
        "epochs": epochs,
        "epoch_evals": epoch_evals,
    }


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s weights, to evaluate once the clock has stopped."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def final_and_epoch_evals(
    workload: str,
    model: torch.nn.Module,
    snapshots: Sequence[dict[str, torch.Tensor]],
    test_set: TensorDataset,
    rank: int,
) -> dict[str, Any]:
    """Rank 0's final eval and its epochs' (``rank_report``'s keys), after the clock.

    The final model is the last epoch's (DDP's; torchft's after its last
    average), so ``eval_snapshots`` evaluates it once.
    """
    if rank != 0:
        return {"eval_accuracy": None, "epoch_evals": []}
    *epochs, final = eval_snapshots(workload, [*snapshots, snapshot(model)], test_set)
    return {"eval_accuracy": final, "epoch_evals": epochs}


def eval_snapshots(
    workload: str, snapshots: Sequence[dict[str, torch.Tensor]], test_set: TensorDataset
) -> list[float]:
    """``eval_fn`` of each snapshot, in order, on a fresh model of ``workload``.

    A snapshot equal to the one before it takes that one's eval without a
    second pass (a one-epoch run's final model is its epoch's: 2.8 s saved
    on tiny-gpt). The clock has stopped, so the evals use every core this
    process may run on, not the one thread a rank trains with (tiny-gpt's
    held-out split: 3.4 s on one thread, 1.9 s on two).
    """
    work = get_workload(workload)
    model = work.make_model("cpu")
    out: list[float] = []
    previous: dict[str, torch.Tensor] | None = None
    threads = torch.get_num_threads()
    torch.set_num_threads(_cores())
    try:
        for state in snapshots:
            if previous is not None and _equal_states(previous, state):
                out.append(out[-1])
                continue
            model.load_state_dict(state)
            out.append(float(work.eval_fn(model, test_set)))
            previous = state
    finally:
        torch.set_num_threads(threads)
    return out


def _cores() -> int:
    """The cores this process may run on (all of the machine's where that cannot be asked)."""
    if hasattr(os, "sched_getaffinity"):  # Linux
        return max(len(os.sched_getaffinity(0)), 1)
    return os.cpu_count() or 1


def _equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _read_report(run_dir: Path, rank: int, system: str = SYSTEM) -> JsonDict:
    """Load ``rank<r>.json``, or say that the rank left none."""
    path = run_dir / f"rank{rank}.json"
    try:
        report: JsonDict = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise RuntimeError(f"{system}: rank {rank} exited without a report") from exc
    return report


def _summarize(plan: _Plan, reports: Sequence[JsonDict], launched_at: float) -> JsonDict:
    """Merge the per-rank reports into the run's result."""
    lead = reports[0]
    wall_s = _num(lead["wall_s"])
    total_samples = sum(_num(r["samples"]) for r in reports)
    loss_samples = sum(_num(r["last_epoch_samples"]) for r in reports)
    loss_sum = sum(_num(r["last_epoch_loss_sum"]) for r in reports)
    keys = ("rank", "speed", "samples", "steps", "base_step_s", "injected_s", "idle_s")
    return {
        "system": SYSTEM,
        "workload": plan.workload,
        "speeds": list(plan.speeds),
        "world_size": len(plan.speeds),
        "epochs": plan.epochs,
        "batch_size": plan.batch_size,
        "wall_s": wall_s,
        "startup_s": max(_num(lead["started_at"]) - launched_at, 0.0),
        "samples_per_s": total_samples / wall_s if wall_s > 0 else 0.0,
        "final_loss": loss_sum / loss_samples if loss_samples else float("nan"),
        "eval": lead["eval_accuracy"],
        "metric": get_workload(plan.workload).metric,
        "eval_accuracy": lead["eval_accuracy"],
        "per_epoch": _per_epoch(reports),
        "per_rank": [{key: r[key] for key in keys} for r in reports],
    }


def _per_epoch(reports: Sequence[JsonDict]) -> list[JsonDict]:
    """Per epoch: rank 0's time and the sample-weighted loss over every rank."""
    tables: list[list[object]] = []
    for report in reports:
        table = report["epochs"]
        if not isinstance(table, list):
            raise RuntimeError(f"{SYSTEM}: malformed rank report epochs {table!r}")
        tables.append(table)
    out: list[JsonDict] = []
    for epoch, lead in enumerate(tables[0]):
        rows = [_triple(table[epoch]) for table in tables]
        loss_sum = sum(row[1] for row in rows)
        count = sum(row[2] for row in rows)
        t_s = _triple(lead)[0]
        out.append(
            {
                "epoch": epoch,
                "t": t_s,
                "loss": loss_sum / count if count else None,
                "eval": _epoch_eval(reports[0], epoch),
            }
        )
    return out


def _epoch_eval(report: JsonDict, epoch: int) -> float | None:
    """Rank 0's eval of its model after ``epoch`` (None if it recorded none)."""
    evals: Any = report.get("epoch_evals")
    if not isinstance(evals, list) or epoch >= len(evals):
        return None
    value = evals[epoch]
    return float(value) if isinstance(value, int | float) else None


def _triple(value: object) -> tuple[float, float, float]:
    """One ``(t, loss_sum, samples)`` entry of a rank's epoch table."""
    if not isinstance(value, list) or len(value) != 3:
        raise RuntimeError(f"{SYSTEM}: malformed rank report epoch entry {value!r}")
    return _num(value[0]), _num(value[1]), _num(value[2])


def _num(value: object) -> float:
    """A JSON number from a rank's report, as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RuntimeError(f"{SYSTEM}: malformed rank report value {value!r}")
    return float(value)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m elche.baselines.ddp``: run the baseline, print the result.

    Args:
        argv: the arguments, ``sys.argv[1:]`` when None.

    Returns:
        The exit status: 0 on success, 2 on a bad argument.
    """
    parser = argparse.ArgumentParser(
        prog="python -m elche.baselines.ddp", description="torch DDP baseline with speed injection"
    )
    parser.add_argument("--speeds", default="1", help="comma-separated, e.g. 1,0.5,0.25")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", default="digits", choices=WORKLOADS)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args(argv)
    try:
        speeds = [float(s) for s in str(args.speeds).split(",")]
        result = run_ddp(
            speeds=speeds,
            epochs=args.epochs,
            batch_size=args.batch_size,
            seed=args.seed,
            workload=args.workload,
            timeout_s=args.timeout,
        )
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))  # exits with status 2
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>14}: {value}")
    return 0


if __name__ == "__main__":
    # Re-import by name, so spawned ranks unpickle ``elche.baselines.ddp._rank_main``
    # rather than a function of ``__main__``.
    from elche.baselines.ddp import main as _main

    sys.exit(_main())
