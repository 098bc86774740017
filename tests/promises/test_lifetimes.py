"""Issue 12, item 12: clean stops and lifetimes.

Real processes, each test in its own session (``start_new_session``), so a
test can signal the whole process group as Ctrl-C would, find every process
of its run by the session id, and kill what is left in a ``finally``. "Mid-run"
is the run dir's timeline gaining an ``EpochEnd`` record (the run dir lives
under the test's ``TMPDIR``); no test sleeps to synchronise.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from elche.chaos import audit_spans
from elche.runtime.lifetimes import CTRL_Z_LINE, process_state
from elche.workloads import digits
from tests.promises.test_storage import small_disk

pytestmark = [pytest.mark.integration, pytest.mark.slow]

if not Path("/proc/self/stat").exists():  # the session scan reads /proc
    pytest.skip("needs Linux /proc", allow_module_level=True)

# Generous upper bounds the acceptance names.
STOP_WITHIN_S = 15.0
ORPHANS_GONE_WITHIN_S = 10.0
# Startup (torch import in the fork server) plus an epoch on 2 busy cores.
MID_RUN_WITHIN_S = 120.0

SCRIPT = """
import os, sys
import elche
from elche.workloads import digits

if __name__ == "__main__":
    train_set, _ = digits.load_digits_split(seed=0)
    try:
        result = elche.train(
            digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
            batch_size=32, epochs=int(sys.argv[2]), speeds=[0.05, 0.02], progress=False,
            save_path=sys.argv[1], metrics_fn=FINAL_HOOK,
        )
    except KeyboardInterrupt as stop:
        print(f"STOPPED {type(stop).__name__} bundle={stop.bundle} code={stop.code}", flush=True)
        raise
    print(f"COMPLETED {result.summary['outcome']} model={bool(result.state_dict)}", flush=True)
"""

SELF_INTERRUPT = """
import os, signal
def interrupt_at_the_end(entry):
    if entry["epoch"] == int(sys.argv[2]) - 1:  # the last epoch has just ended
        os.kill(os.getpid(), signal.SIGINT)
FINAL_HOOK = interrupt_at_the_end
"""

RUN_SCRIPT = """
import os, sys
import elche
from elche.workloads import digits

if __name__ == "__main__":
    train_set, _ = digits.load_digits_split(seed=0)
    rank = int(os.environ["RANK"])
    elche.train(
        digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
        batch_size=32, epochs=8, speeds=[0.05, 0.02], progress=False,
        save_path=sys.argv[1] or None,
    )
"""

SESSION_RUN_SCRIPT = """
import os, sys
import torch
import elche
from elche.workloads import digits

if __name__ == "__main__":
    train_set, _ = digits.load_digits_split(seed=0)
    model = digits.make_model("cpu")
    optimizer = digits.make_optimizer(model.parameters())
    with elche.Session(
        model, optimizer, train_set, batch_size=32, epochs=8, speeds=[0.05, 0.02],
        progress=False, save_path=sys.argv[1] or None,
    ) as session:
        for x, y in session:
            session.step(torch.nn.functional.cross_entropy(model(x), y))
"""


def _session_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[3])  # after state, ppid, pgrp: the session id


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and _session_of(pid) == sid:
            found.append(pid)
    return found


def kill_session(sid: int) -> None:
    """SIGKILL every live process of session ``sid`` (one may end meanwhile)."""
    for pid in session_pids(sid):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_session_gone(sid: int) -> None:
    """Until no process of session ``sid`` is left (the fork server's exit takes a moment)."""
    deadline = time.monotonic() + ORPHANS_GONE_WITHIN_S
    while session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for a condition, with a deadline
    left = session_pids(sid)
    assert not left, [command_line(pid) for pid in left]


def command_line(pid: int) -> str:
    with suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    return "(gone)"


@contextmanager
def session(
    args: list[str], tmp_path: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """Start ``args`` in a new session (with ``env`` added to the environment); kill
    whatever of it is left afterwards."""
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen(
        args, start_new_session=True, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
    )  # fmt: skip
    try:
        yield proc
    finally:
        kill_session(proc.pid)
        proc.kill()
        proc.communicate(timeout=30)


def wait_mid_run(proc: subprocess.Popen[str], tmp_path: Path) -> None:
    """Until some run dir under ``tmp_path`` has a timeline with an ``EpochEnd``."""
    deadline = time.monotonic() + MID_RUN_WITHIN_S
    while time.monotonic() < deadline:
        for timeline in tmp_path.glob("**/timeline.jsonl"):
            if '"EpochEnd"' in timeline.read_text():
                return
        assert proc.poll() is None, "the run ended before it was interrupted"
        time.sleep(0.05)  # polling for a condition, with a deadline
    raise AssertionError("the run never finished an epoch")


def wait_exit(proc: subprocess.Popen[str], within_s: float) -> tuple[int, str, str]:
    started = time.monotonic()
    out, err = proc.communicate(timeout=within_s + 30)
    took = time.monotonic() - started
    assert took < within_s, f"took {took:.1f} s to exit:\n{err[-3000:]}"
    return proc.returncode, out, err


def only_line(err: str) -> str:
    """The one line a stopped run printed (the test fails showing them all if not one)."""
    lines = elche_lines(err)
    assert len(lines) == 1, "\n".join(lines)
    return lines[0]


def elche_lines(err: str) -> list[str]:
    """What was printed on stderr, but for where the run's files are (its directory at
    the start, its report at the end) and how to join it (at the start)."""
    where = ("elche: run directory ", "elche: report at ", "elche: join with ")
    return [line for line in err.splitlines() if line.strip() and not line.startswith(where)]


def demo_args(save: Path, epochs: int = 8) -> list[str]:
    return [
        sys.executable, "-m", "elche.cli", "demo", "--speeds", "0.05,0.02", "--epochs", str(epochs),
        "--no-progress", "--save-path", str(save),
    ]  # fmt: skip


# One handler takes both signals: each launcher gets one of them (the suite's time).
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130)])
def test_issue12_item12_a_signal_to_elche_demos_group_saves_a_bundle_and_exits_quietly(
    tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    save = tmp_path / "bundle"
    with session(demo_args(save, epochs=3), tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        os.killpg(proc.pid, sig)  # Ctrl-C reaches every process of the group
        returncode, _, err = wait_exit(proc, STOP_WITHIN_S)
    assert returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    line = only_line(err)
    assert str(save) in line
    assert Path(f"{save}.meta.json").exists()
    if sig is not signal.SIGINT:
        return
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[:2] == ["elche", "demo"]
    resumed = subprocess.run(  # the command said, its ranks unpaced (the suite's time)
        [sys.executable, "-m", "elche.cli", *command[1:], "--speeds", "1,1", "--json"],
        capture_output=True, text=True, timeout=240, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.splitlines()[-1])
    assert summary["outcome"] == "completed"
    assert summary["lost_samples"] == 0
    assert summary["epochs_completed"] == 3


@pytest.mark.parametrize("launcher", ["demo", "run"])
def test_issue12_item12_kill_9_of_the_launcher_leaves_no_elche_process(
    tmp_path: Path, launcher: str
) -> None:
    save = tmp_path / "bundle"
    # Long enough that it would train on for far longer than the bound.
    if launcher == "demo":
        args = demo_args(save, epochs=40)
    else:
        script = tmp_path / "train.py"
        script.write_text(RUN_SCRIPT.replace("epochs=8", "epochs=40"))
        args = [sys.executable, "-m", "elche.cli", "run", "--nproc", "2", str(script), str(save)]
    with session(args, tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        # demo: launcher, coordinator, fork server, ranks; run: launcher, ranks, coordinator
        assert len(session_pids(proc.pid)) >= 4
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + ORPHANS_GONE_WITHIN_S
        while session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for a condition, with a deadline
        left = session_pids(proc.pid)
        assert not left, [command_line(pid) for pid in left]
    # The coordinator (or rank 0) saw its launcher go and had the ranks save a bundle.
    assert Path(f"{save}.meta.json").exists()


# One rank trains in the script's own process. Its pace is 1/speed of the step it measured
# alone, and a loaded machine can make that measurement far too long (0.05: a 70 s epoch
# beside other tests), so it runs nearer full speed and for more epochs.
@pytest.mark.parametrize(("speeds", "epochs"), [("[0.05, 0.02]", "8"), ("[0.5]", "40")])
def test_issue12_item12_ctrl_c_in_a_script_raises_interrupted_with_the_bundle(
    tmp_path: Path, speeds: str, epochs: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("FINAL_HOOK", "None").replace("[0.05, 0.02]", speeds))
    save = tmp_path / "bundle"
    with session([sys.executable, str(script), str(save), epochs], tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        os.killpg(proc.pid, signal.SIGINT)
        returncode, out, err = wait_exit(proc, STOP_WITHIN_S)
    assert returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert f"STOPPED Interrupted bundle={save} code=130" in out
    line = only_line(err)
    assert f"resume_from={str(save)!r}" in line
    assert Path(f"{save}.meta.json").exists()


THREAD_SCRIPT = """
import sys, threading
import elche
from elche.workloads import digits

def train():
    train_set, _ = digits.load_digits_split(seed=0)
    try:
        result = elche.train(
            digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
            batch_size=32, epochs=int(sys.argv[2]), speeds=SPEEDS, progress=False,
            save_path=sys.argv[1],
        )
    except KeyboardInterrupt as stop:
        print(f"STOPPED {type(stop).__name__} bundle={stop.bundle} code={stop.code}", flush=True)
        raise
    print(f"COMPLETED {result.summary['outcome']}", flush=True)

if __name__ == "__main__":
    trainer = threading.Thread(target=train)
    trainer.start()
    trainer.join()  # Ctrl-C: a KeyboardInterrupt here, on the main thread
"""


# As the test above, with one rank and with two (a local run's launcher on the thread).
@pytest.mark.parametrize(("speeds", "epochs"), [("[0.05, 0.02]", "8"), ("[0.5]", "40")])
def test_ctrl_c_while_elche_train_runs_on_another_thread_saves_the_run(
    tmp_path: Path, speeds: str, epochs: str
) -> None:
    # The main thread's KeyboardInterrupt ended the script's own code, and the
    # interpreter then waited for the thread: the run trained on, unseen, to its end,
    # its result going nowhere.
    script = tmp_path / "train.py"
    script.write_text(THREAD_SCRIPT.replace("SPEEDS", speeds))
    save = tmp_path / "bundle"
    with session([sys.executable, str(script), str(save), epochs], tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        os.killpg(proc.pid, signal.SIGINT)
        returncode, out, err = wait_exit(proc, STOP_WITHIN_S)
    assert returncode == -signal.SIGINT, err[-3000:]  # the main thread's KeyboardInterrupt
    assert "COMPLETED" not in out, out
    assert f"STOPPED Interrupted bundle={save} code=130" in out, out + err[-3000:]
    # The thread that Interrupted ends ends quietly, as SystemExit ends one (it printed
    # "Exception in thread" and a traceback); beside the main thread's traceback, the line:
    assert "Exception in thread" not in err, err[-3000:]
    said = [line for line in elche_lines(err) if line.startswith("elche: ")]
    assert said == [
        f"elche: interrupted by SIGINT; the run is saved under {save}; resume with: "
        f"resume_from={str(save)!r}"
    ], err[-3000:]
    assert Path(f"{save}.meta.json").exists()


FULL_DISK_SCRIPT = """
import os, signal, sys
import elche
from elche.workloads import digits

def fill_then_interrupt(entry):  # the first epoch ended: the run dir's disk fills, then Ctrl-C
    if entry["epoch"] == 0:
        with open(sys.argv[1] + "/ballast", "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(bytes(65536))
            except OSError:
                pass
        os.kill(os.getpid(), signal.SIGINT)

if __name__ == "__main__":
    train_set, _ = digits.load_digits_split(seed=0)
    elche.train(
        digits.make_model, digits.make_optimizer, digits.step_fn, train_set, batch_size=32,
        epochs=8, speeds=[0.05, 0.02], progress=False, run_dir=sys.argv[1] + "/run",
        metrics_fn=fill_then_interrupt,
    )
"""


def test_ctrl_c_on_a_full_disk_says_why_nothing_was_saved(tmp_path: Path) -> None:
    # The coordinator could write no summary, and the launcher said the run that had
    # trained an epoch was "interrupted by SIGINT before the run formed".
    script = tmp_path / "train.py"
    script.write_text(FULL_DISK_SCRIPT)
    with small_disk(tmp_path / "disk", "1m") as disk:
        with session([sys.executable, str(script), str(disk)], tmp_path) as proc:
            returncode, _, err = wait_exit(proc, MID_RUN_WITHIN_S)
        said = [line for line in elche_lines(err) if line.startswith("elche: ")]
    assert returncode == 130, err[-3000:]
    assert said[-1] == (
        "elche: interrupted by SIGINT; nothing could be saved: the coordinator could not "
        f"write in the run directory {disk}/run"
    ), err[-3000:]


PIDS_SCRIPT = """
import os, sys
from pathlib import Path
import elche
from elche.workloads import digits

def step(model, batch):  # each rank says its pid, for the test to signal one
    said = Path(sys.argv[1]) / f"pid{os.environ['ELCHE_RANK']}"
    if not said.exists():
        said.write_text(str(os.getpid()))
    return digits.step_fn(model, batch)

if __name__ == "__main__":
    train_set, _ = digits.load_digits_split(seed=0)
    result = elche.train(
        digits.make_model, digits.make_optimizer, step, train_set, batch_size=32, epochs=8,
        speeds=[0.05, 0.05, 0.02], heartbeat_timeout_s=30.0, progress=False,
        run_dir=sys.argv[1] + ("/resumed" if sys.argv[2:] else "/run"),
        resume_from=sys.argv[2] if sys.argv[2:] else None,
    )
    print(f"RETURNED {result.summary['outcome']}", flush=True)
"""


def test_a_sigterm_to_one_rank_of_a_local_run_alone_stops_that_rank(tmp_path: Path) -> None:
    # A local run's ranks ignored every stop signal: one sent SIGTERM by itself (`kill
    # PID`, a scheduler) trained on, as if nothing had come. Now it leaves the run as
    # a lost rank does, and the run goes on without it, each sample trained once.
    (tmp_path / "train.py").write_text(PIDS_SCRIPT)
    with session([sys.executable, "train.py", str(tmp_path)], tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        os.kill(int((tmp_path / "pid2").read_text()), signal.SIGTERM)
        returncode, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    assert returncode == 0, err[-3000:]
    assert "RETURNED completed" in out, out + err[-3000:]
    assert "elche rank 2: SIGTERM came to this rank alone: it leaves the run" in err, err[-3000:]
    timeline = (tmp_path / "run" / "timeline.jsonl").read_text()
    assert '"kind":"RankLost","rank":2,"reason":"process ended (killed by signal 15)"' in timeline
    num_samples = len(digits.load_digits_split(seed=0)[0])
    assert audit_spans([tmp_path / "run"], epochs=8, num_samples=num_samples) == (0, 0)


def _parent_of(pid: int) -> int | None:
    state = process_state(pid)
    return None if state is None else state[1]


def test_a_local_run_whose_fork_server_is_killed_trains_on(tmp_path: Path) -> None:
    # The launcher learns its ranks' and coordinator's ends from the fork server: killed
    # (the OOM killer, a stray kill), it read as every one's death. The launcher started
    # a second coordinator beside the first, and the run failed with no rank left to
    # write the model, though every rank trained on.
    (tmp_path / "train.py").write_text(PIDS_SCRIPT)
    with session([sys.executable, "train.py", str(tmp_path)], tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        ours = [
            pid for pid in session_pids(proc.pid) if (process_state(pid) or "-0")[1] == proc.pid
        ]
        servers = [pid for pid in ours if "forkserver" in command_line(pid)]
        assert len(servers) == 1, [command_line(pid) for pid in session_pids(proc.pid)]
        os.kill(servers[0], signal.SIGKILL)
        returncode, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    assert returncode == 0, err[-3000:]
    assert "RETURNED completed" in out, out + err[-3000:]
    assert "process ended" not in err and "coordinator" not in err, err[-3000:]
    timeline = (tmp_path / "run" / "timeline.jsonl").read_text()
    assert '"RankLost"' not in timeline
    num_samples = len(digits.load_digits_split(seed=0)[0])
    assert audit_spans([tmp_path / "run"], epochs=8, num_samples=num_samples) == (0, 0)


def signal_every_process(launcher: int, sig: signal.Signals) -> None:
    """Send ``sig`` to every process of ``launcher``'s session at once, the launcher
    last, as systemd stopping a service, Slurm's ``scancel`` or ``pkill -f`` do."""
    pids = [pid for pid in session_pids(launcher) if pid != launcher]
    for pid in [*pids, launcher]:
        with suppress(ProcessLookupError):
            os.kill(pid, sig)


STUCK_HOOK_SCRIPT = PIDS_SCRIPT.replace(
    "speeds=[0.05, 0.05, 0.02],", "speeds=[0.05, 0.05, 0.02], metrics_fn=stuck,"
).replace(
    "if __name__",
    """
import ctypes, ctypes.util, threading, time

def stuck(entry):  # the first epoch's hook stays 4 s in one C call that signals do not end
    if entry["epoch"] != 0:
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    mutex = ctypes.create_string_buffer(64)  # zeroed: an unlocked mutex (glibc)
    holder = threading.Thread(target=libc.pthread_mutex_lock, args=(mutex,))
    holder.start()
    holder.join()
    until = (ctypes.c_long * 2)(int(time.time()) + 4, 0)  # a struct timespec
    (Path(sys.argv[1]) / "stuck").write_text("in the C call")
    libc.pthread_mutex_timedlock(mutex, until)

if __name__""",
)


def test_a_sigterm_to_every_process_of_a_local_run_saves_the_run_even_in_a_long_c_call(
    tmp_path: Path,
) -> None:
    # A stop signal to each rank alone makes that rank leave the run: one sent to every
    # process at once (systemd's KillMode=control-group, scancel, pkill -f train.py)
    # made every rank leave, and the run, with no rank left, was lost. Now a rank waits
    # for its launcher's mark: the launcher got the signal too, so the run is stopped
    # and saved as a SIGTERM to the launcher alone saves it. The launcher marked the
    # stop in its Python handler, which waits for the main thread to come back to
    # Python: a hook inside one long C call (a tensor operation) held the mark past the
    # ranks' grace, and every rank left again. Now the mark is written as the signal
    # comes, so the signal here comes while the hook is in such a call.
    (tmp_path / "train.py").write_text(STUCK_HOOK_SCRIPT)
    with session([sys.executable, "train.py", str(tmp_path)], tmp_path) as proc:
        deadline = time.monotonic() + MID_RUN_WITHIN_S
        while not (tmp_path / "stuck").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
            time.sleep(0.05)  # polling for a condition, with a deadline
        signal_every_process(proc.pid, signal.SIGTERM)
        returncode, _, err = wait_exit(proc, STOP_WITHIN_S)
    assert returncode == 143, err[-3000:]
    assert "came to this rank alone" not in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    found = re.search(r"interrupted by SIGTERM; the run is saved under (\S+);", only_line(err))
    assert found is not None, err[-3000:]
    (tmp_path / "resume.py").write_text(PIDS_SCRIPT)  # the same run, its hook left out
    with session([sys.executable, "resume.py", str(tmp_path), found.group(1)], tmp_path) as proc:
        returncode, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    assert returncode == 0, err[-3000:]
    assert "RETURNED completed" in out, out + err[-3000:]


# Makes the terminal on stdin the controlling terminal of the new session, then runs the rest.
TAKE_THE_TERMINAL = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def test_a_closed_terminal_saves_the_run_and_exits_129(tmp_path: Path) -> None:
    # The script's terminal hangs up (its master side closes): the kernel sends SIGHUP to
    # the terminal's foreground process group, which holds the launcher, the fork server
    # and the ranks of a local run. It ended all three there and then, nothing saved (the
    # orphaned coordinator's ShutdownWithSave reached no rank); then the launcher's last
    # line, written to the terminal that was gone, raised EIO (exit 1).
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("FINAL_HOOK", "None"))
    save = tmp_path / "bundle"
    out_file = tmp_path / "out.txt"
    master, terminal = os.openpty()
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")
    with out_file.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", TAKE_THE_TERMINAL, sys.executable, str(script), str(save), "8"],
            stdin=terminal, stdout=out, stderr=terminal, start_new_session=True, env=env,
            cwd=tmp_path,
        )  # fmt: skip
    os.close(terminal)
    shown = threading.Event()  # set: the terminal stops showing what the run prints
    reader = threading.Thread(target=show_terminal, args=(master, shown), daemon=True)
    reader.start()
    try:
        wait_mid_run(proc, tmp_path)  # type: ignore[arg-type]  # it polls the process only
        shown.set()
        reader.join()
        os.close(master)  # the terminal closes
        returncode = proc.wait(timeout=STOP_WITHIN_S + 30)
        wait_session_gone(proc.pid)
    finally:
        kill_session(proc.pid)
    assert returncode == 129, out_file.read_text()
    assert f"STOPPED Interrupted bundle={save} code=129" in out_file.read_text()
    assert Path(f"{save}.meta.json").exists()


def show_terminal(master: int, shown: threading.Event) -> None:
    """Read what a terminal shows (its writers would block on a full one) until ``shown``."""
    while not shown.is_set():
        if select.select([master], [], [], 0.05)[0]:
            with suppress(OSError):
                os.read(master, 65536)


# Imported by every Python process of the test's run: holds the fork server as it starts,
# before it imports anything of its own, where a stop signal still ends it (SIG_DFL).
HOLD_FORK_SERVER = """
import os, signal, time
from pathlib import Path

if b"multiprocessing.forkserver" in Path("/proc/self/cmdline").read_bytes():
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a server that Ctrl-C ends, as before it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # started with it blocked
    Path(os.environ["ELCHE_TEST_HELD"]).touch()
    time.sleep(60)  # held until the test's signal ends it
"""


def test_ctrl_c_while_the_fork_server_starts_says_nothing_was_saved(tmp_path: Path) -> None:
    # The first run of a process starts the fork server in the launcher's process group;
    # until it imports elche.runtime.forkserved it dies of Ctrl-C, and the launcher, which
    # waited for it to fork the coordinator, ended in an EOFError traceback (exit 1).
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(HOLD_FORK_SERVER)
    held = tmp_path / "held"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("FINAL_HOOK", "None"))
    path = os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")])
    env = {"PYTHONPATH": path, "ELCHE_TEST_HELD": str(held)}
    with session([sys.executable, str(script), str(tmp_path / "b"), "8"], tmp_path, env) as proc:
        deadline = time.monotonic() + MID_RUN_WITHIN_S
        while not held.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for a condition, with a deadline
        assert held.exists(), "the fork server never started"
        os.killpg(proc.pid, signal.SIGINT)
        returncode, out, err = wait_exit(proc, STOP_WITHIN_S)
    assert returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "STOPPED Interrupted bundle=None code=130" in out
    assert only_line(err) == "elche: interrupted by SIGINT before the run formed; nothing was saved"


SIGNAL_THE_STARTING_FORK_SERVER = """
import os, signal, sys, time
from multiprocessing import forkserver
from elche.runtime.launch import rank_context

rank_context()
forkserver.ensure_running()  # (started already, where rank_context starts it)
pid = forkserver._forkserver._forkserver_pid
os.kill(pid, signal.SIGINT)  # while it imports its preloads
time.sleep(1.0)
ended, status = os.waitpid(pid, os.WNOHANG)
if not ended:
    os.kill(pid, signal.SIGKILL)  # (not to import torch for nothing)
print("ended" if ended else "alive")
"""


def test_a_signal_while_the_fork_server_imports_does_not_end_it() -> None:
    # Ctrl-C in the second or two before the fork server ignored it ended the server in
    # a KeyboardInterrupt traceback, in the middle of an elche demo's start-up.
    done = subprocess.run(
        [sys.executable, "-c", SIGNAL_THE_STARTING_FORK_SERVER],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == "alive", done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_issue12_item12_a_run_that_finished_before_ctrl_c_is_returned(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("FINAL_HOOK", "interrupt_at_the_end").replace(
        "import elche\n", "import elche\n" + SELF_INTERRUPT, 1
    ))  # fmt: skip
    with session([sys.executable, str(script), str(tmp_path / "bundle"), "2"], tmp_path) as proc:
        returncode, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    assert returncode == 0, err[-3000:]
    assert "COMPLETED completed model=True" in out, out + err[-3000:]
    assert "Traceback" not in err


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143)])
@pytest.mark.parametrize(
    ("loop", "save_path"),
    [("train", True), ("session", False)],  # (no path: the default's)
)
def test_issue12_item12_a_signal_to_elche_runs_group_saves_a_bundle_and_exits_quietly(
    tmp_path: Path, sig: signal.Signals, code: int, loop: str, save_path: bool
) -> None:
    script = tmp_path / "train.py"
    script.write_text(RUN_SCRIPT if loop == "train" else SESSION_RUN_SCRIPT)
    given = str(tmp_path / "bundle") if save_path else ""  # else RUN_DIR/checkpoint
    args = [sys.executable, "-m", "elche.cli", "run", "--nproc", "2", str(script), given]
    with session(args, tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        if loop == "train" and save_path:
            # As ``timeout`` stops it: the signal to its child, then to the child's whole
            # group. The launcher took the second as a second Ctrl-C: it killed the ranks
            # mid-save, with a traceback, whenever its handler ran between the two.
            os.kill(proc.pid, sig)
        os.killpg(proc.pid, sig)
        returncode, _, err = wait_exit(proc, STOP_WITHIN_S)
    assert returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    line = only_line(err)
    found = re.search(r"the run is saved under (\S+);", line)
    assert found is not None, line  # not 'nothing was saved': the ranks saved it
    save = found.group(1)
    assert save == given if save_path else save.endswith("/checkpoint")
    assert f"resume_from={save!r}" in line
    assert Path(f"{save}.meta.json").exists()


TORCHRUN_SCRIPT = """
import os, sys
import elche
from elche.workloads import digits

if __name__ == "__main__":
    train_set, _ = digits.load_digits_split(seed=0)
    try:
        elche.train(
            digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
            batch_size=32, epochs=40, speeds=[1.0, 0.1], heartbeat_timeout_s=2.0,
            progress=False, save_path=sys.argv[1],
        )
    except KeyboardInterrupt as stop:
        print(f"INTERRUPTED {os.environ['RANK']} {stop.code}", flush=True)
        raise
"""


def worker_of(agent: int, rank: int) -> int | None:
    """The pid of the torchrun worker process (a child of ``agent``) of ``rank``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with suppress(OSError, IndexError, ValueError):
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
            if parent == agent and f"RANK={rank}".encode() in environ:
                return int(entry.name)
    return None


def test_issue12_item12_under_torchrun_a_killed_worker_leaves_a_resumable_bundle(
    tmp_path: Path,
) -> None:
    # A rank's training process that dies is survived under torchrun (see
    # test_launchers_with_faults); its *worker* process dying makes torchrun's
    # agent SIGTERM every survivor (docs/failure-modes.md): they save first. The run
    # is long (40 epochs, ended by the SIGTERM) so that the survivor, training at full
    # speed, cannot finish it on a busy machine before the agent's signal comes.
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    save = tmp_path / "bundle"
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
    ]
    with session([*args, str(save)], tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        worker = worker_of(proc.pid, 1)
        assert worker is not None, "no torchrun worker of rank 1"
        os.kill(worker, signal.SIGKILL)
        _, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    assert sorted(line for line in out.splitlines() if line.startswith("INTERRUPTED")) == [
        "INTERRUPTED 0 143",  # two ranks: the survivor (the suite's budget)
    ], err[-3000:]
    # The one traceback is the agent's own (ChildFailedError); none from elche.
    assert not re.search(r'File ".*/elche/', err), err[-3000:]
    assert Path(f"{save}.meta.json").exists()


# The session's leader starts the launcher in a process group of its own and waits: a
# terminal's job (a group whose parent is in the session), not an orphaned group, which
# the kernel's Ctrl-Z would not stop at all.
AS_A_JOB = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:], process_group=0))"


@pytest.mark.parametrize("launcher", ["elche run", "elche.train"])
def test_ctrl_z_stops_the_launcher_alone_and_says_that_the_run_trains_on(
    tmp_path: Path, launcher: str
) -> None:
    # The ranks and the coordinator run in process groups of their own (the stop signals
    # are the launcher's to order): Ctrl-Z stopped the launcher, the shell said "Stopped",
    # and the run trained on, unsaid.
    script = tmp_path / "train.py"
    if launcher == "elche run":
        script.write_text(RUN_SCRIPT)
        args = [sys.executable, "-m", "elche.cli", "run", "--nproc", "2", str(script), ""]
    else:
        script.write_text(SCRIPT.replace("FINAL_HOOK", "None"))
        args = [sys.executable, str(script), str(tmp_path / "bundle"), "8"]
    with session([sys.executable, "-c", AS_A_JOB, *args], tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        (job,) = [pid for pid in session_pids(proc.pid) if _parent_of(pid) == proc.pid]
        (timeline,) = tmp_path.glob("**/timeline.jsonl")
        os.killpg(job, signal.SIGTSTP)  # Ctrl-Z: the terminal's foreground group
        deadline = time.monotonic() + MID_RUN_WITHIN_S
        while (process_state(job) or "-")[0] != "T":
            assert time.monotonic() < deadline, "the launcher was not stopped"
            time.sleep(0.02)  # polling for a condition, with a deadline
        trained = len(timeline.read_text())
        while len(timeline.read_text()) == trained:  # the run trains on meanwhile
            assert time.monotonic() < deadline and proc.poll() is None, "the run stopped"
            time.sleep(0.05)  # polling for a condition, with a deadline
        assert (process_state(job) or "-")[0] == "T"
        os.killpg(job, signal.SIGCONT)  # the shell's fg
        returncode, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    assert returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    said = [line for line in elche_lines(err) if "Ctrl-Z" in line]
    assert said == [CTRL_Z_LINE], err[-3000:]
    if launcher == "elche.train":
        assert "COMPLETED completed model=True" in out, out + err[-3000:]
