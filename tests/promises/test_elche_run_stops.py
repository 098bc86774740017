"""``elche run`` keeps the promises ``elche.train(ranks=N)`` keeps, off its tested path.

Real processes, each run in a session of its own (``test_lifetimes.session``):
a signal before the run formed, rank 0 (the coordinator's host) SIGKILLed
mid-run, a run directory that fills up mid-run, and rank 0 unable to start the
run. Each failed before its fix: the first exited 0 with an untrained model, the
second told the survivors "nothing saved" beside a committed bundle, the third
ended in a traceback from every rank and named no bundle, the fourth left the
others with gloo's "Connection closed by peer".
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

import elche
from elche.chaos import audit_spans
from elche.workloads import digits
from tests.promises.test_lifetimes import (
    MID_RUN_WITHIN_S,
    RUN_SCRIPT,
    STOP_WITHIN_S,
    elche_lines,
    only_line,
    session,
    session_pids,
    signal_every_process,
    wait_exit,
    wait_mid_run,
    worker_of,
)
from tests.promises.test_storage import fill, small_disk

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = """
import os, sys, time
from pathlib import Path
import elche
from elche.workloads import digits

GATE = Path(sys.argv[1]) / "go"
STEP = digits.step_fn

def gated_model(device):  # holds every rank before it joins, until the test opens it
    (GATE.parent / f"building{os.environ['RANK']}").touch()
    while not GATE.exists():
        time.sleep(0.02)
    return digits.make_model(device)

if __name__ == "__main__":
    train_set, _ = digits.load_digits_split(seed=0)
    rank = os.environ["RANK"]
    try:
        result = elche.train(
            gated_model, digits.make_optimizer, dataset=train_set, batch_size=32,
            epochs=int(sys.argv[2]), speeds=[0.05, 0.05, 0.02][: int(os.environ["WORLD_SIZE"])],
            heartbeat_timeout_s=float(sys.argv[3]), progress=False,
            save_path=sys.argv[1] + "/bundle", step_fn=STEP,
        )
    except KeyboardInterrupt as stop:
        print(f"STOPPED {rank} bundle={stop.bundle} code={stop.code}", flush=True)
        raise
    except RuntimeError as exc:
        print(f"RAISED {rank} {exc}", flush=True)
        raise SystemExit(1)
    print(f"RETURNED {rank} {result.summary['outcome']} {result.summary['bundle']}", flush=True)
"""

FAILS_ON_RANK0 = """
def STEP(model, batch):  # rank 0's own code fails once, mid-run: a one-off
    if os.environ["RANK"] == "0" and elche.progress().fraction > 0.3:
        raise OSError("rank 0 could not read its shard")
    return digits.step_fn(model, batch)
"""


def launch(
    tmp_path: Path, nproc: int, epochs: int, *, heartbeat_s: float = 3.0, step: str = ""
) -> list[str]:
    script = tmp_path / "train.py"
    script.write_text(
        SCRIPT.replace('if __name__ == "__main__":', step + '\nif __name__ == "__main__":')
    )
    args = [sys.executable, "-m", "elche.cli", "run", "--nproc", str(nproc), str(script)]
    return [*args, str(tmp_path), str(epochs), str(heartbeat_s)]


def wait_for(path: Path, proc: object) -> None:
    """Until ``path`` exists (the run's own file), with a deadline."""
    deadline = time.monotonic() + MID_RUN_WITHIN_S
    while not path.exists():
        assert proc.poll() is None, "the run ended first"  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)  # polling for a condition, with a deadline


def test_a_signal_before_the_run_formed_interrupts_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It used to return the untrained model from elche.train, and elche run exited 0.
    run_dir = tmp_path / "run"
    monkeypatch.setenv("ELCHE_RUN_DIR", str(run_dir))
    with session(launch(tmp_path, 2, 2), tmp_path) as proc:
        wait_for(run_dir / "coordinator.pid", proc)  # the ranks wait at the gate
        os.killpg(proc.pid, signal.SIGTERM)
        wait_for(run_dir / "summary.json", proc)  # the coordinator failed the run
        (tmp_path / "go").touch()
        # A rank that reaches the ended run late waits out its silence: no tighter bound.
        returncode, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    assert returncode == 143, err[-3000:]
    assert "RETURNED" not in out, out
    assert sorted(re.findall(r"STOPPED \d bundle=None code=143", out)) == [
        "STOPPED 0 bundle=None code=143", "STOPPED 1 bundle=None code=143",
    ], out + err[-3000:]  # fmt: skip
    said = [line for line in elche_lines(err) if line.startswith("elche: ")]
    assert said == [  # one line, the stop's (the run's failure is not said again)
        "elche: interrupted by SIGTERM; nothing could be saved: stopped before the run formed "
        "(SIGTERM)"
    ], err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def kill_rank_0_mid_run(tmp_path: Path, *, nproc: int) -> tuple[int, str, str]:
    """SIGKILL rank 0 (the coordinator's host) mid-run, at the default heartbeat timeout;
    the run's exit status, stdout and stderr."""
    (tmp_path / "go").touch()
    with session(launch(tmp_path, nproc, 8, heartbeat_s=30.0), tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        rank0 = worker_of(proc.pid, 0)
        assert rank0 is not None, "no rank 0 process"
        os.kill(rank0, signal.SIGKILL)
        returncode, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    return returncode, out, err


def test_rank_0_killed_mid_run_leaves_its_survivors_naming_the_bundle(tmp_path: Path) -> None:
    # Rank 0 hosts the coordinator: its successor-less stop saves through the others,
    # who used to say "nothing saved" beside the committed bundle. With the default
    # heartbeat timeout (30 s) nothing was saved at all: the save waited for rank 0,
    # declared lost only after the orphaned coordinator's 6 s were up. Then the
    # survivors raised Interrupted and exited 143 as if signalled, where a lone
    # survivor returned the run's result: now each returns it.
    returncode, out, err = kill_rank_0_mid_run(tmp_path, nproc=3)
    stem = str(tmp_path / "bundle")
    assert sorted(re.findall(r"RETURNED \d \S+ \S+", out)) == [
        f"RETURNED 1 saved_and_shutdown {stem}", f"RETURNED 2 saved_and_shutdown {stem}",
    ], out + err[-3000:]  # fmt: skip
    assert err.count("the run could not continue (coordinator_host_lost)") == 2, err[-3000:]
    assert f"resume_from={stem!r}" in err, err[-3000:]
    assert returncode == 128 + signal.SIGKILL, err[-3000:]  # rank 0's end, said once:
    assert re.findall(r"elche run: rank \d .*", err) == ["elche run: rank 0 was killed by SIGKILL"]
    assert Path(f"{stem}.meta.json").exists()


def test_the_survivor_of_a_killed_rank_0_returns_the_runs_saved_result(tmp_path: Path) -> None:
    # Left alone, it cannot go on (a collective needs two): it saves, and its
    # elche.train used to return an empty summary, naming no bundle.
    _, out, err = kill_rank_0_mid_run(tmp_path, nproc=2)
    stem = str(tmp_path / "bundle")
    assert f"RETURNED 1 saved_and_shutdown {stem}" in out, out + err[-3000:]
    assert f"resume_from={stem!r}" in err, err[-3000:]
    assert Path(f"{stem}.meta.json").exists()


def test_rank_0s_own_one_off_error_leaves_the_others_the_completed_run(tmp_path: Path) -> None:
    # Rank 0's process raised at once, sharing nothing: the run went on without its
    # rank and completed, and every other rank returned an empty summary.
    (tmp_path / "go").touch()
    args = launch(tmp_path, 3, 3, step=FAILS_ON_RANK0)
    with session(args, tmp_path) as proc:
        returncode, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    assert returncode == 1, err[-3000:]  # rank 0's script raised its own error, at the end
    assert "RAISED 0 rank 0 failed in epoch" in out, out + err[-3000:]
    returned = sorted(re.findall(r"RETURNED (\d) (\S+)", out))
    assert returned == [("1", "completed"), ("2", "completed")], out + err[-3000:]


def timeline_of(tmp_path: Path) -> str:
    """The run's timeline (its run dir is under ``tmp_path``, the ranks' TMPDIR)."""
    (timeline,) = tmp_path.glob("elche-run-*/timeline.jsonl")
    return timeline.read_text()


def test_a_sigterm_to_one_rank_alone_stops_that_rank_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    # Ranks take their stops from the launcher, so a rank that got SIGTERM itself
    # (`kill PID`, a scheduler) did nothing: it trained the run to its end, unsaid.
    # Now it leaves the run as a lost rank would, saying so, and elche run names it.
    out, err, timeline = _signal_rank_2_mid_run(tmp_path, signal.SIGTERM)
    assert "STOPPED" not in out, out
    assert "elche rank 2: SIGTERM came to this rank alone: it leaves the run" in err, err[-3000:]
    assert re.findall(r"elche run: rank \d .*", err) == [
        "elche run: rank 2 was stopped by SIGTERM; the run went on without it"
    ], err[-3000:]
    assert '"kind":"RankLost","rank":2,"reason":"process ended (killed by signal 15)"' in timeline
    num_samples = len(digits.load_digits_split(seed=0)[0])
    (run_dir,) = tmp_path.glob("elche-run-*")
    assert audit_spans([run_dir], epochs=8, num_samples=num_samples) == (0, 0)  # each once


def _signal_rank_2_mid_run(tmp_path: Path, signum: int) -> tuple[str, str, str]:
    """``signum`` to rank 2 of a 3-rank run mid-run: the others complete it, and elche
    run exits with that signal's status; its stdout, stderr and the run's timeline."""
    (tmp_path / "go").touch()
    with session(launch(tmp_path, 3, 8, heartbeat_s=30.0), tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        rank2 = worker_of(proc.pid, 2)
        assert rank2 is not None, "no rank 2 process"
        os.kill(rank2, signum)
        returncode, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    assert returncode == 128 + signum, err[-3000:]
    assert sorted(re.findall(r"RETURNED (\d) (\S+)", out)) == [
        ("0", "completed"), ("1", "completed"),
    ], out + err[-3000:]  # fmt: skip
    return out, err, timeline_of(tmp_path)


def test_a_sigterm_to_every_process_of_the_run_stops_the_whole_run_saved(
    tmp_path: Path,
) -> None:
    # systemd stopping a service, scancel, `pkill -f train.py`: every process gets the
    # signal at once. A rank but 0 that got it before elche run had marked its own stop
    # took it for one sent to it alone and left, saying so: the run was saved by the
    # ranks left, and elche run said each rank that left as killed by SIGTERM.
    (tmp_path / "go").touch()
    with session(launch(tmp_path, 2, 8, heartbeat_s=30.0), tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        signal_every_process(proc.pid, signal.SIGTERM)
        returncode, out, err = wait_exit(proc, STOP_WITHIN_S)
    assert returncode == 143, err[-3000:]
    save = tmp_path / "bundle"
    assert sorted(re.findall(r"STOPPED (\d) (.*)", out)) == [
        (str(rank), f"bundle={save} code=143") for rank in range(2)
    ], out + err[-3000:]
    assert "came to this rank alone" not in err, err[-3000:]
    assert f"interrupted by SIGTERM; the run is saved under {save};" in only_line(err)


def test_a_sigterm_to_rank_0_alone_stops_the_run_said_once(tmp_path: Path) -> None:
    # Rank 0 hosts the coordinator: the run stops, saved, and every rank exits 143; elche
    # run then said "rank N exited with code 143" for each rank, as if each had failed.
    (tmp_path / "train.py").write_text(RUN_SCRIPT)
    save = tmp_path / "bundle"
    args = [sys.executable, "-m", "elche.cli", "run", "--nproc", "2", "train.py", str(save)]
    with session(args, tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        rank0 = worker_of(proc.pid, 0)
        assert rank0 is not None, "no rank 0 process"
        os.kill(rank0, signal.SIGTERM)
        returncode, _, err = wait_exit(proc, STOP_WITHIN_S)
    assert returncode == 143, err[-3000:]
    assert elche_lines(err) == [
        f"elche: interrupted by SIGTERM; the run is saved under {save}; resume with: "
        f"resume_from={str(save)!r}",
        "elche run: the run stopped on a SIGTERM sent to rank 0 (the coordinator's host) "
        "alone, not to elche run",
    ], err[-3000:]


def test_ctrl_c_saves_a_run_whose_exported_run_dir_another_elche_run_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # elche run knew the run had formed by a file rank 0 made in the run dir, which
    # another elche run there removed (as a full disk, or a tmp cleaner, never let it
    # be): Ctrl-C then killed the ranks mid-save and said "before the run formed ...
    # (nothing was trained)".
    monkeypatch.setenv("ELCHE_RUN_DIR", str(tmp_path / "run"))
    (tmp_path / "train.py").write_text(RUN_SCRIPT)
    (tmp_path / "other.py").write_text("")
    save = tmp_path / "bundle"
    args = [sys.executable, "-m", "elche.cli", "run", "--nproc", "2"]
    with session([*args, "train.py", str(save)], tmp_path) as proc:
        wait_mid_run(proc, tmp_path)
        with session([*args, "other.py"], tmp_path) as other:
            assert wait_exit(other, MID_RUN_WITHIN_S)[0] == 0
        os.killpg(proc.pid, signal.SIGINT)
        returncode, _, err = wait_exit(proc, STOP_WITHIN_S)
    assert returncode == 130, err[-3000:]
    assert only_line(err) == (
        f"elche: interrupted by SIGINT; the run is saved under {save}; resume with: "
        f"resume_from={str(save)!r}"
    ), err[-3000:]


def test_a_rank_killed_before_it_joined_the_coordinator_leaves_the_others_the_run(
    tmp_path: Path,
) -> None:
    # Past torch's rendezvous, a rank building its model is not yet the coordinator's:
    # killed there (say, out of memory), the run waited out its formation timeout
    # (60 s) and failed. Now the others form it and complete it.
    with session(launch(tmp_path, 3, 2, heartbeat_s=30.0), tmp_path) as proc:
        wait_for(tmp_path / "building2", proc)  # rank 2 in its model_fn
        rank2 = worker_of(proc.pid, 2)
        assert rank2 is not None, "no rank 2 process"
        os.kill(rank2, signal.SIGKILL)
        (tmp_path / "go").touch()
        returncode, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    assert returncode == 128 + signal.SIGKILL, err[-3000:]
    assert sorted(re.findall(r"RETURNED (\d) (\S+)", out)) == [
        ("0", "completed"), ("1", "completed"),
    ], out + err[-3000:]  # fmt: skip
    assert '"lost_samples":0' in timeline_of(tmp_path)


def test_a_run_directory_that_fills_up_says_where_the_bundle_is_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each rank's report write used to raise a traceback into the user's script.
    (tmp_path / "go").touch()
    stem = str(tmp_path / "bundle")
    with small_disk(tmp_path / "disk", "1m") as disk:
        monkeypatch.setenv("ELCHE_RUN_DIR", str(disk / "run"))
        with session(launch(tmp_path, 2, 200), tmp_path) as proc:
            wait_mid_run(proc, disk)
            fill(disk)
            returncode, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    assert returncode == 1, err[-3000:]
    said = (  # it said "the coordinator exited without a summary; see …"
        f"the coordinator could not write in the run directory {disk / 'run'}; "
        f"the run's state is saved as the bundle {stem}: resume_from={stem!r}"
    )
    raised = re.findall(r"RAISED (\d) (.*)", out)
    assert sorted(rank for rank, _ in raised) == ["0", "1"], out + err[-3000:]
    assert all(said in text for _, text in raised), raised
    assert "Traceback" not in err, err[-3000:]
    assert "cannot write its report in the run directory" in err
    assert Path(f"{stem}.meta.json").exists()


SAVED_OVER_SCRIPT = """
import json, os, sys
from pathlib import Path
import elche
from elche.workloads import digits

STEM = sys.argv[1] + "/bundle"

def saved_over(device):  # rank 0's check of the bundle builds it: another run saves meanwhile
    if os.environ["RANK"] == "0" and not Path(STEM + ".saved-over").exists():
        Path(STEM + ".saved-over").touch()
        meta = json.loads(Path(STEM + ".meta.json").read_text())
        meta["save_seq"] += 1  # written whole, as a save writes it: rank 1 reads it too
        Path(STEM + ".meta.tmp").write_text(json.dumps(meta))
        os.replace(STEM + ".meta.tmp", STEM + ".meta.json")
    return digits.make_model(device)

if __name__ == "__main__":
    train_set, _ = digits.load_digits_split(seed=0)
    try:
        elche.train(
            saved_over, digits.make_optimizer, digits.step_fn, train_set, batch_size=32,
            epochs=1, checkpoint_every=1, progress=False, save_path=STEM, resume_from=STEM,
        )
    except Exception as exc:
        print(f"RAISED {os.environ['RANK']} {type(exc).__name__}: {exc}", flush=True)
        raise SystemExit(1)
    print(f"RETURNED {os.environ['RANK']}", flush=True)
"""


def test_rank_0_that_cannot_start_the_run_tells_the_others_why(tmp_path: Path) -> None:
    # They waited in the broadcast of what rank 0 shares until its process died, then
    # raised gloo's "Connection closed by peer".
    train_set, _ = digits.load_digits_split(seed=0)
    saved = elche.train(  # the bundle to resume, from a local run (cheaper, the same bundle)
        digits.make_model, digits.make_optimizer, digits.step_fn, train_set, batch_size=32,
        epochs=1, checkpoint_every=1, ranks=2, progress=False, save_path=str(tmp_path / "bundle"),
    )  # fmt: skip
    assert saved.summary["outcome"] == "completed", saved.summary
    script = tmp_path / "train.py"
    script.write_text(SAVED_OVER_SCRIPT)
    args = [sys.executable, "-m", "elche.cli", "run", "--nproc", "2", str(script), str(tmp_path)]
    with session(args, tmp_path) as proc:
        returncode, out, err = wait_exit(proc, MID_RUN_WITHIN_S)
    assert returncode == 1, err[-3000:]
    changed = f"the bundle at {tmp_path}/bundle changed after this run checked it"
    raised = dict(re.findall(r"RAISED (\d) (.*)", out))
    assert raised.keys() == {"0", "1"}, out + err[-3000:]
    assert raised["0"].startswith("ConfigError: resume_from: " + changed), raised
    told = "RuntimeError: rank 0 could not start the run: ConfigError"
    assert raised["1"].startswith(told), raised
    assert changed in raised["1"]


EARLY_EXIT_SCRIPT = """
import os, sys
import elche
from elche.workloads import digits

if __name__ == "__main__":
    if os.environ["RANK"] == sys.argv[1]:
        if sys.argv[2] == "0":
            sys.exit(0)  # its script ends there, never training
        raise SystemExit(f"rank {sys.argv[1]}: cannot read its data")
    train_set, _ = digits.load_digits_split(seed=0)
    elche.train(digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
                batch_size=32, epochs=1, progress=False)
"""


# Rank 0 of two, a rank but 0 of three (two others waiting), and one whose script ends
# with status 0 without training (the others waited, and elche run with them, for good).
@pytest.mark.parametrize(
    ("failing", "nproc", "status"), [("0", "2", 1), ("2", "3", 1), ("1", "2", 0)]
)
def test_a_rank_that_fails_before_the_run_formed_ends_it_at_once(
    tmp_path: Path, failing: str, nproc: str, status: int
) -> None:
    # The others waited in torch's rendezvous for it: 30 minutes, deaf to signals.
    script = tmp_path / "train.py"
    script.write_text(EARLY_EXIT_SCRIPT)
    args = [sys.executable, "-m", "elche.cli", "run", "--nproc", nproc, str(script), failing,
            str(status)]  # fmt: skip
    with session(args, tmp_path) as proc:
        returncode, _, err = wait_exit(proc, MID_RUN_WITHIN_S)
        left = session_pids(proc.pid)
    assert returncode == 1, err[-3000:]
    assert status == 0 or f"rank {failing}: cannot read its data" in err
    assert f"elche run: rank {failing} exited with code {status} before every rank reached the " \
           "run, which cannot form without it; the other ranks were stopped (nothing was " \
           "trained)" in err, err[-3000:]  # fmt: skip
    assert "Traceback" not in err, err[-3000:]
    assert not left, "processes of the run outlived its launcher"


GATED_SCRIPT = """
import os, signal, sys, time
from pathlib import Path

import elche
from elche.workloads import digits

def clean_up(signum, frame):  # the script's own, for its set-up's files
    (Path(sys.argv[1]) / f"cleaned.{os.environ['RANK']}").touch()
    sys.exit(0)

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, clean_up)
    (Path(sys.argv[1]) / f"started.{os.environ['RANK']}").touch()
    while not (Path(sys.argv[1]) / "go").exists():  # a script's own set-up, before elche.train
        time.sleep(0.02)
    train_set, _ = digits.load_digits_split(seed=0)
    elche.train(digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
                batch_size=32, epochs=1, progress=False)
"""


def test_ctrl_c_while_the_ranks_start_ends_the_run_in_one_line(tmp_path: Path) -> None:
    # Ctrl-C reached every rank: those not yet in elche.train ended in a KeyboardInterrupt
    # traceback, and elche run exited 1; a rank the launcher started just after the
    # signal never heard it, and trained the run to its end.
    script = tmp_path / "train.py"
    script.write_text(GATED_SCRIPT)
    args = [sys.executable, "-m", "elche.cli", "run", "--nproc", "2", str(script), str(tmp_path)]
    with session(args, tmp_path) as proc:
        for rank in (0, 1):
            wait_for(tmp_path / f"started.{rank}", proc)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal's whole foreground group
        returncode, _, err = wait_exit(proc, MID_RUN_WITHIN_S)
        left = session_pids(proc.pid)
    assert returncode == 130, err[-3000:]
    assert elche_lines(err) == [
        "elche run: interrupted by SIGINT before the run formed; the ranks were stopped "
        "(nothing was trained)"
    ], err[-3000:]
    assert not left, "processes of the run outlived its launcher"
    # Each rank had the stop as SIGTERM, so the script's own handler ran.
    assert sorted(p.name for p in tmp_path.glob("cleaned.*")) == ["cleaned.0", "cleaned.1"]


STUCK_SCRIPT = """
import os, signal, sys, time
from pathlib import Path

import elche
from elche.workloads import digits

if __name__ == "__main__":
    if os.environ["RANK"] == "1":  # stuck in its own set-up, deaf to SIGTERM (say, a hung read)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(0.05)
    train_set, _ = digits.load_digits_split(seed=0)
    elche.train(digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
                batch_size=32, epochs=1, progress=False)
"""


def _at_the_rendezvous(launcher: int) -> bool:
    """Whether rank 0 of ``launcher`` serves its store (``MASTER_PORT``): the rendezvous."""
    rank0 = worker_of(launcher, 0)
    try:
        environ = Path(f"/proc/{rank0}/environ").read_bytes().split(b"\0")
        port = int(next(x for x in environ if x.startswith(b"MASTER_PORT=")).split(b"=")[1])
        tables = [Path(f"/proc/{rank0}/net/{t}").read_text() for t in ("tcp", "tcp6")]
    except (OSError, StopIteration):
        return False
    for row in "".join(tables).splitlines():
        fields = row.split()
        if fields[3:4] == ["0A"] and fields[1].rpartition(":")[2] == f"{port:04X}":  # LISTEN
            return True
    return False


def test_a_stop_while_no_rank_can_end_before_the_run_formed_ends_it_after_the_grace(
    tmp_path: Path,
) -> None:
    # Rank 0 waits in torch's rendezvous (deaf to signals) for rank 1, stuck in its
    # set-up and deaf to SIGTERM: elche run passed a SIGTERM on and then waited for a
    # rank to end, for good, where the ranks still there after the grace are killed.
    script = tmp_path / "train.py"
    script.write_text(STUCK_SCRIPT)
    args = [sys.executable, "-m", "elche.cli", "run", "--nproc", "2", str(script)]
    with session(args, tmp_path) as proc:
        deadline = time.monotonic() + MID_RUN_WITHIN_S
        while not _at_the_rendezvous(proc.pid):
            assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
            time.sleep(0.05)  # polling for a condition, with a deadline
        os.kill(proc.pid, signal.SIGTERM)
        returncode, _, err = wait_exit(proc, STOP_WITHIN_S)
        left = session_pids(proc.pid)
    assert returncode == 143, err[-3000:]
    assert elche_lines(err) == [
        "elche run: interrupted by SIGTERM before the run formed; the ranks were stopped "
        "(nothing was trained)"
    ], err[-3000:]
    assert not left, "processes of the run outlived its launcher"
