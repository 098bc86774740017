"""Issue 12's storage items: a save location that fills up or is taken.

A full disk mid-run is a small ``tmpfs`` (root only; skipped elsewhere),
filled by the test once the run has finished its first epoch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import elche
from elche.core import timeline as tl
from elche.core.checkpoint import CheckpointMeta
from elche.core.errors import ConfigError
from elche.monitor.timeline import TimelineReader
from elche.runtime.bundle import meta_path
from elche.runtime.plan import hold_save_path
from tests.promises.tiny import make_model, make_optimizer, step

DATA = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))


@contextlib.contextmanager
def small_disk(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                      check=False).returncode != 0:  # fmt: skip
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> None:
    """Write until the disk says it is full."""
    with (disk / "ballast").open("wb", buffering=0) as fh, contextlib.suppress(OSError):
        while True:
            fh.write(b"\0" * 65536)


def filled_after_an_epoch(disk: Path, run_dir: Path, **train: object) -> object:
    """Train two ranks on a thread, fill ``disk`` once the first epoch ended; what
    ``elche.train`` returned or raised."""
    outcome: list[object] = []

    def go() -> None:
        try:
            outcome.append(elche.train(
                make_model, make_optimizer, step, DATA, batch_size=16, ranks=2,
                run_dir=str(run_dir), progress=False, **train,  # type: ignore[arg-type]
            ))  # fmt: skip
        except BaseException as exc:
            outcome.append(exc)

    runner = threading.Thread(target=go)
    runner.start()
    reader, waited = TimelineReader(run_dir), threading.Event()
    for _ in range(600):  # up to 60 s for the first epoch to end
        if any(isinstance(e, tl.EpochEnd) for e in reader.new_records()) or outcome:
            break
        waited.wait(0.1)
    fill(disk)
    runner.join(timeout=120)
    assert not runner.is_alive()
    (result,) = outcome
    return result


@pytest.mark.integration
@pytest.mark.slow
def test_issue12_item10_a_save_location_that_fills_up_mid_run_does_not_end_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    with small_disk(tmp_path / "disk", "1m") as disk:
        result = filled_after_an_epoch(
            disk, run_dir, epochs=30, save_path=str(disk / "bundle"), checkpoint_every=1
        )
    assert isinstance(result, elche.TrainResult), result
    assert result.summary["outcome"] == "completed"
    assert result.summary["epochs_completed"] == 30
    err = capfd.readouterr().err
    assert "No space left on device" in err  # said, not swallowed


def test_issue12_item10_two_runs_at_one_save_path_are_refused(tmp_path: Path) -> None:
    stem = str(tmp_path / "bundle")
    with hold_save_path(stem):  # as a first, still running, run would
        with pytest.raises(ConfigError) as info:
            elche.train(make_model, make_optimizer, step, DATA, batch_size=16, epochs=1,
                        ranks=1, save_path=stem, progress=False)  # fmt: skip
        assert info.value.field == "save_path"
        assert f"pid {os.getpid()}" in str(info.value)
    result = elche.train(make_model, make_optimizer, step, DATA, batch_size=16, epochs=1,
                         ranks=1, save_path=stem, progress=False)  # fmt: skip
    assert result.summary["outcome"] == "completed"


def test_issue12_item10_a_full_disk_is_refused_before_training(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "256k") as disk:
        fill(disk)
        with pytest.raises(ConfigError) as info:
            elche.train(make_model, make_optimizer, step, DATA, batch_size=16, epochs=1,
                        ranks=2, save_path=str(disk / "bundle"), progress=False)  # fmt: skip
    assert info.value.field == "save_path"


@pytest.mark.integration
@pytest.mark.slow
def test_a_run_directory_that_fills_up_ends_the_run_with_one_clear_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # The run directory holds the journal, the summary and the ranks' reports: a full
    # one ends the run. It used to end in a dozen tracebacks, a coordinator restarted
    # three times into the same full disk, and a raw OSError from elche.train; then in
    # a run that trained on until its final model could not be written, and nothing
    # resumable (the ranks' local states are described in the run directory too).
    stem = str(tmp_path / "bundle")
    with small_disk(tmp_path / "disk", "1m") as disk:
        run_dir = disk / "run"
        result = filled_after_an_epoch(disk, run_dir, epochs=200, save_path=stem)
    assert isinstance(result, RuntimeError), result
    assert str(result) == (  # it said "the coordinator exited without a summary"
        f"the coordinator could not write in the run directory {run_dir}; the run's state "
        f"is saved as the bundle {stem}: resume_from={stem!r} continues it"
    )
    err = capfd.readouterr().err
    assert f"cannot write in the run directory {run_dir}" in err, err[-3000:]
    assert "so the run stops and saves its state" in err
    assert err.count("could not write the timeline") <= 1  # said once
    assert "restarting it from the journal" not in err  # a successor would fail the same way
    assert "Traceback" not in err, err[-3000:]
    # The bundle resumes: the run stopped mid-way, so it goes on a little and completes.
    meta = json.loads(meta_path(stem).read_text())
    assert 1 <= meta["epoch"] < 200
    resumed = elche.train(
        make_model, make_optimizer, step, DATA, batch_size=16, ranks=2, progress=False,
        epochs=meta["epoch"] + 1, resume_from=stem, run_dir=str(tmp_path / "again"),
    )  # fmt: skip
    assert resumed.summary["outcome"] == "completed"
    assert resumed.summary["lost_samples"] == 0


CHECKPOINTED_SCRIPT = """
import sys
import elche
from elche.workloads import digits

if __name__ == "__main__":
    train_set, _ = digits.load_digits_split(seed=0)
    try:
        elche.train(
            digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
            batch_size=32, epochs=400, ranks=2, speeds=[0.2, 0.2], checkpoint_every=1,
            save_path=sys.argv[1], progress=False,
        )
    except KeyboardInterrupt as stop:
        print(f"STOPPED bundle={stop.bundle}", flush=True)
        raise
"""


@pytest.mark.integration
@pytest.mark.slow
def test_a_stop_whose_save_fails_names_the_runs_last_whole_checkpoint(tmp_path: Path) -> None:
    # It said "nothing could be saved", with .bundle None, beside the whole checkpoint
    # the run had committed an epoch before (a copy of it resumed exactly).
    from tests.promises.test_lifetimes import STOP_WITHIN_S, session, wait_exit

    script = tmp_path / "train.py"
    script.write_text(CHECKPOINTED_SCRIPT)
    with small_disk(tmp_path / "disk", "1m") as disk:
        stem = str(disk / "c")
        with session([sys.executable, str(script), stem], tmp_path) as proc:
            waited = threading.Event()
            for _ in range(1200):  # up to 120 s for the first checkpoint's commit
                if meta_path(stem).exists() or proc.poll() is not None:
                    break
                waited.wait(0.1)
            assert meta_path(stem).exists(), "no checkpoint was committed"
            fill(disk)
            os.killpg(proc.pid, signal.SIGTERM)
            returncode, out, err = wait_exit(proc, STOP_WITHIN_S)
        assert returncode == 143, err[-3000:]
        assert f"STOPPED bundle={stem}" in out, out + err[-3000:]
        (line,) = [x for x in err.splitlines() if x.startswith("elche: interrupted by")]
        assert "the stop's save failed" in line and f"last checkpoint, {stem}, is whole" in line
        assert f"resume_from={stem!r}" in line
        assert CheckpointMeta.from_json(meta_path(stem).read_text()).save_seq >= 1


@pytest.mark.integration
@pytest.mark.slow
def test_a_rank_whose_span_record_is_refused_trains_on(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # Each rank appends what every round averaged to its own record in the run dir
    # (an audit trail, not the run's state). A run dir turned read-only mid-run
    # refused it, and every rank died on the OSError at once: the run ended with
    # no stop's bundle, and all it trained since its last checkpoint was lost.
    # Here the record's name is taken by a folder, which refuses it the same way.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "rank0.spans.jsonl").mkdir()
    result = elche.train(
        make_model, make_optimizer, step, DATA, batch_size=16, epochs=2, ranks=2,
        run_dir=str(run_dir), progress=False,
    )  # fmt: skip
    assert result.summary["outcome"] == "completed"
    assert result.summary["dead_ranks"] == [] and result.summary["lost_samples"] == 0
    err = capfd.readouterr().err
    assert err.count("elche rank 0: cannot write its record in the run directory") == 1, err
    assert "failed" not in err, err[-3000:]
