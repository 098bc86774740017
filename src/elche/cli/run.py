"""``elche run``: a script started as N local ranks, torchrun's way, and watched to its end.

Rules:

- Every flag is checked before a rank starts (``nproc`` against the memory
  this machine has available); the ranks get torchrun's environment, a
  rendezvous port of their own and the run directory (``ELCHE_RUN_DIR``,
  made here unless exported).
- Each rank runs in a process group of its own; the launcher alone hears
  Ctrl-C and passes every stop signal on (``_Ranks``). A rank that fails
  before every rank met ends the run at once; one that fails after, the
  run survives, and rank 0 hears of its exit at once.
- The exit status is the first failed rank's (a shell's: killed by signal
  N, 128 + N), or the stop signal's, or 0; each failed rank is a line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elche.core import timeline as tl
from elche.core.errors import ConfigError
from elche.core.liveness import lost_for_silence
from elche.monitor.timeline import TimelineReader

__all__ = ["RANK_FLOOR_MIB", "available_mib", "run_script"]


# The least memory an `elche run` rank process takes of its own: Python with torch
# imported held ~205 MiB private on this project's CPU build; a floor below that
# refuses only what surely cannot start (a typo's --nproc forked until EAGAIN).
RANK_FLOOR_MIB = 128
# How long ranks stopped before the run formed have to end (a SIGTERM handler of the
# script's own) before ``elche run`` kills them.
STARTUP_STOP_GRACE_S = 3.0


def available_mib() -> int | None:
    """The memory this machine has available (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def run_script(args: argparse.Namespace) -> int:
    env, made = _run_env(args)
    try:
        return _launch_ranks(args, env)
    finally:
        if made:  # left empty when no run began there (a script that never trained)
            with contextlib.suppress(OSError):
                Path(env["ELCHE_RUN_DIR"]).rmdir()


def check_script(path: str) -> None:
    """``SCRIPT`` of ``elche run`` and ``elche join`` is a file Python can run.

    Raises:
        ConfigError: it is not (each rank's Python said so, once per rank, and the
            launcher then that each rank exited with code 2).
    """
    if not Path(path).is_file():
        what = "is a directory" if Path(path).is_dir() else "no such file"
        raise ConfigError("script", f"{what}: {path} (the Python script that calls elche.train)")


def _run_env(args: argparse.Namespace) -> tuple[dict[str, str], bool]:
    """The ranks' environment, every flag checked first; and whether it made the run dir."""
    import socket

    if args.nproc < 1:
        raise ConfigError("nproc", f"must be >= 1, got {args.nproc}")
    available = available_mib()
    if available is not None and args.nproc * RANK_FLOOR_MIB > available:
        raise ConfigError(
            "nproc",
            f"{args.nproc} rank processes do not fit this machine: each imports torch (at "
            f"least {RANK_FLOOR_MIB} MiB of its own) and {available} MiB are available, "
            f"room for at most {available // RANK_FLOOR_MIB}",
        )
    env = dict(os.environ)
    if args.dashboard is not None:
        from elche.monitor.address import DASHBOARD_ENV, parse_address

        parse_address(args.dashboard)
        env[DASHBOARD_ENV] = args.dashboard  # rank 0 serves it
    if args.tensorboard is not None:
        from elche.api import TENSORBOARD_ENV

        env[TENSORBOARD_ENV] = args.tensorboard  # rank 0 writes it
    check_script(args.script)  # (after the flags: their errors come first)
    with socket.socket() as probe:  # an ephemeral port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(args.nproc),
        LOCAL_WORLD_SIZE=str(args.nproc),
    )
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    exported = os.environ.get("ELCHE_RUN_DIR")  # the user's, as rank 0 under torchrun takes it
    if not exported:
        env["ELCHE_RUN_DIR"] = tempfile.mkdtemp(prefix="elche-run-")
        return env, True
    try:
        Path(exported).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("ELCHE_RUN_DIR", f"cannot be made: {exc}") from None
    return env, False


def _launch_ranks(args: argparse.Namespace, env: dict[str, str]) -> int:
    """Start the ranks, pass the stop signals on, wait; ``elche run``'s exit status."""
    from elche.runtime.lifetimes import StopSignals, ctrl_z_said

    ranks = _Ranks(Path(env["ELCHE_RUN_DIR"]))
    # SIGINT/SIGTERM/SIGHUP: the ranks save and exit 130/143/129 (elche.runtime.lifetimes);
    # a second SIGINT kills them. Ctrl-Z stops elche run alone, saying so.
    with ctrl_z_said(), StopSignals(on_signal=ranks.forward) as signals:
        try:
            for rank in range(args.nproc):
                if ranks.stopped_early is None:  # (a signal while they start: no more)
                    ranks.start([sys.executable, args.script, *args.script_args],
                                dict(env, RANK=str(rank), LOCAL_RANK=str(rank)))  # fmt: skip
            cut_short = _wait_ranks(ranks)
        except KeyboardInterrupt:  # the second SIGINT
            print("elche run: stopped at once by a second signal; the ranks were killed, "
                  "and nothing more is saved", file=sys.stderr)  # fmt: skip
            return 130
        finally:
            ranks.kill()
            ranks.close()
    codes = [proc.wait() for proc in ranks.procs]  # (each has ended)
    if ranks.stopped_early is not None:
        name = signal.Signals(ranks.stopped_early).name
        print(f"elche run: interrupted by {name} before the run formed; the ranks were "
              "stopped (nothing was trained)", file=sys.stderr)  # fmt: skip
        return 128 + ranks.stopped_early
    if cut_short is not None:
        print(f"elche run: rank {cut_short} {_ended(codes[cut_short])} before every rank "
              f"reached the run, which cannot form without it; the other ranks were "
              f"stopped (nothing was trained)", file=sys.stderr)  # fmt: skip
        return _status(codes[cut_short]) or 1  # (status 0: the run failed all the same)
    return _formed_run_ended(codes, signals.received, ranks.lost)


def _formed_run_ended(codes: list[int], received: int | None, lost: dict[int, str]) -> int:
    """Say how the ranks of a run that formed ended (``codes``: their ``returncode``s;
    ``received``: the stop signal elche run passed on; ``lost``: the ranks it killed as
    declared lost, and why); ``elche run``'s exit status (a killed rank's counts).

    A stop signal sent to rank 0 alone stops the whole run as one sent to elche
    run does (rank 0 hosts the coordinator): every rank exits with the status of
    that signal, which is said once, not as each rank's failure.
    """
    from elche.runtime.lifetimes import STOP_SIGNALS

    stopped = None if received is None else 128 + received
    if stopped is None and codes[0] - 128 in STOP_SIGNALS:  # rank 0's Interrupted
        stopped = codes[0]
        name = signal.Signals(stopped - 128).name
        print(f"elche run: the run stopped on a {name} sent to rank 0 (the coordinator's "
              "host) alone, not to elche run", file=sys.stderr)  # fmt: skip
    failed = [(rank, code) for rank, code in enumerate(codes) if code not in (0, stopped)]
    for rank, code in failed:
        if rank in lost and code == -signal.SIGKILL:
            after = " once the run had ended without it" if rank == 0 else ""
            print(f"elche run: rank {rank} hung: the run declared it lost ({lost[rank]}), "
                  f"and elche run killed it{after}", file=sys.stderr)  # fmt: skip
        elif stopped is None and -code in STOP_SIGNALS:  # sent to that rank alone: it left
            name = signal.Signals(-code).name
            print(f"elche run: rank {rank} was stopped by {name}; the run went on without it",
                  file=sys.stderr)  # fmt: skip
        else:
            print(f"elche run: rank {rank} {_ended(code)}", file=sys.stderr)
    if failed:
        return _status(failed[0][1])
    return stopped if stopped in codes else 0


class _Ranks:
    """``elche run``'s rank processes, and the stop signals it passes them.

    Each rank runs in a process group of its own (as torchrun's workers run in
    sessions of their own), so Ctrl-C and a signal to the launcher's group
    reach the launcher alone, which passes the stop on: once every rank met in
    torch's rendezvous (``formed``), each is inside ``elche.train``, where a stop
    signal saves the run. Before that, nothing was trained: a rank may still be
    importing or in the script's own set-up, where SIGINT would end it in a
    traceback, or waiting in the rendezvous, deaf to signals. So each is sent
    SIGTERM (it ends at once, or runs the script's own handler) and is killed
    ``STARTUP_STOP_GRACE_S`` later if still there (``stopped_early``: the
    signal that came).

    Once the run formed, the exit of a rank but 0 is reported to rank 0 at
    once (``RANK_EXITS_ENV``, a pipe), which tells its coordinator: the rank
    is lost then, not when its heartbeats go stale, the run waiting for it.

    Every stop it passes on it first marks as the run's (``RUN_STOPS_ENV``, a
    pipe every rank holds): a rank that gets a stop signal left unmarked
    (``STOP_MARK_GRACE_S``) was sent it alone, and leaves the run
    (``elche.runtime.lifetimes.stop_came_alone``). One sent to every process
    at once is marked here too, and the ranks leave the stop to this launcher.
    """

    def __init__(self, run_dir: Path) -> None:
        from elche.runtime.lifetimes import stop_marks

        self.procs: list[subprocess.Popen[bytes]] = []
        self.stopped_early: int | None = None
        self.kill_at: float | None = None  # (monotonic) the stopped ranks' grace ends
        self._exits, self._exits_out = os.pipe()  # rank 0 reads, the launcher writes
        self._stops, self._stops_out = stop_marks()  # every rank looks, the launcher writes
        self._met, self._met_out = os.pipe()  # the launcher looks, rank 0 writes
        self._formed = False  # (latched: see formed)
        self._waiting, self._waiting_out = os.pipe()  # the launcher looks, every rank writes
        self._a_rank_waits = False  # (latched: see waiting)
        # (a run_dir= of the script's own has its timeline elsewhere: not followed)
        self.timeline = TimelineReader(run_dir)  # the run's (``kill_the_lost``)
        self.lost: dict[int, str] = {}  # rank: why the run declared it lost, once killed
        self._hung_host: str | None = None  # why the run declared rank 0 lost (it stays)
        self._ended_after = False  # whether the run ended after it did

    def start(self, command: list[str], env: dict[str, str]) -> None:
        from elche.runtime.lifetimes import (
            RANK_EXITS_ENV,
            RANKS_MET_ENV,
            RANKS_WAITING_ENV,
            RUN_STOPS_ENV,
        )

        env = dict(
            env, **{RUN_STOPS_ENV: str(self._stops), RANKS_WAITING_ENV: str(self._waiting_out)}
        )
        fds: tuple[int, ...] = (self._stops, self._waiting_out)
        if self.procs:
            self.procs.append(subprocess.Popen(command, env=env, process_group=0, pass_fds=fds))
            return
        # rank 0's alone (the launcher keeps its end of the met pipe: no EOF there)
        env = dict(env, **{RANK_EXITS_ENV: str(self._exits), RANKS_MET_ENV: str(self._met_out)})
        fds += (self._exits, self._met_out)
        try:
            self.procs.append(subprocess.Popen(command, env=env, process_group=0, pass_fds=fds))
        finally:
            os.close(self._exits)

    def formed(self) -> bool:
        """Whether every rank met in torch's rendezvous: rank 0 said so in the met pipe
        (``say_ranks_met``; read by no one, what it wrote stays)."""
        self._formed = self._formed or _written(self._met)
        return self._formed

    def waiting(self) -> bool:
        """Whether a rank has reached torch's rendezvous (``say_waiting``; latched, as
        ``formed``)."""
        self._a_rank_waits = self._a_rank_waits or _written(self._waiting)
        return self._a_rank_waits

    def report_exit(self, proc: subprocess.Popen[bytes]) -> None:
        """Tell rank 0 that ``proc``, an ended rank but 0, has ended. (Rank 0's own
        end its coordinator sees: its stdin closes.)"""
        rank = self.procs.index(proc)
        if rank != 0:
            with contextlib.suppress(OSError):  # (a closed pipe: rank 0 has ended)
                os.write(self._exits_out, f"{rank} {proc.returncode}\n".encode())

    def close(self) -> None:
        for fd in (self._exits_out, self._stops, self._stops_out, self._met, self._met_out,
                   self._waiting, self._waiting_out):  # fmt: skip
            with contextlib.suppress(OSError):
                os.close(fd)

    def forward(self, signum: int) -> None:
        """Pass a stop signal on, marked as the run's (run in the signal handler)."""
        from elche.runtime.lifetimes import mark_stop

        if self.stopped_early is None and not self.formed():
            self.stopped_early = signum
            self.kill_at = time.monotonic() + STARTUP_STOP_GRACE_S
            signum = signal.SIGTERM
        mark_stop(self._stops_out)
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.send_signal(signum)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def kill_the_lost(self) -> None:
        """Kill each rank that the run's timeline says was declared lost for its silence
        (``lost_for_silence``), its process group with it, as ``elche.train``'s launcher
        does: a hung rank (a deadlock, a stopped process) must not come back, and the
        run's end would wait for it for good. A rank lost otherwise (its error, its
        exit) ends itself.

        Rank 0's process hosts the coordinator, which goes on without its rank: it is
        killed once the run has ended and every other rank with it (its coordinator,
        in a process group of its own, is done by then)."""
        for event in self.timeline.new_records():
            lost = lost_for_silence(event)
            if isinstance(event, tl.RunEnd):
                self._ended_after = self._hung_host is not None
            elif lost is not None and lost.rank == 0:
                self._hung_host = lost.reason
            elif lost is not None and lost.rank < len(self.procs):
                self._kill_lost(lost.rank, lost.reason)
        others = all(proc.poll() is not None for proc in self.procs[1:])
        if self._hung_host is not None and self._ended_after and others:
            self._kill_lost(0, self._hung_host)

    def _kill_lost(self, rank: int, reason: str) -> None:
        proc = self.procs[rank]
        if proc.poll() is None:
            self.lost[rank] = reason
            with contextlib.suppress(OSError):  # (it has just ended)
                os.killpg(proc.pid, signal.SIGKILL)


def _written(fd: int) -> bool:
    """Whether a rank wrote to the pipe read at ``fd`` (read by no one: what it wrote
    stays, so the answer, once yes, holds)."""
    with contextlib.suppress(OSError, ValueError):  # (closed: the ranks have ended)
        return bool(select.select([fd], [], [], 0)[0])
    return False


def _status(code: int) -> int:
    """A rank's ``Popen.returncode`` as a shell's status: killed by signal N, 128 + N."""
    return 128 - code if code < 0 else code


def _wait_ranks(ranks: _Ranks) -> int | None:
    """Wait for every rank to end; the rank that ended the run before it formed, if one did.

    torch's rendezvous waits (30 minutes by default) for every rank, deaf to
    signals. A rank that fails before every rank met there leaves the others
    waiting for it, so they are killed at once: nothing was trained yet. So is
    one that ended with status 0 (its script never called ``elche.train``), once
    another rank waits at the rendezvous (``say_waiting``): ranks that all end
    without training are a script's own business. One that fails after the
    run formed, the run survives (``ranks.formed``: rank 0 said so). Ranks
    stopped before the run formed (``_Ranks.forward``) are killed once their
    grace is over; ranks the run declared lost after (``_Ranks.kill_the_lost``),
    at once (rank 0, the coordinator's host, once the run ended).
    """
    procs = ranks.procs
    live = list(procs)
    left: subprocess.Popen[bytes] | None = None  # ended with 0 before the run formed
    formed = False  # (as of the last turn)
    while live:
        # Each turn is bounded: until the run formed, so that a stop's grace ends
        # even where no rank does (each deaf in the rendezvous, or stuck in its
        # set-up: a wait for a rank's end would be retried after the signal); after,
        # so that a rank the run declared lost is killed.
        if ranks.kill_at is not None and time.monotonic() >= ranks.kill_at:
            ranks.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            live[0].wait(timeout=0.05 if ranks.kill_at is not None or not formed else 0.2)
        if formed:
            ranks.kill_the_lost()
        ended = [proc for proc in live if proc.poll() is not None]
        live = [proc for proc in live if proc not in ended]
        failed = [proc for proc in ended if proc.returncode != 0]
        formed = ranks.formed()
        if left is None and not formed:
            left = next((proc for proc in ended if proc.returncode == 0), None)
        gone = failed[0] if failed else left if ranks.waiting() else None
        if gone is not None and live and not formed and ranks.stopped_early is None:
            for proc in live:
                proc.kill()
                proc.wait()
            return procs.index(gone)
        for proc in ended if formed else ():
            ranks.report_exit(proc)
    return None


def _ended(code: int) -> str:
    """How a rank process ended, from its ``Popen.returncode``."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"
