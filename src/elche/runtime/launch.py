"""Launching a local run: the coordinator process plus one process per rank.

Theory of operation. ``launch_local`` starts the coordinator (its own
process, no torch), then starts the ranks with the ``forkserver`` start
method where the platform has it (``spawn`` elsewhere): the fork server
imports torch (and torch._dynamo, which a rank's first optimizer would
import) and elche's rank code once, and every rank forks from it instead of
importing them again: a 3-rank run on 2 cores starts in ~0.4 s instead of
~2.7 s once the fork server is up (~2.9 s for the first run of a process
instead of ~4.3). The fork server holds no threads, sockets or CUDA state,
so forking it is safe. Each rank takes the launcher's environment as it is
at launch (a fork would otherwise see the fork server's, from the first run
in this process); settings read while torch imports, such as
``OMP_NUM_THREADS``, come from the first run. As with ``spawn``, the user's
functions must be importable, top-level callables and the script must guard
its entry with ``if __name__ == "__main__":``.

While the run goes on, the launcher follows the coordinator's timeline to
drive the progress display and the user's ``eval_result_fn``/``metrics_fn``,
and it watches the children: a rank that exits early is reported; the
coordinator's heartbeat timeout decides what that means for the run. When
the coordinator exits, the ranks get a grace period to finish, then are
stopped. SIGINT and SIGTERM stop the run cleanly: the launcher asks the
coordinator to stop, the ranks save a bundle, and ``Interrupted`` is raised
(``elche.runtime.lifetimes``); the coordinator, the fork server and the
ranks outlive the launcher by at most ``ORPHAN_GRACE_S``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elche.core import timeline as tl
from elche.core.checkpoint import CheckpointMeta
from elche.core.config import CoordinatorConfig
from elche.core.errors import ConfigError, TrainingError
from elche.monitor.progress import Progress
from elche.monitor.summary import SUMMARY_FILE, read_run, run_summary
from elche.monitor.timeline import TimelineReader
from elche.runtime import bundle
from elche.runtime.frames import SECRET_ENV, new_secret, secret_from_env
from elche.runtime.groups import parse_address_line
from elche.runtime.host import ADDRESS_LINE, FAILED_EXIT, RESUME_OUTER, config_to_json
from elche.runtime.lifetimes import (
    Interrupted,
    StopSignals,
    announce,
    ignore_stop_signals,
    watch_launcher,
)
from elche.runtime.plan import Hooks, Plan, TrainResult

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext

    from elche.monitor.dashboard import Dashboard
    from elche.runtime.worker import RankSpec, UserFns

__all__ = [
    "collect",
    "explain_outcome",
    "interrupted",
    "launch_local",
    "on_record",
    "rank_spec",
    "start_coordinator",
    "start_watching",
    "tell_coordinator",
    "with_bundle",
]

# Ranks normally exit within a few hundred ms of the coordinator's Shutdown.
RANK_EXIT_GRACE_S = 30.0
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
# (elche.runtime.forkserved keeps the fork server alive through SIGTERM.)
FORKSERVER_PRELOAD = (
    "elche.runtime.forkserved", "torch", "torch.distributed", "torch._dynamo",
    "elche.runtime.worker",
)  # fmt: skip


def _rank_process(
    spec: Any,
    fns: Any,
    batch_size: int,
    env: dict[str, str],
    launcher_pid: int,
    *,
    state_out: str | None = None,
) -> None:
    """The body of a rank process; ``state_out``: where its final model goes."""
    ignore_stop_signals()  # the launcher orders the stop
    watch_launcher(launcher_pid)
    # A forked rank inherits the fork server's environment, from when it
    # started; the launcher's environment now is the one that counts.
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["ELCHE_RANK"] = str(spec.rank)  # lets user callbacks know where they run
    from elche.runtime.worker import train_rank

    try:
        _, state = train_rank(spec, fns, batch_size)
        if state_out is not None:
            import torch

            torch.save(state, state_out)
    except BaseException as exc:
        # The user's own error: its traceback is the useful part, not elche's frames.
        text = str(exc) if isinstance(exc, TrainingError) else traceback.format_exc()
        (Path(spec.run_dir) / f"rank{spec.rank}.error").write_text(text)
        print(f"elche rank {spec.rank} failed:\n{text}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _report_lost(host: Any, rank: int, code: int | None) -> None:
    """Tell the coordinator (over its stdin) that a rank process is gone."""
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    print(f"elche: rank {rank} process ended ({how})", file=sys.stderr, flush=True)
    tell_coordinator(host, f"lost {rank} process ended ({how})")


def tell_coordinator(host: Any, line: str) -> None:
    """Write one report line to the coordinator's stdin (``Host.watch`` reads it)."""
    try:
        host.stdin.write(line + "\n")
        host.stdin.flush()
    except (BrokenPipeError, OSError, ValueError):
        pass  # the coordinator is already gone


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
        run_dir=str(run_dir), mode=cfg.mode.value, seed=cfg.seed, speed=plan.speeds[rank],
        speed_base_s=plan.speed_base_s, device=plan.devices[rank], gamma=cfg.scheduler.gamma,
        max_grad_norm=max_grad_norm,
        save_path=cfg.save_path, resume_from=plan.resume_from,
        coordinator_timeout_s=max(cfg.heartbeat_timeout_s, 10.0),
        collective_timeout_s=max(2 * cfg.heartbeat_timeout_s, 60.0),
        faults=plan.faults.for_rank(rank), group_port=group_port,
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
        print(
            f"elche: the run could not continue ({summary.get('reason')}); its state is saved "
            f"as the bundle {save_path} ({save_path}.meta.json names its files). Resume it "
            f"with resume_from={save_path!r} (elche demo: --resume-from {save_path}).",
            file=sys.stderr,
            flush=True,
        )


def start_coordinator(
    config: CoordinatorConfig, run_dir: Path, secret: bytes, resume_from: str | None
) -> tuple[subprocess.Popen[str], str, int | None]:
    """Start ``python -m elche.runtime.host``; it, its address and its group store's port.

    The port is None where no collective group forms (``elche.runtime.groups``).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "coordinator.json").write_text(config_to_json(config), encoding="utf-8")
    if resume_from is not None:
        text = bundle.meta_path(resume_from).read_text(encoding="utf-8")
        (run_dir / "resume.meta.json").write_text(text, encoding="utf-8")
        outer = bundle.locate(resume_from, CheckpointMeta.from_json(text), config.world_size).outer
        if config.outer_lr is not None and outer is not None:
            shutil.copyfile(outer, run_dir / RESUME_OUTER)
    env = dict(os.environ, **{SECRET_ENV: secret.hex()})
    proc = subprocess.Popen(
        [sys.executable, "-m", "elche.runtime.host", str(run_dir)],
        stdin=subprocess.PIPE,  # the launcher reports rank exits and stops here
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        # Its own process group: Ctrl-C (to the launcher's group) does not reach
        # it, even while it starts; its launcher tells it to stop.
        process_group=0 if os.name == "posix" else None,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith(ADDRESS_LINE):
        proc.kill()
        raise RuntimeError(f"the coordinator failed to start (said {line!r}); see stderr")
    address, group_port = parse_address_line(line.split()[1:])
    return proc, address, group_port


def start_watching(plan: Plan, run_dir: Path, dashboard: str | None) -> Dashboard | None:
    """Say where the run's files are and start its dashboard, if asked for one.

    A dashboard that cannot start is reported; the run goes on without it.
    """
    print(f"elche: run directory {run_dir}", file=sys.stderr, flush=True)
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


def _rank_context() -> ForkServerContext | SpawnContext:
    """The multiprocessing context rank processes start from (see the module doc)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def check_picklable(fns: UserFns) -> None:
    """Every function a rank needs can be sent to it (ranks are separate processes).

    Raises:
        ConfigError: naming the function that cannot be pickled.
    """
    for name in ("model_fn", "optimizer_fn", "step_fn", "eval_fn", "epoch_fn",
                 "checkpoint_fn", "collate_fn"):  # fmt: skip
        fn = getattr(fns, name)
        if fn is None:
            continue
        try:
            pickle.dumps(fn)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise ConfigError(
                name,
                f"{fn!r} cannot be sent to the rank processes ({exc}); define it with def at "
                "the top level of a module (not a lambda or a nested function)",
            ) from None


def launch_local(
    plan: Plan,
    fns: UserFns,
    hooks: Hooks,
    run_dir: Path,
    *,
    max_grad_norm: float | None,
    progress: bool,
    dashboard: str | None = None,
) -> TrainResult:
    """Run ``plan`` with one local process per rank; see ``elche.train``.

    Raises:
        Interrupted: SIGINT or SIGTERM stopped the run; its bundle is saved.
    """
    t0 = time.monotonic()
    plan = with_bundle(plan, run_dir)
    with StopSignals() as signals:
        epochs = _supervise(
            plan, fns, hooks, run_dir, signals, max_grad_norm=max_grad_norm, progress=progress,
            dashboard=dashboard,
        )  # fmt: skip
        try:
            result = collect(plan, run_dir, t0, epochs)
        except RuntimeError:  # the coordinator left no summary
            if signals.received is None:
                raise
            raise interrupted(signals.received, None, plan.config.save_path) from None
    if signals.received is not None and result.summary.get("outcome") != "completed":
        raise interrupted(signals.received, result, plan.config.save_path)
    explain_outcome(result.summary, plan.config.save_path)
    return result


def _supervise(
    plan: Plan,
    fns: UserFns,
    hooks: Hooks,
    run_dir: Path,
    signals: StopSignals,
    *,
    max_grad_norm: float | None,
    progress: bool,
    dashboard: str | None,
) -> list[dict[str, object]]:
    """Start the coordinator and the ranks, follow the run to its end; its epochs."""
    cfg = plan.config
    secret = secret_from_env(os.environ) or new_secret()
    host, address, group_port = start_coordinator(cfg, run_dir, secret, plan.resume_from)
    board = start_watching(plan, run_dir, dashboard)
    ctx = _rank_context()
    procs: list[Any] = []
    timeline = TimelineReader(run_dir)
    epochs: list[dict[str, object]] = []
    display = Progress(cfg.epochs, enabled=progress)
    reported: set[int] = set()
    stop_by = math.inf  # once asked to stop: when the launcher stops waiting
    failed = False
    try:
        for rank in range(cfg.world_size):
            if signals.received is not None:
                break  # stopped while starting: the run will not form
            spec = rank_spec(
                plan, rank, address, secret, run_dir, max_grad_norm=max_grad_norm,
                group_port=group_port,
            )  # fmt: skip
            proc = ctx.Process(
                target=_rank_process,
                args=(spec, fns, cfg.batch_size, dict(os.environ), os.getpid()),
                name=f"elche-rank{rank}",
            )
            proc.start()
            procs.append(proc)
        while host.poll() is None and time.monotonic() < stop_by and not failed:
            time.sleep(SUPERVISE_EVERY_S)  # supervision cadence, not synchronisation
            if signals.received is not None and stop_by == math.inf:
                stop_by = time.monotonic() + cfg.heartbeat_timeout_s + STOP_SLACK_S
                tell_coordinator(host, f"stop {signal.Signals(signals.received).name}")
            for event in timeline.new_records():
                on_record(event, epochs, hooks, display)
                if isinstance(event, tl.RankLost) and event.rank < len(procs):
                    # Declared dead: it must not come back (a hung rank is killed).
                    reported.add(event.rank)
                    procs[event.rank].kill()
            for rank, proc in enumerate(procs):
                if proc.exitcode not in (None, 0) and rank not in reported:
                    reported.add(rank)
                    _report_lost(host, rank, proc.exitcode)
            failed = _run_failed(run_dir)
    finally:
        display.close()
        # A failed run has nothing left to save: no rank is waited for.
        grace_s = RANK_EXIT_GRACE_S if signals.received is None else STOPPED_RANK_GRACE_S
        if failed or host.poll() == FAILED_EXIT:
            grace_s = 0.0
        deadline = time.monotonic() + grace_s
        for proc in procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0.1))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        if host.poll() is None:
            host.kill()
        if board is not None:
            board.stop()
    for event in timeline.new_records():
        on_record(event, epochs, hooks, display)
    return epochs


def interrupted(signum: int, result: TrainResult | None, save_path: str | None) -> Interrupted:
    """The ``Interrupted`` to raise for a run ``signum`` stopped, announced on stderr."""
    saved = result is not None and result.summary.get("outcome") == "saved_and_shutdown"
    stop = Interrupted(signum, save_path if saved else None, result)
    announce(stop)
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
    match event:
        case tl.EpochEnd(epoch=epoch, loss=loss, rounds_done=syncs):
            entry: dict[str, object] = {"epoch": epoch, "loss": loss, "syncs": syncs}
            epochs.append(entry)
            if hooks.metrics_fn is not None:
                _call_hook("metrics_fn", hooks.metrics_fn, entry)
        case tl.Eval(epoch=epoch, metric=metric):
            for entry in epochs:
                if entry["epoch"] == epoch - 1:
                    entry["eval"] = metric
            if hooks.eval_result_fn is not None:
                _call_hook("eval_result_fn", hooks.eval_result_fn, epoch, metric)
        case _:
            pass


def _call_hook(name: str, fn: Callable[..., object], *args: object) -> None:
    """Run a user hook; one that raises is reported and the run goes on."""
    try:
        fn(*args)
    except Exception:
        print(
            f"elche: {name} raised; training goes on:\n{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )


def collect(plan: Plan, run_dir: Path, t0: float, epochs: list[dict[str, object]]) -> TrainResult:
    """Build the result of a finished run from the files in ``run_dir``.

    Raises:
        TrainingError: the run failed on the user's code (the summary's ``user_error``).
        RuntimeError: the coordinator left no summary.
    """
    import torch

    host, ranks = read_run(run_dir, plan.config.world_size)
    summary = run_summary(
        host, ranks, speeds=plan.speeds, launched_s=t0, save_path=plan.config.save_path
    )
    user_error = summary.get("user_error")
    if isinstance(user_error, dict):
        explain_outcome(summary, plan.config.save_path)  # a non-finite loss saved a bundle
        print(f"elche: the run's files are kept in {run_dir}", file=sys.stderr, flush=True)
        stem = summary.get("bundle")
        raise TrainingError.from_summary(user_error, stem if isinstance(stem, str) else None)
    model_file = run_dir / bundle.FINAL_MODEL
    state = torch.load(model_file, map_location="cpu") if model_file.exists() else {}
    return TrainResult(state_dict=state, epochs=epochs, summary=summary, run_dir=str(run_dir))
