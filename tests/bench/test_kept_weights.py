"""``bench.kept_weights``: elche's evals in the bench are copies, evaluated after the clock."""

from __future__ import annotations

import errno
import multiprocessing
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from elche.baselines.ddp import eval_snapshots, snapshot
from elche.bench.kept_weights import SUFFIX, KeepWeights, evaluate_kept, keeping
from elche.bench.runner import _kept_evals
from elche.workloads import get as get_workload
from tests.promises.test_storage import fill, small_disk


def test_each_kept_copy_is_numbered_and_evaluated_after_the_clock(tmp_path: Path) -> None:
    work = get_workload("digits-ae")
    _, test_set = work.load_split(0)
    model = work.make_model("cpu")
    keep = KeepWeights(str(tmp_path))
    expected = []
    for number, scale in enumerate((1.0, 0.0)):  # the second copy differs: all-zero weights
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        assert keep(model, test_set) == number  # nothing evaluated in the clock
        expected.append(work.eval_fn(model, test_set))
    assert not list(tmp_path.glob(f"*{SUFFIX}"))  # nor written: the copies are in memory
    kept, final = evaluate_kept("digits-ae", tmp_path, test_set, final=snapshot(model))
    assert kept == pytest.approx(expected)
    assert final == pytest.approx(expected[1])
    assert expected[0] != expected[1]


def test_a_snapshot_equal_to_the_one_before_is_not_evaluated_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import elche.workloads.digits_ae as module

    work = get_workload("digits-ae")
    _, test_set = work.load_split(0)
    model = work.make_model("cpu")
    calls: list[int] = []

    def counting(m: torch.nn.Module, dataset: object) -> float:
        calls.append(1)
        return float(len(calls))

    monkeypatch.setattr(module, "eval_fn", counting)
    first = snapshot(model)
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in first.items()}
    evals = eval_snapshots("digits-ae", [first, snapshot(model), changed, first], test_set)
    assert evals == [1.0, 1.0, 2.0, 3.0]  # equal neighbours share one pass; not-neighbours do not


def test_snapshots_are_evaluated_on_every_core_and_the_rank_keeps_its_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import elche.workloads.digits_ae as module

    work = get_workload("digits-ae")
    _, test_set = work.load_split(0)
    seen: list[int] = []

    def threads_seen(m: torch.nn.Module, dataset: object) -> float:
        seen.append(torch.get_num_threads())
        return 0.0

    monkeypatch.setattr(module, "eval_fn", threads_seen)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank trains
    try:
        eval_snapshots("digits-ae", [snapshot(work.make_model("cpu"))], test_set)
        assert torch.get_num_threads() == 1  # the rank's own setting, back
    finally:
        torch.set_num_threads(threads)
    assert seen == [len(os.sched_getaffinity(0))]


def test_each_epoch_gets_the_eval_of_the_copy_it_names() -> None:
    rows = [{"epoch": 0, "eval": 1.0}, {"epoch": 1, "eval": None}, {"epoch": 2, "eval": 0.0}]
    assert [r["eval"] for r in _kept_evals(rows, [0.5, 0.9])] == [0.9, None, 0.5]
    with pytest.raises(ValueError, match="epoch 3: copy 2 of 2 kept"):
        _kept_evals([{"epoch": 3, "eval": 2.0}], [0.5, 0.9])


def _keep_in_a_child(directory: str) -> None:
    work = get_workload("digits-ae")
    KeepWeights(directory)(work.make_model("cpu"), None)


def test_a_rank_process_writes_its_copies_when_it_exits(tmp_path: Path) -> None:
    work = get_workload("digits-ae")
    _, test_set = work.load_split(0)
    child = multiprocessing.get_context("fork").Process(
        target=_keep_in_a_child, args=(str(tmp_path),)
    )
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert [p.name for p in tmp_path.iterdir()] == [f"000000{SUFFIX}"]
    kept, _ = evaluate_kept("digits-ae", tmp_path, test_set, final=snapshot(work.make_model("cpu")))
    assert kept == pytest.approx([work.eval_fn(work.make_model("cpu"), test_set)])


def test_a_run_ended_unevaluated_leaves_its_copies_to_no_other_process_or_run(
    tmp_path: Path,
) -> None:
    # A run in the bench's own process (ranks=1) that failed after keeping copies left
    # them held: a child forked later wrote them at its exit, and the next run's
    # evaluate_kept wrote them again, failing on their numbers' files (FileNotFoundError).
    work = get_workload("digits-ae")
    _, test_set = work.load_split(0)
    failed, held, child_s = tmp_path / "failed", tmp_path / "held", tmp_path / "child"
    with pytest.raises(RuntimeError), keeping(failed):
        KeepWeights(str(failed))(work.make_model("cpu"), None)
        raise RuntimeError("the run failed")
    held.mkdir()
    KeepWeights(str(held))(work.make_model("cpu"), None)  # this process's, held
    with keeping(child_s):
        child = multiprocessing.get_context("fork").Process(
            target=_keep_in_a_child, args=(str(child_s),)
        )
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        assert [p.name for p in held.iterdir()] == ["000000.reserved"]  # the parent's, unwritten
        kept, _ = evaluate_kept(
            "digits-ae", child_s, test_set, final=snapshot(work.make_model("cpu"))
        )
    assert len(kept) == 1
    assert [p.name for p in failed.iterdir()] == ["000000.reserved"]  # dropped, never written
    assert [p.name for p in held.iterdir()] == ["000000.reserved"]  # not the other run's to write
    kept, _ = evaluate_kept("digits-ae", held, test_set, final=snapshot(work.make_model("cpu")))
    assert len(kept) == 1


def test_a_copy_whose_process_died_unwritten_is_named(tmp_path: Path) -> None:
    work = get_workload("digits-ae")
    _, test_set = work.load_split(0)
    (tmp_path / "000000.reserved").touch()  # a number taken by a process killed before its exit
    with pytest.raises(RuntimeError, match=r"never written .*000000\.reserved"):
        evaluate_kept("digits-ae", tmp_path, test_set, final=snapshot(work.make_model("cpu")))


def _keep_two_in_a_child(directory: str) -> None:
    work = get_workload("digits-ae")
    keep = KeepWeights(directory)
    keep(work.make_model("cpu"), None)
    keep(work.make_model("cpu"), None)


def test_a_copy_a_full_disk_refused_is_named_with_the_reason(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # The rank's exit thread wrote its copies on a full disk: torch.save's own error, a
    # two-exception traceback on the rank's stderr, a .tmp left, and the bench said
    # the copies' process had died.
    work = get_workload("digits-ae")
    _, test_set = work.load_split(0)
    with small_disk(tmp_path / "disk", "256k") as disk:
        kept = disk / "kept"
        kept.mkdir()
        fill(disk)
        child = multiprocessing.get_context("fork").Process(
            target=_keep_two_in_a_child, args=(str(kept),)
        )
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        with pytest.raises(OSError) as info:
            evaluate_kept("digits-ae", kept, test_set, final=snapshot(work.make_model("cpu")))
        left = sorted(p.name for p in kept.iterdir())
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == f"[Errno 28] No space left on device: '{kept}/000000{SUFFIX}'"
    assert left == ["000000.unwritten-ENOSPC", "000001.unwritten-ENOSPC"]  # no partial file
    assert "Traceback" not in capfd.readouterr().err


def _keep_then_exit_when_told(directory: str, kept: Any, go: Any) -> None:
    KeepWeights(directory)(get_workload("digits-ae").make_model("cpu"), None)
    kept.set()
    go.wait(60)


def test_a_copy_a_read_only_disk_refused_is_said_so(tmp_path: Path) -> None:
    # A read-only disk takes no rename either: the number stays reserved, and the
    # bench said the copies' process had died.
    work = get_workload("digits-ae")
    _, test_set = work.load_split(0)
    fork = multiprocessing.get_context("fork")
    kept_one, go = fork.Event(), fork.Event()
    with small_disk(tmp_path / "disk", "256k") as disk:
        kept = disk / "kept"
        kept.mkdir()
        child = fork.Process(target=_keep_then_exit_when_told, args=(str(kept), kept_one, go))
        child.start()
        assert kept_one.wait(60)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        go.set()
        child.join(timeout=60)
        assert child.exitcode == 0
        with pytest.raises(RuntimeError) as info:
            evaluate_kept("digits-ae", kept, test_set, final=snapshot(work.make_model("cpu")))
    assert str(info.value).startswith(
        f"kept copies never written (cannot write in {kept}: [Errno 30] Read-only file system"
    )
    assert str(info.value).endswith(": ['000000.reserved']")
