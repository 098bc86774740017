"""``bundle.write_file``: what a rank reports when its file cannot be written."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from elche.runtime import bundle


def test_a_full_disk_under_torch_save_is_the_os_error_naming_the_file(tmp_path: Path) -> None:
    # torch.save turns the file's ENOSPC into "RuntimeError: [enforce fail at
    # inline_container.cc:672] . unexpected pos 66624 vs 66576", which the user saw
    # as the reason their checkpoint was not written (here, where the file's close
    # fails too, it was an OSError naming no file).
    path = tmp_path / "run.s1.model.pt"
    (tmp_path / "run.s1.model.pt.tmp").symlink_to("/dev/full")  # every write: ENOSPC
    with pytest.raises(OSError) as info:
        bundle.write_file(path, lambda f: torch.save({"w": torch.zeros(4096)}, f), kind="model")
    assert info.value.errno == errno.ENOSPC
    assert str(path) in str(info.value)
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone


def test_an_error_of_the_writer_itself_passes_through(tmp_path: Path) -> None:
    def fails(f: object) -> None:
        raise ValueError("not a state dict")

    with pytest.raises(ValueError, match="not a state dict"):
        bundle.write_file(tmp_path / "x", fails, kind="model")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_gone_is_the_os_error_naming_the_file_not_its_temporary_name(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gone" / "run.s1.model.pt"  # the temporary file cannot be opened
    with pytest.raises(OSError) as info:
        bundle.write_file(path, lambda f: torch.save({"w": torch.zeros(4)}, f), kind="model")
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(path)
