"""A new rank joins a running run: ``elche join ADDRESS script.py``.

Theory of operation. A collective run keeps join slots (rank ids past its
ranks, ``CoordinatorConfig.join_slots``; ``elche.core.joins`` says how the
coordinator takes a joiner in). Its coordinator's group store
(``elche.runtime.groups``) holds what a joiner needs besides the secret: the
run's world size, its join slots, its coordinator config and its run
directory (``store_info``). When the run starts, the launcher prints the
exact join command (``announce_join``).

``elche join`` starts the script with ``ELCHE_JOIN`` (the coordinator's
address) and ``ELCHE_JOIN_STORE_PORT`` in the environment; its
``elche.train`` call lands in ``elche.runtime.joined.train_joined``: it takes the next free slot
from the store (a counter there), checks that the script trains what the
run trains, and trains as that rank with the speed ``ELCHE_JOIN_SPEED`` (the
script's ``ranks=`` and ``speeds=`` are ignored). It leaves the run once
``elche join`` is gone (``ELCHE_JOIN_LAUNCHER``: killed, say), as a rank
that died does. The rank waits for its
first ``Regroup``, forms the group with the others, takes the consensus in
its first round (at weight 0) and trains from then on. Its optimizer state
is fresh. It writes its report to the run directory's path on its own host
(on the run's host, the run's directory itself, so the run's summary lists
it in ``per_rank``). It returns its own model, the consensus at the end,
with a summary of its own rank: the run's summary is rank 0's.

No torch at import: the coordinator process imports ``store_info`` (and
nothing of the launcher: the joiner's side is ``elche.runtime.joined``).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import os
import select
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from elche.core.config import CoordinatorConfig
from elche.core.errors import ConfigError
from elche.runtime.frames import SECRET_ENV
from elche.runtime.lifetimes import SILENT_PROCESS_S
from elche.runtime.store_calls import SILENT_S

__all__ = [
    "JOIN_ENV",
    "JOIN_LAUNCHER_ENV",
    "JOIN_RANK_FD_ENV",
    "JOIN_SPEED_ENV",
    "JOIN_STORE_ENV",
    "announce_join",
    "run_join",
    "store_info",
]

JOIN_ENV = "ELCHE_JOIN"  # the coordinator's address: this process joins that run
JOIN_STORE_ENV = "ELCHE_JOIN_STORE_PORT"  # its group store's port
JOIN_SPEED_ENV = "ELCHE_JOIN_SPEED"  # the joiner's testing speed (elche join --speed)
JOIN_LAUNCHER_ENV = "ELCHE_JOIN_LAUNCHER"  # elche join's pid: the rank ends once it is gone
JOIN_RANK_FD_ENV = "ELCHE_JOIN_RANK_FD"  # a pipe the rank writes its number, then beats, to
# How often elche join looks whether the run declared its rank lost for its silence.
HUNG_WATCH_S = 0.5
SECRET_FILE = "join.secret"  # in the run dir, owner-only: the secret of a generated run

KEY = "elche/"  # the store's keys for joiners
JOINED_KEY = KEY + "joined"  # a counter: slots taken so far
CONTROL_PORT_KEY = KEY + "control_port"  # the coordinator's port (its host is the store's)
SECRET_CHECK_KEY = KEY + "secret_check"  # ``secret_check(secret)``


def store_info(
    config: CoordinatorConfig, run_dir: Path, config_json: str, *, address: str, secret: bytes
) -> dict[str, str]:
    """What the group store holds for joiners (keys and values).

    Besides the run's shape: the coordinator's control port and a check of
    the secret (an HMAC of a fixed text under it: the store is not
    authenticated, and the check gives nothing away to forge a frame with),
    so that a joiner with a wrong port or secret is told so by name before
    it takes a slot, not after 10 s of silence from a coordinator that
    never heard it.
    """
    return {
        KEY + "world_size": str(config.world_size),
        KEY + "join_slots": str(config.join_slots),
        KEY + "config": config_json,
        KEY + "run_dir": str(run_dir),
        CONTROL_PORT_KEY: address.rpartition(":")[2],
        SECRET_CHECK_KEY: secret_check(secret),
    }


def secret_check(secret: bytes) -> str:
    """What the store holds to tell a joiner whether its secret is the run's."""
    return hmac.new(secret, b"elche join: secret check", "sha256").hexdigest()


def announce_join(
    address: str, group_port: int | None, run_dir: Path, secret: bytes, config: CoordinatorConfig
) -> None:
    """Print the command that joins a rank to this run (collective runs with join slots).

    The secret is not printed: a secret the user set is named by its
    variable; a generated one is written, owner-only, to ``RUN_DIR/join.secret``.
    """
    if not config.join_slots or group_port is None:
        return
    if os.environ.get(SECRET_ENV):
        secret_text = f"${SECRET_ENV}"
    else:
        path = run_dir / SECRET_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret.hex())
        secret_text = f"$(cat {shlex.quote(str(path))})"
    script = " ".join(shlex.quote(arg) for arg in sys.argv) if sys.argv[0] else "SCRIPT"
    print(
        f"elche: join with {SECRET_ENV}={secret_text} elche join {address} "
        f"--store-port {group_port} {script}  ({config.join_slots} join slot(s))",
        file=sys.stderr,
        flush=True,
    )


def run_join(address: str, store_port: int, speed: float, script: Sequence[str]) -> int:
    """``elche join``: run ``script`` (path and arguments) as a rank joining ``address``.

    Returns:
        The script's exit code.

    Raises:
        ConfigError: a bad address or speed, or no ``ELCHE_SECRET``.
    """
    from elche.runtime.lifetimes import StopSignals

    if not address.startswith("tcp://"):
        raise ConfigError("address", f"must be tcp://HOST:PORT, got {address!r}")
    if not 0 < speed <= 1:
        raise ConfigError("speed", f"must be in (0, 1], got {speed}")
    if not os.environ.get(SECRET_ENV):
        raise ConfigError(SECRET_ENV, "must hold the run's secret (the run's join line says how)")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({JOIN_ENV: address, JOIN_STORE_ENV: str(store_port), JOIN_SPEED_ENV: str(speed)})
    env[JOIN_LAUNCHER_ENV] = str(os.getpid())
    if _on_loopback(address):  # gloo on this kind of machine needs the interface named
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs: list[subprocess.Popen[bytes]] = []
    numbers, number_out = os.pipe()  # the rank's number once it took a slot, then beats
    env[JOIN_RANK_FD_ENV] = str(number_out)

    def forward(signum: int) -> None:  # the rank stops; the run goes on without it
        for proc in procs:
            proc.send_signal(signum)

    with StopSignals(on_signal=forward), open(numbers, "rb") as pipe:  # an fd
        try:
            procs.append(subprocess.Popen([sys.executable, *script], env=env,
                                          pass_fds=(number_out,)))  # fmt: skip
        finally:
            os.close(number_out)
        hung = _wait_rank(procs[0], pipe, address, store_port)
    if hung is None:
        return procs[0].returncode
    rank, why = hung
    print(f"elche join: rank {rank} hung: the run declared it lost ({why}), and elche join "
          "killed it", file=sys.stderr, flush=True)  # fmt: skip
    return 128 + signal.SIGKILL


def _wait_rank(
    proc: subprocess.Popen[bytes], said: BinaryIO, address: str, store_port: int
) -> tuple[int, str] | None:
    """Wait for ``proc``, the joined rank, to end; kill it once the run declared it lost
    for its silence and it is silent here too (its rank and why, then): a hung rank
    (a deadlock, a stopped process) must not come back, and ``elche join`` would
    wait for it for good. One that runs was cut off from the run: it ends itself.

    The rank writes to ``said`` its number once it took a slot, then a beat every
    ``BEACON_S``; once it has not beaten for ``SILENT_PROCESS_S``, the run's group
    store says whether it was declared lost (``groups.hung``; connected to then,
    not before: a rank that beats needs no store, nor this process torch). A store
    that does not answer (the run ended, its host cut off) is looked at no more.
    """
    from elche.runtime import groups

    number = b""
    rank: int | None = None
    store = None
    looking = True  # until the store does not answer
    last_beat = time.monotonic()
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=HUNG_WATCH_S)
            return None
        while select.select([said], [], [], 0)[0]:
            got = os.read(said.fileno(), 4096)
            if not got:  # (its process closed the pipe: it ends)
                break
            last_beat = time.monotonic()
            if rank is None:  # (the beats come after the number's line)
                number += got
                rank = int(number.partition(b"\n")[0]) if b"\n" in number else None
        if rank is None or not looking or time.monotonic() - last_beat < SILENT_PROCESS_S:
            continue
        try:
            if store is None:
                store = groups.connect(address, store_port, SILENT_S)
            why = groups.ask(store, functools.partial(groups.hung, store, rank))
        except (groups.StoreUnanswered, RuntimeError):  # (DistNetworkError: the run ended)
            looking = False
            continue
        if why is not None:
            proc.kill()
            proc.wait()
            return rank, why


def _on_loopback(address: str) -> bool:
    host = address.partition("://")[2].rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
