"""The balancer's phase order and its saved state's JSON form."""

from __future__ import annotations

import pytest

from elche.core.elche_state import ElCheState, Phase
from elche.core.errors import ConfigError
from elche.core.scheduler import ElChe


def test_phase_order() -> None:
    assert Phase.PROBE < Phase.WARMUP < Phase.STABLE < Phase.MATURE
    assert Phase.MATURE >= Phase.STABLE
    assert Phase.WARMUP <= Phase.WARMUP
    assert [p.order for p in Phase] == [0, 1, 2, 3]
    assert [p.value for p in Phase] == ["probe", "warmup", "stable", "mature"]


def test_state_json_round_trip() -> None:
    state = ElCheState(
        anchor=12,
        anchor_rank=1,
        smoothed_ms_per_batch=(50.0, 100.0),
        phase=Phase.STABLE,
        calibration_count=7,
        trend_history=(0.01, 0.02),
    )
    doc = state.to_json()
    assert doc["phase"] == "stable"
    assert ElCheState.from_json(doc) == state


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"phase": "Stable"}, "phase"),
        ({"anchor": 0}, "anchor"),
        ({"anchor": "12"}, "anchor"),
        ({"anchor_rank": True}, "anchor_rank"),
        ({"smoothed_ms_per_batch": [1.0, None]}, "smoothed_ms_per_batch"),
        ({"smoothed_ms_per_batch": [-1.0]}, "smoothed_ms_per_batch"),
        ({"calibration_count": -1}, "calibration_count"),
        ({"trend_history": "x"}, "trend_history"),
    ],
)
def test_state_json_rejects_bad_fields(patch: dict[str, object], field: str) -> None:
    doc: dict[str, object] = {**ElChe(2, 10).to_state().to_json(), **patch}
    with pytest.raises(ConfigError) as info:
        ElCheState.from_json(doc)
    assert info.value.field == field
