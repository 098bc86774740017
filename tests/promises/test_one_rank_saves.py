"""One rank keeps the promises several ranks keep: checkpoint bundles, and a stop that saves.

``elche.train(ranks=1)`` trains in the caller's process. It used to ignore
``save_path`` and ``checkpoint_every`` (no bundle was ever written) and to lose
everything on Ctrl-C. The signals here are real: the step function sends them
to its own process, so each lands at a known step.
"""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elche
from elche.core.checkpoint import CheckpointMeta, SaveReason
from elche.runtime.bundle import meta_path
from tests.promises.test_storage import fill, small_disk
from tests.promises.tiny import make_model

DATA = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
BATCH = 16  # four steps an epoch


def momentum_sgd(params: object) -> torch.optim.Optimizer:
    """With momentum, so a resume that lost the optimizer's state would show."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


class SignalAt:
    """A step function that sends ``signals`` to this process during training step ``at``
    (counted from 1; 0: never)."""

    def __init__(self, at: int, *signals: signal.Signals, before: object = None) -> None:
        self.signals, self.before, self.calls = signals, before, 0
        self.at = at + warm_up_calls() if at else 0

    def __call__(self, model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            if callable(self.before):
                self.before()
            for sig in self.signals:
                os.kill(os.getpid(), sig)
        return nn.functional.cross_entropy(model(batch[0]), batch[1])


@functools.cache
def warm_up_calls() -> int:
    """How often a run calls the step function before its first step (its warm-up)."""
    counter = SignalAt(0)
    train(counter, epochs=1)
    return counter.calls - len(DATA) // BATCH


def train(step: object, **kwargs: object) -> elche.TrainResult:
    options: dict[str, object] = {"batch_size": BATCH, "epochs": 3, "ranks": 1, "progress": False}
    return elche.train(make_model, momentum_sgd, step, DATA, **(options | kwargs))  # type: ignore[arg-type]


def read_meta(stem: Path) -> CheckpointMeta:
    return CheckpointMeta.from_json(meta_path(str(stem)).read_text(encoding="utf-8"))


def test_one_rank_writes_a_bundle_every_checkpoint_every_epochs(tmp_path: Path) -> None:
    stem = tmp_path / "bundle"
    run_dir = str(tmp_path / "run")
    result = train(SignalAt(0), save_path=str(stem), checkpoint_every=1, run_dir=run_dir)
    assert result.summary["outcome"] == "completed"
    assert [b["seq"] for b in result.summary["bundles"]] == [1, 2, 3]  # after epochs 1-3
    meta = read_meta(stem)
    assert (meta.epoch, meta.reason, meta.save_seq, meta.world_size) == (
        3, SaveReason.CHECKPOINT, 3, 1,
    )  # fmt: skip
    assert meta.global_step == 3 * len(DATA) // BATCH
    assert meta.coverage == ()
    assert meta.files is not None
    kept = sorted(p.name for p in tmp_path.glob("bundle.s*"))
    assert kept == sorted(meta.files.names())  # the superseded save's files are gone


def test_a_completed_one_rank_run_resumed_for_more_epochs_trains_only_the_new_ones(
    tmp_path: Path,
) -> None:
    # One rank saved no checkpoint after its last epoch (several ranks do): its bundle
    # was the one before, and a resume for more epochs trained the last epoch again.
    stem = tmp_path / "bundle"
    first = train(SignalAt(0), epochs=2, save_path=str(stem), checkpoint_every=1)
    assert first.summary["outcome"] == "completed"
    assert read_meta(stem).epoch == 2
    more = train(SignalAt(0), epochs=3, resume_from=str(stem))
    assert [e["epoch"] for e in more.epochs] == [2]
    assert more.summary["per_rank"][0]["samples"] == len(DATA)  # type: ignore[index]
    whole = train(SignalAt(0), epochs=3)
    for name, tensor in whole.state_dict.items():  # the same steps on the same state
        assert torch.equal(tensor, more.state_dict[name]), name


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_on_one_rank_saves_a_bundle_that_resumes_to_the_same_model(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], sig: signal.Signals, code: int
) -> None:
    whole = train(SignalAt(0))
    stem = tmp_path / "bundle"
    with pytest.raises(elche.Interrupted) as info:
        train(SignalAt(7, sig), save_path=str(stem))  # in epoch 1's third step
    stop = info.value
    assert (stop.code, stop.signal, stop.bundle) == (code, sig, str(stem))
    assert stop.result.summary["outcome"] == "saved_and_shutdown"
    line = capfd.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"elche: interrupted by {sig.name}; the run is saved under {stem};")
    meta = read_meta(stem)
    assert (meta.epoch, meta.reason, meta.global_step) == (1, SaveReason.GRACEFUL_SHUTDOWN, 7)
    (started,) = meta.coverage
    assert (started.epoch, started.uncovered) == (1, ((3 * BATCH, BATCH),))  # its last step
    resumed = train(SignalAt(0), resume_from=str(stem))
    assert resumed.summary["outcome"] == "completed"
    samples = [r.summary["per_rank"][0]["samples"] for r in (stop.result, resumed)]
    assert sum(samples) == 3 * len(DATA)
    for name, tensor in whole.state_dict.items():  # the same steps on the same state
        assert torch.equal(tensor, resumed.state_dict[name]), name


def test_a_stop_between_epochs_on_one_rank_lists_no_started_epoch(tmp_path: Path) -> None:
    stem = tmp_path / "bundle"
    with pytest.raises(elche.Interrupted):
        train(SignalAt(4, signal.SIGINT), save_path=str(stem))  # epoch 0's last step
    meta = read_meta(stem)
    assert meta.epoch == 1
    assert [c.uncovered for c in meta.coverage] == [((0, len(DATA)),)]  # epoch 1, untouched


def test_a_second_signal_stops_one_rank_at_once_saving_nothing(tmp_path: Path) -> None:
    stem = tmp_path / "bundle"
    with pytest.raises(KeyboardInterrupt) as info:
        train(SignalAt(5, signal.SIGINT, signal.SIGINT), save_path=str(stem))
    assert not isinstance(info.value, elche.Interrupted)
    assert not meta_path(str(stem)).exists()


def test_a_one_rank_stop_whose_bundle_cannot_be_written_says_why(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with small_disk(tmp_path / "disk", "256k") as disk:
        stem = disk / "bundle"
        with pytest.raises(elche.Interrupted) as info:
            train(SignalAt(6, signal.SIGINT, before=lambda: fill(disk)), save_path=str(stem))
        assert info.value.bundle is None
        assert info.value.code == 130
        assert sorted(p.name for p in disk.iterdir()) == ["ballast", "bundle.lock"]
    summary = info.value.result.summary
    assert summary["outcome"] == "failed"
    assert "No space left on device" in summary["reason"]
    err = capfd.readouterr().err
    assert err.count("could not be written") == 1  # said once, in the one line
    line = err.strip().splitlines()[-1]
    assert line.startswith(
        "elche: interrupted by SIGINT; nothing could be saved: graceful_shutdown:"
    )


def test_ctrl_c_in_a_one_rank_session_loop_saves_a_bundle_that_resumes(tmp_path: Path) -> None:
    # The signal lands on the main thread, in the script's own loop; the session's
    # rank trains on a thread of its own and stops there, between two steps.
    stem = tmp_path / "bundle"

    def run(stop_at: int, **kwargs: object) -> elche.TrainResult:
        model = make_model(torch.device("cpu"))
        optimizer = momentum_sgd(model.parameters())
        with elche.Session(model, optimizer, DATA, batch_size=BATCH, epochs=3, **kwargs) as s:
            for batch, (x, y) in enumerate(s, start=1):
                if batch == stop_at:
                    os.kill(os.getpid(), signal.SIGINT)
                s.step(nn.functional.cross_entropy(model(x), y))
        return s.result

    with pytest.raises(elche.Interrupted) as info:
        run(warm_up_calls() + 6, save_path=str(stem))
    assert info.value.bundle == str(stem)
    trained = info.value.result.summary["per_rank"][0]["samples"]
    assert 0 < trained < 3 * len(DATA)
    resumed = run(0, resume_from=str(stem))
    assert resumed.summary["outcome"] == "completed"
    assert trained + resumed.summary["per_rank"][0]["samples"] == 3 * len(DATA)


def test_one_rank_removes_the_files_of_saves_that_never_committed_at_its_stem(
    tmp_path: Path,
) -> None:
    # A writer killed mid-write leaves its temporary file; a save that failed on
    # another host, its files. Nothing removed them at a stem one rank saves at.
    stem = tmp_path / "run"
    leftovers = [tmp_path / "run.s3.model.pt.tmp", tmp_path / "run.s2.rank1.optim.pt"]
    for path in leftovers:
        path.write_bytes(b"\0" * 1024)
    result = elche.train(make_model, momentum_sgd, SignalAt(0), DATA, batch_size=BATCH,
                         epochs=2, ranks=1, checkpoint_every=1, save_path=str(stem),
                         progress=False)  # fmt: skip
    assert result.summary["outcome"] == "completed"
    meta = CheckpointMeta.from_json(meta_path(str(stem)).read_text())
    assert meta.files is not None and meta.save_seq >= 4  # numbered past the leftovers
    assert sorted(p.name for p in tmp_path.glob("run.s*")) == sorted(meta.files.names())
