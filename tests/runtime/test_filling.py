"""The ``FillSavePath`` fault fills a small tmpfs, and nothing else (``elche.runtime.filling``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from elche.runtime.filling import FILL_FILE, fill_file_system


def test_a_folder_not_on_a_small_tmpfs_is_never_filled(tmp_path: Path) -> None:
    said = fill_file_system(tmp_path)
    assert said.startswith(f"not filling {tmp_path}")
    assert not (tmp_path / FILL_FILE).exists()


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None,
    reason="mounting a tmpfs needs root",
)
def test_a_small_tmpfs_is_filled_until_a_write_fails(tmp_path: Path) -> None:
    folder = tmp_path / "bundle"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], check=True)
    try:
        assert fill_file_system(folder).startswith(f"filled {folder}")
        with pytest.raises(OSError, match="No space left"):
            (folder / "model.pt").write_bytes(b"x" * 8192)
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)
    assert not any(folder.iterdir())  # unmounted: the folder underneath is as it was
