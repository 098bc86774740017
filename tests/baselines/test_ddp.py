"""The torch DDP baseline and the digits workload it trains.

Fast tests cover the workload's contract (split sizes, dtypes, determinism,
identical initial weights) and ``run_ddp``'s argument checks, which refuse
before any process starts. The ``integration`` tests spawn real gloo ranks:
a paced two-rank run, the ``python -m`` entry, and the two ways a run must
end without hanging — a rank raising, and the run exceeding its timeout.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from elche.baselines import ddp
from elche.baselines.ddp import main, run_ddp
from elche.core.errors import ConfigError
from elche.workloads import digits

DIGITS_TOTAL = 1797
DIGITS_TRAIN = 1437  # stratified 80/20
DIGITS_TEST = 360

RESULT_KEYS = {
    "system", "speeds", "world_size", "epochs", "wall_s", "startup_s", "samples_per_s",
    "final_loss", "eval_accuracy", "per_rank",
}  # fmt: skip
PER_RANK_KEYS = {"rank", "speed", "samples", "idle_s"}


@pytest.fixture(scope="module")
def split() -> tuple[TensorDataset, TensorDataset]:
    return digits.load_digits_split(seed=0)


# --- the digits workload -----------------------------------------------------------


def test_split_sizes_dtypes_and_range(split: tuple[TensorDataset, TensorDataset]) -> None:
    train, test = split
    (x_train, y_train), (x_test, y_test) = train.tensors, test.tensors
    assert (len(train), len(test)) == (DIGITS_TRAIN, DIGITS_TEST)
    assert x_train.shape == (DIGITS_TRAIN, 64)
    assert x_test.shape == (DIGITS_TEST, 64)
    assert x_train.dtype == x_test.dtype == torch.float32
    assert y_train.dtype == y_test.dtype == torch.int64
    assert float(x_train.min()) >= 0.0 and float(x_train.max()) == 1.0
    assert set(y_test.tolist()) == set(range(10))


def test_split_is_stratified(split: tuple[TensorDataset, TensorDataset]) -> None:
    train, test = split
    train_counts = Counter(train.tensors[1].tolist())
    test_counts = Counter(test.tensors[1].tolist())
    for label in range(10):
        share = test_counts[label] / (train_counts[label] + test_counts[label])
        assert abs(share - 0.2) < 0.01, label


def test_split_is_deterministic_per_seed(split: tuple[TensorDataset, TensorDataset]) -> None:
    again = digits.load_digits_split(seed=0)
    other = digits.load_digits_split(seed=1)
    for a, b in zip(split[0].tensors, again[0].tensors, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(split[0].tensors[0], other[0].tensors[0])
    assert len(other[0]) + len(other[1]) == DIGITS_TOTAL


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.2])
def test_bad_test_fraction_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="test_fraction"):
        digits.load_digits_split(test_fraction=fraction)


def test_every_model_starts_equal_without_touching_the_global_rng() -> None:
    rng_before = torch.get_rng_state()
    first, second = digits.make_model("cpu"), digits.make_model(torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), rng_before)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_step_and_eval(split: tuple[TensorDataset, TensorDataset]) -> None:
    train, test = split
    model = digits.make_model("cpu")
    batch = next(iter(DataLoader(train, batch_size=32)))
    loss = digits.step_fn(model, batch)
    assert loss.shape == () and loss.requires_grad
    assert math.isclose(loss.item(), math.log(10), rel_tol=0.2)  # untrained: about uniform
    accuracy = digits.eval_fn(model, test)
    assert 0.0 <= accuracy <= 1.0
    assert model.training  # back in train mode


@pytest.mark.slow
def test_one_process_learns_the_digits(split: tuple[TensorDataset, TensorDataset]) -> None:
    train, test = split
    model = digits.make_model("cpu")
    optimizer = digits.make_optimizer(model.parameters())
    loader = DataLoader(
        train, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    for _ in range(3):
        for batch in loader:
            optimizer.zero_grad()
            digits.step_fn(model, batch).backward()  # type: ignore[no-untyped-call]  # torch stub
            optimizer.step()
    assert digits.eval_fn(model, test) >= 0.9


# --- run_ddp: argument checks (nothing is spawned) ---------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"speeds": []}, "speeds"),
        ({"speeds": "1,0.5"}, "speeds"),
        ({"speeds": [1, 0]}, "speeds"),
        ({"speeds": [1.5]}, "speeds"),
        ({"epochs": 0}, "epochs"),
        ({"epochs": True}, "epochs"),
        ({"batch_size": 0}, "batch_size"),
        ({"workload": "mnist"}, "workload"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": math.inf}, "timeout_s"),
        ({"base_step_s": 0.0}, "speed_base_s"),
        ({"base_step_s": math.nan}, "speed_base_s"),
    ],
)
def test_bad_arguments_are_refused_before_spawning(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"speeds": [1.0], "epochs": 1, **kwargs}
    with pytest.raises(ConfigError) as info:
        run_ddp(**args)  # type: ignore[arg-type]  # deliberately wrong values
    assert info.value.field == field


def test_cli_refuses_a_bad_speed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--speeds", "1,2"])
    assert info.value.code == 2
    assert "speeds" in capsys.readouterr().err


# --- run_ddp: real processes -------------------------------------------------------


@pytest.fixture
def loopback_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ddp.GLOO_SOCKET_IFNAME_ENV, "lo")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.usefixtures("loopback_gloo")
def test_two_paced_ranks_train_and_report() -> None:
    result = run_ddp(speeds=[1, 0.5], epochs=2)

    assert result.keys() >= RESULT_KEYS
    assert result["system"] == "torch-ddp"
    assert result["speeds"] == [1.0, 0.5]
    assert (result["world_size"], result["epochs"]) == (2, 2)
    for key in ("wall_s", "startup_s", "samples_per_s"):
        value = result[key]
        assert isinstance(value, float) and value > 0, key
    assert isinstance(result["final_loss"], float) and math.isfinite(result["final_loss"])
    accuracy = result["eval_accuracy"]
    assert isinstance(accuracy, float) and accuracy > 0.8

    per_rank = result["per_rank"]
    assert isinstance(per_rank, list) and len(per_rank) == 2
    fast, slow = per_rank
    assert fast.keys() >= PER_RANK_KEYS
    assert (fast["rank"], slow["rank"]) == (0, 1)
    # DistributedSampler pads 1,437 to 1,438 so both ranks get 719 per epoch.
    assert fast["samples"] == slow["samples"] == 2 * math.ceil(DIGITS_TRAIN / 2)
    assert fast["injected_s"] == 0.0 < slow["injected_s"]
    assert fast["idle_s"] >= 0.0 and slow["idle_s"] >= 0.0


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.usefixtures("loopback_gloo")
def test_a_given_base_paces_every_rank_without_timing_any() -> None:
    result = run_ddp(speeds=[1, 0.5], epochs=1, base_step_s=0.002)

    fast, slow = result["per_rank"]  # type: ignore[misc]  # JSON-shaped result
    assert fast["base_step_s"] == slow["base_step_s"] == 0.002
    assert fast["injected_s"] == 0.0
    assert slow["injected_s"] == pytest.approx(slow["steps"] * 0.002)  # base x (1/0.5 - 1)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.usefixtures("loopback_gloo")
def test_module_entry_prints_one_json_line() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "elche.baselines.ddp", "--speeds", "1", "--epochs", "1", "--json"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result.keys() >= RESULT_KEYS
    assert result["per_rank"][0]["samples"] == DIGITS_TRAIN


def _rank_1_raises(rank: int, plan: ddp._Plan) -> None:
    """Spawned: rank 1 fails at once while rank 0 blocks, as in a collective."""
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    threading.Event().wait()


def _every_rank_hangs(rank: int, plan: ddp._Plan) -> None:
    """Spawned: nobody ever finishes."""
    threading.Event().wait()


def _plan(timeout_s: float) -> ddp._Plan:
    empty = TensorDataset(torch.zeros(0, 64), torch.zeros(0, dtype=torch.int64))
    return ddp._Plan(
        speeds=(1.0, 1.0), epochs=1, batch_size=32, seed=0, workload="digits",
        train_set=empty, test_set=empty, run_dir="unused", timeout_s=timeout_s,
    )  # fmt: skip


@pytest.mark.integration
@pytest.mark.slow
def test_a_run_past_its_timeout_is_stopped() -> None:
    with pytest.raises(RuntimeError, match="timeout"):
        ddp._spawn_ranks(_every_rank_hangs, _plan(1.0), nprocs=2, timeout_s=1.0)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("stop", ["hang-up", "second ctrl-c"])
def test_a_stop_while_the_ranks_start_stops_every_one_started(
    stop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stop signal that came while start_processes forked the ranks raised in it, before
    # _spawn_ranks had them: the ranks started so far, deaf to it, were left waiting for
    # their peers (and the fork server lived on for them after the bench had ended). A
    # closed terminal's SIGHUP is now held until all have started; a second Ctrl-C still
    # ends the start at once, and the ranks it started are stopped too.
    import signal

    from elche.cli.endings import Terminated, stop_signals_raise

    started: list[Any] = []
    start_processes = ddp.start_processes

    def started_then_stopped(*args: Any, **kwargs: Any) -> Any:
        context = start_processes(*args, **kwargs)
        started.extend(context.processes)
        if stop == "hang-up":
            os.kill(os.getpid(), signal.SIGHUP)  # before start_processes returns
        else:
            os.kill(os.getpid(), signal.SIGINT)  # held
            os.kill(os.getpid(), signal.SIGINT)  # raises KeyboardInterrupt here
        return context

    monkeypatch.setattr(ddp, "GRACE_S", 0.0)
    monkeypatch.setattr(ddp, "start_processes", started_then_stopped)
    raised = Terminated if stop == "hang-up" else KeyboardInterrupt
    try:
        with stop_signals_raise(), pytest.raises(raised):
            ddp._spawn_ranks(_every_rank_hangs, _plan(60.0), nprocs=2, timeout_s=60.0)
        assert len(started) == 2
        assert [rank.is_alive() for rank in started] == [False, False]
    finally:
        for rank in started:
            rank.kill()
            rank.join()


@pytest.mark.integration
@pytest.mark.slow
def test_the_ranks_of_a_killed_launcher_end(tmp_path: Path) -> None:
    # Forked from the fork server, the ranks are not the launcher's children: a bench
    # killed by SIGKILL left its DDP ranks training to the end of their run.
    import signal
    import time

    from tests.promises.test_lifetimes import command_line, session, session_pids, wait_session_gone

    args = [sys.executable, "-m", "elche.baselines.ddp", "--speeds", "1,1", "--epochs", "10000"]
    with session(args, tmp_path) as proc:
        deadline = time.monotonic() + 120.0  # the fork server imports torch first
        forked: list[int] = []
        while len(forked) < 3 and time.monotonic() < deadline:  # the server and its 2 ranks
            forked = [pid for pid in session_pids(proc.pid) if "forkserver" in command_line(pid)]
            time.sleep(0.05)  # polling for a condition, with a deadline
        assert len(forked) == 3, [command_line(pid) for pid in session_pids(proc.pid)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        wait_session_gone(proc.pid)


PROBE = "ELCHE_TEST_SPAWN_PROBE"


def _write_probe(rank: int, path: str) -> None:
    """A spawned rank: write what it sees of ``PROBE``."""
    del rank
    with open(path, "w", encoding="utf-8") as f:
        f.write(os.environ.get(PROBE, "<unset>"))


@pytest.mark.integration
@pytest.mark.slow
def test_spawned_ranks_take_this_process_environment_as_it_is_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ranks fork from elche's fork server, started by the first spawn with the
    # environment of that moment; a setting made after it (the bench's RUST_LOG for
    # torchft) must still reach the next ranks.
    monkeypatch.delenv(PROBE, raising=False)
    before, after = tmp_path / "before", tmp_path / "after"
    ddp._spawn_ranks(_write_probe, str(before), nprocs=1, timeout_s=120)
    monkeypatch.setenv(PROBE, "set after the fork server started")
    ddp._spawn_ranks(_write_probe, str(after), nprocs=1, timeout_s=120)
    assert before.read_text() == "<unset>"
    assert after.read_text() == "set after the fork server started"


@pytest.mark.integration
@pytest.mark.slow
def test_a_failing_rank_raises_with_its_traceback_and_leaves_no_torch_error_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The others are stopped and the run raises the failing rank's traceback. And
    # torch's start_processes names /tmp/pytorch-errorfile-*.pickle for each rank and
    # never removes one a rank wrote (as an interrupted elche compare's ranks did).
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError) as info:
        ddp._spawn_ranks(_rank_1_raises, _plan(60.0), nprocs=2, timeout_s=60.0)
    message = str(info.value)
    assert "rank 1 failed" in message
    assert "Traceback" in message and "ValueError: rank 1 broke on purpose" in message
    assert list(tmp_path.glob("pytorch-errorfile-*")) == []


class _DeafRank:
    """A rank process that ignores SIGTERM, as one forked from elche's fork server
    does; it writes what is done to it in ``log``."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.alive = name, log, True

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.log.append(f"terminate {self.name}")

    def kill(self) -> None:
        self.log.append(f"kill {self.name}")
        self.alive = False

    def join(self, timeout: float | None = None) -> None:
        self.log.append(f"join {self.name}")


def test_stopped_ranks_are_killed_together_after_one_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Killed one grace apart, each rank's peers outlived it by a second and printed
    # a traceback for each connection closed under them (an interrupted bench's
    # torchft ranks did, pages of them).
    monkeypatch.setattr(ddp, "GRACE_S", 0.0)
    log: list[str] = []
    ranks = [_DeafRank(str(r), log) for r in range(3)]
    ddp._stop_all(ranks)  # type: ignore[arg-type]  # fakes of BaseProcess's few methods
    kills = [i for i, entry in enumerate(log) if entry.startswith("kill")]
    assert [log[i] for i in kills] == ["kill 0", "kill 1", "kill 2"]
    assert kills == list(range(kills[0], kills[0] + 3))  # nothing waited between them
    assert not any(rank.alive for rank in ranks)
