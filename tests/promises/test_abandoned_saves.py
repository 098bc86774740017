"""Saves that never commit leave no files behind (real processes, a real small disk).

A save that fails (a full disk, a file that cannot be created) is abandoned by
the coordinator. Its files, whole or not, are of no use to anyone: no meta
will ever name them. They used to stay, and on a nearly full disk they made
every later save fail too.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch

from elche.core.checkpoint import CheckpointMeta
from elche.runtime import bundle
from tests.promises.test_saves_commit import make_wide_model, train
from tests.promises.test_storage import small_disk
from tests.promises.tiny import bundle_on_disk

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PAGE = 4096


def model_bytes() -> int:
    """The size of the wide model's file (``torch.save`` of its state)."""
    buf = io.BytesIO()
    torch.save(make_wide_model(torch.device("cpu")).state_dict(), buf)
    return len(buf.getvalue())


def leave_free(disk: Path, free_bytes: int) -> None:
    """Fill ``disk`` with a ballast file until ``free_bytes`` are left."""
    stat = os.statvfs(disk)
    ballast = stat.f_bavail * stat.f_frsize - free_bytes
    assert ballast > 0, "the disk is too small for the test"
    with (disk / "ballast").open("wb") as fh:
        fh.write(b"\0" * (ballast // PAGE * PAGE))


def bundle_files(disk: Path) -> list[str]:
    """The plain files of saves at the stem ``disk/run``."""
    return sorted(p.name for p in disk.glob("run.s*") if p.is_file())


def test_an_abandoned_save_leaves_no_files_and_the_next_save_fits(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with small_disk(tmp_path / "disk", "2m") as disk:
        # Save 2 cannot commit: each rank finds a directory where its optimizer
        # state's temporary file goes (the writer writes its model first).
        for rank in (0, 1):
            (disk / f"run.s2.rank{rank}.optim.pt.tmp").mkdir()
        # Room for the committed bundle and one more save, not for a third model.
        leave_free(disk, 5 * model_bytes() // 2 + 8 * PAGE)
        stem = str(disk / "run")
        result = train(tmp_path, epochs=3, speeds=[1.0, 1.0], checkpoint_every=1, save_path=stem)
        err = capfd.readouterr().err
        assert result.summary["outcome"] == "completed", err[-3000:]
        assert "checkpoint bundle 2 was not written" in err, err[-3000:]
        # The save after the abandoned one fits: the abandoned one's model is gone.
        assert "checkpoint bundle 3 was not written" not in err, err[-3000:]
        meta = json.loads(bundle.meta_path(stem).read_text())
        assert meta["save_seq"] == 3
        files = bundle_on_disk(stem)
        assert bundle_files(disk) == sorted(p.name for p in [files.model, *files.optim.values()])


def test_the_files_of_a_runs_last_save_that_failed_go_too(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # No later save prunes them: the coordinator's word that the save is
    # abandoned does. The writer's model was whole, and stayed.
    folder = tmp_path / "bundle"
    folder.mkdir()
    for rank in (0, 1):
        (folder / f"run.s2.rank{rank}.optim.pt.tmp").mkdir()
    stem = str(folder / "run")
    result = train(tmp_path, epochs=2, speeds=[1.0, 1.0], checkpoint_every=1, save_path=stem)
    err = capfd.readouterr().err
    assert result.summary["outcome"] == "completed", err[-3000:]
    assert "checkpoint bundle 2 was not written" in err, err[-3000:]
    assert json.loads(bundle.meta_path(stem).read_text())["save_seq"] == 1
    files = bundle_on_disk(stem)
    assert bundle_files(folder) == sorted(p.name for p in [files.model, *files.optim.values()])


def test_checkpoints_whose_meta_cannot_be_written_leave_the_bundle_before_them_whole(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # The coordinator counted a checkpoint committed once it asked for its meta,
    # written or not: the next save's ranks then removed the files of the bundle the
    # meta on disk still named, which no longer resumed ("... is missing").
    stem = str(tmp_path / "bundle" / "run")
    first = train(tmp_path / "a", epochs=1, speeds=[1.0, 1.0], checkpoint_every=1,
                  save_path=stem)  # fmt: skip
    assert first.summary["outcome"] == "completed"
    (tmp_path / "bundle" / "run.meta.json.tmp").mkdir()  # no meta can be written now
    second = train(tmp_path / "b", epochs=3, speeds=[1.0, 1.0], checkpoint_every=1,
                   save_path=stem, resume_from=stem)  # fmt: skip
    err = capfd.readouterr().err
    assert second.summary["outcome"] == "completed", err[-3000:]
    assert err.count("could not write the checkpoint meta") == 2, err[-3000:]
    meta = CheckpointMeta.from_json(bundle.meta_path(stem).read_text())
    assert meta.save_seq == 1
    files = bundle_on_disk(stem)
    assert meta.files is not None
    bundle.verify(files.model, meta.files.model, what="model")  # whole, as committed
    for rank, entry in meta.files.optim:
        bundle.verify(files.optim[rank], entry, what="optimizer state")
    # The saves whose meta never came left nothing either.
    assert bundle_files(tmp_path / "bundle") == sorted(
        p.name for p in [files.model, *files.optim.values()]
    )
