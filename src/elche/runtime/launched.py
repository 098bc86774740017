"""Training under a launcher: ``torchrun`` or ``elche run``.

Theory of operation. The launcher starts one process per rank with the
torch.distributed environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``). Each process calls ``elche.train`` and
lands here: it joins the default gloo group from the environment; global rank
0 starts the coordinator as its own process and shares its address and the
run secret over the group; then every process trains as one rank. Rank 0
waits for the coordinator to finish and builds the result; every rank
returns its final model (the consensus) with the same summary and per-epoch
metrics, which rank 0 shares (``elche.runtime.shared_result``).
When the run fails on the user's code, every process raises the same
``TrainingError`` (a failing rank its own, the others the coordinator's).

Under torchrun each worker trains its rank in a child process and
waits for it (``_supervises``): torchrun's agent ends the whole group when a
worker exits non-zero, so a worker whose rank died must exit 0 for the others
to go on.

Rank 0's process also watches its coordinator: one that dies without its
summary is restarted from the run's journal on the same address
(``supervision.Supervised``), up to ``max_coordinator_restarts`` times, while the
ranks hold their state and rejoin it.

Across hosts the coordinator binds every interface and is reached at the
address ``elche.runtime.addresses`` chooses among rank 0's (``ELCHE_ADVERTISE``
overrides it), rank 0 on any host; the run's secret (``ELCHE_SECRET`` when
set, else a fresh one) authenticates every frame. Every host keeps its own
run directory, at the path rank 0 chose; the ranks' groups form through the
coordinator's store (``elche.runtime.groups``), never through files.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store
from torch.distributed.rendezvous import rendezvous

from elche.core.checkpoint import SaveReason
from elche.core.errors import ConfigError, RankExcluded, TrainingError
from elche.core.liveness import lost_for_silence
from elche.core.rank import COORDINATOR_LOST, SAVED
from elche.monitor.progress import Progress
from elche.monitor.summary import SUMMARY_FILE, rank_report_file
from elche.monitor.timeline import TimelineReader, read_timeline
from elche.runtime.addresses import BIND_ENV, EVERY_INTERFACE, advertised_host
from elche.runtime.frames import new_secret, secret_from_env
from elche.runtime.handoff import is_handoff
from elche.runtime.joining import announce_join
from elche.runtime.journal_file import JOURNAL_FILE
from elche.runtime.launch import (
    HANDBACK_FAILED,
    _rank_process,
    check_picklable,
    collect,
    epoch_log,
    explain_outcome,
    fresh_bundle,
    interrupted,
    on_record,
    rank_error_file,
    rank_spec,
    start_watching,
    with_bundle,
)
from elche.runtime.lifetimes import (
    RANK_EXITS_ENV,
    SILENT_PROCESS_S,
    Interrupted,
    StopSignals,
    leave_run,
    say_ranks_met,
    say_waiting,
    stop_came_alone,
    watch_launcher,
)
from elche.runtime.plan import Hooks, Plan, TrainResult
from elche.runtime.same_run import REFUSED, check_refusals, check_same_plans, plan_of, refusal
from elche.runtime.shared_result import HOLD_S, BoardSilent, ResultBoard
from elche.runtime.supervision import (
    Supervised,
    report_lost,
    run_dir_unwritable,
    salvage_if_lost,
    start_coordinator,
)
from elche.runtime.worker import raise_if_refused, train_rank

if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.process import BaseProcess

    from elche.runtime.worker import RankSpec, UserFns

__all__ = ["train_launched"]

# How long rank 0 waits for the coordinator to exit after its own rank stopped.
COORDINATOR_EXIT_S = 60.0
# How long rank 0 waits for the other ranks to keep their state once their
# coordinator is gone for good (they see it within a heartbeat, unless in a long step).
LOCAL_STATE_WAIT_S = 15.0
# How long a rank whose rank 0 is gone waits for the coordinator's summary on its host.
SUMMARY_WAIT_S = 10.0
# A worker's report when the child that trained its rank died (``_train_in_child``).
CHILD_LOST = "lost"
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # set in torchrun's workers
# How often a torchrun worker looks for its rank among the hung (``_wait_child``).
CHILD_WATCH_S = 0.2


def train_launched(
    plan: Plan,
    fns: UserFns,
    hooks: Hooks,
    *,
    max_grad_norm: float | None,
    run_dir: str | None,
    dashboard: str | None = None,
    tensorboard_dir: str | None = None,
    refused: ConfigError | None = None,
) -> TrainResult:
    """Train this process as rank ``$RANK`` of ``$WORLD_SIZE``; see ``elche.train``.

    ``refused``: why this rank's own checks refused the run before it started
    (``elche.api``); the rank meets the others to tell them, and every rank
    raises it.

    SIGINT, SIGTERM and SIGHUP stop the run cleanly (``elche.runtime.lifetimes``):
    rank 0 asks its coordinator to stop, every rank saves, and every rank's
    ``elche.train`` raises ``Interrupted``; rank 0 prints the one line. Under
    ``elche run`` one that reaches a rank but 0 alone ends that rank's process,
    and the run goes on without it. A rank whose launcher dies ends within
    ``ORPHAN_GRACE_S``.

    Raises:
        Interrupted: a signal (or the launcher's death) stopped the run.
        ConfigError: the ranks' scripts plan different runs (another seed,
            dataset length, batch size, ...: ``elche.runtime.same_run``), or a
            rank's checks refused it (``refused``); on every rank, before
            anything starts.
    """
    t0 = time.monotonic()
    rank = int(os.environ["RANK"])
    host: list[Supervised] = []  # rank 0's coordinator, once started
    whole_lines()

    def ask_stop(reason: str) -> None:
        if host:
            host[0].ask_stop(reason)

    def on_signal(signum: int) -> None:
        if rank != 0 and stop_came_alone():
            leave_run(rank, signum, "elche run")
        ask_stop(signal.Signals(signum).name)

    with StopSignals(on_signal=on_signal, force_on_repeat=False) as signals:
        watch_launcher(os.getppid(), on_gone=lambda: ask_stop("the launching process is gone"))
        result, stopped = _train(
            plan, fns, hooks, rank=rank, host_box=host, signals=signals,
            max_grad_norm=max_grad_norm, run_dir=run_dir, dashboard=dashboard,
            tensorboard_dir=tensorboard_dir, refused=refused,
        )  # fmt: skip
    asked = stopped == f"{SAVED}{SaveReason.GRACEFUL_SHUTDOWN.value}"  # stopped on request
    signalled = signals.received is not None and result.summary.get("outcome") != "completed"
    if not (asked or signalled):  # (a signal before the run formed: it failed, nothing saved)
        return result
    signum = signals.received if signals.received is not None else signal.SIGTERM
    stem = result.summary.get("bundle")  # RUN_DIR/checkpoint where the user named no save_path
    bundle = stem if isinstance(stem, str) else None
    # (a rank's result always names its run dir)
    save_path = with_bundle(plan, Path(result.run_dir or ".")).config.save_path
    if bundle is None and asked and rank != 0:  # rank 0 is gone, and the line it would say
        bundle = fresh_bundle(save_path, t0)
        if bundle is not None:
            _say_saved_without_rank0(rank, bundle)
    if rank == 0:
        raise interrupted(signum, result, save_path, resumed_from=plan.resume_from, t0=t0)
    raise Interrupted(signum, bundle, result)


def whole_lines() -> None:
    """This rank's stdout and stderr, unless terminals, go out one line per write.

    A launcher's ranks share its output. Unbuffered (``PYTHONUNBUFFERED``, as
    CI sets it) a ``print`` writes each piece on its own, so two ranks' lines
    mix mid-line; block-buffered, a log shows them kilobytes late. A whole
    line in one write (up to the pipe's 4 KiB) never mixes and shows at once.
    """
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and not stream.isatty():
            with contextlib.suppress(ValueError, OSError):  # closed, or not a real file
                stream.reconfigure(line_buffering=True, write_through=False)


def _train(
    plan: Plan,
    fns: UserFns,
    hooks: Hooks,
    *,
    rank: int,
    host_box: list[Supervised],
    signals: StopSignals,
    max_grad_norm: float | None,
    run_dir: str | None,
    dashboard: str | None,
    tensorboard_dir: str | None,
    refused: ConfigError | None,
) -> tuple[TrainResult, object]:
    """Join, start the coordinator on rank 0, train; the result and why this rank stopped."""
    t0 = time.monotonic()
    world = plan.config.world_size
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    multi_host = local_world < world
    if not multi_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    say_waiting()  # (elche run stops the others if a rank ended before it got here)
    dist.init_process_group(
        "gloo", store=_launchers_store(rank, world), rank=rank, world_size=world
    )
    plans: list[Any] = [None] * world  # every rank's, to refuse a run its ranks disagree on
    dist.all_gather_object(plans, plan_of(plan.config, fns.dataset) | {REFUSED: refusal(refused)})
    try:
        check_refusals(plans, refused)
        check_same_plans(plans)
    except ConfigError:
        dist.destroy_process_group()
        raise
    rank0 = None
    if rank == 0:
        say_ranks_met()
    box: list[object] = [None]  # what rank 0 shares (``_Shared``)
    if rank == 0:
        rank0 = _start_or_tell(lambda: _start_on_rank0(
            plan, host_box, signals, run_dir=run_dir, multi_host=multi_host,
            dashboard=dashboard, tensorboard_dir=tensorboard_dir,
        ))  # fmt: skip
        box = [rank0.shared]
    dist.broadcast_object_list(box, src=0)
    shared = box[0]
    assert isinstance(shared, _Shared)
    if shared.failure:
        dist.destroy_process_group()
        raise RuntimeError(f"rank 0 could not start the run: {shared.failure}")
    # Every rank starts from the save rank 0 checked (another run may have saved
    # at the stem between two ranks' checks).
    plan = replace(plan, resume_seq=shared.resume_seq)
    host = None if rank0 is None else rank0.host
    if rank0 is None:
        results = ResultBoard.join(_board_host(multi_host), shared.port, COORDINATOR_EXIT_S)
    else:
        results = rank0.results
    directory = Path(shared.directory)
    directory.mkdir(parents=True, exist_ok=True)  # on another host: this host's own run dir
    plan = with_bundle(plan, directory)
    spec = rank_spec(
        plan, rank, shared.address, bytes.fromhex(shared.secret_hex), directory,
        max_grad_norm=max_grad_norm, group_port=shared.group_port,
    )  # fmt: skip
    report, state, own_error = _rank_outcome(spec, fns, plan.config.batch_size, host, results)
    stopped = report.get("stopped")
    if rank0 is None:
        result = _other_rank_result(report, state, results, plan=plan, directory=directory, t0=t0)
        return result, stopped
    # Its own rank failed or was lost (torchrun: its child): the run may go on a long while.
    until_end = own_error is not None or stopped == CHILD_LOST
    result = _serve_result(plan, hooks, rank0, directory, t0, signals=signals, until_end=until_end)
    if own_error is not None:
        raise own_error
    if not result.state_dict:
        result.state_dict = state
    return result, stopped


# The launcher's rendezvous store (``env://``), opened once a process: rank 0 hosts it
# under ``elche run``, torchrun's agent under torchrun. Each ``elche.train`` call of the
# script meets the others under a prefix of its own.
_LAUNCHERS_STORE: list[Store] = []
_CALLS = itertools.count(1)


def _launchers_store(rank: int, world: int) -> Store:
    """The store this call's default group forms over: the launcher's, under the call's
    number. A script that calls ``elche.train`` twice used to open the rendezvous again:
    rank 0's second store replaced its first while a faster rank had already met there,
    and every rank waited in gloo's rendezvous for good (torch's timeout: 30 minutes)."""
    if not _LAUNCHERS_STORE:
        store, _, _ = next(rendezvous("env://", rank=rank, world_size=world))
        _LAUNCHERS_STORE.append(store)
    return PrefixStore(f"elche/train{next(_CALLS)}/", _LAUNCHERS_STORE[0])


def _rank_outcome(
    spec: RankSpec, fns: UserFns, batch_size: int, host: Supervised | None, results: ResultBoard
) -> tuple[dict[str, object], dict[str, torch.Tensor], TrainingError | None]:
    """Train this rank: its report and model, or (rank 0) the user error its rank raised.

    Rank 0's own rank may fail while the run goes on without it; its process
    still hosts the run, so it serves it to its end and shares the result
    before it raises that error.
    """
    try:
        report, state = _run_rank(spec, fns, batch_size, host, results)
    except TrainingError as exc:
        if host is None:
            results.leave()
            raise
        return {}, {}, exc
    except BaseException:
        if host is None:  # rank 0 need not hold the result for this rank
            results.leave()
        raise
    return report, state, None


def _serve_result(
    plan: Plan,
    hooks: Hooks,
    rank0: _Rank0,
    directory: Path,
    t0: float,
    *,
    signals: StopSignals,
    until_end: bool,
) -> TrainResult:
    """Rank 0: wait for the coordinator (and its successors), build the run's result and
    share it with every other rank (or what it raised, shared too); say how a run that
    did not complete can go on (a signalled one: ``interrupted`` says).

    ``until_end``: rank 0's own rank failed while the run goes on without it; the
    coordinator is waited for as long as the run lasts, not ``COORDINATOR_EXIT_S``.
    """
    readers = plan.config.world_size - 1
    try:
        rank0.watcher.join(timeout=None if until_end else COORDINATOR_EXIT_S)
        rank0.results.stop_watching()  # the run is over: no rank's exit matters now
        if rank0.board is not None:
            rank0.board.stop()
        salvage_if_lost(plan, directory, rank0.host.host, wait_s=LOCAL_STATE_WAIT_S)
        unwritable = run_dir_unwritable(rank0.host.host)
        result = _result_in_run_dir(plan, hooks, directory, t0, unwritable=unwritable)
    except BaseException as exc:
        rank0.results.publish(_failure_doc(exc), readers=readers)
        raise
    rank0.results.publish({"summary": result.summary, "epochs": result.epochs}, readers=readers)
    stopped = result.summary.get("reason") == SaveReason.GRACEFUL_SHUTDOWN.value
    if not stopped and signals.received is None:
        explain_outcome(result.summary, plan.config.save_path)
    return result


def _failure_doc(exc: BaseException) -> dict[str, object]:
    """What rank 0 shares when it raises: the run's user error, which every rank then
    raises with the bundle it names, or its own error."""
    if isinstance(exc, TrainingError):
        fields = ("rank", "epoch", "error_type", "message", "traceback")
        return {"user_error": {f: getattr(exc, f) for f in fields}, "bundle": exc.bundle}
    return {"error": f"{type(exc).__name__}: {exc}"}


def _start_or_tell(start: Callable[[], _Rank0]) -> _Rank0:
    """Rank 0: ``start`` the run; if it cannot, tell the other ranks why (they wait for
    what it shares), then raise its error."""
    try:
        return start()
    except Exception as exc:
        told: list[object] = [_Shared(failure=f"{type(exc).__name__}: {exc}")]
        dist.broadcast_object_list(told, src=0)
        dist.destroy_process_group()  # (left to the exit, gloo's threads may abort it)
        raise


@dataclass(frozen=True, slots=True)
class _Shared:
    """What every rank needs from rank 0 to join the run, or why rank 0 could not start it."""

    address: str = ""  # the coordinator's (one the other hosts reach, across hosts)
    secret_hex: str = ""
    directory: str = ""  # the run directory (each host keeps its own, at this path)
    port: int = 0  # the result board's
    group_port: int | None = None  # the group store's (``start_coordinator``)
    resume_seq: int | None = None  # the save rank 0 checked (``Plan.resume_seq``)
    failure: str = ""  # rank 0's error, when it could not start the run


@dataclass(slots=True)
class _Rank0:
    """What rank 0 starts for the run: the coordinator and who follows it."""

    host: Supervised  # the coordinator, and each successor of a lost one
    watcher: threading.Thread  # replaces a lost coordinator; ends with the last one
    results: ResultBoard  # where the other ranks read the run's result
    board: Any  # the dashboard and TensorBoard log (launch.Watchers)
    shared: _Shared  # what every rank needs


def _start_on_rank0(
    plan: Plan,
    host_box: list[Supervised],
    signals: StopSignals,
    *,
    run_dir: str | None,
    multi_host: bool,
    dashboard: str | None,
    tensorboard_dir: str | None,
) -> _Rank0:
    """Start the coordinator (supervised), the result board and the watchers, and
    say what every rank needs (``_Shared``)."""
    directory = Path(
        run_dir or os.environ.get("ELCHE_RUN_DIR") or tempfile.mkdtemp(prefix="elche-run-")
    )
    secret = secret_from_env(os.environ) or new_secret()
    advertise = None
    if multi_host:
        advertise = advertised_host(os.environ)  # before anything starts: fail fast
        os.environ.setdefault(BIND_ENV, EVERY_INTERFACE)
    bundled = with_bundle(plan, directory)
    host, address, group_port = start_coordinator(
        bundled.config, directory, secret, plan.resume_from, resume_seq=plan.resume_seq
    )
    coordinator = Supervised(host, address, group_port, bundled.config, directory, secret)
    host_box.append(coordinator)
    lost: dict[int, int | None] = {}  # the rank processes known gone: rank, exit code

    def rank_exited(rank: int, code: int | None) -> None:
        lost[rank] = code
        # (to the one up now; said unless the run is stopping, its ranks exiting as told)
        report_lost(coordinator.host, rank, code, stopping=signals.received is not None)

    _relay_rank_exits(rank_exited)
    watcher = _watch_coordinator(coordinator, lost)
    if signals.received is not None:  # the signal came while the coordinator started
        coordinator.ask_stop(signal.Signals(signals.received).name)
    if advertise is not None:
        address = f"tcp://{advertise}:{address.rsplit(':', 1)[1]}"
    announce_join(address, group_port, directory, secret, bundled.config)
    results = ResultBoard.serve()
    if TORCHRUN_ENV in os.environ:  # its workers say their ranks' exits there (elche run: a pipe)
        timeline = TimelineReader(directory)

        def silent_losses() -> list[tuple[int, str]]:  # for the workers to kill (``_wait_child``)
            try:
                found = [lost_for_silence(event) for event in timeline.new_records()]
            except OSError:  # (an unreadable timeline: no news, the exits still relayed)
                return []
            return [(lost.rank, lost.reason) for lost in found if lost is not None]

        results.watch_ranks(range(1, plan.config.world_size), rank_exited, silent_losses)
    board = start_watching(bundled, directory, dashboard, tensorboard_dir)
    shared = _Shared(
        address=address, secret_hex=secret.hex(), directory=str(directory), port=results.port,
        group_port=group_port, resume_seq=plan.resume_seq,
    )  # fmt: skip
    return _Rank0(host=coordinator, watcher=watcher, results=results, board=board, shared=shared)


def _other_rank_result(
    report: dict[str, object],
    state: dict[str, torch.Tensor],
    results: ResultBoard,
    *,
    plan: Plan,
    directory: Path,
    t0: float,
) -> TrainResult:
    """A rank but 0: the run's user error (raised), or its result as rank 0 shares it.

    Raises:
        TrainingError: the user's code failed, on this rank or another.
        RankExcluded: the run went on without this rank.
        RuntimeError: this rank's process ended (under torchrun) and rank 0
            shared no result: this worker has neither a model nor the run's.
    """
    try:
        raise_if_refused(report, int(os.environ["RANK"]))
    except RankExcluded:
        results.leave()
        raise
    user_error = report.get("user_error")
    if isinstance(user_error, dict):  # another rank's: the same error here
        results.leave()
        raise TrainingError.from_summary(user_error)
    cut_off = _cut_off(report)
    result = _shared_result(results, state, directory, cut_off=cut_off)
    if result.summary or cut_off:
        return result
    if not _coordinator_summary(directory):
        nothing = "rank 0 shared no run summary, and the coordinator's is not on this host"
        if report.get("stopped") == CHILD_LOST:  # nor has this rank a model of its own
            raise RuntimeError(f"rank {os.environ['RANK']}'s process ended (said above); {nothing}")
        print(f"elche: {nothing}", file=sys.stderr, flush=True)
        return result
    # Rank 0 is gone, and its coordinator wrote the run's end on this host.
    result = _result_in_run_dir(plan, Hooks(eval_result_fn=None, metrics_fn=None), directory, t0)
    stem = result.summary.get("bundle")
    if result.summary.get("reason") != SaveReason.GRACEFUL_SHUTDOWN.value:
        explain_outcome(result.summary, plan.config.save_path)
    elif isinstance(stem, str):  # the line rank 0 would say; then Interrupted
        _say_saved_without_rank0(int(os.environ["RANK"]), stem)
    result.state_dict = result.state_dict or state
    return result


def _say_saved_without_rank0(rank: int, bundle: str) -> None:
    print(f"elche rank {rank}: rank 0 shared no result; the run stopped and is saved "
          f"under {bundle}; resume_from={bundle!r} continues it", file=sys.stderr,
          flush=True)  # fmt: skip


def _coordinator_summary(directory: Path) -> bool:
    """Whether the coordinator's summary is in ``directory``, or comes within
    ``SUMMARY_WAIT_S`` where its journal is (its host: an orphaned coordinator
    writes the summary just after it told the ranks the run is over)."""
    summary = directory / SUMMARY_FILE
    if (directory / JOURNAL_FILE).exists():
        deadline = time.monotonic() + SUMMARY_WAIT_S
        while not summary.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the coordinator's last file, awaited with a deadline
    return summary.exists()


def _cut_off(report: dict[str, object]) -> str:
    """Why this rank lost its coordinator and gave up ('' when it did not)."""
    stopped = report.get("stopped")
    if isinstance(stopped, str) and stopped.startswith(COORDINATOR_LOST):
        return stopped.removeprefix(COORDINATOR_LOST)
    return ""


def _board_host(multi_host: bool) -> str:
    return os.environ["MASTER_ADDR"] if multi_host else "127.0.0.1"


def _shared_result(
    results: ResultBoard, state: dict[str, torch.Tensor], directory: Path, *, cut_off: str = ""
) -> TrainResult:
    """A rank but 0: its model with the summary and epochs rank 0 published.

    Raises:
        TrainingError: rank 0 raised the run's user error (a survivor of the
            failed ranks saved nothing of its own to say so).
        RankExcluded: this rank lost its coordinator (``cut_off``: why) and
            rank 0 shared nothing either: a host cut off for good.
        RuntimeError: rank 0 ended with an error (it said which) instead.
    """
    silent = None
    try:
        doc = results.read(COORDINATOR_EXIT_S + HOLD_S)
    except BoardSilent as exc:  # rank 0's host is off the network: nothing can come
        doc, silent = None, str(exc)
    user_error = doc.get("user_error") if doc else None
    if isinstance(user_error, dict):  # what rank 0 raised
        bundle = doc.get("bundle") if doc else None
        raise TrainingError.from_summary(user_error, bundle if isinstance(bundle, str) else None)
    summary = doc.get("summary") if doc else None
    epochs = doc.get("epochs") if doc else None
    if not isinstance(summary, dict):
        why = doc.get("error") if doc else silent or "none came"
        if doc and why and not cut_off:  # rank 0 raised it, and said it: so does every rank
            raise RuntimeError(f"rank 0 ended with {why}")
        if cut_off:  # neither the coordinator nor rank 0 reached: the run is elsewhere
            print(f"elche: rank 0 shared no run summary ({why})", file=sys.stderr, flush=True)
            rank = int(os.environ["RANK"])
            raise RankExcluded(
                rank=rank,
                reason=f"lost the coordinator ({cut_off}) and rank 0 shared no summary ({why})",
            )
        summary = {}
    return TrainResult(
        state_dict=state, summary=summary, epochs=epochs if isinstance(epochs, list) else [],
        run_dir=str(directory),
    )  # fmt: skip


def _result_in_run_dir(
    plan: Plan, hooks: Hooks, directory: Path, t0: float, *, unwritable: bool = False
) -> TrainResult:
    """The run's result from the coordinator's files in ``directory`` (on its host;
    ``unwritable``: its coordinator ended because it could not write there).

    Raises:
        TrainingError: the run ended on the user's error.
    """
    epochs = epoch_log(plan)
    quiet = Progress(plan.config.epochs, enabled=False)
    for event in read_timeline(directory):
        on_record(event, epochs, hooks, quiet)
    return collect(plan, directory, t0, epochs, unwritable=unwritable)


def _watch_coordinator(coordinator: Supervised, lost: dict[int, int | None]) -> threading.Thread:
    """Wait on the coordinator on a thread, replacing it while it is lost; ends with it.
    ``lost``: the rank processes known gone (rank: exit code), which a successor hears."""

    def watch() -> None:
        while True:
            coordinator.host.wait()
            if not coordinator.replaced(lost):  # (read once its successor is up)
                return

    thread = threading.Thread(target=watch, name="elche-coordinator-watch", daemon=True)
    thread.start()
    return thread


# Where the launcher's reports of rank exits go: the current run's ``rank_exited``
# (a script may call ``elche.train`` more than once; the pipe is read by one thread).
_RANK_EXITS_TO: list[Callable[[int, int | None], None]] = []


def _relay_rank_exits(rank_exited: Callable[[int, int | None], None]) -> None:
    """Rank 0 under ``elche run``: call ``rank_exited`` for each of the launcher's
    reports of a rank's exit (``RANK_EXITS_ENV``: ``RANK CODE`` lines, a negative
    code the signal that ended it), on a thread; from now on, until the next call
    (the script's next ``elche.train``) takes them."""
    first = not _RANK_EXITS_TO
    _RANK_EXITS_TO[:] = [rank_exited]
    fd = os.environ.pop(RANK_EXITS_ENV, "") if first else ""
    if not fd.isdigit():
        return

    def relay(reports: TextIO) -> None:
        with reports:
            for line in reports:  # EOF: the launcher is gone (``watch_launcher`` acts)
                rank, code = (int(word) for word in line.split())
                _RANK_EXITS_TO[0](rank, code)

    reports = open(int(fd), encoding="utf-8")  # noqa: SIM115  # the relay's, closed there
    threading.Thread(target=relay, args=(reports,), name="elche-rank-exits", daemon=True).start()


def _run_rank(
    spec: RankSpec,
    fns: UserFns,
    batch_size: int,
    host: Supervised | None,
    results: ResultBoard,
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """Train the rank, here or in a child (``_supervises``); its report and model."""
    if _supervises(fns):
        dist.destroy_process_group()  # the rank's own process forms its group
        return _train_in_child(spec, fns, batch_size, host, results)
    try:
        return train_rank(spec, fns, batch_size)
    finally:
        if dist.is_initialized():  # the rank's last group, if its membership left one
            dist.destroy_process_group()


def _supervises(fns: UserFns) -> bool:
    """Under torchrun, the rank trains in a process of its own.

    torchrun's agent ends the whole group when any worker exits non-zero
    (``docs/failure-modes.md``), so a worker whose rank is SIGKILLed must
    exit 0: the worker starts the rank as its child, waits for it, and
    returns whatever became of it. On one host or several alike: the child's
    groups form through the coordinator's store (``elche.runtime.groups``).
    With functions that cannot be sent to another process, or an
    ``elche.Session`` (whose loop is this process's), the rank trains in the
    worker itself.
    """
    if TORCHRUN_ENV not in os.environ or is_handoff(fns.step_fn):
        return False
    try:
        check_picklable(fns)
    except ConfigError as exc:
        print(f"elche: {exc}; under torchrun this rank trains in its worker, and a "
              "rank that dies ends the run", file=sys.stderr, flush=True)  # fmt: skip
        return False
    return True


def _wait_child(child: BaseProcess, rank: int, alive: Any, results: ResultBoard) -> str | None:
    """Wait for ``child``, the process that trains ``rank``, to end; why the run declared
    it lost for its silence, if it did and ``child`` was killed for it.

    A hung rank (a deadlock, a stopped process) must not come back, and this
    worker, torchrun with it, would wait for it for good: it is killed once rank 0
    posts on the board that the run went on without it (``ResultBoard.hung``) and
    it has not run here for ``SILENT_PROCESS_S`` either (``alive``, its beacon's
    last monotonic time). One that runs was cut off from the run (its host off the
    network a while): it ends itself, refused or giving its coordinator up.
    """
    while child.exitcode is None:
        child.join(CHILD_WATCH_S)
        silent = time.monotonic() - alive.value > SILENT_PROCESS_S
        hung = results.hung(rank) if silent and child.exitcode is None else None
        if hung is not None:
            child.kill()
            child.join()
            return hung
    return None


def _train_in_child(
    spec: RankSpec,
    fns: UserFns,
    batch_size: int,
    host: Supervised | None,
    results: ResultBoard,
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """Run rank ``spec.rank`` in a child process; its report and final model.

    A child that dies is reported to the coordinator: by rank 0, which has
    it, or on the result board, where rank 0 watches; this worker then
    returns an empty model and the run goes on without the rank. One that
    hangs, the run declares lost, and this worker kills (``_wait_child``).
    """
    out = Path(spec.run_dir) / f"rank{spec.rank}.state.pt"
    context = mp.get_context("spawn")
    trained = context.Value("b", 0, lock=False)  # set by the child at the run's end
    alive = context.Value("d", time.monotonic(), lock=False)  # its beacon's last beat
    child = context.Process(
        target=_rank_process,
        args=(spec, fns, batch_size, dict(os.environ), os.getpid()),
        kwargs={"state_out": str(out), "trained": trained, "alive": alive},
        name=f"elche-rank{spec.rank}",
    )
    child.start()
    hung = _wait_child(child, spec.rank, alive, results)
    # Trained to the end: its model handed back (exit 0), or not (``HANDBACK_FAILED``);
    # any other end, an exit status of 0 or 3 from the user's code included, is a rank lost.
    if trained.value and child.exitcode in (0, HANDBACK_FAILED):
        done = child.exitcode == 0
        state = torch.load(out, map_location="cpu") if done else {}
        out.unlink(missing_ok=True)
        if not done:  # the run has its model (rank 0's result): this worker has none
            print(f"elche: rank {spec.rank} trained to the run's end; its worker returns the "
                  "run's result without the model", file=sys.stderr, flush=True)  # fmt: skip
        written = rank_report_file(Path(spec.run_dir), spec.rank)  # not in a full run dir
        return (json.loads(written.read_text()) if written.exists() else {}), state
    if hung is not None:  # (its loss is the run's own)
        print(f"elche: rank {spec.rank} hung: the run declared it lost ({hung}), and its "
              "worker killed it", file=sys.stderr, flush=True)  # fmt: skip
        return {"stopped": CHILD_LOST}, {}
    if host is not None:
        report_lost(host.host, spec.rank, child.exitcode)  # the one up now
    else:
        results.say_exit(spec.rank, child.exitcode)  # rank 0 tells its coordinator
    if rank_error_file(Path(spec.run_dir), spec.rank).exists():
        # It said why (the user's error, the run's failure to form): whether the run
        # goes on is the coordinator's to say, in the run's result.
        print(f"elche: rank {spec.rank}'s process ended with the error above",
              file=sys.stderr, flush=True)  # fmt: skip
    else:
        print(f"elche: rank {spec.rank} was lost (its process ended with {child.exitcode}); "
              "the run goes on without it", file=sys.stderr, flush=True)  # fmt: skip
    return {"stopped": CHILD_LOST}, {}
