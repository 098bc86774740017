"""``Worker.wait_peers_started``: paced ranks time their step after peers start.

On a small machine a rank that times its solo step while its peers still
import torch measures a slow step and then runs slower than its ``speed``.
Without a process group (coordinator modes, local launch), each rank marks
``started.rank<r>`` in the run dir; a paced rank waits for every mark, at
most ``coordinator_timeout_s``. The method reads only ``self.spec``, so these
tests call it on a stand-in holding a real ``RankSpec``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace

from elche.core.faults import SlowDown
from elche.runtime.worker import RankSpec, Worker


def spec(tmp_path: Path, *, rank: int, speed: float, timeout_s: float = 5.0) -> RankSpec:
    return RankSpec(
        rank=rank, world_size=2, address="tcp://127.0.0.1:1", secret_hex="00",
        run_dir=str(tmp_path), mode="cpu-cadence", seed=0, num_samples=1, speed=speed,
        coordinator_timeout_s=timeout_s,
    )  # fmt: skip


def wait(s: RankSpec) -> float:
    started = time.monotonic()
    Worker.wait_peers_started(SimpleNamespace(spec=s))  # type: ignore[arg-type]  # reads .spec only
    return time.monotonic() - started


def test_a_full_speed_rank_marks_itself_and_never_waits(tmp_path: Path) -> None:
    assert wait(spec(tmp_path, rank=0, speed=1.0)) < 0.5
    assert (tmp_path / "started.rank0").exists()


def test_a_paced_rank_goes_on_once_every_peer_has_marked(tmp_path: Path) -> None:
    (tmp_path / "started.rank0").touch()
    assert wait(spec(tmp_path, rank=1, speed=0.5)) < 0.5
    assert (tmp_path / "started.rank1").exists()


def test_a_paced_rank_gives_up_waiting_after_the_timeout(tmp_path: Path) -> None:
    took = wait(spec(tmp_path, rank=1, speed=0.5, timeout_s=0.1))
    assert 0.1 <= took < 1.0  # pacing, not safety: it times its step anyway


def test_a_full_speed_rank_that_will_slow_down_waits_like_a_paced_one(tmp_path: Path) -> None:
    slowed = dataclasses.replace(
        spec(tmp_path, rank=1, speed=1.0, timeout_s=0.1),
        faults=(SlowDown(rank=1, at_epoch=1.0, speed=0.5),),
    )
    assert 0.1 <= wait(slowed) < 1.0  # it will time its step, so it waits for rank 0
