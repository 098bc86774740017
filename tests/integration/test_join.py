"""``elche join``: a fourth process joins a running three-rank run of the same script."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from elche.workloads import digits

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("join_script.py")
EPOCHS = 6  # the ranks wait at epoch 2's start until rank 3 joined (join_script.py)
JOIN_LINE = re.compile(
    r"elche: join with ELCHE_SECRET=\$\(cat (?P<secret>\S+)\) elche join (?P<address>tcp://\S+) "
    r"--store-port (?P<port>\d+) "
)


def _lines(stream: object, into: queue.Queue[str]) -> None:
    with contextlib.suppress(ValueError):  # the test's communicate() closed it: done
        for line in stream:  # type: ignore[attr-defined]  # a text pipe
            into.put(line)


def _result(output: str) -> dict[str, object]:
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, output
    return json.loads(lines[0].removeprefix("RESULT "))  # type: ignore[no-any-return]  # JSON


@contextlib.contextmanager
def _run_and_join(
    tmp_path: Path,
    run_dir: Path,
    *,
    new_session: bool = False,
    before: Callable[[re.Match[str], dict[str, str]], None] | None = None,
) -> Iterator[tuple[subprocess.Popen[str], subprocess.Popen[str], list[str]]]:
    """Start the three-rank run, read its join line, call ``before`` (the line and the
    joiner's environment), start the joiner; both, and the run's stderr lines so far.
    Whichever is still running afterwards is killed."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", JOIN_SCRIPT_RUN_DIR=str(run_dir))
    env.pop("ELCHE_SECRET", None)  # the run generates its secret: the join line says where
    run = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(EPOCHS)], env=env, cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    errors: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(run.stderr, errors), daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 120
    match = None
    try:
        while match is None and time.monotonic() < deadline:  # the run's join line
            line = errors.get(timeout=max(deadline - time.monotonic(), 0.1))
            seen.append(line)
            match = JOIN_LINE.search(line)
        assert match is not None, "".join(seen)
        secret = Path(match["secret"]).read_text(encoding="utf-8")
        assert oct(Path(match["secret"]).stat().st_mode & 0o777) == "0o600"
        if before is not None:
            before(match, dict(env, ELCHE_SECRET=secret))
        joiner = subprocess.Popen(
            [sys.executable, "-m", "elche.cli", "join", match["address"], "--store-port",
             match["port"], "--speed", "0.1", str(SCRIPT), str(EPOCHS)],
            env=dict(env, ELCHE_SECRET=secret), cwd=tmp_path, start_new_session=new_session,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    except BaseException:
        run.kill()
        run.wait()
        raise
    try:
        yield run, joiner, seen
    finally:
        for proc in (run, joiner):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _wait_joined(run_dir: Path, *, trained: bool = False) -> None:
    """Until the run's timeline says rank 3 joined (``trained``: and trained a window,
    so its group has formed), with a deadline.

    A member lost while its group forms holds the others in torch's rendezvous until
    its timeout (``elche.runtime.groups``): a minute of the suite's time."""
    timeline = run_dir / "timeline.jsonl"
    said = '"kind":"RankWindow","rank":3,' if trained else '"kind":"RankJoined","rank":3,'
    deadline = time.monotonic() + 120
    while not (timeline.exists() and said in timeline.read_text()):
        assert time.monotonic() < deadline, "the joiner never joined"
        time.sleep(0.05)  # polling the run's timeline, with a deadline


def test_a_rank_joins_a_running_run_and_trains_a_share_and_wrong_joins_take_no_slot(
    tmp_path: Path,
) -> None:
    # One run: two joins that name the wrong secret, then the wrong port, are refused
    # by name, and the right one after them joins as rank 3 and trains a share. The
    # wrong two were found by the coordinator's silence alone: the joiner said after
    # 10 s that it had lost the coordinator, and the slot it took stayed taken.
    tried: list[subprocess.CompletedProcess[str]] = []

    def wrong_joins(match: re.Match[str], env: dict[str, str]) -> None:
        host, _, port = match["address"].rpartition(":")
        for address, secret in ((match["address"], "ab" * 32), (f"{host}:{int(port) + 1}", None)):
            tried.append(subprocess.run(
                [sys.executable, "-m", "elche.cli", "join", address, "--store-port",
                 match["port"], str(SCRIPT), str(EPOCHS)],
                env=dict(env, ELCHE_SECRET=secret or env["ELCHE_SECRET"]), cwd=tmp_path,
                capture_output=True, text=True, timeout=120, check=False,
            ))  # fmt: skip

    run_dir = tmp_path / "run"
    with _run_and_join(tmp_path, run_dir, before=wrong_joins) as (run, joiner, seen):
        joined_out, joined_err = joiner.communicate(timeout=240)
        run_out, _ = run.communicate(timeout=60)
    wrong_secret, wrong_port = tried
    assert wrong_secret.returncode != 0
    assert "ConfigError: ELCHE_SECRET: is not the secret of the run at" in wrong_secret.stderr, (
        wrong_secret.stderr
    )
    assert wrong_port.returncode != 0
    assert "ConfigError: address: the run's coordinator listens at port" in wrong_port.stderr, (
        wrong_port.stderr
    )
    assert joiner.returncode == 0, joined_err
    assert "as rank 3" in joined_err, joined_err  # neither wrong join took a slot
    assert run.returncode == 0, "".join(seen)
    summary = _result(run_out)
    assert summary["outcome"] == "completed", "".join(seen) + str(summary)
    assert summary["lost_samples"] == 0
    assert summary["epochs_completed"] == EPOCHS
    assert summary["joined_ranks"] == [3]
    rows = {row["rank"]: row for row in summary["per_rank"]}  # type: ignore[attr-defined]
    assert sorted(rows) == [0, 1, 2, 3]
    # The joiner came in at epoch 2: it trained a share of the epochs after it,
    # and every sample was trained once (lost 0 above). How large a share
    # depends on the pace the busy machine gives each process, so no bound
    # on its size beyond what it could have trained.
    train_set, _ = digits.load_digits_split(seed=0)
    assert 0 < rows[3]["samples"] <= (EPOCHS - 2) * len(train_set)
    assert sum(row["samples"] for row in rows.values()) == EPOCHS * len(train_set)
    own = _result(joined_out)
    assert own["joined_as"] == 3 and own["stopped"] == "completed"


@pytest.mark.parametrize("stop", ["ctrl-c", "elche join killed"])
def test_a_joined_rank_stopped_leaves_in_one_line_and_the_run_goes_on(
    stop: str, tmp_path: Path
) -> None:
    # The joined rank had no stop handling: Ctrl-C raised KeyboardInterrupt in its step,
    # printed two tracebacks, and it went on closing its socket meanwhile. And elche
    # join's child is a plain child: with its launcher SIGKILLed, it trained on in the
    # run, its output going nowhere, until the run ended.
    run_dir = tmp_path / "run"
    with _run_and_join(tmp_path, run_dir, new_session=True) as (run, joiner, seen):
        _wait_joined(run_dir, trained=True)
        if stop == "ctrl-c":
            os.killpg(joiner.pid, signal.SIGINT)  # Ctrl-C in the joiner's terminal
        else:
            os.kill(joiner.pid, signal.SIGKILL)
        _, joined_err = joiner.communicate(timeout=60)  # (the rank shares its stderr)
        run_out, _ = run.communicate(timeout=240)
    if stop == "ctrl-c":
        assert joiner.returncode == 130, joined_err
        said = "elche rank 3: stopped by SIGINT; the run goes on without this joined rank"
    else:
        said = f"elche rank 3: elche join (pid {joiner.pid}) is gone; the run goes on"
    assert said in joined_err, joined_err
    assert "Traceback" not in joined_err, joined_err
    summary = _result(run_out)
    assert summary["outcome"] == "completed", "".join(seen) + str(summary)
    assert summary["lost_samples"] == 0 and summary["dead_ranks"] == [3]


def test_a_joined_rank_that_hangs_is_killed_by_elche_join_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    # SIGSTOPped mid-run (as a deadlock or a stuck driver would hang it): the run declared
    # it lost and completed without it, and elche join then waited for its process for good.
    run_dir = tmp_path / "run"
    stopped: list[int] = []
    try:
        with _run_and_join(tmp_path, run_dir) as (run, joiner, seen):
            _wait_joined(run_dir, trained=True)
            stopped += _children(joiner.pid)
            assert len(stopped) == 1, stopped  # the joined rank's process
            os.kill(stopped[0], signal.SIGSTOP)
            _, joined_err = joiner.communicate(timeout=120)
            run_out, _ = run.communicate(timeout=240)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert joiner.returncode == 128 + signal.SIGKILL, joined_err
    said = (
        r"^elche join: rank 3 hung: the run declared it lost \(heartbeat stale: silent for "
        r"[\d.]+ s\), and elche join killed it$"
    )
    assert re.search(said, joined_err, re.MULTILINE), joined_err
    summary = _result(run_out)
    assert summary["outcome"] == "completed", "".join(seen) + str(summary)
    assert summary["lost_samples"] == 0 and summary["dead_ranks"] == [3]


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def test_a_join_to_a_run_that_has_ended_says_so_at_once(tmp_path: Path) -> None:
    # torch's client retried the refused store for 150 s, then raised its own traceback.
    with socket.socket() as probe:  # a port nothing listens on: the run is gone
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", ELCHE_SECRET="ab" * 32)
    done = subprocess.run(
        [sys.executable, "-m", "elche.cli", "join", f"tcp://127.0.0.1:{port}", "--store-port",
         str(port), str(SCRIPT), str(EPOCHS)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    said = (
        f"ConfigError: join: no run answers at tcp://127.0.0.1:{port} (group store port {port}): "
        "it has ended, or this host cannot reach it"
    )
    assert said in done.stderr, done.stderr


def test_a_joined_rank_of_a_run_stopped_by_a_signal_says_where_the_run_is_saved(
    tmp_path: Path,
) -> None:
    # It returned normally (exit 0, as if the run had completed), naming no bundle,
    # where every rank of the run raised Interrupted with it.
    run_dir = tmp_path / "run"
    with _run_and_join(tmp_path, run_dir) as (run, joiner, seen):
        _wait_joined(run_dir, trained=True)
        run.send_signal(signal.SIGTERM)  # the run's own launcher stops it, and saves
        _, joined_err = joiner.communicate(timeout=120)
        run.communicate(timeout=120)
    assert run.returncode == 143, "".join(seen)
    stem = run_dir / "checkpoint"
    assert Path(f"{stem}.meta.json").exists()
    assert joiner.returncode == 143, joined_err
    assert (
        f"elche rank 3: the run stopped (graceful_shutdown) and is saved under {stem} on its "
        "own host; this joined rank's model is no part of it" in joined_err
    ), joined_err
    assert "Traceback" not in joined_err, joined_err
