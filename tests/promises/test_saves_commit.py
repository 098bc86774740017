"""Issue 12's "saves that commit" and "resumes that check", with real processes.

A writer is caught in the middle of its save by making the file it writes a
FIFO: ``open`` blocks until the test opens the other end, and a model larger
than a pipe's buffer then blocks in ``write``. The test finds the writer as
the process holding the FIFO open (``/proc/PID/fd``), SIGKILLs it, and removes
the FIFO so the next writer writes a plain file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elche
from elche.core.errors import ConfigError
from elche.runtime import bundle
from tests.promises.tiny import bundle_on_disk, make_model, make_optimizer, step

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DATA = TensorDataset(torch.randn(96, 4), torch.randint(0, 2, (96,)))


def make_wide_model(device: torch.device) -> nn.Module:
    """~100 KB of weights: more than a pipe holds, so its writer blocks in write."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4096), nn.Linear(4096, 2)).to(device)


def train(tmp_path: Path, **overrides: object) -> elche.TrainResult:
    args: dict[str, object] = {
        "batch_size": 8, "epochs": 2, "speeds": [1.0, 0.8, 0.6], "progress": False,
        "heartbeat_timeout_s": 5.0, "run_dir": str(tmp_path / "run"),
    }  # fmt: skip
    args.update(overrides)
    model_fn = args.pop("model_fn", make_wide_model)
    return elche.train(model_fn, make_optimizer, step, DATA, **args)  # type: ignore[arg-type]


def one_epoch_bundle(tmp_path: Path) -> str:
    """The stem of the bundle a completed one-epoch run (three ranks) saved after its epoch."""
    stem = str(tmp_path / "bundle" / "run")
    first = train(tmp_path / "a", epochs=1, checkpoint_every=1, save_path=stem,
                  model_fn=make_model)  # fmt: skip
    assert first.summary["outcome"] == "completed"
    return stem


def holder_of(path: Path) -> int | None:
    """The pid of the process (not this one) that has ``path`` open."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            links = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        if str(path) in links:
            return int(entry.name)
    return None


def kill_the_writer_of(fifo: Path, killed: list[int]) -> threading.Thread:
    """Wait for a writer to open ``fifo``, SIGKILL it, then remove the FIFO."""
    os.mkfifo(fifo)

    def catch() -> None:
        with fifo.open("rb"):  # returns once the writer has opened its end
            pid = holder_of(fifo)
            assert pid is not None, "no process holds the FIFO open"
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            fifo.unlink()  # the next writer writes a plain file

    thread = threading.Thread(target=catch, daemon=True)
    thread.start()
    return thread


def test_issue12_item07_a_final_writer_killed_mid_write_is_replaced(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    killed: list[int] = []
    catcher = kill_the_writer_of(run_dir / f"{bundle.FINAL_MODEL}.tmp", killed)
    result = train(tmp_path)
    catcher.join(timeout=5)
    assert killed, "the final writer never opened its file"
    assert result.summary["outcome"] == "completed"
    assert result.summary["dead_ranks"] == [0]  # rank 0, the first writer, died writing
    assert result.summary["lost_samples"] == 0
    assert set(result.state_dict) == set(make_wide_model(torch.device("cpu")).state_dict())


def test_issue12_item08_a_bundle_writer_killed_mid_save_is_replaced(tmp_path: Path) -> None:
    stem = tmp_path / "bundle" / "run"
    stem.parent.mkdir()
    # An older model at the stem, which the bundle must never be paired with.
    torch.save(make_wide_model(torch.device("cpu")).state_dict(), f"{stem}.model.pt")
    killed: list[int] = []
    # Rank 2 crashes, max_failures=1 stops the run: save 1 is the stop's bundle.
    catcher = kill_the_writer_of(stem.parent / f"{bundle.model_name(str(stem), 1)}.tmp", killed)
    result = train(tmp_path, crash={2: 0.5}, max_failures=1, save_path=str(stem))
    catcher.join(timeout=5)
    assert killed, "the bundle's writer never opened its file"
    assert result.summary["outcome"] == "saved_and_shutdown"
    assert sorted(result.summary["dead_ranks"]) == [0, 2]  # type: ignore[arg-type]
    files = bundle_on_disk(str(stem))
    assert files.model.name == bundle.model_name(str(stem), 1)  # written by rank 1 instead
    assert sorted(files.optim) == [1]  # the only survivor's optimizer state
    meta = json.loads(bundle.meta_path(str(stem)).read_text())
    assert meta["files"]["model"]["size"] == files.model.stat().st_size


def test_issue12_item09_a_checkpoint_names_every_ranks_files_and_they_match(
    tmp_path: Path,
) -> None:
    stem = str(tmp_path / "bundle" / "run")
    result = train(tmp_path, checkpoint_every=1, save_path=stem, model_fn=make_model)
    assert result.summary["outcome"] == "completed"
    meta = json.loads(bundle.meta_path(stem).read_text())
    assert meta["save_reason"] == "checkpoint" and meta["epoch"] == 2
    assert sorted(meta["files"]["optim"]) == ["0", "1", "2"]  # every rank's optimizer
    files = bundle_on_disk(stem)
    for path in [files.model, *files.optim.values()]:
        assert path.exists()
    # The first checkpoint's files are gone once the second one committed.
    assert sorted(p.name for p in Path(stem).parent.glob("run.s*")) == sorted(
        p.name for p in [files.model, *files.optim.values()]
    )


def test_issue12_item11_a_resume_is_checked_before_anything_starts(tmp_path: Path) -> None:
    stem = str(tmp_path / "bundle" / "run")
    first = train(tmp_path / "a", epochs=1, checkpoint_every=1, save_path=stem,
                  model_fn=make_model)  # fmt: skip
    assert first.summary["outcome"] == "completed"
    again = {"resume_from": stem, "model_fn": make_model, "run_dir": str(tmp_path / "b")}

    for field, change in [("mode", {"mode": "cpu-cadence"}), ("seed", {"seed": 7}),
                          ("batch_size", {"batch_size": 16})]:  # fmt: skip
        with pytest.raises(ConfigError) as info:
            train(tmp_path, **again, **change)
        assert info.value.field == field
    with pytest.raises(ConfigError, match="does not fit model_fn") as info:
        train(tmp_path, **{**again, "model_fn": make_wide_model})
    files = bundle_on_disk(stem)
    optim = files.optim[1]
    optim.write_bytes(optim.read_bytes() + b"\0")  # a file changed since the save
    with pytest.raises(ConfigError, match="not the file its meta names") as info:
        train(tmp_path, **again)
    assert info.value.field == "resume_from"
    optim.unlink()
    with pytest.raises(ConfigError, match="is missing"):
        train(tmp_path, **again)
    assert not (tmp_path / "b").exists()  # nothing started


def test_issue12_item10_a_final_save_that_fails_keeps_the_trained_model_as_a_bundle(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # Every writer finds a directory where its temporary file should go.
    obstacle = run_dir / f"{bundle.FINAL_MODEL}.tmp"
    obstacle.mkdir()
    stem = str(tmp_path / "bundle" / "run")
    result = train(tmp_path, model_fn=make_model, save_path=stem)
    reason = str(result.summary["reason"])
    # It used to fail the run, and the two trained epochs went with the ranks.
    assert result.summary["outcome"] == "saved_and_shutdown"
    assert "final model could not be written" in reason
    assert "IsADirectoryError" in reason  # each writer's own error
    assert result.summary["bundle"] == stem
    assert result.run_dir == str(run_dir)  # kept, with the ranks' reports
    meta = json.loads(bundle.meta_path(stem).read_text())
    assert (meta["epoch"], meta["epochs"], meta["save_reason"]) == (2, 2, "final_model_unwritten")
    err = capfd.readouterr().err
    assert f"resume_from={stem!r}" in err
    # Resuming it trains nothing and writes the final model: the trained one.
    obstacle.rmdir()
    resumed = train(tmp_path / "again", model_fn=make_model, resume_from=stem)
    assert resumed.summary["outcome"] == "completed"
    assert resumed.summary["epochs_completed"] == 2
    saved = torch.load(bundle_on_disk(stem).model, map_location="cpu")
    assert saved.keys() == resumed.state_dict.keys()
    assert all(torch.equal(saved[k], resumed.state_dict[k]) for k in saved)


def test_issue12_item11_a_bundle_resumes_on_another_world_size(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    stem = one_epoch_bundle(tmp_path)
    capfd.readouterr()
    second = train(tmp_path / "b", epochs=3, speeds=[1.0, 0.5], resume_from=stem,
                   model_fn=make_model)  # fmt: skip
    assert second.summary["outcome"] == "completed"
    assert second.summary["epochs_completed"] == 3 and second.summary["lost_samples"] == 0
    assert [e["epoch"] for e in second.epochs] == [1, 2]
    err = capfd.readouterr().err
    assert "saved by 3 ranks and resumes on 2" in err
    assert "the optimizer states of ranks [2] are not used" in err


class SavedOverOnStart:
    """A ``model_fn`` whose first call in a rank process makes the bundle at ``stem``
    another run's newer save, as a run saving there meanwhile would."""

    def __init__(self, stem: str) -> None:
        self.stem = stem

    def __call__(self, device: torch.device) -> nn.Module:
        if "ELCHE_RANK" in os.environ:  # in a rank, not the launcher's check
            with contextlib.suppress(FileExistsError):  # the first rank does it
                os.close(os.open(f"{self.stem}.saved-over", os.O_CREAT | os.O_EXCL))
                meta = json.loads(bundle.meta_path(self.stem).read_text())
                meta["save_seq"] += 1  # written whole, as a save writes it: another rank
                # checks the same bundle meanwhile
                Path(f"{self.stem}.meta.tmp").write_text(json.dumps(meta))
                os.replace(f"{self.stem}.meta.tmp", bundle.meta_path(self.stem))
        return make_model(device)


def test_a_bundle_saved_over_while_the_run_starts_is_refused_by_every_rank(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # The coordinator planned from the save the launcher checked; the ranks loaded
    # whatever save the stem held when they got there. Another run saving at the
    # stem in between made them train its samples twice, reported "lost 0".
    stem = one_epoch_bundle(tmp_path)
    seq = json.loads(bundle.meta_path(stem).read_text())["save_seq"]
    capfd.readouterr()
    result = train(tmp_path / "b", epochs=2, resume_from=stem, model_fn=SavedOverOnStart(stem))
    assert result.summary["outcome"] == "failed"
    assert result.summary["epochs_completed"] == 1  # nothing trained past the bundle
    err = capfd.readouterr().err
    changed = f"the bundle at {stem} changed after this run checked it (save {seq} then, save"
    assert changed in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # elche's own refusal: its line says it all


def test_issue12_item08_a_stop_whose_meta_cannot_be_written_is_not_announced_as_saved(
    tmp_path: Path,
) -> None:
    stem = tmp_path / "bundle" / "run"
    stem.parent.mkdir()
    (stem.parent / "run.meta.json.tmp").mkdir()  # the meta cannot be written; the files can
    result = train(tmp_path, crash={2: 0.5}, max_failures=1, save_path=str(stem),
                   model_fn=make_model)  # fmt: skip
    assert result.summary["outcome"] == "failed"
    assert "its meta could not be written" in str(result.summary["reason"])
    assert result.summary["bundle"] is None
    assert not bundle.meta_path(str(stem)).exists()


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_checkpoints_a_completed_run_in_a_temporary_dir_asked_for_stay_and_resume(
    ranks: int,
) -> None:
    # No run_dir, no save_path: the run's bundles go to its temporary directory,
    # which a completed run trims to its record. The last bundle checkpoint_every
    # asked for stays, as the summary names it: it was removed with the rest,
    # and resuming it for more epochs said its meta was missing.
    first = elche.train(
        make_model, make_optimizer, step, DATA, batch_size=8, epochs=2, ranks=ranks,
        checkpoint_every=1, progress=False,
    )  # fmt: skip
    assert first.summary["outcome"] == "completed"
    stem = first.summary["bundle"]
    assert isinstance(stem, str) and bundle.meta_path(stem).exists(), stem
    on_disk = bundle_on_disk(stem)
    assert on_disk.model.exists() and all(p.exists() for p in on_disk.optim.values())
    kept = {p.name for p in Path(stem).parent.iterdir()}
    assert {"summary.json", "timeline.jsonl"} <= kept and "final_model.pt" not in kept, kept
    more = elche.train(
        make_model, make_optimizer, step, DATA, batch_size=8, epochs=3, ranks=ranks,
        resume_from=stem, progress=False,
    )  # fmt: skip
    assert more.summary["outcome"] == "completed"
    assert more.summary["epochs_completed"] == 3 and more.summary["lost_samples"] == 0
