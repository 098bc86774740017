"""The rank's protocol state machine (``elche.core.rank``): rules, priority, illegal completions."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elche.core import messages as m
from elche.core.config import Mode
from elche.core.errors import LocalProtocolError
from elche.core.rank import (
    REFUSED,
    Average,
    Callback,
    Discard,
    Done,
    FormGroup,
    Hold,
    Land,
    Load,
    RankProtocol,
    RankStage,
    Save,
    SaveKind,
    StartEpoch,
    Train,
    Upload,
)


def proto(mode: Mode = Mode.CADENCE, *, rank: int = 0, epoch_fn: bool = False) -> RankProtocol:
    return RankProtocol(rank, mode=mode, batch_size=32, runs_epoch_fn=epoch_fn)


def train(p: RankProtocol) -> m.BatchDone:
    action = p.next_action()
    assert isinstance(action, Train), action
    return p.trained(action, batch_ms=1.0, data_ms=0.0, loss=0.5)


def state(p: RankProtocol) -> dict[str, object]:
    """Everything observable about the machine, for whole-state assertions."""
    return {
        "stage": p.stage,
        "stop": p.stop_reason,
        "chunks": [(c.epoch, c.offset, c.size, c.cursor) for c in p.chunks],
        "budget": p.budget,
        "window": p.window,
        "steps": p.steps_since_sync,
        "epoch_started": p.epoch_started,
        "stale": p.num_stale,
        "next": p.next_action(),
    }


def test_a_new_rank_holds_until_it_gets_work() -> None:
    p = proto()
    assert state(p) == {
        "stage": RankStage.TRAINING,
        "stop": None,
        "chunks": [],
        "budget": 0,
        "window": 0,
        "steps": 0,
        "epoch_started": -1,
        "stale": 0,
        "next": Hold(),
    }


def test_a_chunk_is_trained_batch_by_batch_up_to_the_budget() -> None:
    p = proto()
    p.handle(m.AssignChunk(epoch=0, offset=100, size=70, budget=2, window=2))
    assert p.next_action() == Train(epoch=0, offset=100, size=32)
    assert p.next_action() == Train(epoch=0, offset=100, size=32)  # asking again changes nothing
    done = train(p)
    assert (done.epoch, done.offset, done.size, done.loss) == (0, 100, 32, 0.5)
    assert p.report_due is False
    assert train(p).offset == 132
    assert p.report_due is True  # the window is complete
    assert state(p)["next"] == Hold()  # budget spent
    p.handle(m.SetBudget(budget=3, window=3))
    assert p.next_action() == Train(epoch=0, offset=164, size=6)  # the chunk's short tail
    train(p)
    assert state(p) | {"next": None} == {
        "stage": RankStage.TRAINING,
        "stop": None,
        "chunks": [],
        "budget": 3,
        "window": 3,
        "steps": 3,
        "epoch_started": -1,
        "stale": 0,
        "next": None,
    }
    assert p.report_due is True  # out of work


def test_a_collective_round_acknowledges_every_step_since_the_last() -> None:
    p = proto()
    p.handle(m.AssignChunk(epoch=0, offset=0, size=320, budget=5))
    train(p)
    train(p)
    p.handle(m.SyncNow(round=4, generation=0))
    assert p.next_action() == Average(round=4, generation=0, steps=2)
    ack = p.averaged(divergence=0.1, pre_norm=2.0, post_norm=1.5)
    assert ack == m.SyncAck(round=4, steps=2, divergence=0.1, pre_norm=2.0, post_norm=1.5)
    assert p.steps_since_sync == 0
    assert isinstance(p.next_action(), Train)


@pytest.mark.parametrize(("mode", "holds"), [(Mode.CPU_CADENCE, True), (Mode.CPU_ASYNC, False)])
def test_an_upload_holds_for_its_update_unless_async(mode: Mode, holds: bool) -> None:
    p = proto(mode)
    p.handle(m.AssignChunk(epoch=0, offset=0, size=320, budget=10))
    train(p)
    p.handle(m.RequestParams(round=1))
    assert p.next_action() == Upload(round=1, steps=1)
    assert p.uploaded() == m.SnapshotReady(round=1, steps=1)
    assert (p.next_action() == Hold()) is holds
    assert p.stage is (RankStage.WAITING_UPDATE if holds else RankStage.TRAINING)
    if not holds:
        train(p)  # async trains on while the average round-trips
    p.handle(m.Update(round=1, alpha=0.5))
    assert p.next_action() == Load(round=1, alpha=0.5, steps=1)
    assert p.loaded(divergence=0.2) == m.SyncAck(round=1, steps=1, divergence=0.2)
    assert p.steps_since_sync == (0 if holds else 1)
    assert p.stage is RankStage.TRAINING


def test_an_update_for_another_round_is_stale_and_ignored() -> None:
    p = proto(Mode.CPU_SYNC)
    p.handle(m.AssignChunk(epoch=0, offset=0, size=64, budget=1))
    train(p)
    p.handle(m.Update(round=1))  # nothing uploaded yet
    p.handle(m.RequestParams(round=2))
    p.uploaded()
    p.handle(m.Update(round=1))  # an older round's
    assert p.num_stale == 2
    assert p.next_action() == Hold()
    p.handle(m.Update(round=2))
    assert p.next_action() == Load(round=2, alpha=None, steps=1)


def test_priority_round_before_callbacks_before_training() -> None:
    p = proto()
    p.handle(m.AssignChunk(epoch=0, offset=0, size=320, budget=5))
    p.handle(m.RunEval(epoch=0))
    p.handle(m.RunCheckpoint(version=3))
    p.handle(m.SyncNow(round=1, generation=0))
    assert isinstance(p.next_action(), Average)
    p.averaged()
    assert p.next_action() == Callback(request=m.RunEval(epoch=0))
    assert p.evaluated(metric=0.9, elapsed_ms=5.0, error=None) == m.EvalResult(
        epoch=0, metric=0.9, elapsed_ms=5.0
    )
    assert p.next_action() == Callback(request=m.RunCheckpoint(version=3))
    assert p.checkpointed(elapsed_ms=1.0, error="disk full") == m.CheckpointResult(
        version=3, elapsed_ms=1.0, error="disk full"
    )
    assert isinstance(p.next_action(), Train)


@pytest.mark.parametrize(
    ("mode", "foreign"),
    [(Mode.CADENCE, m.RequestParams(round=1)), (Mode.CPU_ASYNC, m.SyncNow(round=1, generation=0))],
)
def test_a_request_of_the_other_backend_is_stale(mode: Mode, foreign: m.CoordMessage) -> None:
    """Found by the property below: a SyncNow in a cpu-async run averaged the steps an
    uploaded snapshot still held, and the Update then took them again (steps -1)."""
    p = proto(mode)
    p.handle(foreign)
    assert (p.next_action(), p.num_stale) == (Hold(), 1)


def test_a_newer_request_replaces_an_older_one() -> None:
    p = proto()
    p.handle(m.SyncNow(round=1, generation=0))
    p.handle(m.SyncNow(round=2, generation=0))
    assert p.next_action() == Average(round=2, generation=0, steps=0)


def test_epoch_fn_runs_once_before_each_new_epoch() -> None:
    p = proto(epoch_fn=True)
    p.handle(m.AssignChunk(epoch=0, offset=0, size=32, budget=9))
    p.handle(m.AssignChunk(epoch=1, offset=0, size=32, budget=9))
    assert p.next_action() == StartEpoch(epoch=0)
    assert p.started_epoch(elapsed_ms=2.0, lr=0.1) == [
        m.EpochFnElapsed(epoch=0, elapsed_ms=2.0),
        m.LrUpdate(lr=0.1),
    ]
    train(p)
    assert p.next_action() == StartEpoch(epoch=1)
    assert p.started_epoch(elapsed_ms=2.0, lr=None) == [m.EpochFnElapsed(epoch=1, elapsed_ms=2.0)]
    assert train(p).epoch == 1
    p.handle(m.AssignChunk(epoch=1, offset=32, size=32, budget=9))
    assert isinstance(p.next_action(), Train)  # epoch 1 already started


def test_regroup_drops_the_old_groups_round_and_reforms() -> None:
    p = proto(rank=1)
    p.handle(m.SyncNow(round=3, generation=0))
    p.handle(m.Regroup(generation=1, members=[0, 1]))
    assert p.next_action() == FormGroup(generation=1, members=(0, 1))
    p.regrouped(1)
    assert p.next_action() == Hold()


def test_a_newer_regroup_that_came_while_a_generation_formed_stays_waiting() -> None:
    p = proto(rank=1)
    p.handle(m.Regroup(generation=1, members=[0, 1, 2]))
    p.handle(m.Regroup(generation=2, members=[0, 1]))  # while generation 1 formed
    p.regrouped(1)
    assert p.next_action() == FormGroup(generation=2, members=(0, 1))
    p.regrouped(2)
    assert p.next_action() == Hold()


def test_a_rank_left_out_of_a_regroup_was_declared_dead_and_stops() -> None:
    p = proto(rank=2)
    p.handle(m.Regroup(generation=1, members=[0, 1]))
    assert p.next_action() == Done(reason="refused: the coordinator declared this rank dead")


def test_a_refused_rank_stops_saying_why() -> None:
    p = proto(rank=2)
    p.handle(m.AssignChunk(epoch=0, offset=0, size=320, budget=5))
    p.handle(m.Shutdown(writer=-1, refused="declared lost (heartbeat stale: silent for 3.5 s)"))
    assert p.next_action() == Done(
        reason=REFUSED + "declared lost (heartbeat stale: silent for 3.5 s)"
    )


@pytest.mark.parametrize(("writer", "is_writer"), [(0, True), (1, False)])
def test_the_final_writer_saves_then_every_rank_holds_for_the_last_shutdown(
    writer: int, is_writer: bool
) -> None:
    p = proto()
    p.handle(m.Shutdown(writer=writer, seq=3))
    if is_writer:
        assert p.next_action() == Save(kind=SaveKind.FINAL, seq=3, writer=True)
        file = m.SavedFile(kind="final", name="final_model.pt", size=9, sha256="0" * 64)
        assert p.saved(files=[file]) == m.StateSaved(seq=3, files=[file], writer=True)
    assert p.next_action() == Hold()
    p.handle(m.AssignChunk(epoch=0, offset=0, size=32, budget=1))  # ignored while held
    assert state(p)["chunks"] == []
    p.handle(m.Shutdown(writer=-1))
    assert p.next_action() == Done(reason="completed")


def test_a_held_rank_can_be_named_the_writer_when_the_first_one_died() -> None:
    p = proto(rank=1)
    p.handle(m.Shutdown(writer=0, seq=3))
    assert p.next_action() == Hold()
    p.handle(m.Shutdown(writer=1, seq=3))
    assert p.next_action() == Save(kind=SaveKind.FINAL, seq=3, writer=True)


@pytest.mark.parametrize(("writer", "is_writer"), [(0, True), (1, False)])
def test_shutdown_with_save_saves_then_holds(writer: int, is_writer: bool) -> None:
    q = proto()
    q.handle(m.AssignChunk(epoch=0, offset=0, size=320, budget=5))
    q.handle(m.ShutdownWithSave(reason="single_survivor", writer=writer, seq=2, keep=1))
    assert q.next_action() == Save(
        kind=SaveKind.SHUTDOWN, seq=2, writer=is_writer, keep=1, reason="single_survivor"
    )
    train_action = Train(epoch=0, offset=0, size=32)
    q.trained(train_action, batch_ms=1.0, data_ms=0.0, loss=None)  # a step in flight still counts
    assert q.saved(error="disk full") == m.StateSaved(seq=2, error="disk full", writer=is_writer)
    assert q.next_action() == Hold()
    q.handle(m.ShutdownWithSave(reason="single_survivor", writer=0, seq=2, keep=1))
    assert q.next_action() == Save(
        kind=SaveKind.SHUTDOWN, seq=2, writer=True, keep=1, reason="single_survivor"
    )
    q.saved()
    q.handle(m.Shutdown(writer=-1))
    assert q.next_action() == Done(reason="saved: single_survivor")


def test_a_rank_not_asked_to_save_learns_the_run_stopped_short_from_the_last_shutdown() -> None:
    # A joiner not yet in a round when the run stopped and saved: it was told nothing
    # but the last Shutdown, and took the run for completed.
    p = proto(rank=3)
    p.handle(m.Shutdown(writer=-1, saved="graceful_shutdown"))
    assert p.next_action() == Done(reason="saved: graceful_shutdown")


def test_a_periodic_save_is_served_after_the_round_and_training_goes_on() -> None:
    p = proto()
    p.handle(m.AssignChunk(epoch=0, offset=0, size=320, budget=5))
    p.handle(m.RunEval(epoch=1))
    p.handle(m.SaveState(seq=4, writer=0, keep=2))
    p.handle(m.SyncNow(round=1, generation=0))
    assert isinstance(p.next_action(), Average)
    p.averaged()
    assert p.next_action() == Save(kind=SaveKind.CHECKPOINT, seq=4, writer=True, keep=2)
    assert p.saved() == m.StateSaved(seq=4, writer=True)
    assert isinstance(p.next_action(), Callback)
    assert p.stage is RankStage.TRAINING


def test_coordinator_lost_stops_the_rank() -> None:
    p = proto()
    p.coordinator_lost("silent for 30 s")
    assert p.next_action() == Done(reason="coordinator lost: silent for 30 s")


def _completions(p: RankProtocol) -> list[tuple[str, object]]:
    return [
        (
            "trained",
            lambda: p.trained(Train(epoch=0, offset=0, size=32), batch_ms=1, data_ms=0, loss=None),
        ),
        ("started_epoch", lambda: p.started_epoch(elapsed_ms=1.0, lr=None)),
        ("averaged", p.averaged),
        ("average_failed", p.average_failed),
        ("uploaded", p.uploaded),
        ("loaded", p.loaded),
        ("evaluated", lambda: p.evaluated(metric=1.0, elapsed_ms=1.0, error=None)),
        ("checkpointed", lambda: p.checkpointed(elapsed_ms=1.0, error=None)),
        ("regrouped", lambda: p.regrouped(1)),
        ("saved", p.saved),
        ("discarded", p.discarded),
    ]


@pytest.mark.parametrize("name", [name for name, _ in _completions(proto())])
def test_a_completion_without_its_action_raises_and_changes_nothing(name: str) -> None:
    p = proto(epoch_fn=True)
    p.handle(m.AssignChunk(epoch=0, offset=64, size=64, budget=4))  # not at offset 0
    if name == "checkpointed":
        p.handle(m.RunEval(epoch=0))  # the front callback is the other kind
    if name == "evaluated":
        p.handle(m.RunCheckpoint(version=1))
    p.epoch_started = 0  # so started_epoch has nothing to start
    before = copy.deepcopy(state(p))
    completion = dict(_completions(p))[name]
    with pytest.raises(LocalProtocolError, match=name):
        completion()
    assert state(p) == before


_COORD_MESSAGES = st.one_of(
    st.builds(
        m.AssignChunk,
        epoch=st.integers(0, 2),
        offset=st.integers(0, 500),
        size=st.integers(1, 100),
        budget=st.integers(0, 6),
        window=st.integers(0, 6),
    ),
    st.builds(m.SetBudget, budget=st.integers(0, 6), window=st.integers(0, 6)),
    st.builds(m.SyncNow, round=st.integers(1, 4), generation=st.just(0)),
    st.builds(m.RequestParams, round=st.integers(1, 4)),
    st.builds(m.Update, round=st.integers(1, 4)),
    st.builds(m.RunEval, epoch=st.integers(0, 2)),
    st.builds(m.RunCheckpoint, version=st.integers(0, 2)),
    st.builds(m.Regroup, generation=st.integers(1, 3), members=st.just([0, 1])),
    st.builds(m.SaveState, seq=st.integers(1, 3), writer=st.integers(-1, 1)),
    st.builds(m.ShutdownWithSave, reason=st.just("x"), writer=st.integers(0, 1), seq=st.just(4)),
    st.builds(m.Shutdown, writer=st.integers(-1, 1), seq=st.just(5)),
    st.builds(m.DiscardSave, seq=st.integers(1, 4)),
    st.just(m.CoordHeartbeat()),
)


def _complete(p: RankProtocol, action: object, *, launch: bool = False) -> None:
    """Do what a well-behaved driver does for ``action`` (``launch``: its
    collective rounds overlap training)."""
    match action:
        case Train():
            p.trained(action, batch_ms=1.0, data_ms=0.0, loss=None)
        case StartEpoch():
            p.started_epoch(elapsed_ms=0.0, lr=None)
        case Average() if launch:
            p.launched()
        case Average() | Land():
            p.averaged()
        case Upload():
            p.uploaded()
        case Load():
            p.loaded()
        case Callback(request=m.RunEval()):
            p.evaluated(metric=0.0, elapsed_ms=0.0, error=None)
        case Callback():
            p.checkpointed(elapsed_ms=0.0, error=None)
        case FormGroup(generation=generation):
            p.regrouped(generation)
        case Save():
            p.saved()
        case Discard():
            p.discarded()


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    mode=st.sampled_from(list(Mode)),
    script=st.lists(st.tuples(_COORD_MESSAGES, st.integers(0, 4)), max_size=30),
    launch=st.booleans(),
)
def test_a_well_behaved_driver_never_hits_an_illegal_completion(
    mode: Mode, script: list[tuple[m.CoordMessage, int]], launch: bool
) -> None:
    """Any message stream, acted on between messages, by a driver that waits
    for its rounds or launches them: every action's completion is legal,
    next_action is pure, a round in flight allows nothing but training (and
    removing a discarded save's files, which comes first in every stage)
    before it lands, and counts stay sane."""
    p = proto(mode, epoch_fn=True)
    for message, num_actions in script:
        p.handle(message)
        for _ in range(num_actions):
            action = p.next_action()
            assert p.next_action() == action  # pure
            if isinstance(action, Hold | Done):
                break
            if isinstance(action, Train):
                chunk = p.chunks[0]
                assert chunk.offset <= action.offset < chunk.offset + chunk.size
                assert 0 < action.size <= min(32, chunk.left)
                assert p.steps_since_sync < p.budget
            if p.in_flight:
                assert isinstance(action, Train | Land | Discard), action
            _complete(p, action, launch=launch)
            assert p.steps_since_sync >= 0


def test_a_callback_asked_with_a_round_waits_until_the_rank_applied_that_round_or_a_later() -> None:
    p = proto()
    p.handle(m.AssignChunk(epoch=0, offset=0, size=64, budget=2, window=2))
    p.handle(m.SyncNow(round=3, generation=0))
    p.handle(m.RunEval(epoch=1))
    p.handle(m.AssignChunk(epoch=1, offset=0, size=32, budget=1, window=1))
    assert isinstance(p.next_action(), Average)
    p.handle(m.Regroup(generation=1, members=[0, 1]))  # round 3 abandoned with the old group
    assert isinstance(p.next_action(), FormGroup)
    p.regrouped(1)
    assert isinstance(p.next_action(), Train)  # the eval waits: the model is no consensus yet
    p.handle(m.SyncNow(round=4, generation=1))
    action = p.next_action()
    assert isinstance(action, Average)
    p.averaged()
    assert p.next_action() == Callback(request=m.RunEval(epoch=1))  # round 4 applied: now
