"""Fixtures of the runtime's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    """A gloo world of this one process (a ``FileStore``: no ports), destroyed even on failure."""
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
