"""A rank that hangs is killed by whatever started it, once the run no longer needs it.

Real processes: ranks SIGSTOPped mid-run (as a deadlock, a stuck driver or a
frozen process would hang them) under ``elche run``, and under torchrun: rank 0
on one host, and rank 1 on another host than the coordinator's (network
namespaces). The run declared them lost and ended without them, and then the
launcher waited for their processes for good: ``elche.train``'s own launcher
kills such a rank.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import pytest

from elche.runtime.lifetimes import process_state
from elche.testing.hosts import Rig
from tests.hosts.test_lost_host import start_torchrun, wait_for
from tests.promises.test_elche_run_stops import SCRIPT, launch
from tests.promises.test_lifetimes import (
    MID_RUN_WITHIN_S,
    command_line,
    session,
    wait_exit,
    wait_mid_run,
    worker_of,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LOST = r"the run declared it lost \(heartbeat stale: silent for [\d.]+ s\)"


def test_under_elche_run_rank_1_is_killed_at_once_and_rank_0_once_the_run_ended(
    tmp_path: Path,
) -> None:
    # Rank 0's process hosts the coordinator, which goes on without its rank.
    (tmp_path / "go").touch()
    with session(launch(tmp_path, 3, 8), tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        hung = [worker_of(proc.pid, rank) for rank in (0, 1)]
        assert None not in hung, f"rank processes not found: {hung}"
        for pid in hung:
            os.kill(pid, signal.SIGSTOP)  # type: ignore[arg-type]
        returncode, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    assert returncode == 128 + signal.SIGKILL, err[-3000:]  # a rank killed: its status
    stem = tmp_path / "bundle"
    assert re.findall(r"RETURNED \d .*", out) == [f"RETURNED 2 saved_and_shutdown {stem}"], out
    said = re.findall(r"elche run: rank \d .*", err)
    assert len(said) == 2, err[-3000:]
    assert re.fullmatch(
        rf"elche run: rank 0 hung: {LOST}, and elche run killed it once the run had ended "
        "without it",
        said[0],
    ), said
    assert re.fullmatch(rf"elche run: rank 1 hung: {LOST}, and elche run killed it", said[1]), said


def rank_process(worker: int) -> int | None:
    """The process a torchrun worker trains its rank in (its spawned child)."""
    for entry in Path("/proc").iterdir():
        pid = int(entry.name) if entry.name.isdigit() else 0
        parent = (process_state(pid) or ("-", 0))[1] if pid else 0
        if parent == worker and "multiprocessing.spawn" in command_line(pid):
            return pid
    return None


def test_under_torchrun_rank_0s_worker_kills_its_hung_rank_and_torchrun_ends(
    tmp_path: Path,
) -> None:
    # Each worker trains its rank in a child and waited for that child for good. Rank
    # 0's worker hosts the coordinator and the board it reads its own rank on (a rank
    # on another host: the next test). torchrun's workers run in sessions of their own,
    # so the stopped process is killed here whatever the test's end.
    (tmp_path / "go").touch()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    args = [*torchrun, "--nproc-per-node", "2", str(script), str(tmp_path), "8", "3.0"]
    hung: list[int] = []
    try:
        with session(args, tmp_path) as proc:
            wait_mid_run(proc, tmp_path)
            worker = worker_of(proc.pid, 0)
            child = None if worker is None else rank_process(worker)
            assert child is not None, "no process of rank 0"
            os.kill(child, signal.SIGSTOP)
            hung.append(child)
            returncode, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    finally:
        for pid in hung:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert returncode == 0, err[-3000:]  # each worker outlives its rank's process
    stem = tmp_path / "bundle"
    assert sorted(re.findall(r"RETURNED \d .*", out)) == [
        f"RETURNED {rank} saved_and_shutdown {stem}" for rank in range(2)
    ], out + err[-3000:]
    said = re.findall(r"elche: rank \d hung.*", err)
    assert len(said) == 1, err[-3000:]
    assert re.fullmatch(rf"elche: rank 0 hung: {LOST}, and its worker killed it", said[0]), said


def test_under_torchrun_a_hung_rank_on_another_host_is_killed_by_its_worker() -> None:
    # Rank 0 posts the run's declaration on its result board, which every host reads.
    procs: list[subprocess.Popen[bytes]] = []
    hung: list[int] = []
    try:
        with Rig(2) as rig:
            logs = start_torchrun(rig, "static", 8, procs=procs, hosts=2)
            path = wait_for(
                "rank 0's timeline",
                lambda: next(iter(rig.tmp(0).glob("elche-run-*/timeline.jsonl")), None),
            )
            wait_for("the first epoch", lambda: "EpochEnd" in path.read_text() or None)
            worker = wait_for("rank 1's worker", lambda: worker_of(procs[1].pid, 1))
            hung.append(wait_for("rank 1's process", lambda: rank_process(worker)))
            os.kill(hung[0], signal.SIGSTOP)
            codes = [
                wait_for(f"torchrun on h{i} to end", proc.poll) for i, proc in enumerate(procs)
            ]
            texts = [log.read_text() for log in logs]
    finally:
        for pid in hung:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert codes == [0, 0], texts[1][-3000:]
    assert re.search(rf"^elche: rank 1 hung: {LOST}, and its worker killed it$", texts[1], re.M)
    assert re.search(r"^RETURNED 0 ", texts[0], re.M), texts[0][-3000:]
