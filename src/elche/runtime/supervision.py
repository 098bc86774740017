"""The coordinator process of a run: started, told, supervised, replaced.

Rules:

- The coordinator runs in a process of its own, in a process group of its
  own (Ctrl-C to the launcher's group does not reach it): ``python -m
  elche.runtime.host``, or forked from a local run's fork server
  (``ForkedCoordinator``), so the group store the collective ranks form
  through serves at once. It says its address on its first stdout line.
- The launcher tells it what it alone sees on its stdin, a line each
  (``tell_coordinator``): a rank process gone (``report_lost``), a stop
  asked for (``Supervised.ask_stop``, told to each successor too).
- One that exits without its summary was lost (killed, crashed), unless it
  could not write the run directory (``UNWRITABLE_EXIT``: a successor would
  fail too). A lost one is restarted from the run's journal on the same
  address, ``max_coordinator_restarts`` times at most; the rank exits it
  missed are told to its successor. Lost for good, what the ranks kept is
  committed as the run's bundle (``salvage_if_lost``). So is it when the
  coordinator ended because it did not run for longer than its ranks wait for
  it (``GIVEN_UP_EXIT``: stopped, starved): they gave it up and keep their state.

Theory of operation: ``start_coordinator`` copies the run's settings and the
resumed bundle's meta into the run directory, where the coordinator (and a
successor, and a salvage) reads them; ``Supervised`` holds the process the
run has now and replaces it when it is lost (``replaced``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from elche.core.checkpoint import CheckpointMeta
from elche.core.config import CoordinatorConfig
from elche.monitor.summary import SUMMARY_FILE
from elche.runtime import bundle
from elche.runtime.addresses import BIND_ENV
from elche.runtime.frames import SECRET_ENV
from elche.runtime.groups import GROUPS_PORT_ENV, parse_address_line
from elche.runtime.host import (
    ADDRESS_LINE,
    GIVEN_UP_EXIT,
    LAUNCHER_RANK_ENV,
    RESUME_META,
    RESUME_OUTER,
    UNWRITABLE_EXIT,
    config_to_json,
    forked_main,
)
from elche.runtime.journal_file import JOURNAL_FILE
from elche.runtime.lifetimes import Forked, launcher_stream
from elche.runtime.plan import Plan
from elche.runtime.salvage import (
    forget_earlier_run,
    give_up_coordinator,
    salvage_run,
    start_round,
    wait_local_states,
)

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext

__all__ = [
    "CoordinatorProcess",
    "ForkedCoordinator",
    "Supervised",
    "coordinator_lost",
    "report_lost",
    "run_dir_unwritable",
    "salvage_if_lost",
    "start_coordinator",
    "supervised",
    "tell_coordinator",
]


def restart_coordinator(
    config: CoordinatorConfig,
    run_dir: Path,
    secret: bytes,
    address: tuple[str, int | None],
    forks: ForkServerContext | None = None,
) -> CoordinatorProcess | None:
    """Start a lost coordinator's successor from the run's journal, on ``address``
    (its control address and its group store's port).

    Returns None (and says why on stderr) when it cannot: no journal yet, or
    the new process did not come up.
    """
    if not (run_dir / JOURNAL_FILE).exists():
        print("elche: the coordinator was lost before the run began", file=sys.stderr, flush=True)
        return None
    print(
        "elche: the coordinator process was lost; restarting it from the journal",
        file=sys.stderr,
        flush=True,
    )
    try:
        return start_coordinator(config, run_dir, secret, None, restore_at=address, forks=forks)[0]
    except RuntimeError as exc:
        print(f"elche: {exc}", file=sys.stderr, flush=True)
        return None


@dataclasses.dataclass(slots=True)
class Supervised:
    """The run's coordinator process, replaced from the journal when it is lost."""

    host: CoordinatorProcess
    address: str
    group_port: int | None  # its collective groups' store (``elche.runtime.groups``)
    config: CoordinatorConfig
    run_dir: Path
    secret: bytes
    restarts: int = 0
    forks: ForkServerContext | None = None  # where its successor forks from (``start_coordinator``)
    stop_line: str | None = None  # the stop asked for (``ask_stop``), told to each successor too

    def ask_stop(self, reason: str) -> None:
        """Ask the coordinator to stop the run, saving; one that replaces it is asked too
        (a stop told to a coordinator as it died would otherwise be lost)."""
        self.stop_line = f"stop {reason}"
        tell_coordinator(self.host, self.stop_line)

    def running(self, lost_ranks: dict[int, int | None]) -> bool:
        """It is up, or it was lost and its successor is (``replaced``)."""
        return self.host.poll() is None or self.replaced(lost_ranks)

    def replaced(self, lost_ranks: dict[int, int | None]) -> bool:
        """It exited: start its successor if it was lost and may be restarted.

        ``lost_ranks``: the rank processes known gone (rank: exit code); the
        successor hears of them, and of those another thread adds meanwhile.
        """
        if not coordinator_lost(self.host, self.run_dir):
            return False
        if self.host.poll() == GIVEN_UP_EXIT:  # its ranks gave it up: no successor gets them
            give_up_coordinator(self.run_dir, "it did not run for longer than its ranks wait")
            return False
        limit = self.config.max_coordinator_restarts
        if self.restarts >= limit:
            print(
                f"elche: the coordinator was lost again after {self.restarts} restart(s) "
                f"(max_coordinator_restarts={limit}); the run stops",
                file=sys.stderr,
                flush=True,
            )
            give_up_coordinator(self.run_dir, f"restarts used up ({self.restarts})")
            return False
        successor = restart_coordinator(
            self.config, self.run_dir, self.secret, (self.address, self.group_port), self.forks
        )
        if successor is None:
            give_up_coordinator(self.run_dir, "its successor could not start")
            return False
        self.host, self.restarts = successor, self.restarts + 1
        for rank, code in sorted(dict(lost_ranks).items()):  # gone while it was away
            report_lost(successor, rank, code)
        if self.stop_line is not None:  # (after ``host``: an ask_stop meanwhile tells it)
            tell_coordinator(successor, self.stop_line)
        return True


def supervised(
    config: CoordinatorConfig,
    run_dir: Path,
    secret: bytes,
    resume_from: str | None,
    ctx: ForkServerContext | SpawnContext,
    *,
    resume_seq: int | None = None,
) -> Supervised:
    """Start the coordinator of a local run whose ranks start from ``ctx``, supervised."""
    forks = cast("ForkServerContext", ctx) if ctx.get_start_method() == "forkserver" else None
    started = start_coordinator(
        config, run_dir, secret, resume_from, forks=forks, resume_seq=resume_seq
    )
    return Supervised(*started, config, run_dir, secret, forks=forks)


def salvage_if_lost(
    plan: Plan, run_dir: Path, host: CoordinatorProcess, *, wait_s: float = 0.0
) -> None:
    """The coordinator left no summary because it was lost for good (not restarted):
    commit what the ranks kept, once they described it (up to ``wait_s``: ranks
    in other processes). One that could not write the run directory
    (``UNWRITABLE_EXIT``) was not lost: the bundle it committed stands."""
    if (run_dir / SUMMARY_FILE).exists() or run_dir_unwritable(host):
        return
    if wait_s > 0:
        wait_local_states(plan.config, run_dir, wait_s)
    salvage_run(plan.config, run_dir, start_round=start_round(run_dir))


def run_dir_unwritable(host: CoordinatorProcess) -> bool:
    """The coordinator ended because it could not write the run directory (a full
    disk, say: ``UNWRITABLE_EXIT``); the error it said names the cause."""
    return host.poll() == UNWRITABLE_EXIT


def coordinator_lost(host: CoordinatorProcess, run_dir: Path) -> bool:
    """The coordinator process ended without its summary (killed, crashed), not for a
    run directory it could not write (``UNWRITABLE_EXIT``: a successor would fail too)."""
    code = host.poll()
    return code not in (None, UNWRITABLE_EXIT) and not (run_dir / SUMMARY_FILE).exists()


def start_coordinator(
    config: CoordinatorConfig,
    run_dir: Path,
    secret: bytes,
    resume_from: str | None,
    *,
    restore_at: tuple[str, int | None] | None = None,
    forks: ForkServerContext | None = None,
    resume_seq: int | None = None,
) -> tuple[CoordinatorProcess, str, int | None]:
    """Start the coordinator; it, its address and its group store's port.

    ``python -m elche.runtime.host`` by default; with ``forks`` (a local
    run's fork server, torch loaded) it is forked from there instead, so the
    group store the collective ranks form through serves at once rather than
    after the new process has imported torch (~2 s on 2 cores).
    The port is None where no collective group forms (``elche.runtime.groups``).
    ``restore_at``: the lost coordinator's address and store port; the new one
    binds them and goes on from the run's journal. ``resume_seq``: the save of
    ``resume_from`` the run was checked at (``Plan.resume_seq``).

    Raises:
        ConfigError: ``resume_from`` holds another save by now.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "coordinator.json").write_text(config_to_json(config), encoding="utf-8")
    if resume_from is not None:  # refused before an earlier run's files here go
        text = bundle.meta_path(resume_from).read_text(encoding="utf-8")
        meta = CheckpointMeta.from_json(text)
        bundle.check_unchanged(resume_from, meta, resume_seq)
    if restore_at is None:  # an earlier run's copy of the bundle it resumed goes too
        forget_earlier_run(run_dir)
    if resume_from is not None:
        (run_dir / RESUME_META).write_text(text, encoding="utf-8")
        outer = bundle.locate(resume_from, meta, config.world_size).outer
        if config.outer_lr is not None and outer is not None:
            shutil.copyfile(outer, run_dir / RESUME_OUTER)
    env = dict(os.environ, **{SECRET_ENV: secret.hex()})
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a launched rank starts it
        env[LAUNCHER_RANK_ENV] = os.environ["RANK"]
    args = [str(run_dir)]
    if restore_at is not None:
        env[BIND_ENV], port = restore_at
        if port is not None:
            env[GROUPS_PORT_ENV] = str(port)
        args.append("--restore")
    proc: CoordinatorProcess
    if forks is not None:
        proc = ForkedCoordinator(forks, args, env)
    else:
        proc = subprocess.Popen(
            [sys.executable, "-m", "elche.runtime.host", *args],
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


class ForkedCoordinator:
    """The coordinator forked from the fork server: what the launcher uses of ``Popen``.

    Its stdin and stdout are pipes to the launcher and its stderr is the
    launcher's, as a ``Popen``'s would be (``host.forked_main`` makes them
    its standard streams); it puts itself in a process group of its own
    before it does anything else, and until then it ignores SIGINT and
    SIGTERM as the fork server does.
    """

    def __init__(self, forks: ForkServerContext, args: list[str], env: dict[str, str]) -> None:
        their_stdin, our_stdin = forks.Pipe(duplex=False)
        our_stdout, their_stdout = forks.Pipe(duplex=False)
        streams = (their_stdin, their_stdout, launcher_stream(2))
        process = forks.Process(
            target=forked_main, args=(args, env, streams), name="elche-coordinator"
        )
        process.start()
        self._process = Forked(process)  # (followed past the fork server's death)
        for stream in streams:
            stream.close()
        self.stdin = open(os.dup(our_stdin.fileno()), "w", encoding="utf-8")  # noqa: SIM115
        self.stdout = open(os.dup(our_stdout.fileno()), encoding="utf-8")  # noqa: SIM115
        our_stdin.close()
        our_stdout.close()

    def poll(self) -> int | None:
        """Its exit code (negative: the signal that ended it), or None while it runs."""
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to exit; its exit code.

        Raises:
            subprocess.TimeoutExpired: it still ran after ``timeout`` seconds.
        """
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired("elche-coordinator", timeout or 0.0)
        return code

    def kill(self) -> None:
        self._process.kill()


# The coordinator process, however it was started.
CoordinatorProcess: TypeAlias = "subprocess.Popen[str] | ForkedCoordinator"


def report_lost(
    host: CoordinatorProcess, rank: int, code: int | None, *, stopping: bool = False
) -> None:
    """Tell the coordinator (over its stdin) that a rank process is gone.

    One that exits 0 did so at the run's end, which the coordinator knows
    (it ignores the report then, and nothing is said), or in the middle of
    it (``os._exit(0)`` in the user's code), where it is lost at once rather
    than when its heartbeats go stale. Nor is one said while the run stops
    (``stopping``: a stop signal came): its ranks save and exit, 143 say,
    which the stop's one line accounts for; nor one whose ``code`` is
    unknown (None), whose loss, if it was one, the coordinator says.
    """
    if code is None:  # (it outlived the fork server, or was declared lost and killed)
        how = "its exit status is unknown"
    else:
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    if code not in (0, None) and not stopping:
        print(f"elche: rank {rank} process ended ({how})", file=sys.stderr, flush=True)
    tell_coordinator(host, f"lost {rank} process ended ({how})")


# One report line at a time: threads (rank exits, a replaced coordinator) and the
# stop signals' handler all write; re-entrant, since a handler runs in the main
# thread between two of its bytecodes, a whole line written before it.
_TELLING = threading.RLock()


def tell_coordinator(host: Any, line: str) -> None:
    """Write one report line to the coordinator's stdin (``Host.watch`` reads it)."""
    try:
        with _TELLING:
            host.stdin.write(line + "\n")
            host.stdin.flush()
    except (BrokenPipeError, OSError, ValueError):
        pass  # the coordinator is already gone
