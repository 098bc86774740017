"""Launching a local run: the coordinator process plus one process per rank.

Theory of operation. ``launch_local`` starts the coordinator, then the
ranks, with the ``forkserver`` start method where the platform has it: the
fork server imports torch (and torch._dynamo, which a rank's first optimizer
would import) and elche's rank and coordinator code once, and every rank
forks from it instead of importing them again: a 3-rank run on 2 cores
starts in ~0.4 s instead of ~2.7 s once the fork server is up (~2.9 s for
the first run of a process instead of ~4.3). The coordinator forks from it
too (``supervision.ForkedCoordinator``), so in the collective modes the group store it
serves is up at once, not after a fresh process imported torch (which kept
the ranks waiting ~1.7 s at every run). Elsewhere the ranks start with
``spawn`` and the coordinator as ``python -m elche.runtime.host``. The fork
server holds no threads, sockets or CUDA state, so forking it is safe. Each
rank, and the coordinator, takes the launcher's environment and stderr (a
rank its stdout too) as they are at launch (a fork would otherwise see the
fork server's, from the first run in this process); settings read while
torch imports, such as ``OMP_NUM_THREADS``, come from the first run. As with
``spawn``, the user's functions must be importable, top-level callables and
the script must guard its entry with ``if __name__ == "__main__":``.

While the run goes on, the launcher follows the coordinator's timeline to
drive the progress display and the user's ``eval_result_fn``/``metrics_fn``,
and it watches the children: a rank that exits early is reported; the
coordinator's heartbeat timeout decides what that means for the run. When
the coordinator exits, the ranks get a grace period to finish, then are
stopped. SIGINT, SIGTERM and SIGHUP stop the run cleanly, sent to the launcher
or to every process of the run at once (each rank waits for the launcher's mark,
``lifetimes.stop_came_alone``): the launcher asks the coordinator to stop, the
ranks save a bundle, and ``Interrupted`` is raised (``elche.runtime.lifetimes``);
the coordinator, the fork server and the ranks outlive the launcher by at most
``ORPHAN_GRACE_S``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elche.core import timeline as tl
from elche.core.checkpoint import SaveReason
from elche.core.errors import ConfigError, TrainingError
from elche.monitor.progress import Progress
from elche.monitor.summary import SUMMARY_FILE, read_run, run_summary
from elche.monitor.timeline import TimelineReader
from elche.runtime import bundle
from elche.runtime.epochs import EpochLog, with_bundles
from elche.runtime.frames import new_secret, secret_from_env
from elche.runtime.groups import RunEndedUnformed, StoreUnanswered
from elche.runtime.host import FAILED_EXIT
from elche.runtime.joining import announce_join
from elche.runtime.journal_file import JOURNAL_FILE
from elche.runtime.lifetimes import (
    STOP_SIGNALS,
    Forked,
    Interrupted,
    StopSignals,
    announce,
    beacon,
    ignore_stop_signals,
    launcher_stream,
    launcher_streams,
    leave_on_stop_signals,
    marked_stop_signals,
    take_environment,
    take_streams,
    watch_launcher,
)
from elche.runtime.options import check_picklable as check_options_picklable
from elche.runtime.options import check_sendable
from elche.runtime.plan import Hooks, Plan, TrainResult
from elche.runtime.sending import SEND_ERRORS, check_main_module, to_ranks
from elche.runtime.supervision import (
    report_lost,
    run_dir_unwritable,
    salvage_if_lost,
    supervised,
)

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import ForkServerContext, SpawnContext

    from elche.monitor.dashboard import Dashboard
    from elche.monitor.tensorboard import TensorBoardLog
    from elche.runtime.worker import RankSpec, UserFns

__all__ = [
    "Watchers",
    "call_hook",
    "collect",
    "explain_outcome",
    "interrupted",
    "keep_report",
    "launch_local",
    "on_record",
    "rank_context",
    "rank_error_file",
    "rank_spec",
    "start_watching",
    "with_bundle",
]

# Ranks normally exit within a few hundred ms of the coordinator's Shutdown.
RANK_EXIT_GRACE_S = 30.0
# How long the launcher waits for a rank process after the run in silence.
RANK_EXIT_SAY_S = 5.0
# After a stop, the ranks have saved before the coordinator exits (it waits
# for their StateSaved): they only have to exit, and one that never joined has
# nothing to save, so a short grace loses nothing.
STOPPED_RANK_GRACE_S = 1.0
# How long a stopped run may take to save once asked (beyond the coordinator's
# own save deadline, one heartbeat timeout).
STOP_SLACK_S = 5.0
# How often the launcher looks at its children and the timeline.
SUPERVISE_EVERY_S = 0.1
# Imported once by the fork server, so ranks fork with them loaded. torch.optim
# imports torch._dynamo when it builds its first optimizer: ~1 s on one core,
# that every rank would otherwise pay at once, on every run.
# (elche.runtime.forkserved keeps the fork server alive through SIGTERM.) The
# coordinator forks from it too (``ForkedCoordinator``).
FORKSERVER_PRELOAD = (
    "elche.runtime.forkserved", "torch", "torch.distributed", "torch._dynamo",
    "elche.runtime.worker", "elche.runtime.host",
)  # fmt: skip


def _rank_process(
    spec: Any,
    fns: Any,
    batch_size: int,
    env: dict[str, str],
    launcher_pid: int,
    *,
    state_out: str | None = None,
    trained: Any = None,
    alive: Any = None,
    streams: Sequence[Connection] = (),
    marks: Connection | None = None,
) -> None:
    """The body of a rank process; ``state_out``: where its final model goes;
    ``trained``: a shared flag set once the rank trained to the run's end (what
    its torchrun worker reads: an exit status the user's code may use too);
    ``alive``: a shared double this process sets to its monotonic clock every
    ``BEACON_S`` (``lifetimes.beacon``: its torchrun worker kills it only if
    declared lost and silent);
    ``streams``: the launcher's stdout and stderr, to take (``launcher_streams``);
    ``marks``: a local run's rank's read end of the pipe where its launcher
    marks each stop of the run (``lifetimes.marked_stop_signals``).

    A local run's rank (``marks``) runs in a process group of its own: the stop
    signals of the launcher's group (Ctrl-C) are the launcher's, which stops the
    run through the coordinator. A stop signal that reaches the rank unmarked
    was sent to it alone, and the rank leaves the run; one marked was sent to
    every process of the run, the launcher too, and the launcher saves the run.
    Elsewhere (a torchrun worker's child, whose agent signals the worker's
    whole group) the rank ignores them.
    """
    if marks is not None:  # (forked with the three ignored: none ends it before it left the group)
        os.setpgid(0, 0)
        launcher = f"the process that called elche.train, PID {launcher_pid}"
        leave_on_stop_signals(spec.rank, launcher, marks)
    else:
        ignore_stop_signals()  # the launcher orders the stop
    watch_launcher(launcher_pid)
    if alive is not None:
        beacon(lambda: setattr(alive, "value", time.monotonic()))
    take_environment(env)
    take_streams(streams)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["ELCHE_RANK"] = str(spec.rank)  # lets user callbacks know where they run
    from elche.runtime.worker import train_rank

    if isinstance(fns, bytes):  # the launcher pickled them by value
        fns = pickle.loads(fns)
    try:
        _, state = train_rank(spec, fns, batch_size)
    except BaseException as exc:
        # The user's own error: its traceback is the useful part, not elche's frames;
        # of a full or read-only disk (the run directory's), or of a bundle that is no
        # longer the one checked (ConfigError), none helps.
        storage = isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS
        said = isinstance(exc, TrainingError | ConfigError | RunEndedUnformed | StoreUnanswered)
        said = said or storage
        text = str(exc) if said else traceback.format_exc()
        from torch.distributed import DistError

        if isinstance(exc, DistError):  # its message goes on with torch's C++ frames
            text = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        with contextlib.suppress(OSError):  # said below either way
            rank_error_file(Path(spec.run_dir), spec.rank).write_text(text)
        print(f"elche rank {spec.rank} failed:\n{text}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    if trained is not None:
        trained.value = 1
    if state_out is not None:
        _hand_back(spec.rank, state, Path(state_out))


def rank_error_file(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank``'s process writes why it failed, when it knows."""
    return run_dir / f"rank{rank}.error"


# A rank process's status when it trained to the run's end but could not write
# its final model for its torchrun worker (``state_out``): not a rank lost. (The
# worker knows by the ``trained`` flag: a user's ``os._exit(3)`` is a rank lost.)
HANDBACK_FAILED = 3


def _hand_back(rank: int, state: object, path: Path) -> None:
    """Write the rank's final model to ``path`` for its torchrun worker, whole or
    not at all; one that cannot be written is said in the system's words, naming
    the file (``torch.save`` turns a full disk into ``RuntimeError:
    basic_ios::clear: iostream error``), and the process ends ``HANDBACK_FAILED``."""
    import torch

    try:  # (a file its worker reads at once and removes: no fsync, no hash)
        bundle.write_whole(path, lambda f: torch.save(state, f), sync=False)
    except OSError as exc:
        print(
            f"elche rank {rank} trained to the run's end, but could not write its model for "
            f"its worker: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True,
        )  # fmt: skip
        raise SystemExit(HANDBACK_FAILED) from None


# A disk that is full, over quota or read-only.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def rank_spec(
    plan: Plan,
    rank: int,
    address: str,
    secret: bytes,
    run_dir: Path,
    *,
    max_grad_norm: float | None,
    group_port: int | None = None,
) -> RankSpec:
    """The spec rank ``rank`` of ``plan`` runs with (``group_port``: see ``start_coordinator``)."""
    from elche.runtime.worker import RankSpec

    cfg = plan.config
    return RankSpec(
        rank=rank, world_size=cfg.world_size, address=address, secret_hex=secret.hex(),
        run_dir=str(run_dir), mode=cfg.mode.value, seed=cfg.seed, num_samples=cfg.num_samples,
        order=cfg.order,
        speed=plan.speeds[rank],
        speed_base_s=plan.speed_base_s, device=plan.devices[rank], gamma=cfg.scheduler.gamma,
        max_grad_norm=max_grad_norm,
        save_path=cfg.save_path, resume_from=plan.resume_from, resume_seq=plan.resume_seq,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        coordinator_timeout_s=cfg.rank_patience_s,
        collective_timeout_s=max(2 * cfg.heartbeat_timeout_s, 60.0),
        faults=plan.faults.for_rank(rank), group_port=group_port, launcher_pid=os.getpid(),
    )  # fmt: skip


def with_bundle(plan: Plan, run_dir: Path) -> Plan:
    """Give the run a bundle stem in its run dir when the user named none.

    An unrecoverable run always writes a resumable bundle; without a
    ``save_path`` it goes to ``RUN_DIR/checkpoint``.
    """
    if plan.config.save_path is not None:
        return plan
    config = dataclasses.replace(plan.config, save_path=str(run_dir / "checkpoint"))
    return dataclasses.replace(plan, config=config)


def explain_outcome(summary: dict[str, object], save_path: str | None) -> None:
    """Tell the user, on stderr, how a run that did not complete can go on."""
    if summary.get("outcome") == "failed":
        print(f"elche: the run failed: {summary.get('reason')}", file=sys.stderr, flush=True)
    if summary.get("outcome") == "saved_and_shutdown":
        reason = str(summary.get("reason"))
        unwritten = SaveReason.FINAL_MODEL_UNWRITTEN.value + ": "
        said = (
            f"the run trained to its end, but {reason.removeprefix(unwritten)}; the trained "
            "model is saved"
            if reason.startswith(unwritten)
            else f"the run could not continue ({reason}); its state is saved"
        )
        print(
            f"elche: {said} as the bundle {save_path} ({save_path}.meta.json names its "
            f"files). Resume it with resume_from={save_path!r} (elche demo: --resume-from "
            f"{save_path}).",
            file=sys.stderr,
            flush=True,
        )


class Watchers:
    """What follows the timeline in the launching process: the dashboard, the TensorBoard log."""

    def __init__(self, dashboard: Dashboard | None, tensorboard: TensorBoardLog | None) -> None:
        self.dashboard = dashboard
        self.tensorboard = tensorboard

    def stop(self) -> None:
        """Read the timeline one last time and stop following it."""
        if self.dashboard is not None:
            self.dashboard.stop()
        if self.tensorboard is not None:
            self.tensorboard.stop()


def start_watching(
    plan: Plan, run_dir: Path, dashboard: str | None, tensorboard_dir: str | None = None
) -> Watchers:
    """Say where the run's files are; start its dashboard and TensorBoard log, if asked for.

    Either that cannot start is reported; the run goes on without it.
    """
    print(f"elche: run directory {run_dir}", file=sys.stderr, flush=True)
    return Watchers(_start_dashboard(plan, run_dir, dashboard),
                    _start_tensorboard(run_dir, tensorboard_dir))  # fmt: skip


def _start_dashboard(plan: Plan, run_dir: Path, dashboard: str | None) -> Dashboard | None:
    if dashboard is None:
        return None
    from elche.monitor.address import parse_address
    from elche.monitor.dashboard import Dashboard

    host, port = parse_address(dashboard)
    board = Dashboard(
        run_dir, plan.config.world_size, host=host, port=port, devices=list(plan.devices)
    )
    try:
        url = board.start()
    except OSError as exc:
        print(f"elche: no dashboard ({exc}); training goes on", file=sys.stderr, flush=True)
        return None
    print(f"elche: dashboard at {url}", file=sys.stderr, flush=True)
    return board


def _start_tensorboard(run_dir: Path, tensorboard_dir: str | None) -> TensorBoardLog | None:
    if tensorboard_dir is None:
        return None
    from elche.monitor.tensorboard import TensorBoardLog

    try:
        log = TensorBoardLog(run_dir, Path(tensorboard_dir))
    except (OSError, ImportError) as exc:
        print(f"elche: no TensorBoard log ({exc}); training goes on", file=sys.stderr, flush=True)
        return None
    log.start()
    print(f"elche: TensorBoard log in {tensorboard_dir}", file=sys.stderr, flush=True)
    return log


def rank_context() -> ForkServerContext | SpawnContext:
    """The multiprocessing context rank processes start from (see the module doc).

    The fork server is one per process: the benchmark's baselines start their
    ranks from it too, so every system's ranks fork with torch loaded.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    _start_fork_server()
    return ctx


def _start_fork_server() -> None:
    """Start the fork server (if it is not running) with the stop signals blocked.

    It inherits the mask, so a Ctrl-C to the process group while it imports
    (a second or two) waits, pending, until ``elche.runtime.forkserved``,
    its first preload, has ignored the three and unblocked them; it ended
    the server in a ``KeyboardInterrupt`` traceback. (Python's resource
    tracker starts so.) Here, a stop signal that came meanwhile is delivered
    once they are unblocked.
    """
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()  # first: starting, it unblocks SIGINT and SIGTERM
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def check_picklable(fns: UserFns) -> None:
    """Every function a rank needs can be sent to it (ranks are separate processes).

    Raises:
        ConfigError: naming the function that cannot be pickled, or ``ranks`` for a
            main module the ranks cannot rebuild (``check_main_module``).
    """
    check_main_module()
    check_sendable(fns, ("model_fn", "optimizer_fn", "step_fn", "eval_fn", "epoch_fn",
                         "checkpoint_fn", "collate_fn"))  # fmt: skip
    check_options_picklable(fns.options)  # lr_schedule, batch_sampler, collate_fn


def pickled(fns: UserFns) -> bytes:
    """``fns`` pickled by value, once for every rank (``_start_rank``); its
    functions passed ``check_picklable``.

    Raises:
        ConfigError: naming ``dataset`` or ``eval_dataset``, whichever cannot
            be pickled (an attribute that is a lambda, an open file, a lock).
    """
    try:
        return to_ranks(fns)
    except SEND_ERRORS as exc:
        for name in ("dataset", "eval_dataset"):
            value = getattr(fns, name)
            try:
                to_ranks(value)
            except SEND_ERRORS:
                raise ConfigError(
                    name,
                    f"{type(value).__name__} cannot be sent to the rank processes ({exc}): "
                    "each rank gets a pickled copy; keep no lambda, nested function, open "
                    "file or lock in it (open files in __getitem__, or use elche.Shards of "
                    "top-level functions)",
                ) from None
        raise


def launch_local(
    plan: Plan,
    fns: UserFns,
    hooks: Hooks,
    run_dir: Path,
    *,
    max_grad_norm: float | None,
    progress: bool,
    dashboard: str | None = None,
    tensorboard_dir: str | None = None,
) -> TrainResult:
    """Run ``plan`` with one local process per rank; see ``elche.train``.

    Raises:
        Interrupted: SIGINT, SIGTERM or SIGHUP stopped the run; its bundle is saved.
        ConfigError: the dataset cannot be sent to the ranks (``pickled``);
            nothing has started.
    """
    t0 = time.monotonic()
    plan = with_bundle(plan, run_dir)
    with marked_stop_signals() as (signals, marks):  # (marked: for the ranks, the run's stops)
        epochs, unwritable = _supervise(
            plan, fns, hooks, run_dir, signals, marks=marks, max_grad_norm=max_grad_norm,
            progress=progress, dashboard=dashboard, tensorboard_dir=tensorboard_dir,
        )  # fmt: skip
        try:
            result = collect(plan, run_dir, t0, epochs, unwritable=unwritable)
        except RuntimeError as exc:  # the coordinator left no summary
            if signals.received is None:
                raise
            # A run that began (an epoch ended, or a journal kept), on a full disk, say:
            # why nothing is saved. Else it had not formed.
            began = bool(epochs) or not _never_began(run_dir)
            raise interrupted(
                signals.received,
                None,
                plan.config.save_path,
                resumed_from=plan.resume_from,
                t0=t0,
                unsaved=str(exc) if began else None,
            ) from None
    if signals.received is not None and result.summary.get("outcome") != "completed":
        raise interrupted(
            signals.received,
            result,
            plan.config.save_path,
            resumed_from=plan.resume_from,
            t0=t0,
        )
    explain_outcome(result.summary, plan.config.save_path)
    return result


def _supervise(
    plan: Plan,
    fns: UserFns,
    hooks: Hooks,
    run_dir: Path,
    signals: StopSignals,
    *,
    marks: int,
    max_grad_norm: float | None,
    progress: bool,
    dashboard: str | None,
    tensorboard_dir: str | None,
) -> tuple[list[dict[str, object]], bool]:
    """Start the coordinator and the ranks, follow the run to its end (committing what
    the ranks kept if its coordinator was lost for good); its epochs, and whether its
    coordinator ended for a run directory it could not write. ``marks``: the read end
    of the pipe where ``signals`` marks each stop, for the ranks."""
    cfg = plan.config
    sent = pickled(fns)  # before anything starts
    secret = secret_from_env(os.environ) or new_secret()
    ctx = rank_context()
    try:
        coordinator = supervised(
            cfg, run_dir, secret, plan.resume_from, ctx, resume_seq=plan.resume_seq
        )
    except (EOFError, OSError):
        if signals.received is None:
            raise
        # The group's stop signal ended the fork server as it started (the first run
        # of this process), before it could ignore it (``elche.runtime.forkserved``):
        # no coordinator, nothing trained; ``launch_local`` says so.
        return [], False
    announce_join(coordinator.address, coordinator.group_port, run_dir, secret, cfg)
    board = start_watching(plan, run_dir, dashboard, tensorboard_dir)
    procs: list[Any] = []
    timeline = TimelineReader(run_dir)
    epochs = epoch_log(plan)
    display = Progress(cfg.epochs, enabled=progress)
    reported: set[int] = set()
    stop_by = math.inf  # once asked to stop: when the launcher stops waiting
    failed = False
    try:
        for rank in range(cfg.world_size):
            if signals.received is not None:
                break  # stopped while starting: the run will not form
            procs.append(_start_rank(ctx, rank_spec(
                plan, rank, coordinator.address, secret, run_dir, max_grad_norm=max_grad_norm,
                group_port=coordinator.group_port,
            ), sent, cfg.batch_size, marks))  # fmt: skip
        del sent  # the dataset's copy, pickled for the ranks: each has its own now
        while (
            time.monotonic() < stop_by
            and not failed
            and coordinator.running({r: procs[r].known_exitcode for r in reported})
        ):
            time.sleep(SUPERVISE_EVERY_S)  # supervision cadence, not synchronisation
            if signals.received is not None and stop_by == math.inf:
                stop_by = time.monotonic() + cfg.heartbeat_timeout_s + STOP_SLACK_S
                coordinator.ask_stop(signal.Signals(signals.received).name)
            for event in timeline.new_records():
                on_record(event, epochs, hooks, display)
                if isinstance(event, tl.RankLost) and event.rank < len(procs):
                    # Declared dead: it must not come back (a hung rank is killed).
                    reported.add(event.rank)
                    procs[event.rank].kill()
            for rank, proc in enumerate(procs):
                if proc.exitcode is not None and rank not in reported:
                    reported.add(rank)
                    report_lost(coordinator.host, rank, proc.known_exitcode,
                                stopping=signals.received is not None)  # fmt: skip
            failed = _run_failed(run_dir)
    finally:
        display.close()
        # A failed run has nothing left to save: no rank is waited for. Nor is one
        # of a run whose coordinator was lost before it began (nothing trained).
        grace_s = RANK_EXIT_GRACE_S if signals.received is None else STOPPED_RANK_GRACE_S
        host = coordinator.host
        if failed or host.poll() == FAILED_EXIT or _never_began(run_dir):
            grace_s = 0.0
        _end_ranks(procs, grace_s)
        if host.poll() is None:
            host.kill()
        board.stop()
    salvage_if_lost(plan, run_dir, coordinator.host)
    for event in timeline.new_records():  # the salvage's bundle and the run's end too
        on_record(event, epochs, hooks, display)
    return epochs, run_dir_unwritable(coordinator.host)


def _end_ranks(procs: Sequence[Forked], grace_s: float) -> None:
    """Give the rank processes ``grace_s`` to exit once the run is over, then kill them.

    A thread of the user's code (started in ``model_fn``, say) keeps its
    process alive past the rank's end; one that writes something at exit
    must be given the time, so the wait is said, not cut short.
    """
    start = time.monotonic()
    deadline = start + grace_s
    for rank, proc in enumerate(procs):
        proc.join(timeout=max(min(deadline, start + RANK_EXIT_SAY_S) - time.monotonic(), 0.1))
        if proc.is_alive() and (left := deadline - time.monotonic()) > 0:
            print(f"elche: rank {rank}'s process has not exited though the run is over; "
                  f"waiting {left:.0f} s more before it is killed (a thread of your code that "
                  "does not end keeps it alive)", file=sys.stderr, flush=True)  # fmt: skip
            proc.join(timeout=left)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _never_began(run_dir: Path) -> bool:
    """The coordinator left neither a summary nor a journal: it was lost before any
    work went out (the journal's first record precedes it), so no rank trained."""
    return not (run_dir / SUMMARY_FILE).exists() and not (run_dir / JOURNAL_FILE).exists()


def _start_rank(
    ctx: ForkServerContext | SpawnContext, spec: RankSpec, fns: bytes, batch_size: int, marks: int
) -> Forked:
    """Start rank ``spec.rank``'s process; a forked one takes the launcher's stdout and stderr.
    Each holds the read end of the pipe where its launcher marks the run's stops, ``marks``
    (``lifetimes.marked_stop_signals``), sent as the streams are.

    ``fns`` are pickled by value (``pickled``): the process pickler would send
    every tensor in the dataset as a shared-memory fd (too many fds for a list
    of them).
    """
    with (
        launcher_streams(ctx.get_start_method()) as streams,
        contextlib.closing(launcher_stream(marks)) as sent_marks,
    ):
        proc = ctx.Process(
            target=_rank_process,
            args=(spec, fns, batch_size, dict(os.environ), os.getpid()),
            kwargs={"streams": streams, "marks": sent_marks},
            name=f"elche-rank{spec.rank}",
        )
        proc.start()
    return Forked(proc)


def keep_report(plan: Plan, run_dir: Path) -> str | None:
    """Write ``RUN_DIR/report.html``; its path, or None (said on stderr) when it cannot be."""
    from elche.monitor.report import write_report

    try:
        path = write_report(run_dir, plan.config.world_size, devices=list(plan.devices))
    except (OSError, ValueError) as exc:  # the run's result matters more than its report
        print(f"elche: no report for this run ({exc})", file=sys.stderr, flush=True)
        return None
    print(f"elche: report at {path}", file=sys.stderr, flush=True)
    return str(path)


def interrupted(
    signum: int,
    result: TrainResult | None,
    save_path: str | None,
    *,
    resumed_from: str | None = None,
    t0: float | None = None,
    unsaved: str | None = None,
) -> Interrupted:
    """The ``Interrupted`` to raise for a run ``signum`` stopped, announced on stderr.

    When the stop's own save failed (a full disk), a checkpoint the run committed
    at ``save_path`` since ``t0`` is the bundle it names: whole, and resumable.
    ``unsaved``: why a run that began and left no ``result`` saved nothing.
    """
    saved = result is not None and result.summary.get("outcome") == "saved_and_shutdown"
    earlier = None if saved or t0 is None else fresh_bundle(save_path, t0)
    stop = Interrupted(signum, save_path if saved else earlier, result)
    announce(stop, resumed_from, earlier=earlier is not None, unsaved=unsaved)
    return stop


def _run_failed(run_dir: Path) -> bool:
    """The coordinator wrote its summary, and the run failed (it may still be up)."""
    summary = run_dir / SUMMARY_FILE
    if not summary.exists():
        return False
    try:
        return bool(json.loads(summary.read_text(encoding="utf-8"))["outcome"] == "failed")
    except (OSError, ValueError, KeyError):
        return False


def on_record(
    event: tl.TimelineEvent,
    epochs: list[dict[str, object]],
    hooks: Hooks,
    display: Progress,
) -> None:
    """Apply one timeline record: per-epoch metrics, user hooks, the display."""
    display.show(event)
    log = epochs if isinstance(epochs, EpochLog) else EpochLog()
    match event:
        case tl.EpochEnd():
            entry = log.ended(event)
            if log is not epochs:
                epochs.append(entry)
            if hooks.metrics_fn is not None:
                call_hook("metrics_fn", hooks.metrics_fn, entry)
        case tl.Eval(epoch=done, metric=metric):  # after ``done`` epochs: epoch ``done - 1``
            log.evaluated(done - 1, metric)
            if hooks.eval_result_fn is not None:
                call_hook("eval_result_fn", hooks.eval_result_fn, done - 1, metric)
        case tl.RankWindow():
            log.note_window(event)
        case tl.BundleWritten():
            log.note_bundle(event)
        case _:
            pass


def call_hook(name: str, fn: Callable[..., object], *args: object) -> None:
    """Run a user hook; one that raises is reported and the run goes on."""
    try:
        fn(*args)
    except Exception:
        print(
            f"elche: {name} raised; training goes on:\n{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )


def fresh_bundle(stem: str | None, t0: float) -> str | None:
    """``stem`` if a bundle was committed there since ``t0`` (monotonic), else None:
    what a run whose summary never came saved (its summary would name it)."""
    began = time.time() - (time.monotonic() - t0)
    if stem is None or bundle.read_meta(stem) is None:
        return None
    try:
        return stem if bundle.meta_path(stem).stat().st_mtime >= began else None
    except OSError:  # gone since it was read
        return None


def epoch_log(plan: Plan) -> EpochLog:
    """The run's per-epoch metrics, filled from its timeline."""
    cfg = plan.config
    return EpochLog(epochs=cfg.epochs, num_samples=cfg.num_samples, reference_batch=cfg.batch_size)


def collect(
    plan: Plan,
    run_dir: Path,
    t0: float,
    epochs: list[dict[str, object]],
    *,
    unwritable: bool = False,
) -> TrainResult:
    """Build the result of a finished run from the files in ``run_dir``; ``unwritable``:
    its coordinator ended because it could not write there (a full disk, say).

    Raises:
        TrainingError: the run failed on the user's code (the summary's ``user_error``).
        RuntimeError: the coordinator left no summary.
    """
    import torch

    try:
        host, ranks = read_run(run_dir, plan.config.world_size)
    except RuntimeError as exc:  # no summary: a bundle of this run's still resumes it
        saved = fresh_bundle(plan.config.save_path, t0)
        # One that could not write there said its error (a full disk, say) as it ended.
        why = f"the coordinator could not write in the run directory {run_dir}"
        where = f"; the run's state is saved as the bundle {saved}: resume_from={saved!r}"
        raise RuntimeError(
            f"{why if unwritable else exc}{where + ' continues it' if saved else ''}"
        ) from None
    summary = run_summary(
        host, ranks, speeds=plan.speeds, launched_s=t0, save_path=plan.config.save_path
    )
    summary["run_dir"] = str(run_dir)
    summary["report"] = keep_report(plan, run_dir)
    user_error = summary.get("user_error")
    if isinstance(user_error, dict):
        explain_outcome(summary, plan.config.save_path)  # a non-finite loss saved a bundle
        print(f"elche: the run's files are kept in {run_dir}", file=sys.stderr, flush=True)
        stem = summary.get("bundle")
        raise TrainingError.from_summary(user_error, stem if isinstance(stem, str) else None)
    with_bundles(summary, epochs)
    model_file = run_dir / bundle.FINAL_MODEL
    state = torch.load(model_file, map_location="cpu") if model_file.exists() else {}
    return TrainResult(state_dict=state, epochs=epochs, summary=summary, run_dir=str(run_dir))
