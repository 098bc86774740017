"""A rank cut off for good raises ``RankExcluded`` instead of returning an empty result.

Its coordinator went silent (``CoordinatorLost``), and rank 0's result board,
across the same cut, shares nothing either: the run, if it goes on, goes on
without this rank, which must not look like a finished run to its script.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elche.core.errors import RankExcluded
from elche.runtime.launched import _other_rank_result
from elche.runtime.plan import TrainResult


class SilentBoard:
    """Rank 0's result board, out of reach: nothing comes."""

    def __init__(self) -> None:
        self.left = False

    def read(self, timeout_s: float) -> None:
        return None

    def leave(self) -> None:
        self.left = True


class SharingBoard(SilentBoard):
    def read(self, timeout_s: float) -> dict[str, object]:  # type: ignore[override]
        return {"summary": {"outcome": "saved_and_shutdown"}, "epochs": []}


def other_rank_result(
    report: dict[str, object], state: dict[str, torch.Tensor], board: SilentBoard, directory: Path
) -> TrainResult:
    """As a rank but 0 takes its result (no summary of the coordinator's on this host)."""
    return _other_rank_result(report, state, board, plan=None, directory=directory, t0=0.0)  # type: ignore[arg-type]


def test_a_rank_that_lost_its_coordinator_and_hears_nothing_from_rank_0_is_excluded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "2")
    state = {"w": torch.zeros(1)}
    lost = {"stopped": "coordinator lost: no word from the coordinator for 10 s"}
    with pytest.raises(RankExcluded) as info:
        other_rank_result(lost, state, SilentBoard(), tmp_path)
    assert info.value.rank == 2
    assert "lost the coordinator (no word from the coordinator for 10 s)" in str(info.value)
    # rank 0 salvaged the run (the coordinator could not be restarted): its summary holds
    shared = other_rank_result(lost, state, SharingBoard(), tmp_path)
    assert shared.summary == {"outcome": "saved_and_shutdown"}
    # a rank that finished, whose rank 0 shared nothing: its model, no summary, as before
    done = other_rank_result({"stopped": "done"}, state, SilentBoard(), tmp_path)
    assert done.summary == {} and done.state_dict is state


def test_a_torchrun_worker_whose_rank_ended_and_hears_nothing_from_rank_0_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its rank's process ended (its error said; say the group store stopped answering)
    # and rank 0's host is gone: the worker returned an empty result, no model and no
    # summary, and the script went on as if the run had ended (torchrun: exit 0).
    from elche.runtime.launched import CHILD_LOST

    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError) as info:
        other_rank_result({"stopped": CHILD_LOST}, {}, SilentBoard(), tmp_path)
    assert str(info.value) == (
        "rank 1's process ended (said above); rank 0 shared no run summary, and the "
        "coordinator's is not on this host"
    )
    # the run went on without it, and rank 0 shared its result: that, as before
    shared = other_rank_result({"stopped": CHILD_LOST}, {}, SharingBoard(), tmp_path)
    assert shared.summary == {"outcome": "saved_and_shutdown"}
