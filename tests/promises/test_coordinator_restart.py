"""Issue 13 item 2: a coordinator that dies is restarted from its journal and the run completes.

Real processes, one run per launcher, each killing the first coordinator at
another moment: mid-run, by rank 0 when it reaches epoch 1.3 (the
``KillCoordinator`` fault: a SIGKILL from outside, wherever the coordinator
is), and with the host's testing hook (``ELCHE_FAULT_COORDINATOR``: it SIGKILLs
itself once what it sent has left) right after asking for round 3's average
(during an averaging round), right after ordering the final model's save and
right after writing the last epoch's end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

import elche
from elche.core import messages as m
from elche.core.config import CoordinatorConfig, Mode
from elche.core.journal import record_of
from elche.runtime import bundle, supervision
from elche.runtime.addresses import BIND_ENV
from elche.runtime.frames import SECRET_ENV, new_secret
from elche.runtime.host import ADDRESS_LINE, config_to_json
from elche.runtime.journal_file import JOURNAL_FILE, JournalWriter, read_journal
from elche.runtime.supervision import Supervised
from elche.runtime.transport import RankEndpoint
from elche.workloads import digits
from tests.core.harness import Harness

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = """
import json, os, sys
import elche
from elche.workloads import digits

if __name__ == "__main__":
    train_set, test_set = digits.load_digits_split(seed=0)
    faults = elche.FaultPlan()
    if sys.argv[2] == "fault":
        faults = faults.kill_coordinator(rank=0, at_epoch=1.3)
    checkpoints = {}
    if sys.argv[2] == "epoch:2":  # killed with the last epoch's callbacks asked, not sent
        from tests.promises import tiny
        checkpoints = dict(checkpoint_fn=tiny.log_checkpoint, checkpoint_every=1)
    result = elche.train(
        digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
        batch_size=32, epochs=3, mode=sys.argv[1], heartbeat_timeout_s=5.0,
        ranks=None if "RANK" in os.environ else 3, faults=faults,
        eval_fn=digits.eval_fn, eval_dataset=test_set, progress=False, **checkpoints,
    )
    print(f"RETURNED {os.environ.get('RANK', 0)}", flush=True)
    if os.environ.get("RANK", "0") == "0":  # every rank holds it; one line to parse
        print("SUMMARY " + json.dumps(result.summary), flush=True)
        print("EPOCHS " + json.dumps(result.epochs), flush=True)
"""

EVERY_RANK = ["RETURNED 0", "RETURNED 1", "RETURNED 2"]
REPO = str(Path(__file__).resolve().parents[2])  # the script imports tests.promises.tiny
LAUNCHERS = {
    "elche.train": ([], ["RETURNED 0"]),
    "elche-run": (["-m", "elche.cli", "run", "--nproc", "3"], EVERY_RANK),
    "torchrun": (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"],
        EVERY_RANK,
    ),
}


@pytest.mark.parametrize(
    ("launcher", "mode", "kill_at"),
    [
        ("elche.train", "cadence", "fault"),
        ("elche-run", "cpu-cadence", "averaging:3"),
        ("torchrun", "cadence", "final"),
        ("elche.train", "cadence", "epoch:2"),
    ],
)
def test_issue13_a_killed_coordinator_is_restarted_and_the_run_completes(
    tmp_path: Path, launcher: str, mode: str, kill_at: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    args, expected = LAUNCHERS[launcher]
    env = dict(os.environ, ELCHE_RUN_DIR=str(tmp_path / "run"))
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])
    env["CHECKPOINT_LOG"] = str(tmp_path / "checkpoints")
    if kill_at != "fault":
        env["ELCHE_FAULT_COORDINATOR"] = kill_at
    done = subprocess.run(
        [sys.executable, *args, str(script), mode, kill_at],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    returned = sorted(re.findall(r"RETURNED \d", done.stdout))  # lines of 3 processes may mix
    assert returned == expected, done.stderr[-4000:]
    assert "restarting it from the journal" in done.stderr
    assert done.stderr.count("the coordinator restarted; rejoining") == 3
    # The monitor sees it: the successor raises the alert, in the timeline too.
    said = "elche [critical] coordinator_lost coordinator — the coordinator process was lost; "
    assert said + "restart 1 goes on from its journal (x1)" in done.stderr, done.stderr[-4000:]
    # No rank waited its collective timeout out in a rendezvous its peers had left
    # (the restarted coordinator orders a new generation and the final save at once).
    whys = set(re.findall(r"did not form \(([^)]*)\)", done.stderr))
    assert whys <= {"a newer order came while its members gathered"}, done.stderr[-4000:]
    (line,) = re.findall(r"SUMMARY (\{.*\})", done.stdout)
    summary = json.loads(line)
    assert summary["outcome"] == "completed", summary
    assert summary["coordinator_restarts"] == 1
    timeline = (Path(summary["run_dir"]) / "timeline.jsonl").read_text()
    assert '"name":"coordinator_lost"' in timeline.replace(" ", "")
    assert summary["lost_samples"] == 0 and summary["dead_ranks"] == []
    assert summary["epochs_completed"] == 3
    assert sum(r["samples"] for r in summary["per_rank"]) == 3 * 1437  # each sample once per epoch
    assert summary["eval_accuracy"] is not None and summary["eval_accuracy"] > 0.7
    assert summary["wall_s"] > 0
    # Each epoch once, with its eval. Killed once it wrote the last epoch's end
    # (epoch:2), it left a successor that ended it again (listed twice, the second
    # time with no loss); an eval answered before its epoch's end was written was
    # lost from its epoch.
    (line,) = re.findall(r"EPOCHS (\[.*\])", done.stdout)
    epochs = json.loads(line)
    assert [(e["epoch"], e.get("eval") is not None) for e in epochs] == [
        (0, True), (1, True), (2, True),
    ], line  # fmt: skip
    if kill_at == "epoch:2":  # (lost mid-round, an epoch can lose its loss: docs)
        assert all(e["loss"] is not None for e in epochs), line
        # Each epoch's checkpoint_fn ran (the last one's, asked of no rank before the
        # kill, is asked again by the successor): it never ran, and nothing said so.
        versions = (tmp_path / "checkpoints").read_text().split()
        assert sorted(set(versions)) == ["1", "2", "3"], versions


@pytest.mark.parametrize("launcher", ["elche.train", "elche-run"])
def test_a_coordinator_lost_before_the_run_began_fails_it_saying_nothing_was_trained(
    tmp_path: Path, launcher: str, monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # No journal yet, so no successor: the run fails. It used to say the journal
    # "cannot be read: [Errno 2] No such file", after the launcher had given ranks
    # that trained nothing 30 s to keep their state.
    monkeypatch.setenv("ELCHE_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("ELCHE_FAULT_COORDINATOR", "start")  # the coordinator takes it at launch
    if launcher == "elche.train":  # in this process: its fork server is up (the suite's time)
        train_set, _ = digits.load_digits_split(seed=0)
        summary = elche.train(
            digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
            batch_size=32, epochs=3, mode="cadence", ranks=3, progress=False,
        ).summary  # fmt: skip
        err = capfd.readouterr().err
    else:
        script = tmp_path / "train.py"
        script.write_text(SCRIPT)
        done = subprocess.run(
            [sys.executable, "-m", "elche.cli", "run", "--nproc", "2", str(script), "cadence",
             "start"],
            capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
        )  # fmt: skip
        err = done.stderr
        assert done.returncode == 0, err[-4000:]
        returned = sorted(re.findall(r"RETURNED \d", done.stdout))
        assert returned == ["RETURNED 0", "RETURNED 1"], err[-4000:]
        (line,) = re.findall(r"SUMMARY (\{.*\})", done.stdout)
        summary = json.loads(line)
    assert "the coordinator was lost before the run began" in err, err[-4000:]
    assert summary["outcome"] == "failed"
    assert "lost before the run began; nothing was trained" in summary["reason"], summary
    assert summary["epochs_completed"] == 0


def test_issue13_a_coordinator_lost_past_its_restarts_is_not_restarted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = CoordinatorConfig(
        mode=Mode.CADENCE, world_size=2, num_samples=64, batch_size=8, epochs=1,
        max_coordinator_restarts=1,
    )  # fmt: skip
    gone = subprocess.Popen([sys.executable, "-c", "pass"], text=True)
    gone.wait()
    watched = Supervised(gone, "tcp://127.0.0.1:1", None, config, tmp_path, b"0" * 32, restarts=1)
    assert not watched.running({})
    assert "lost again after 1 restart(s) (max_coordinator_restarts=1)" in capsys.readouterr().err
    (tmp_path / "summary.json").write_text("{}")  # it wrote its summary: it ended, not lost
    assert not Supervised(gone, "tcp://127.0.0.1:1", None, config, tmp_path, b"0" * 32).running({})


def test_issue13_a_stop_asked_as_the_coordinator_died_reaches_its_successor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C as the coordinator dies: the stop line finds a broken pipe. Its successor,
    # restored from the journal, must be asked too, or the run trains on to the
    # launcher's deadline and is killed with nothing saved.
    config = CoordinatorConfig(
        mode=Mode.CADENCE, world_size=2, num_samples=64, batch_size=8, epochs=1
    )
    dying = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE, text=True)
    dying.wait()
    echo = (
        "import sys; sys.stdout.write(sys.stdin.read())"  # what it was told, once its stdin closes
    )
    successor = subprocess.Popen(
        [sys.executable, "-c", echo], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    monkeypatch.setattr(supervision, "restart_coordinator", lambda *_: successor)
    watched = Supervised(dying, "tcp://127.0.0.1:1", None, config, tmp_path, b"0" * 32)
    watched.ask_stop("SIGINT")  # told to the dying one: lost in its pipe
    assert watched.replaced({1: -9})
    told, _ = successor.communicate(timeout=30)
    assert told.splitlines() == ["lost 1 process ended (killed by signal 9)", "stop SIGINT"]


def _successor(run_dir: Path, secret: bytes, address: str) -> subprocess.Popen[str]:
    """A lost coordinator's successor on ``address``, as ``restart_coordinator`` starts it."""
    env = dict(os.environ, **{SECRET_ENV: secret.hex(), BIND_ENV: address})
    proc = subprocess.Popen(
        [sys.executable, "-m", "elche.runtime.host", str(run_dir), "--restore"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith(ADDRESS_LINE)
    return proc


def test_a_successor_killed_while_its_ranks_rejoin_is_followed_by_one_they_accept(
    tmp_path: Path,
) -> None:
    # The successor asks the rank to rejoin and is SIGKILLed before the rank does
    # (before the run re-formed). The next successor used to number its frames as
    # the first did (both read one journal record): the rank refused them as
    # replayed and gave the coordinator up for lost.
    h = Harness(world_size=2, epochs=2, num_samples=640, mode=Mode.CPU_CADENCE)
    h.form()
    h.run_to_end(until=lambda: h.core.rounds_done >= 1)
    (tmp_path / "coordinator.json").write_text(config_to_json(h.cfg))
    writer = JournalWriter(tmp_path / JOURNAL_FILE)
    writer.append(record_of(h.core), compact=True)
    writer.close()
    secret = new_secret()
    lost = zmq.Context.instance().socket(zmq.ROUTER)  # the lost coordinator: the rank's Hello
    lost.bind("tcp://127.0.0.1:0")
    address = lost.getsockopt_string(zmq.LAST_ENDPOINT)
    rank = RankEndpoint(address=address, rank=0, world_size=2, secret=secret)
    procs: list[subprocess.Popen[str]] = []
    try:
        lost.recv_multipart()
        lost.close(linger=0)
        for _ in range(2):
            procs.append(_successor(tmp_path, secret, address))
            rank.send(m.Heartbeat(step=1))  # its DEALER reconnected by itself
            got = rank.recv(30.0)  # (TransportError: a frame numbered as one it had)
            assert got is not None and isinstance(got[0], m.Rejoin), got
            procs[-1].kill()
            procs[-1].wait(timeout=30)
        assert read_journal(tmp_path / JOURNAL_FILE).coordinator_restarts == 2
    finally:
        rank.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def test_a_coordinator_lost_between_a_saves_files_and_its_meta_leaves_no_files_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Killed once the ranks wrote the last checkpoint's files, before its meta
    (``save:2``): the run completes, the meta before stands, and the files of
    the save that never committed go (its successor removes them)."""
    stem = tmp_path / "bundle" / "ck"
    stem.parent.mkdir()
    monkeypatch.setenv("ELCHE_FAULT_COORDINATOR", "save:2")  # the coordinator takes it at launch
    train_set, _ = digits.load_digits_split(seed=0)
    result = elche.train(  # in this process: its fork server is up (the suite's time)
        digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
        batch_size=32, epochs=2, mode="cadence", heartbeat_timeout_s=5.0, ranks=3,
        checkpoint_every=1, save_path=str(stem), progress=False,
    )  # fmt: skip
    assert "restarting it from the journal" in capfd.readouterr().err
    summary = result.summary
    assert summary["outcome"] == "completed" and summary["lost_samples"] == 0, summary
    assert [e["epoch"] for e in result.epochs] == [0, 1]
    meta = bundle.read_meta(str(stem))
    assert meta is not None and meta.save_seq == 1 and meta.files is not None
    named = [meta.files.model, *(f for _, f in meta.files.optim)]
    for f in named:
        bundle.verify(stem.parent / f.name, f, what="file")
    left = {p.name for p in stem.parent.iterdir()} - {"ck.lock", "ck.meta.json"}
    assert left == {f.name for f in named}, sorted(left)


def test_a_coordinator_stopped_longer_than_its_ranks_wait_ends_and_their_state_is_the_bundle(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # SIGSTOPped past its ranks' patience (10 s), the coordinator was given up: each rank
    # kept its state and ended. Woken, the coordinator took their ends for deaths, failed
    # the run and saved nothing ("no rank was left to write the model"), where what the
    # ranks kept was the whole run.
    run_dir = tmp_path / "run"
    stem = str(tmp_path / "bundle")

    def stop_the_coordinator(entry: dict[str, object]) -> None:  # the launcher's, epoch 0
        if entry["epoch"] != 0:
            return
        pid = int((run_dir / "coordinator.pid").read_text())
        os.kill(pid, signal.SIGSTOP)
        try:
            kept = [run_dir / f"rank{r}.local.json" for r in (0, 1)]
            deadline = time.monotonic() + 120.0
            while not all(p.exists() for p in kept) and time.monotonic() < deadline:
                time.sleep(0.05)  # polling a condition, bounded by the deadline
            assert all(p.exists() for p in kept), "the ranks kept no state"
        finally:
            os.kill(pid, signal.SIGCONT)

    train_set, _ = digits.load_digits_split(seed=0)
    args = dict(
        model_fn=digits.make_model, optimizer_fn=digits.make_optimizer, step_fn=digits.step_fn,
        dataset=train_set, batch_size=32, epochs=4, mode="cadence", ranks=2,
        heartbeat_timeout_s=5.0, progress=False,
        speeds=[0.2, 0.2],  # paced (idle, not CPU): the run is still on when epoch 0 is read
    )  # fmt: skip
    result = elche.train(**args, run_dir=str(run_dir), save_path=stem,  # type: ignore[arg-type]
                         metrics_fn=stop_the_coordinator)  # fmt: skip
    summary = result.summary
    assert summary["outcome"] == "saved_and_shutdown", summary
    assert summary["reason"] == "coordinator_lost" and summary["bundle"] == stem, summary
    assert summary["lost_samples"] == 0 and summary["dead_ranks"] == [], summary
    err = capfd.readouterr().err
    said = "elche coordinator [error] this process did not run for "
    assert said in err and "longer than its ranks wait for a word from it (10 s)" in err, err
    resumed = elche.train(**args, resume_from=stem).summary  # type: ignore[arg-type]
    assert resumed["outcome"] == "completed" and resumed["lost_samples"] == 0, resumed
    assert resumed["epochs_completed"] == 4, resumed
