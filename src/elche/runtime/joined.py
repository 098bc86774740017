"""The joining rank's side of ``elche join`` (see ``elche.runtime.joining``)."""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elche.core.checkpoint import SaveReason
from elche.core.config import RANDOM_SHUFFLE, SHARD_ORDER, CoordinatorConfig
from elche.core.errors import ConfigError, RankExcluded, TrainingError
from elche.core.rank import COORDINATOR_LOST, FAILED, SAVED
from elche.runtime.frames import SECRET_ENV
from elche.runtime.joining import (
    CONTROL_PORT_KEY,
    JOIN_ENV,
    JOIN_LAUNCHER_ENV,
    JOIN_RANK_FD_ENV,
    JOIN_SPEED_ENV,
    JOIN_STORE_ENV,
    JOINED_KEY,
    KEY,
    SECRET_CHECK_KEY,
    secret_check,
)
from elche.runtime.lifetimes import Interrupted, StopSignals, beacon, watch_launcher
from elche.runtime.same_run import SAME_RUN_FIELDS
from elche.runtime.store_calls import GRACE_S

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

    from elche.runtime.plan import Hooks, Plan, TrainResult
    from elche.runtime.worker import UserFns

__all__ = ["train_joined"]

_GOES_ON = "the run goes on without this joined rank"

# How long a joiner waits for the run's group store to take a connection at all.
LISTEN_CHECK_S = 10.0


def train_joined(
    plan: Plan, fns: UserFns, hooks: Hooks, *, max_grad_norm: float | None
) -> TrainResult:
    """Train this process as a rank that joins the run at ``$ELCHE_JOIN``.

    A stop signal ends this rank at once (``_leave``); the run goes on.

    Raises:
        ConfigError: no secret, no store port, no run answering at the
            address, no slot left, or the script trains something else than
            the run (the field named).
        RankExcluded: the run refused this rank, or it lost the coordinator
            (the run ended as it joined): its model is not the run's.
    """
    from elche.runtime import groups
    from elche.runtime.launch import rank_spec
    from elche.runtime.plan import TrainResult
    from elche.runtime.worker import raise_if_refused, train_rank

    del hooks  # the run's hooks run on rank 0
    address = os.environ[JOIN_ENV]
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        raise ConfigError(SECRET_ENV, "joining a run needs the run's secret (see the join line)")
    port = _int_env(JOIN_STORE_ENV)
    speed = float(os.environ.get(JOIN_SPEED_ENV, "1"))
    if not 0 < speed <= 1:
        raise ConfigError("speed", f"must be in (0, 1], got {speed}")
    timeout_s = max(2 * plan.config.heartbeat_timeout_s, 60.0)  # the store may still be starting
    _check_listening(address, port)
    try:
        store = groups.connect(address, port, timeout_s)
    except RuntimeError as exc:  # torch's DistNetworkError: no store answered in time
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            "join",
            f"no run answers at {address} (group store port {port}) after {timeout_s:.0f} s: "
            f"it has ended, or this host cannot reach it ({first})",
        ) from None
    world, slots, rank, run, run_dir = _take_slot(store, address, secret, plan.config, timeout_s)
    run_dir.mkdir(parents=True, exist_ok=True)  # on another host: this host's own
    # Each epoch's order as the run draws it (a resumed run keeps its bundle's).
    order = run.get("order", RANDOM_SHUFFLE)
    config = replace(plan.config, world_size=world, join_slots=slots, order=order)
    spec = rank_spec(  # rank 0's spec of this script, then this rank's own
        replace(plan, config=config), 0, address, bytes.fromhex(secret), run_dir,
        max_grad_norm=max_grad_norm, group_port=port,
    )  # fmt: skip
    spec = replace(spec, rank=rank, speed=speed, join_slots=slots, resume_from=None, faults=())
    print(f"elche: joining the run at {address} as rank {rank}", file=sys.stderr, flush=True)
    _tell_launcher(rank)
    if os.environ.get(JOIN_LAUNCHER_ENV):  # started by elche join: it owns this rank
        launcher = _int_env(JOIN_LAUNCHER_ENV, "elche join's pid")
        watch_launcher(launcher, on_gone=lambda: _say_orphaned(rank, launcher), grace_s=0.0)
    # (one signal is enough: a second, the group's and the relayed one, is no force)
    with StopSignals(on_signal=lambda signum: _leave(rank, signum), force_on_repeat=False):
        report, state = train_rank(spec, fns, config.batch_size)
    raise_if_refused(report, rank)  # e.g. a join refused: the run goes on without it
    stopped = str(report.get("stopped") or "")
    if stopped.startswith(COORDINATOR_LOST):  # (the run ended as it joined, say)
        reason = f"lost the coordinator ({stopped.removeprefix(COORDINATOR_LOST)})"
        raise RankExcluded(rank=rank, reason=reason)
    summary: dict[str, object] = {
        "joined_as": rank,
        "stopped": report.get("stopped"),
        "samples": report.get("samples_trained"),
        "speed": speed,
    }
    result = TrainResult(state_dict=state, summary=summary, epochs=[], run_dir=str(run_dir))
    _run_ended_short(rank, report, run.get("save_path"), result)
    return result


def _tell_launcher(rank: int) -> None:
    """Write this rank's number to ``elche join``'s pipe (``JOIN_RANK_FD_ENV``), if it
    gave one, then a beat there every ``BEACON_S`` (``lifetimes.beacon``): it kills
    this process if the run declares the rank lost for its silence and the beats
    stop too. (Written without blocking: a beat that finds the pipe full is dropped.)"""
    fd = os.environ.pop(JOIN_RANK_FD_ENV, "")
    if not fd.isdigit():
        return
    with contextlib.suppress(OSError):  # (elche join is gone: nobody to tell)
        os.write(int(fd), f"{rank}\n".encode())
        os.set_blocking(int(fd), False)
        beacon(functools.partial(_beat, int(fd)))


def _beat(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):  # (a full pipe: elche join reads late)
        os.write(fd, b".")


def _take_slot(
    store: Store, address: str, secret: str, mine: CoordinatorConfig, timeout_s: float
) -> tuple[int, int, int, dict[str, Any], Path]:
    """The run's world size, join slots, this joiner's rank (a slot taken), the run's
    config and its run directory, from the run's store, once the joiner is checked
    against them. Each call to the store ends within its timeout (``groups.ask``):
    the store's host may drop off the network as this rank joins.

    Raises:
        ConfigError: a wrong address or secret, another run, no slot left, or
            the store stopped answering.
    """
    from elche.runtime import groups

    def get(key: str) -> str:
        return bytes(groups.ask(store, lambda: store.get(key), timeout_s + GRACE_S)).decode()

    try:
        _check_address_and_secret(get, address, secret)
        world = int(get(KEY + "world_size"))
        slots = int(get(KEY + "join_slots"))
        run = json.loads(get(KEY + "config"))
        _check_same_run(mine, run)
        taken = int(groups.ask(store, lambda: store.add(JOINED_KEY, 1), timeout_s + GRACE_S))
        if taken > slots:
            raise ConfigError("join", f"the run has no join slot left (it keeps {slots})")
        run_dir = Path(get(KEY + "run_dir"))
    except groups.StoreUnanswered as exc:
        raise ConfigError("join", f"the run at {address} stopped answering ({exc})") from None
    return world, slots, world + taken - 1, run, run_dir


def _check_listening(address: str, port: int) -> None:
    """Something listens at the run's group store, or a ``ConfigError`` says so at once:
    torch's client would retry a refused connection for minutes. (The coordinator
    listens there from its start, before its join line is printed.)"""
    from elche.runtime import groups

    host = groups.store_host(address)
    try:
        with socket.create_connection((host, port), timeout=LISTEN_CHECK_S):
            pass
    except OSError as exc:
        raise ConfigError(
            "join",
            f"no run answers at {address} (group store port {port}): it has ended, or this "
            f"host cannot reach it ({exc})",
        ) from None


def _check_address_and_secret(get: Callable[[str], str], address: str, secret: str) -> None:
    """The run's store (``get``) says the joiner's control port and secret are the run's, or a
    ``ConfigError`` names the wrong one before a slot is taken. (Both were found only
    by the coordinator's silence: the joiner gave up after 10 s, saying it had lost the
    coordinator, and its slot stayed taken.)"""
    port = get(CONTROL_PORT_KEY)
    given = address.rpartition(":")[2]
    if given != port:
        raise ConfigError(
            "address",
            f"the run's coordinator listens at port {port}, not {given} (the run's join "
            "line says its address)",
        )
    try:
        key = bytes.fromhex(secret)
    except ValueError:
        raise ConfigError(SECRET_ENV, "is not hex (the run's join line says where it is)") from None
    if not hmac.compare_digest(get(SECRET_CHECK_KEY), secret_check(key)):
        raise ConfigError(
            SECRET_ENV,
            f"is not the secret of the run at {address} (the run's join line says where it is)",
        )


def _leave(rank: int, signum: int) -> None:
    """A stop signal to a joined rank: it leaves at once, saying so. Its state is no
    part of the run's bundle (the run's own ranks save that); the run goes on
    without it, as without a rank that died, and redoes its unaveraged work."""
    name = signal.Signals(signum).name
    print(f"elche rank {rank}: stopped by {name}; {_GOES_ON}", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def _say_orphaned(rank: int, launcher: int) -> None:
    """``elche join`` (pid ``launcher``) is gone: this rank leaves the run at once, as
    after a stop signal (``_leave``); its launcher's terminal may be gone too."""
    line = f"elche rank {rank}: elche join (pid {launcher}) is gone; {_GOES_ON}\n"
    with contextlib.suppress(OSError):
        os.write(2, line.encode())


def _run_ended_short(
    rank: int, report: dict[str, object], stem: object, result: TrainResult
) -> None:
    """Say how the run ended, if it did not complete: a joined rank is told nothing
    else. It ends as the run's own ranks do: a run stopped on request (a signal to
    its launcher) with ``Interrupted``, naming the bundle; the user's error with
    ``TrainingError``.

    Raises:
        Interrupted: the run was stopped on request; its ranks saved it.
        TrainingError: the run failed on the user's code.
    """
    stopped = str(report.get("stopped") or "")
    user_error = report.get("user_error")
    if isinstance(user_error, dict):
        raise TrainingError.from_summary(user_error)
    if stopped.startswith(FAILED):
        print(f"elche rank {rank}: the run failed: {stopped.removeprefix(FAILED)}",
              file=sys.stderr, flush=True)  # fmt: skip
    if not stopped.startswith(SAVED):
        return
    reason = stopped.removeprefix(SAVED)
    where = f"saved under {stem} on its own host" if isinstance(stem, str) else "saved"
    print(f"elche rank {rank}: the run stopped ({reason}) and is {where}; this joined "
          "rank's model is no part of it", file=sys.stderr, flush=True)  # fmt: skip
    if reason == SaveReason.GRACEFUL_SHUTDOWN.value:
        raise Interrupted(signal.SIGTERM, stem if isinstance(stem, str) else None, result)


def _int_env(name: str, what: str = "the run's group store port") -> int:
    text = os.environ.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(name, f"must be {what}, got {text!r}") from None


def _check_same_run(mine: CoordinatorConfig, theirs: dict[str, object]) -> None:
    """The joiner's script must train what the run trains: its fields, and its kind of
    dataset (an ``elche.Shards`` draws its epochs in an order of its own)."""
    for name in SAME_RUN_FIELDS:
        value = getattr(mine, name)
        value = value.value if name == "mode" else value
        if theirs.get(name) != value:
            raise ConfigError(
                name, f"the run trains with {name}={theirs.get(name)!r}; this script has {value!r}"
            )
    sharded = [order == SHARD_ORDER for order in (theirs.get("order"), mine.order)]
    if sharded[0] != sharded[1]:
        kinds = ["an elche.Shards" if s else "a map-style dataset" for s in sharded]
        raise ConfigError(
            "dataset", f"the run trains {kinds[0]}; this script has {kinds[1]} (their epochs "
            "are drawn in other orders, so the same positions would name other samples)",
        )  # fmt: skip
