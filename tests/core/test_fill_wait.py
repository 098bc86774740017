"""``cadence``: a rank out of budget mid-epoch trains on while its peers finish theirs.

Budgets are sized by each rank's smoothed pace; when a peer runs slower than
its pace, a rank that trained its budget would hold for it. With
``SchedulerConfig.fill_wait`` (the default) it is given as many of its own
steps as end before the late peer is expected to end its budget. These tests
drive the coordinator on a clock: each rank's batches end at its own pace,
and the coordinator hears them in the order they end.
"""

from __future__ import annotations

from elche.core import messages as m
from elche.core.config import SchedulerConfig
from elche.core.coordinator import RunState
from tests.core.harness import Harness, messages


class Clocked:
    """Ranks training at their own pace, heard by the coordinator in time order."""

    def __init__(self, h: Harness, ms: dict[int, float]) -> None:
        self.h = h
        self.ms = dict(ms)
        self.free_s = dict.fromkeys(ms, 0.0)  # when each rank's last batch ended
        self.ends: dict[int, list[float]] = {r: [] for r in ms}  # every batch's end, per rank
        self.gates: list[float] = []  # when each SyncNow went out

    def until_round(self) -> int:
        """Train until a round is ordered and every member serves it; returns its number."""
        h = self.h
        while not h.core.round.in_flight:
            ready = [r for r in h.core.live if h.chunks[r]]
            assert ready, "no rank can train and no round was ordered"
            rank = min(ready, key=lambda r: self.free_s[r] + self.ms[r] / 1000)
            self._idle_until(self.free_s[rank] + self.ms[rank] / 1000)
            out = h.train(rank, 1, batch_ms=self.ms[rank])
            self.free_s[rank] = h.now
            self.ends[rank].append(h.now)
            if messages(out, m.SyncNow):
                self.gates.append(h.now)
        number = h.core.round.number
        for rank in sorted(h.core.round.members):  # the round lands at once
            h.send(rank, m.SyncAck(round=number, steps=h.core.work.steps_since_sync(rank)))
            self.free_s[rank] = h.now
        return number

    def _idle_until(self, now_s: float) -> None:
        """Move the clock on; a rank with no work starts its next when it gets it."""
        for rank in self.h.core.live:
            if not self.h.chunks[rank]:
                self.free_s[rank] = now_s
        self.h.now = now_s


def _two_ranks(*, fill_wait: bool) -> tuple[Harness, Clocked]:
    """Ranks at 10 and 40 ms a batch, calibrated over two rounds."""
    h = Harness(num_samples=64_000, scheduler=SchedulerConfig(max_anchor=10), fill_wait=fill_wait)
    h.form()
    run = Clocked(h, {0: 10.0, 1: 40.0})
    for _ in range(2):
        run.until_round()
    return h, run


def _late_window(h: Harness, run: Clocked) -> tuple[int, int, float]:
    """Rank 1 runs at 60 ms a batch in the next window, its budget sized at 40.

    Returns rank 0's budget as planned, the steps it trained in the
    window, and how long it waited for the round at the end.
    """
    planned = h.core.planner.budget[0]
    run.ms[1] = 60.0
    run.until_round()
    gate = run.gates[-1]
    last = max(t for t in run.ends[0] if t <= gate)
    trained = sum(1 for t in run.ends[0] if run.gates[-2] < t <= gate)
    return planned, trained, gate - last


def test_a_rank_out_of_budget_trains_on_until_its_late_peer_ends_its_window() -> None:
    h, run = _two_ranks(fill_wait=True)
    planned, trained, waited = _late_window(h, run)
    assert trained > planned  # it trained past its budget, on the same epoch's work
    # It stops where the late rank's smoothed pace (45 ms, on its way to 60)
    # says the window ends: it waits less than one late step, where it held
    # 200 ms without the fill (the next test).
    assert waited < 0.060
    # The gate fired at the late rank's last batch: the fill did not delay it.
    assert run.gates[-1] == run.ends[1][-1]


def test_without_fill_wait_a_rank_out_of_budget_holds_for_the_round() -> None:
    h, run = _two_ranks(fill_wait=False)
    planned, trained, waited = _late_window(h, run)
    assert trained == planned
    assert waited > 0.1  # 10 late batches, 20 ms each
    assert run.gates[-1] == run.ends[1][-1]


def test_no_fill_when_the_peer_is_due_before_one_more_step_would_end() -> None:
    h, run = _two_ranks(fill_wait=True)
    planned = h.core.planner.budget[0]
    run.until_round()  # paces as measured: the windows end together
    trained = sum(1 for t in run.ends[0] if run.gates[-2] < t <= run.gates[-1])
    assert trained == planned


def test_every_sample_is_averaged_once_whatever_the_fill_gives() -> None:
    # Without a clock every peer's steps left look like time still ahead: the
    # fill gives all it may, which must still train every sample exactly once.
    h = Harness(num_samples=3200, epochs=2, fill_wait=True)
    h.form()
    h.run_to_end({0: 10.0, 1: 40.0})
    assert h.core.state is RunState.DONE
    averaged = sorted(h.in_averages)
    assert len(averaged) == len(set(averaged))
    assert sum(size for _, _, size in averaged) == 2 * 3200
