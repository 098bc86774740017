"""A collective round launched and landed later (``RankProtocol.launched``, ``Land``).

The rank trains on while its round is in flight; it lands the round before
anything but training, callbacks wait for it, and a failed round gives its
steps back.
"""

from __future__ import annotations

import pytest

from elche.core import messages as m
from elche.core.config import Mode
from elche.core.errors import LocalProtocolError
from elche.core.rank import (
    Average,
    Callback,
    FormGroup,
    Hold,
    Land,
    RankProtocol,
    Save,
    SaveKind,
    StartEpoch,
    Train,
    round_given_up,
)
from tests.core.test_rank import proto, train


def launched(p: RankProtocol, *, steps: int, round_: int = 1, budget: int = 10) -> None:
    """``p`` trained ``steps`` batches, then launched round ``round_``."""
    p.handle(m.AssignChunk(epoch=0, offset=0, size=32 * 20, budget=budget))
    for _ in range(steps):
        train(p)
    p.handle(m.SyncNow(round=round_, generation=0))
    assert p.next_action() == Average(round=round_, generation=0, steps=steps)
    p.launched()


def test_a_launched_round_lets_the_rank_train_on_and_acks_its_own_steps() -> None:
    p = proto()
    launched(p, steps=2, round_=3)
    assert (p.in_flight, p.steps_since_sync) == (3, 0)
    assert train(p).offset == 64  # the window counts from the launch
    assert train(p).offset == 96
    ack = p.averaged(divergence=0.2, pre_norm=1.0, post_norm=0.9, through_ms=12.5)
    assert ack == m.SyncAck(
        round=3, steps=2, divergence=0.2, pre_norm=1.0, post_norm=0.9, through_ms=12.5
    )
    assert (p.in_flight, p.steps_since_sync, p.last_round) == (0, 2, 3)
    # The round averaged the batches before the launch; the two after stay unaveraged.
    assert p.held() == m.Held(
        last_round=3, averaged=((0, 0, 32), (0, 32, 32)), since=((0, 64, 32), (0, 96, 32))
    )


def test_the_round_lands_when_the_budget_is_spent() -> None:
    p = proto()
    launched(p, steps=1, round_=2, budget=2)
    train(p)
    assert isinstance(p.next_action(), Train)
    train(p)
    assert p.next_action() == Land(round=2, steps=1)
    p.averaged()
    assert p.next_action() == Hold()  # the budget is spent: the coordinator's move


def test_the_round_lands_when_the_rank_runs_out_of_work() -> None:
    p = proto()
    p.handle(m.AssignChunk(epoch=0, offset=0, size=64, budget=10))
    train(p)
    p.handle(m.SyncNow(round=1, generation=0))
    p.launched()
    train(p)  # the chunk's last batch
    assert p.next_action() == Land(round=1, steps=1)


@pytest.mark.parametrize(
    ("message", "then"),
    [
        (m.SyncNow(round=2, generation=0), Average(round=2, generation=0, steps=0)),
        (m.SaveState(seq=4, writer=0, keep=2),
         Save(kind=SaveKind.CHECKPOINT, seq=4, writer=True, keep=2)),
    ],
)  # fmt: skip
def test_anything_but_training_lands_the_round_first(message: m.CoordMessage, then: object) -> None:
    p = proto()
    launched(p, steps=3, round_=1)
    p.handle(message)
    assert p.next_action() == Land(round=1, steps=3)
    p.averaged()
    assert p.next_action() == then


@pytest.mark.parametrize("completed", [True, False])
def test_a_regroup_lands_the_round_first_saying_a_member_is_lost(completed: bool) -> None:
    # The driver drops a collective that has not completed (a lost member may
    # never send its part) and lands one that has; either way the group re-forms.
    p = proto()
    launched(p, steps=3, round_=1)
    assert p.next_action() == Train(epoch=0, offset=96, size=32)
    p.handle(m.Regroup(generation=1, members=[0, 1]))
    assert p.next_action() == Land(round=1, steps=3, regroup=True)
    if completed:
        assert p.averaged() == m.SyncAck(round=1, steps=3)
        assert p.last_round == 1
    else:
        assert p.average_failed() == m.SyncAck(round=1, steps=0, failed=True)
        assert (p.last_round, p.steps_since_sync) == (0, 3)  # to average in the new group
    assert p.next_action() == FormGroup(generation=1, members=(0, 1))


@pytest.mark.parametrize(
    ("message", "why"),
    [
        (m.Regroup(generation=2, members=[0, 1]), "its group re-forms without a lost member"),
        (m.Shutdown(refused="declared lost"), "the run goes on without this rank"),
        (m.Shutdown(failure="rank 1 raised"), "the run failed"),
        (m.Shutdown(writer=1, seq=3), None),  # held, not stopped: the round may still land
        (m.ShutdownWithSave(seq=3, writer=0, reason="stopped"), None),
        (m.AssignChunk(epoch=0, offset=0, size=32, budget=1), None),
    ],
)  # fmt: skip
def test_a_round_a_rank_waits_for_is_given_up_by_a_regroup_or_a_stop(
    message: m.CoordMessage, why: str | None
) -> None:
    # The driver keeps what comes while it waits for a round's collectives for
    # after the round, and gives the round up as a launched one's Land would.
    assert round_given_up(message) == why


def test_an_epoch_start_lands_the_round_first() -> None:
    p = proto(epoch_fn=True)
    p.handle(m.AssignChunk(epoch=0, offset=0, size=32, budget=10))
    assert isinstance(p.next_action(), StartEpoch)
    p.started_epoch(elapsed_ms=1.0, lr=None)
    train(p)
    p.handle(m.SyncNow(round=1, generation=0))
    p.launched()
    p.handle(m.AssignChunk(epoch=1, offset=0, size=32, budget=10))
    assert p.next_action() == Land(round=1, steps=1)
    p.averaged()
    assert p.next_action() == StartEpoch(epoch=1)


def test_a_callback_waits_for_the_round_in_flight_and_runs_on_its_consensus() -> None:
    p = proto()
    launched(p, steps=1, round_=5)
    p.handle(m.RunEval(epoch=1))  # asked for the model of round 5 or later
    assert isinstance(p.next_action(), Train)  # not on a model that round 5 has not reached
    with pytest.raises(LocalProtocolError, match="evaluated"):
        p.evaluated(metric=1.0, elapsed_ms=1.0, error=None)
    train(p)
    p.averaged()
    assert p.next_action() == Callback(request=m.RunEval(epoch=1))


def test_a_callback_due_before_the_launch_waits_for_the_land_too() -> None:
    p = proto()
    p.handle(m.AssignChunk(epoch=0, offset=0, size=320, budget=10))
    train(p)
    p.handle(m.RunCheckpoint(version=2))  # due now: no round is pending
    p.handle(m.SyncNow(round=1, generation=0))
    assert isinstance(p.next_action(), Average)  # the round first, as ever
    p.launched()
    # The model holds the rank's own steps since the launch: no consensus to save.
    assert isinstance(p.next_action(), Train)
    train(p)
    p.averaged()
    assert p.next_action() == Callback(request=m.RunCheckpoint(version=2))


def test_a_failed_round_in_flight_gives_its_steps_back() -> None:
    p = proto()
    launched(p, steps=2, round_=1)
    train(p)
    p.average_failed()
    assert (p.in_flight, p.steps_since_sync, p.last_round) == (0, 3, 0)
    assert p.held().since == ((0, 0, 32), (0, 32, 32), (0, 64, 32))  # none of them averaged


def test_a_launch_needs_a_pending_round_and_none_in_flight() -> None:
    p = proto()
    with pytest.raises(LocalProtocolError, match="launched"):
        p.launched()
    launched(p, steps=1, round_=1)
    p.handle(m.SyncNow(round=2, generation=0))
    with pytest.raises(LocalProtocolError, match="round 1 is in flight"):
        p.launched()
    assert p.next_action() == Land(round=1, steps=1)  # nothing changed


def test_a_restarted_coordinator_forgets_the_round_in_flight() -> None:
    p = proto()
    launched(p, steps=1, round_=1)
    hello = p.rejoin(world_size=2)
    assert p.in_flight == 0
    assert hello.held.since == ((0, 0, 32),)
    assert p.next_action() == Hold()


@pytest.mark.parametrize("launch", [True, False])
def test_a_callback_asked_after_the_round_failed_here_waits_for_the_round_tried_next(
    launch: bool,
) -> None:
    """The coordinator asks an epoch end's eval with the round; the rank may
    read it only after its collective broke, before the coordinator knows."""
    p = proto()
    p.handle(m.AssignChunk(epoch=0, offset=0, size=320, budget=10))
    train(p)
    p.handle(m.SyncNow(round=3, generation=0))
    if launch:
        p.launched()
    p.average_failed()
    p.handle(m.RunEval(epoch=1))
    assert isinstance(p.next_action(), Train)  # not on this rank's own model
    p.handle(m.Regroup(generation=1, members=[0, 1]))
    p.regrouped(1)
    p.handle(m.SyncNow(round=4, generation=1))
    assert isinstance(p.next_action(), Average)
    p.averaged()
    assert p.next_action() == Callback(request=m.RunEval(epoch=1))


def test_the_progress_counts_what_the_rank_trained_through_its_round_as_after_it() -> None:
    # The round averages the batches before its launch; those trained while it
    # travelled count after it. Counted from the land, a slow rank's estimate
    # fell behind its peers' by what it trained through over its share.
    p = RankProtocol(0, mode=Mode.CADENCE, batch_size=32, planned_samples=10_000, world_size=2)
    launched(p, steps=2, round_=1)
    train(p)
    train(p)  # trained through the round
    p.averaged()
    assert p.progress is not None
    p.progress.confirmed(m.GlobalProgress(round=1, samples=256, share=0.25))
    assert p.progress.samples() == 256 + 2 * 32 * 4  # its 64 samples since, over its share


def test_a_launched_round_that_failed_here_is_not_counted_in_the_progress() -> None:
    p = RankProtocol(0, mode=Mode.CADENCE, batch_size=32, planned_samples=10_000, world_size=2)
    launched(p, steps=2, round_=1)
    train(p)
    train(p)  # trained through the round
    p.average_failed()  # the others got the average; this rank's steps count in the next
    assert p.progress is not None
    p.progress.confirmed(m.GlobalProgress(round=1, samples=256, share=0.25))
    assert p.progress.samples() == 256  # counted from now, as for a round it was not part of
