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

Across hosts the coordinator binds every interface and is reached at
``MASTER_ADDR``; the per-run secret then authenticates every frame.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from elche.core.errors import TrainingError
from elche.monitor.progress import Progress
from elche.monitor.timeline import read_timeline
from elche.runtime.frames import new_secret
from elche.runtime.launch import (
    collect,
    explain_outcome,
    on_record,
    rank_spec,
    start_coordinator,
    start_watching,
    with_bundle,
)
from elche.runtime.plan import Hooks, Plan, TrainResult
from elche.runtime.worker import train_rank

if TYPE_CHECKING:
    from elche.runtime.worker import UserFns

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
    """Train this process as rank ``$RANK`` of ``$WORLD_SIZE``; see ``elche.train``."""
    t0 = time.monotonic()
    rank = int(os.environ["RANK"])
    world = plan.config.world_size
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    multi_host = local_world < world
    if not multi_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    shared: list[object] = [None, None, None]
    host = None
    board = None
    if rank == 0:
        directory = Path(
            run_dir or os.environ.get("ELCHE_RUN_DIR") or tempfile.mkdtemp(prefix="elche-run-")
        )
        secret = new_secret()
        if multi_host:
            os.environ["ELCHE_BIND"] = "tcp://0.0.0.0:0"
        bundled = with_bundle(plan, directory)
        host, address = start_coordinator(bundled.config, directory, secret, plan.resume_from)
        if multi_host:
            address = f"tcp://{os.environ['MASTER_ADDR']}:{address.rsplit(':', 1)[1]}"
        shared = [address, secret.hex(), str(directory)]
        board = start_watching(bundled, directory, dashboard)
    dist.broadcast_object_list(shared, src=0)
    address, secret_hex, directory_text = (str(x) for x in shared)
    directory = Path(directory_text)
    plan = with_bundle(plan, directory)
    spec = rank_spec(
        plan, rank, address, bytes.fromhex(secret_hex), directory, max_grad_norm=max_grad_norm
    )
    try:
        report, state = train_rank(spec, fns, plan.config.batch_size)
    finally:
        if dist.is_initialized():  # a regroup after a death replaced the launcher's group
            dist.destroy_process_group()
    user_error = report.get("user_error")
    if host is None and isinstance(user_error, dict):  # another rank's: the same error here
        raise TrainingError.from_summary(user_error)
    if host is None:
        return TrainResult(state_dict=state, summary={}, run_dir=str(directory))
    host.wait(timeout=COORDINATOR_EXIT_S)
    if board is not None:
        board.stop()
    epochs: list[dict[str, object]] = []
    quiet = Progress(plan.config.epochs, enabled=False)
    for event in read_timeline(directory):
        on_record(event, epochs, hooks, quiet)
    result = collect(plan, directory, t0, epochs)
    explain_outcome(result.summary, plan.config.save_path)
    if not result.state_dict:
        result.state_dict = state
    return result
