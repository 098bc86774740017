"""Training under a launcher: ``torchrun`` or ``elche run``.

Theory of operation. The launcher starts one process per rank with the
torch.distributed environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``). Each process calls ``elche.train`` and
lands here: it joins the default gloo group from the environment; global rank
0 starts the coordinator as its own process and shares its address and the
run secret over the group; then every process trains as one rank. Rank 0
waits for the coordinator to finish and returns the full result; the other
ranks return their final model (the consensus) and an empty summary.
When the run fails on the user's code, every process raises the same
``TrainingError`` (a failing rank its own, the others the coordinator's).

Under torchrun each worker trains its rank in a child process and
waits for it (``_supervises``): torchrun's agent ends the whole group when a
worker exits non-zero, so a worker whose rank died must exit 0 for the others
to go on.

Across hosts the coordinator binds every interface and is reached at the
address ``elche.runtime.addresses`` chooses among rank 0's (``ELCHE_ADVERTISE``
overrides it), rank 0 on any host; the run's secret (``ELCHE_SECRET`` when
set, else a fresh one) authenticates every frame. Every host keeps its own
run directory, at the path rank 0 chose; the ranks' groups form through the
coordinator's store (``elche.runtime.groups``), never through files.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from elche.core.checkpoint import SaveReason
from elche.core.errors import ConfigError, TrainingError
from elche.monitor.progress import Progress
from elche.monitor.summary import rank_report_file
from elche.monitor.timeline import read_timeline
from elche.runtime.addresses import BIND_ENV, EVERY_INTERFACE, advertised_host
from elche.runtime.frames import new_secret, secret_from_env
from elche.runtime.launch import (
    _rank_process,
    _report_lost,
    check_picklable,
    collect,
    explain_outcome,
    interrupted,
    on_record,
    rank_spec,
    start_coordinator,
    start_watching,
    tell_coordinator,
    with_bundle,
)
from elche.runtime.lifetimes import Interrupted, StopSignals, watch_launcher
from elche.runtime.plan import Hooks, Plan, TrainResult
from elche.runtime.worker import train_rank

if TYPE_CHECKING:
    from elche.runtime.worker import RankSpec, UserFns

__all__ = ["train_launched"]

# How long rank 0 waits for the coordinator to exit after its own rank stopped.
COORDINATOR_EXIT_S = 60.0


def train_launched(
    plan: Plan,
    fns: UserFns,
    hooks: Hooks,
    *,
    max_grad_norm: float | None,
    run_dir: str | None,
    dashboard: str | None = None,
) -> TrainResult:
    """Train this process as rank ``$RANK`` of ``$WORLD_SIZE``; see ``elche.train``.

    SIGINT and SIGTERM stop the run cleanly (``elche.runtime.lifetimes``):
    rank 0 asks its coordinator to stop, every rank saves, and every rank's
    ``elche.train`` raises ``Interrupted``; rank 0 prints the one line. A
    rank whose launcher dies ends within ``ORPHAN_GRACE_S``.

    Raises:
        Interrupted: a signal (or the launcher's death) stopped the run.
    """
    rank = int(os.environ["RANK"])
    host: list[subprocess.Popen[str]] = []  # rank 0's coordinator, once started

    def ask_stop(reason: str) -> None:
        if host:
            tell_coordinator(host[0], f"stop {reason}")

    with StopSignals(
        on_signal=lambda signum: ask_stop(signal.Signals(signum).name), force_on_repeat=False
    ) as signals:
        watch_launcher(os.getppid(), on_gone=lambda: ask_stop("the launching process is gone"))
        result, stopped = _train(
            plan, fns, hooks, rank=rank, host_box=host, signals=signals,
            max_grad_norm=max_grad_norm, run_dir=run_dir, dashboard=dashboard,
        )  # fmt: skip
    if stopped != f"saved: {SaveReason.GRACEFUL_SHUTDOWN.value}":  # not stopped on request
        return result
    signum = signals.received if signals.received is not None else signal.SIGTERM
    if rank == 0:
        raise interrupted(signum, result, plan.config.save_path)
    raise Interrupted(signum, plan.config.save_path, result)


def _train(
    plan: Plan,
    fns: UserFns,
    hooks: Hooks,
    *,
    rank: int,
    host_box: list[subprocess.Popen[str]],
    signals: StopSignals,
    max_grad_norm: float | None,
    run_dir: str | None,
    dashboard: str | None,
) -> tuple[TrainResult, object]:
    """Join, start the coordinator on rank 0, train; the result and why this rank stopped."""
    t0 = time.monotonic()
    world = plan.config.world_size
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    multi_host = local_world < world
    if not multi_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    shared: list[object] = [None, None, None, None]
    host = None
    board = None
    if rank == 0:
        directory = Path(
            run_dir or os.environ.get("ELCHE_RUN_DIR") or tempfile.mkdtemp(prefix="elche-run-")
        )
        bundled = with_bundle(plan, directory)
        host, shared = _start_coordinator(bundled, directory, multi_host=multi_host)
        host_box.append(host)
        if signals.received is not None:  # the signal came while the coordinator started
            tell_coordinator(host, f"stop {signal.Signals(signals.received).name}")
        board = start_watching(bundled, directory, dashboard)
    dist.broadcast_object_list(shared, src=0)
    address, secret_hex, directory_text = (str(x) for x in shared[:3])
    group_port = shared[3] if isinstance(shared[3], int) else None
    directory = Path(directory_text)
    directory.mkdir(parents=True, exist_ok=True)  # on another host: this host's own run dir
    plan = with_bundle(plan, directory)
    spec = rank_spec(
        plan, rank, address, bytes.fromhex(secret_hex), directory, max_grad_norm=max_grad_norm,
        group_port=group_port,
    )  # fmt: skip
    report, state = _run_rank(spec, fns, plan.config.batch_size, host)
    user_error = report.get("user_error")
    if host is None and isinstance(user_error, dict):  # another rank's: the same error here
        raise TrainingError.from_summary(user_error)
    stopped = report.get("stopped")
    if host is None:
        return TrainResult(state_dict=state, summary={}, run_dir=str(directory)), stopped
    host.wait(timeout=COORDINATOR_EXIT_S)
    if board is not None:
        board.stop()
    epochs: list[dict[str, object]] = []
    quiet = Progress(plan.config.epochs, enabled=False)
    for event in read_timeline(directory):
        on_record(event, epochs, hooks, quiet)
    result = collect(plan, directory, t0, epochs)
    if result.summary.get("reason") != SaveReason.GRACEFUL_SHUTDOWN.value:
        explain_outcome(result.summary, plan.config.save_path)
    if not result.state_dict:
        result.state_dict = state
    return result, stopped


def _start_coordinator(
    plan: Plan, directory: Path, *, multi_host: bool
) -> tuple[subprocess.Popen[str], list[object]]:
    """Rank 0 starts the coordinator; it and what every rank needs of it.

    That is ``[address, secret (hex), run dir, group store port]``, the
    address one the other hosts reach when the ranks are on several.
    """
    secret = secret_from_env(os.environ) or new_secret()
    advertise = None
    if multi_host:
        advertise = advertised_host(os.environ)  # before anything starts: fail fast
        os.environ.setdefault(BIND_ENV, EVERY_INTERFACE)
    host, address, group_port = start_coordinator(plan.config, directory, secret, plan.resume_from)
    if advertise is not None:
        address = f"tcp://{advertise}:{address.rsplit(':', 1)[1]}"
    return host, [address, secret.hex(), str(directory), group_port]


def _run_rank(
    spec: RankSpec,
    fns: UserFns,
    batch_size: int,
    host: subprocess.Popen[str] | None,
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """Train the rank, here or in a child (``_supervises``); its report and model."""
    if _supervises(fns):
        dist.destroy_process_group()  # the rank's own process forms its group
        return _train_in_child(spec, fns, batch_size, host)
    try:
        return train_rank(spec, fns, batch_size)
    finally:
        if dist.is_initialized():  # a regroup after a death replaced the launcher's group
            dist.destroy_process_group()


def _supervises(fns: UserFns) -> bool:
    """Under torchrun, the rank trains in a process of its own.

    torchrun's agent ends the whole group when any worker exits non-zero
    (``docs/failure-modes.md``), so a worker whose rank is SIGKILLed must
    exit 0: the worker starts the rank as its child, waits for it, and
    returns whatever became of it. On one host or several alike: the child's
    groups form through the coordinator's store (``elche.runtime.groups``).
    With functions that cannot be sent to another process, the rank trains
    in the worker itself.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    try:
        check_picklable(fns)
    except ConfigError as exc:
        print(f"elche: {exc}; under torchrun this rank trains in its worker, and a "
              "rank that dies ends the run", file=sys.stderr, flush=True)  # fmt: skip
        return False
    return True


def _train_in_child(
    spec: RankSpec, fns: UserFns, batch_size: int, host: subprocess.Popen[str] | None
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """Run rank ``spec.rank`` in a child process; its report and final model.

    A child that dies is reported to the coordinator (rank 0, which has it)
    or noticed by its heartbeat; this worker then returns an empty model and
    the run goes on without the rank.
    """
    out = Path(spec.run_dir) / f"rank{spec.rank}.state.pt"
    child = mp.get_context("spawn").Process(
        target=_rank_process,
        args=(spec, fns, batch_size, dict(os.environ), os.getpid()),
        kwargs={"state_out": str(out)},
        name=f"elche-rank{spec.rank}",
    )
    child.start()
    child.join()
    if child.exitcode == 0:
        state = torch.load(out, map_location="cpu")
        out.unlink(missing_ok=True)
        report = json.loads(rank_report_file(Path(spec.run_dir), spec.rank).read_text())
        return report, state
    if host is not None:
        _report_lost(host, spec.rank, child.exitcode)
    print(f"elche: rank {spec.rank} was lost (its process ended with {child.exitcode}); "
          "the run goes on without it", file=sys.stderr, flush=True)  # fmt: skip
    return {"stopped": "lost"}, {}
