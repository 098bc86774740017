"""The host rig itself: addresses, reachability, private /tmp, shaping, cleanup."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elche.testing.hosts import RIG_PREFIX, Rig, sweep_stale

SERVE = """
import socket, sys, time
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
total = 0
t0 = None
while chunk := conn.recv(1 << 16):
    t0 = t0 or time.monotonic()
    total += len(chunk)
print(total, time.monotonic() - t0, flush=True)
"""

SEND = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30) as s:
    s.sendall(b"x" * int(sys.argv[3]))
"""


NAMES = "import socket as s; print(s.gethostname(), s.gethostbyname('h0'), s.gethostbyname('h2'))"


def _netns() -> str:
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True)
    return listed.stdout


def _send(rig: Rig, src: int, dst: int, num_bytes: int) -> float:
    """Send ``num_bytes`` from host ``src`` to ``dst``; seconds from first to last byte received."""
    server = rig.spawn(dst, [sys.executable, "-c", SERVE, rig.hosts[dst].address],
                       stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert server.stdout is not None
    port = server.stdout.readline().strip()
    sent = rig.run(src, [sys.executable, "-c", SEND, rig.hosts[dst].address, port,
                         str(num_bytes)])  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    received, took_s = server.stdout.readline().split()
    assert int(received) == num_bytes
    server.wait(timeout=30)
    return float(took_s)


@pytest.mark.slow
def test_hosts_have_their_own_addresses_reach_each_other_and_a_private_tmp() -> None:
    with Rig(3) as rig:
        addresses = [h.address for h in rig.hosts]
        assert len(set(addresses)) == 3
        shown = rig.run(1, ["ip", "-4", "-o", "addr", "show"]).stdout
        assert rig.hosts[1].address in shown
        assert rig.hosts[0].address not in shown  # only its own address
        assert _send(rig, 2, 0, 1000) >= 0
        named = rig.run(1, [sys.executable, "-c", NAMES]).stdout.split()
        assert named == ["h1", rig.hosts[0].address, rig.hosts[2].address]
        (rig.tmp(0) / "mine").write_text("host 0")
        assert rig.run(0, ["cat", "/tmp/mine"]).stdout == "host 0"
        assert rig.run(1, ["ls", "/tmp"]).stdout.split() == rig.kept  # only what runs it
        rig.run(1, ["sh", "-c", "echo one > /tmp/written"])
        assert (rig.tmp(1) / "written").read_text() == "one\n"  # persists across commands
        assert not (rig.tmp(0) / "written").exists()
        rig.partition(2)
        cut = rig.run(2, [sys.executable, "-c", SEND.replace("timeout=30", "timeout=1"),
                          addresses[0], "9", "1"])  # fmt: skip
        assert cut.returncode != 0
        rig.heal(2)
        assert _send(rig, 2, 0, 1000) >= 0
        sleeper = rig.spawn(1, ["sleep", "600"])
        assert rig.kill_host(1)
        assert sleeper.wait(timeout=10) == -9
        names = [h.netns for h in rig.hosts] + [rig.switch]
        root = rig.root
    listed = _netns()
    assert not any(name in listed for name in names)
    assert not root.exists()
    assert not any(Path("/etc/netns", name).exists() for name in names)


@pytest.mark.slow
def test_a_shaped_link_carries_no_more_than_its_rate() -> None:
    rate_mbit = 40.0
    num_bytes = 2_000_000  # 0.4 s at 40 Mbit/s
    with Rig(2, rate_mbit=rate_mbit) as rig:
        took_s = _send(rig, 0, 1, num_bytes)
    floor_s = num_bytes * 8 / (rate_mbit * 1e6)
    assert took_s >= 0.8 * floor_s, took_s  # unshaped, a veth moves this in milliseconds


def test_a_failing_body_still_cleans_up_and_stale_rigs_are_swept() -> None:
    names: list[str] = []
    with pytest.raises(RuntimeError, match="boom"), Rig(1) as rig:
        names = [rig.hosts[0].netns, rig.switch]
        rig.spawn(0, ["sleep", "600"])
        raise RuntimeError("boom")
    assert not any(name in _netns() for name in names)
    # A rig left by a process that is gone: a namespace named for a dead pid.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{RIG_PREFIX}-{dead.pid}-abcdef-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in sweep_stale()
        assert stale not in _netns()
    finally:
        subprocess.run(["ip", "netns", "del", stale], check=False, capture_output=True)


CREATOR = """
import sys, time
from elche.testing.hosts import Rig
rig = Rig(1)
sleeper = rig.spawn(0, ["sleep", "600"])
print(rig.hosts[0].netns, sleeper.pid, flush=True)
time.sleep(600)  # until the test SIGKILLs it
"""


@pytest.mark.slow
def test_what_a_killed_creator_spawned_dies_with_it_and_its_rig_is_swept() -> None:
    # SIGKILLed, a bench leaves its rig's namespaces behind (swept by the next one),
    # and the runs it had started in them trained on to their end.
    import os
    import signal
    import time

    from elche.runtime.lifetimes import pid_alive

    creator = subprocess.Popen([sys.executable, "-c", CREATOR], stdout=subprocess.PIPE, text=True)
    try:
        netns, sleeper = creator.stdout.readline().split()  # type: ignore[union-attr]  # a pipe
        os.kill(creator.pid, signal.SIGKILL)
        creator.wait(timeout=10)
        deadline = time.monotonic() + 10.0
        while pid_alive(int(sleeper)) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for a condition, with a deadline
        assert not pid_alive(int(sleeper))
        sweep_stale()  # (or a test beside this one sweeps it: either way it goes)
        assert netns not in _netns()
    finally:
        creator.kill()
        creator.wait()
        sweep_stale()
