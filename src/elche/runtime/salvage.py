"""The bundle of a run whose coordinator is lost for good (``elche.core.salvage``).

Theory of operation. The process that watches the coordinator
(``supervision.Supervised``) decides it will not be restarted (restarts used up,
no journal, the successor would not start) and says so in
``RUN_DIR/coordinator.gone``; each rank's IO thread sees that file within a
heartbeat (or the coordinator's silence, ``max(heartbeat_timeout_s, 10 s)``,
where it cannot), and the rank keeps what it holds (``keep_local_state``):

- ``STEM.rank<R>.local.model.pt``: its last consensus, the model as the last
  averaging round it applied left it (not the local steps since: those are
  in no average, and the bundle lists them as still to train);
- ``STEM.rank<R>.local.optim.pt``: its optimizer state;
- ``RUN_DIR/rank<R>.local.json``: the round of that consensus, what it would
  say on a rejoin (``Held``) and which of those files are on disk.

Once the ranks have exited, the launcher (``salvage_run``) reads the journal
and those states, lets the core decide what fits, moves the writer's model
and every optimizer state to the numbered names of one more save, and writes
the meta last, as a coordinator would. The run's summary then says
``saved_and_shutdown``, reason ``coordinator_lost``; or, when no bundle fits,
``failed`` with the reason and where the ranks' files are.

This module never imports torch: the rank passes its writers in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import msgspec

from elche.core import timeline as tl
from elche.core.checkpoint import BundleFile, BundleFiles, CheckpointMeta
from elche.core.config import CoordinatorConfig
from elche.core.errors import ConfigError
from elche.core.journal import JournalRecord
from elche.core.messages import Held
from elche.core.salvage import LocalState, Salvage, SalvageRefused, salvage
from elche.monitor.summary import SUMMARY_FILE, RunStats, coordinator_summary
from elche.monitor.timeline import TIMELINE_FILE, TimelineWriter, read_timeline
from elche.runtime import bundle
from elche.runtime.host import RESUME_META, RESUME_OUTER
from elche.runtime.journal_file import JOURNAL_FILE, read_journal

__all__ = [
    "GONE_FILE",
    "forget_earlier_run",
    "give_up_coordinator",
    "keep_local_state",
    "local_state_file",
    "salvage_run",
    "start_round",
    "wait_local_states",
]

GONE_FILE = "coordinator.gone"  # the coordinator will not come back: ranks keep their state
# Written by the coordinator process (runtime/host.py); read here for the summary's clock.
_RUN_START_FILE = "coordinator.started"
_FIRST_DISPATCH_FILE = "first_dispatch"


class _LocalRecord(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    consensus_round: int
    held: Held
    model: str | None  # file names in the stem's folder, None where the write failed
    optim: str | None


def local_state_file(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` describes the state it kept (``keep_local_state``)."""
    return run_dir / f"rank{rank}.local.json"


def give_up_coordinator(run_dir: Path, why: str) -> None:
    """Tell the ranks (``GONE_FILE``) that the coordinator will not come back."""
    with contextlib.suppress(OSError):  # then they notice its silence instead
        bundle.write_file(run_dir / GONE_FILE, lambda f: f.write(why.encode()), kind="gone")


def keep_local_state(
    run_dir: Path,
    stem: str,
    rank: int,
    *,
    consensus_round: int,
    held: Held,
    write_model: Callable[[BinaryIO], object] | None,
    write_optim: Callable[[BinaryIO], object],
) -> str | None:
    """Write rank ``rank``'s consensus model and optimizer state, and describe them.

    ``write_model`` is None when the rank holds no consensus. Returns the
    model's path, or None when it could not be written (a full disk: the
    description says so, and the run is not resumable from this rank).
    """
    base = f"{stem}.rank{rank}.local"
    written: dict[str, str | None] = {"model": None, "optim": None}
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    writers = {"model": write_model, "optim": write_optim}
    for kind, write in writers.items():
        if write is None:
            continue
        path = Path(f"{base}.{kind}.pt")
        with contextlib.suppress(OSError, RuntimeError):  # torch.save: RuntimeError on ENOSPC
            written[kind] = bundle.write_file(path, write, kind=kind).name
    record = _LocalRecord(
        rank=rank, consensus_round=consensus_round, held=held,
        model=written["model"], optim=written["optim"],
    )  # fmt: skip
    text = msgspec.json.encode(record)
    with contextlib.suppress(OSError):
        bundle.write_file(local_state_file(run_dir, rank), lambda f: f.write(text), kind="state")
    return None if written["model"] is None else f"{base}.model.pt"


def start_round(run_dir: Path) -> int:
    """The averaging round a run starts at: its resumed bundle's, from the copy of its
    meta in ``run_dir`` (the bundle itself may have changed or gone since), else 0."""
    try:
        text = (run_dir / RESUME_META).read_text(encoding="utf-8")
    except FileNotFoundError:
        return 0
    return CheckpointMeta.from_json(text).rounds_done


def wait_local_states(config: CoordinatorConfig, run_dir: Path, timeout_s: float) -> None:
    """Wait until every rank the journal counts live has described its state, or
    ``timeout_s`` passed (ranks in other processes: under ``elche run``, ``torchrun``)."""
    try:
        dead = set(read_journal(run_dir / JOURNAL_FILE).dead_ranks)
    except ConfigError:
        return  # nothing can be committed without it: no need to wait
    waiting = [local_state_file(run_dir, r) for r in range(config.world_size) if r not in dead]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(p.exists() for p in waiting):
        time.sleep(0.1)  # polling files another process writes, up to a deadline


def _read_states(run_dir: Path, world_size: int) -> list[_LocalRecord]:
    states = []
    for rank in range(world_size):
        with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
            raw = local_state_file(run_dir, rank).read_bytes()
            states.append(msgspec.json.decode(raw, type=_LocalRecord))
    return states


def salvage_run(config: CoordinatorConfig, run_dir: Path, *, start_round: int = 0) -> str | None:
    """Commit the bundle of a run whose coordinator is gone, and write its summary.

    Call it once the ranks have exited. Returns the bundle's stem, or None
    when none could be committed (the summary says why, outcome ``failed``).
    """
    stem = config.save_path
    record: JournalRecord | None = None
    try:
        if stem is None:
            raise SalvageRefused("the run has no save path")
        if not (run_dir / JOURNAL_FILE).exists():  # its first record precedes any work
            raise SalvageRefused("it was lost before the run began; nothing was trained")
        record = read_journal(run_dir / JOURNAL_FILE)
        states = _read_states(run_dir, config.world_size)
        plan = salvage(config, record, [_state(s) for s in states], start_round=start_round)
        seq = _commit(stem, plan, states)
    except (SalvageRefused, ConfigError, OSError) as exc:
        kept = stem is not None and any(Path(stem).parent.glob(f"{Path(stem).name}.rank*.local.*"))
        where = f"; each rank's own state is in {stem}.rank<R>.local.*" if kept else ""
        _write_summary(config, run_dir, record, None, f"coordinator_lost: {exc}{where}")
        return None
    written = tl.BundleWritten(stem=stem, seq=seq, reason=plan.meta.reason.value)
    _write_summary(config, run_dir, record, plan, "coordinator_lost", written=written)
    return stem


def _state(record: _LocalRecord) -> LocalState:
    return LocalState(
        rank=record.rank, consensus_round=record.consensus_round, held=record.held,
        has_model=record.model is not None,
    )  # fmt: skip


def _commit(stem: str, plan: Salvage, states: list[_LocalRecord]) -> int:
    """Rename the files to one more save's names and write the meta that names them;
    the save's number.

    Raises:
        OSError: a rename or the meta's write failed (the meta before stays).
    """
    folder = Path(stem).parent
    seq = bundle.next_seq(stem, plan.meta.save_seq)  # the dead coordinator may have
    # started saves after its journal's last record
    by_rank = {s.rank: s for s in states}
    writer = by_rank[plan.writer]
    assert writer.model is not None  # the core picks a writer whose model is on disk
    model = _move(folder / writer.model, folder / bundle.model_name(stem, seq), "model")
    optim = []
    for rank, state in sorted(by_rank.items()):
        if state.optim is not None:
            target = folder / bundle.optim_name(stem, seq, rank)
            optim.append((rank, _move(folder / state.optim, target, "optim")))
    files = BundleFiles(model=model, optim=tuple(optim))
    bundle.write_meta(stem, dataclasses.replace(plan.meta, save_seq=seq, files=files))
    for state in states:  # the other ranks' copies of a consensus: the bundle has one
        if state.model is not None and state.rank != plan.writer:
            with contextlib.suppress(OSError):
                (folder / state.model).unlink()
    return seq


def _move(src: Path, dst: Path, kind: str) -> BundleFile:
    return BundleFile.from_saved(bundle.rename_file(src, dst, kind=kind))


def _write_summary(
    config: CoordinatorConfig,
    run_dir: Path,
    record: JournalRecord | None,
    plan: Salvage | None,
    reason: str,
    *,
    written: tl.BundleWritten | None = None,
) -> None:
    """The summary (and the timeline's last records: the bundle ``written``, the
    run's end) a coordinator would have written."""
    started = _read_float(run_dir / _RUN_START_FILE) or 0.0
    stats = RunStats(first_dispatch_s=_read_float(run_dir / _FIRST_DISPATCH_FILE))
    for event in read_timeline(run_dir):
        if not isinstance(event, tl.RunEnd):
            stats.observe(event, started + event.t)
    if plan is not None:
        done, rounds, dead = plan.epochs_completed, plan.meta.rounds_done, plan.dead_ranks
        samples = plan.samples_per_rank
    elif record is not None:
        done, rounds, dead = record.epochs_completed, record.rounds_done, record.dead_ranks
        samples = record.samples_committed
    else:  # no journal: the run never formed
        done, rounds, dead, samples = 0, 0, (), (0,) * config.world_size
    used = [r for r, n in enumerate(samples) if n]  # the journal counts every join slot too
    samples = tuple(samples[: max(config.world_size, used[-1] + 1 if used else 0)])
    end = tl.RunEnd(
        outcome="saved_and_shutdown" if plan is not None else "failed",
        reason=reason,
        epochs_completed=done,
        rounds_done=rounds,
        lost_samples=0,  # the journal keeps no count of finished epochs' holes (0 unless a bug)
        dead_ranks=dead,
        rejected_frames=0,
        anchor=record.elche_state.anchor if record else 1,
        samples_per_rank=samples,
        coordinator_restarts=record.coordinator_restarts if record else 0,
    )
    stats.observe(end, started)
    with contextlib.suppress(OSError):
        writer = TimelineWriter(run_dir, started_s=started)
        if written is not None:  # summary["bundles"] lists it, as a coordinator's saves
            writer.write(written, time.monotonic())
        writer.write(end, time.monotonic())
        writer.close()
    summary = coordinator_summary(stats, mode=config.mode.value, world_size=config.world_size)
    text = json.dumps(summary, indent=2)
    try:
        bundle.write_file(run_dir / SUMMARY_FILE, lambda f: f.write(text.encode()), kind="summary")
    except OSError as exc:  # a full or read-only run directory: said, the launcher reports it
        print(
            f"elche: cannot write the run's summary in {run_dir} ({exc}); the run ended: {reason}",
            file=sys.stderr,
        )


def _read_float(path: Path) -> float | None:
    try:
        return float(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def forget_earlier_run(run_dir: Path) -> None:
    """Remove what an earlier run in this run dir left here (a fresh start; its
    bundles stay, to resume from).

    Its summary and journal: read before this run's own exist, they would say
    of this run what that one did (that it failed, or began). The copy of the
    bundle it resumed from: the coordinator would resume this run from it too
    (its epoch, its coverage), and a salvage start at its round. Its timeline,
    ranks' reports, records and kept states, and final model: this run's
    result would hold that run's epochs, a lost rank that one's figures, and
    a final model this run failed to write that one's weights.
    """
    earlier = [GONE_FILE, SUMMARY_FILE, JOURNAL_FILE, TIMELINE_FILE, bundle.FINAL_MODEL]
    resumed = [RESUME_META, RESUME_OUTER]
    ranks = [*run_dir.glob("rank*.json"), *run_dir.glob("rank*.spans.jsonl")]
    for path in (*(run_dir / name for name in (*earlier, *resumed)), *ranks):
        with contextlib.suppress(OSError):
            os.unlink(path)
