"""What a collective round costs, as the balancer sees it.

A rank that trains through its round (``overlap``) acknowledges it late, by
the steps it took meanwhile; it says how long it trained (``through_ms``),
and the round's duration (``SyncEnd.duration_ms``, the balancer's fixed cost
per window) counts only what the round held each rank.
"""

from __future__ import annotations

import pytest

from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.commands import Emit
from tests.core.harness import Harness


def _round_in_flight() -> Harness:
    h = Harness(num_samples=6400)
    h.form()
    h.train_window({0: 10.0, 1: 40.0})
    assert h.core.round.in_flight
    return h


def _duration_ms(h: Harness) -> float:
    ends = [c.event for c in h.log if isinstance(c, Emit) and isinstance(c.event, tl.SyncEnd)]
    return ends[-1].duration_ms


@pytest.mark.parametrize(
    ("through_ms", "want_ms"),
    [
        ((0.0, 0.0), 600.0),  # both waited for it: the last ack's arrival
        ((400.0, 0.0), 600.0),  # rank 1 waited to the end
        ((400.0, 550.0), 100.0),  # both trained through it: held 100 and 50 ms
        ((900.0, 900.0), 0.0),  # more than the whole round: never before its start
    ],
)
def test_a_round_costs_what_it_held_the_ranks(
    through_ms: tuple[float, float], want_ms: float
) -> None:
    h = _round_in_flight()
    rnd, start = h.core.round, h.core.round.started_s
    for rank, at in ((0, 0.5), (1, 0.6)):
        h.now = start + at
        steps = h.core.work.steps_since_sync(rank)
        h.send(rank, m.SyncAck(round=rnd.number, steps=steps, through_ms=through_ms[rank]))
    assert not h.core.round.in_flight
    assert _duration_ms(h) == pytest.approx(want_ms)
