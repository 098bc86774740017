"""Several hosts on one machine: network namespaces joined by a bridge.

Theory of operation. A ``Rig`` of N hosts makes N + 1 network namespaces:
one switch (``…-sw``) holding a Linux bridge, and one per host (``…-h0``,
``…-h1``, …). Each host gets a veth pair created straight into the two
namespaces (so the machine's own namespace never sees an interface of the
rig): ``eth0`` inside the host, ``h<i>`` on the bridge. Host ``i`` has the
address ``10.<a>.<b>.<i + 1>/24`` on a subnet the rig picks at random, a
loopback, and the host name ``h<i>`` (a UTS namespace), which every host
resolves through its own ``/etc/hosts`` (no name server is asked). Every
command the rig runs on a host enters the host's network namespace, its UTS
namespace and a fresh mount namespace in which the host's own directory
(``Rig.tmp(i)`` on the machine) is bind-mounted over ``/tmp``: the hosts
share the machine's files except ``/tmp``, as hosts that share a software
install but no scratch storage.

With ``rate_mbit`` each host's link is shaped both ways with a token bucket
(``tc qdisc … tbf``; the kernel here has no ``netem``), and ``limit(i, rate)``
shapes host ``i``'s link so mid-run. ``partition(i)``
takes host ``i``'s bridge port down (no traffic either way) and ``heal(i)``
brings it back; ``kill_host(i)`` SIGKILLs every process in the host's
namespace, whoever started it.

Cleanup is guaranteed: ``close`` (the context manager's exit) kills every
process of every host, deletes the namespaces (deleting a namespace deletes
its end of each veth pair, and so the pair) and removes the host
directories. What ``spawn`` started the kernel kills once the creating
thread is gone, even by SIGKILL (and each elche launcher's ranks follow
their launcher). Names carry the creating process's pid and a random tag, so
rigs of parallel runs never collide, and ``sweep_stale`` removes the rigs
of processes that are gone (a crashed test run, a killed bench). Needs
root, ``ip``, ``unshare`` and ``mount``; ``missing()`` says what is absent.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from elche.runtime.lifetimes import pid_alive

__all__ = ["RIG_PREFIX", "HostSpec", "Rig", "missing", "sweep_stale"]

RIG_PREFIX = "elche-rig"  # every namespace and directory of a rig starts with it
INTERFACE = "eth0"  # a host's interface, inside its namespace
NETNS_ETC = Path("/etc/netns")  # per-namespace files ``ip netns exec`` mounts over /etc
KILL_WAIT_S = 10.0  # how long processes get to vanish after SIGKILL
_TOOLS = ("ip", "unshare", "mount", "tc")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def missing() -> str | None:
    """Why a rig cannot be built here, or None when it can."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (network and mount namespaces)"
    absent = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if absent:
        return f"needs {', '.join(absent)} on PATH"
    return None


@dataclass(frozen=True, slots=True)
class HostSpec:
    """One host of a rig."""

    index: int
    netns: str  # its network namespace
    address: str  # its IPv4 address on the rig's subnet
    interface: str  # the interface that address is on, inside the namespace
    tmp: Path  # on the machine: what the host sees as /tmp
    port: str  # the bridge port (in the switch namespace) its link plugs into

    @property
    def name(self) -> str:
        """Its host name (``h<i>``), which every host of the rig resolves."""
        return self.port


def _killed_with_parent() -> Callable[[], None]:
    """A ``preexec_fn``: the child is SIGKILLed once the thread that forked it is gone
    (``PR_SET_PDEATHSIG``, kept across ``ip netns exec``, ``unshare`` and ``sh``'s
    exec, none of them set-user-ID), or at once if its parent died before that.
    ``prctl`` is looked up here, before the fork: a child does no more than call it."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # (gone already: no signal will come)
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _in(netns: str, *argv: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, *argv], check=True, capture_output=True)


def _netns_pids(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False).stdout
    return [int(word) for word in out.split()]


def _kill_netns(netns: str) -> None:
    """SIGKILL every process in ``netns`` and wait (bounded) until none is left."""
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        pids = _netns_pids(netns)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)  # polling the kernel's list, bounded by the deadline


def _delete_netns(netns: str) -> None:
    _kill_netns(netns)
    _ip("netns", "del", netns, check=False)
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)


def _write_etc(netns: str, names: str) -> None:
    """The host's /etc/hosts (every rig host by name) and a resolv.conf with no server.

    ``ip netns exec`` mounts ``/etc/netns/NS/*`` over ``/etc``: lookups of the
    rig's names answer at once, and no lookup waits on a name server the
    namespace cannot reach (torch's c10d looks up every peer's name).
    """
    etc = NETNS_ETC / netns
    etc.mkdir(parents=True)
    (etc / "hosts").write_text(f"127.0.0.1 localhost\n{names}", encoding="utf-8")
    (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n", encoding="utf-8")


def _tbf(netns: str, device: str, rate_mbit: float) -> None:
    rate_bytes_s = rate_mbit * 1e6 / 8
    burst_bytes = max(16_000, int(rate_bytes_s / 100))  # >= one 10 ms timer tick of data
    _in(netns, "tc", "qdisc", "replace", "dev", device, "root", "tbf",
        "rate", f"{rate_mbit}mbit", "burst", str(burst_bytes), "latency", "100ms")  # fmt: skip


class Rig:
    """N hosts as network namespaces on one bridge (see the module docstring).

    Use it as a context manager; ``close`` undoes everything even when the
    body raised.
    """

    def __init__(self, num_hosts: int, *, rate_mbit: float | None = None) -> None:
        if num_hosts < 1:
            raise ValueError(f"num_hosts must be at least 1, got {num_hosts}")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive or None, got {rate_mbit}")
        reason = missing()
        if reason is not None:
            raise RuntimeError(f"no host rig here: {reason}")
        self.name = f"{RIG_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.rate_mbit = rate_mbit
        self.kept = kept_under_tmp()  # what a host's private /tmp still shows of the machine's
        self.switch = f"{self.name}-sw"
        self.root = Path(tempfile.gettempdir()) / self.name
        a, b = secrets.randbelow(256), secrets.randbelow(256)
        self.subnet = f"10.{a}.{b}.0/24"
        self.hosts = [
            HostSpec(
                i,
                f"{self.name}-h{i}",
                f"10.{a}.{b}.{i + 1}",
                INTERFACE,
                tmp=self.root / f"h{i}",
                port=f"h{i}",
            )
            for i in range(num_hosts)
        ]
        self._procs: list[tuple[int, subprocess.Popen[Any]]] = []  # (host, what spawn started)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        _in(sw, "ip", "link", "add", "br0", "type", "bridge")
        _in(sw, "ip", "link", "set", "br0", "up")
        names = "".join(f"{h.address} {h.name}\n" for h in self.hosts)
        for host in self.hosts:
            host.tmp.mkdir(parents=True)
            _write_etc(host.netns, names)
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.interface, "netns", host.netns, "type", "veth",
                "peer", "name", host.port, "netns", sw)  # fmt: skip
            _in(sw, "ip", "link", "set", host.port, "master", "br0", "up")
            _in(host.netns, "ip", "link", "set", "lo", "up")
            _in(host.netns, "ip", "addr", "add", f"{host.address}/24", "dev", host.interface)
            _in(host.netns, "ip", "link", "set", host.interface, "up")
            if self.rate_mbit is not None:
                self.limit(host.index, self.rate_mbit)

    # -- running things on a host ---------------------------------------------

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` on host ``host`` (its network, its /tmp)."""
        spec = self.hosts[host]
        # The folders of /tmp this Python and elche run from (a venv or a clone there)
        # are bound into the host's own /tmp first, then that goes over /tmp whole.
        keep = "".join(
            f'mkdir -p "$0/{n}" && mount --bind "/tmp/{n}" "$0/{n}" && ' for n in self.kept
        )
        enter = f'{keep}mount --rbind "$0" /tmp && hostname {spec.name} && exec "$@"'
        return ["ip", "netns", "exec", spec.netns,
                "unshare", "--mount", "--uts", "--propagation", "private",
                "sh", "-c", enter, str(spec.tmp), *argv]  # fmt: skip

    def env(self, host: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment for host ``host``: its interface for gloo, TMPDIR /tmp."""
        iface = self.hosts[host].interface
        env = dict(os.environ, GLOO_SOCKET_IFNAME=iface, NCCL_SOCKET_IFNAME=iface, TMPDIR="/tmp")
        env.update(extra or {})
        return env

    def spawn(
        self, host: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
        **popen: Any,
    ) -> subprocess.Popen[Any]:  # fmt: skip
        """Start ``argv`` on host ``host``; ``env`` adds to ``env(host)``; killed on close,
        and by the kernel once the thread that called this is gone (a killed bench)."""
        if "preexec_fn" in popen:
            raise ValueError("Rig.spawn sets preexec_fn itself (its processes die with this one)")
        dies_with_us = _killed_with_parent()  # (the child only calls prctl: thread-safe)
        command, on_host = self.command(host, argv), self.env(host, env)
        proc = subprocess.Popen(command, env=on_host, preexec_fn=dies_with_us, **popen)  # noqa: PLW1509
        self._procs.append((host, proc))
        return proc

    def run(
        self, host: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """Run ``argv`` on host ``host`` to its end; its output as text."""
        return subprocess.run(
            self.command(host, argv), env=self.env(host, env), capture_output=True, text=True,
            timeout=timeout_s, check=False,
        )  # fmt: skip

    def free_port(self, host: int) -> int:
        """A TCP port free on host ``host`` (its namespace is the rig's alone)."""
        probe = "import socket; s = socket.create_server(('', 0)); print(s.getsockname()[1])"
        done = self.run(host, [sys.executable, "-c", probe])
        if done.returncode != 0:
            raise RuntimeError(f"no free port on host {host}: {done.stderr.strip()}")
        return int(done.stdout)

    def tmp(self, host: int) -> Path:
        """Where host ``host``'s /tmp lies on this machine."""
        return self.hosts[host].tmp

    # -- faults ------------------------------------------------------------------

    def kill_host(self, host: int) -> list[int]:
        """SIGKILL every process on host ``host``; the pids that were there."""
        started = [proc for h, proc in self._procs if h == host and proc.poll() is None]
        for proc in started:  # one may not have entered the namespace yet
            with contextlib.suppress(OSError):
                proc.kill()
        pids = sorted({p.pid for p in started} | set(_netns_pids(self.hosts[host].netns)))
        _kill_netns(self.hosts[host].netns)
        return pids

    def limit(self, host: int, rate_mbit: float) -> None:
        """Limit host ``host``'s link to ``rate_mbit`` each way from now on."""
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        spec = self.hosts[host]
        _tbf(spec.netns, spec.interface, rate_mbit)  # host -> bridge
        _tbf(self.switch, spec.port, rate_mbit)  # bridge -> host

    def partition(self, host: int) -> None:
        """Cut host ``host`` off: its bridge port goes down, no traffic either way."""
        _in(self.switch, "ip", "link", "set", self.hosts[host].port, "down")

    def heal(self, host: int) -> None:
        """Undo ``partition(host)``."""
        _in(self.switch, "ip", "link", "set", self.hosts[host].port, "up")

    # -- cleanup -------------------------------------------------------------------

    def close(self) -> None:
        """Kill every host's processes, delete the namespaces and the host directories."""
        for _, proc in self._procs:
            with contextlib.suppress(OSError):
                proc.kill()
        for host in self.hosts:
            _delete_netns(host.netns)
        _delete_netns(self.switch)
        for _, proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_WAIT_S)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Rig:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def kept_under_tmp() -> list[str]:
    """The top-level folders of ``/tmp`` the running Python, elche and the working
    directory live in: a host's private ``/tmp`` must still show them (a CI clone
    and its venv under ``/tmp`` would otherwise vanish inside every host)."""
    paths = [Path(sys.prefix), Path(sys.executable), Path(__file__), Path.cwd()]
    paths += [Path(p) for p in sys.path if p]
    kept = set()
    for path in paths:
        try:
            parts = path.resolve().relative_to("/tmp").parts
        except (ValueError, OSError):
            continue
        if parts and not parts[0].startswith(RIG_PREFIX):
            kept.add(parts[0])
    return sorted(kept)


def sweep_stale() -> list[str]:
    """Remove the rigs whose creating process is gone; the namespaces removed."""
    if missing() is not None:
        return []
    out = _ip("netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith(RIG_PREFIX + "-")]
    stale = [n for n in names if (pid := _rig_pid(n)) is not None and not pid_alive(pid)]
    for netns in sorted(stale, key=lambda n: n.endswith("-sw")):  # hosts first, then switches
        _delete_netns(netns)
    for etc in NETNS_ETC.glob(RIG_PREFIX + "-*") if NETNS_ETC.exists() else []:
        pid = _rig_pid(etc.name)
        if pid is not None and not pid_alive(pid):
            shutil.rmtree(etc, ignore_errors=True)
    for path in Path(tempfile.gettempdir()).glob(RIG_PREFIX + "-*"):
        pid = _rig_pid(path.name)
        if pid is not None and not pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
    return stale


def _rig_pid(name: str) -> int | None:
    """The creating pid in ``elche-rig-<pid>-<tag>[-…]``; None for another name."""
    word = name[len(RIG_PREFIX) + 1 :].split("-", 1)[0]
    return int(word) if word.isdigit() else None
