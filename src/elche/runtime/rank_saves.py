"""A rank's saves: the bundle files it writes when told, and its state kept when
its coordinator is lost.

Rules:

- A save order is written durably, file by file (``elche.runtime.bundle``),
  and answered with the files written or the error that stopped it: none
  of its files stays when one fails. Files of saves that never committed go
  first, so they take no room from this one. A save for a non-finite value
  writes the last finite consensus.
- A rank that lost its coordinator keeps its consensus and optimizer state
  on disk (``elche.runtime.salvage``: the launcher may commit them as a
  bundle), says where, and stops. A joined rank keeps none.

Theory of operation: the worker calls these with itself, between steps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch
from torch import nn

from elche.core import messages as m
from elche.core import rank as r
from elche.core.checkpoint import SaveReason
from elche.runtime import bundle, salvage

if TYPE_CHECKING:
    from elche.runtime.worker import Worker

__all__ = ["coordinator_lost", "save"]


def coordinator_lost(worker: Worker, reason: str) -> None:
    """No coordinator: keep this rank's consensus and state on disk, then stop
    (``elche.runtime.salvage``: the launcher may commit them as a bundle). A
    joined rank keeps none: a salvage commits the launched ranks' states only."""
    where = None
    worker._take_up_local()  # the model holds every batch ``held`` names
    if worker.spec.save_path is not None and not worker.spec.joining:
        kept = worker.consensus.state
        where = salvage.keep_local_state(
            Path(worker.spec.run_dir), worker.spec.save_path, worker.spec.rank,
            consensus_round=worker.consensus.round, held=worker.proto.held(),
            write_model=None if kept is None else (lambda f: torch.save(kept, f)),
            write_optim=_torch_save(worker.optimizer),
        )  # fmt: skip
    print(
        f"elche rank {worker.spec.rank}: lost the coordinator ({reason}); "
        + (f"local state saved as {where}; " if where else "")
        + "stopping",
        file=sys.stderr,
        flush=True,
    )
    worker.proto.coordinator_lost(reason)


def save(worker: Worker, order: r.Save) -> None:
    """Write save ``order.seq`` durably and report its files (``elche.runtime.bundle``)."""
    worker._report()  # the coordinator books the writer's batches before its save
    if order.reason == SaveReason.NONFINITE.value:  # save the last finite consensus
        worker.consensus.restore(worker.model)
    error: str | None = None
    files: list[m.SavedFile] = []
    try:
        files = _write_save(worker, order)
    except (OSError, RuntimeError) as exc:  # the file's, named; or torch.save's own
        error = f"{type(exc).__name__}: {exc}"
    stop = order.kind is r.SaveKind.SHUTDOWN and order.reason != SaveReason.NONFINITE.value
    if stop and any(f.kind == "model" for f in files):  # the bundle's model holds them:
        worker._record_spans(worker.proto.held().since, f"save {order.seq}")  # (coordinator too)
    worker._send(worker.proto.saved(files=files, error=error))


def _write_save(worker: Worker, order: r.Save) -> list[m.SavedFile]:
    if order.kind is r.SaveKind.FINAL:
        path = Path(worker.spec.run_dir) / bundle.FINAL_MODEL
        return [bundle.write_file(path, _torch_save(worker.model), kind="final")]
    stem = worker.spec.save_path
    if stem is None:
        return []
    folder = Path(stem).parent
    folder.mkdir(parents=True, exist_ok=True)
    # Files of saves that never committed go first: they would take this one's room.
    bundle.prune(stem, {order.seq, order.keep})
    files: list[m.SavedFile] = []
    try:
        if order.writer:
            path = folder / bundle.model_name(stem, order.seq)
            files.append(bundle.write_file(path, _torch_save(worker.model), kind="model"))
        path = folder / bundle.optim_name(stem, order.seq, worker.spec.rank)
        files.append(bundle.write_file(path, _torch_save(worker.optimizer), kind="optim"))
    except BaseException:  # the answer names no file: none of them stays
        for saved in files:
            (folder / saved.name).unlink(missing_ok=True)
        raise
    return files


def _torch_save(owner: nn.Module | torch.optim.Optimizer) -> Callable[[BinaryIO], None]:
    return lambda f: torch.save(owner.state_dict(), f)
