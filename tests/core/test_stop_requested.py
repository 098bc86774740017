"""``StopRequested``: a run asked to stop saves, fails or completes by its state."""

from __future__ import annotations

import pytest

from elche.core import messages as m
from elche.core.checkpoint import SaveReason
from elche.core.commands import Finish, Notice, Send, WriteMeta
from elche.core.coordinator import RunState
from elche.core.events import RankJoined, RankLost, Started, StopRequested
from tests.core.harness import Harness, messages, of


def test_a_run_still_forming_fails_and_names_the_stop() -> None:
    h = Harness(world_size=2)
    h.feed(Started())
    h.feed(RankJoined(rank=0))
    out = h.feed(StopRequested(reason="SIGINT"))
    assert of(out, Finish) == [
        Finish(outcome="failed", reason="stopped before the run formed (SIGINT)")
    ]
    assert h.core.state is RunState.DONE


def test_a_training_run_saves_a_graceful_bundle_and_stops() -> None:
    h = Harness(world_size=2, epochs=3, save_path="/tmp/bundle")
    h.form()
    h.train(0, 2)
    out = h.feed(StopRequested(reason="SIGTERM"))
    assert h.core.state is RunState.SAVING
    assert messages(out, m.ShutdownWithSave) == [
        m.ShutdownWithSave(reason="graceful_shutdown", writer=0, seq=1)
    ]
    assert [c.level for c in of(out, Notice)] == ["info"]  # the launcher tells the user
    assert h.feed(StopRequested(reason="SIGTERM")) == []  # already stopping: nothing new
    out = h.answer_saves()
    (write,) = of(out, WriteMeta)
    assert write.meta.reason is SaveReason.GRACEFUL_SHUTDOWN  # type: ignore[attr-defined]
    assert of(out, Finish) == [Finish(outcome="saved_and_shutdown", reason="graceful_shutdown")]
    # The last Shutdown says why, for a rank that was not asked to save (a joiner).
    assert messages(out, m.Shutdown) == [m.Shutdown(writer=-1, saved="graceful_shutdown")]


def test_a_run_whose_training_is_over_completes_anyway() -> None:
    h = Harness(epochs=1, has_eval_fn=True)
    h.form()
    h.run_to_end()
    assert h.core.state is RunState.FINISHING  # the final eval is out
    assert h.feed(StopRequested(reason="SIGINT")) == []
    h.send(0, m.EvalResult(epoch=1, metric=0.9, elapsed_ms=1.0))
    assert h.feed(StopRequested(reason="SIGINT")) == []  # writing the final model
    assert of(h.answer_saves(), Finish) == [Finish(outcome="completed")]
    assert h.feed(StopRequested(reason="SIGINT")) == []  # DONE ignores it


def test_a_stop_during_an_averaging_round_saves_once_the_round_is_over() -> None:
    # A rank already inside the round's collective cannot hear a save order until
    # its peers join it; peers told to save instead never would (chaos run 1:152:
    # SIGTERM while round 1 was in flight, nothing saved).
    h = Harness(world_size=2, epochs=3, save_path="/tmp/bundle")
    h.form()
    h.train_window()
    rnd = h.core.round
    assert rnd.in_flight
    out = h.feed(StopRequested(reason="SIGTERM"))
    assert messages(out, m.ShutdownWithSave) == []  # not yet: the round first
    assert h.core.state is RunState.TRAINING
    assert [c.text for c in of(out, Notice)] == [  # type: ignore[attr-defined]
        f"stopping on request once averaging round {rnd.number} ends"
    ]
    h.send(0, m.SyncAck(round=rnd.number, steps=h.core.work.steps_since_sync(0)))
    out = h.send(1, m.SyncAck(round=rnd.number, steps=h.core.work.steps_since_sync(1)))
    assert h.core.state is RunState.SAVING
    saves = messages(out, m.ShutdownWithSave)
    assert [msg.reason for msg in saves] == ["graceful_shutdown"]  # type: ignore[attr-defined]
    assert of(h.answer_saves(), Finish) == [
        Finish(outcome="saved_and_shutdown", reason="graceful_shutdown")
    ]


@pytest.mark.parametrize("dead", [0, 1])
def test_a_rank_lost_once_training_is_over_leaves_the_survivor_to_finish(dead: int) -> None:
    # Two ranks: the eval rank dies during the final eval. Training is over and the
    # survivor holds the final consensus: it runs the eval and the run completes
    # (a bundle saved as 'single_survivor' resumed to a run that never ran that eval).
    h = Harness(world_size=2, epochs=1, has_eval_fn=True, save_path="/tmp/bundle")
    h.form()
    h.run_to_end()
    assert h.core.state is RunState.FINISHING
    evaluator = eval_ranks(h)[-1]
    out = h.feed(RankLost(rank=evaluator if dead == 0 else 1 - evaluator, reason="killed"))
    survivor = 1 - evaluator if dead == 0 else evaluator
    if dead == 0:  # the eval it owed is asked of the survivor
        assert messages(out, m.RunEval) == [m.RunEval(epoch=1)]
        assert eval_ranks(h)[-1] == survivor
    h.send(survivor, m.EvalResult(epoch=1, metric=0.9, elapsed_ms=1.0))
    assert of(h.answer_saves(), Finish) == [Finish(outcome="completed")]


def eval_ranks(h: Harness) -> list[int]:
    """The ranks asked for an eval, in order."""
    return [c.rank for c in of(h.log, Send) if isinstance(c.message, m.RunEval)]  # type: ignore[attr-defined]


@pytest.mark.parametrize("in_flight", [False, True])
def test_the_coordinators_host_lost_saves_as_such_not_as_a_request(in_flight: bool) -> None:
    # Under elche run rank 0's process started the coordinator: its death is no
    # stop anybody asked for. Saved as a graceful shutdown, the survivors took it
    # for a signal (Interrupted, exit 143) where a lone survivor returned the result.
    h = Harness(world_size=3, epochs=3, save_path="/tmp/bundle")
    h.form()
    why = "rank 0, whose process started the coordinator, is gone"
    if in_flight:  # the stop waits for the round, as a requested one does
        h.train_window()
        rnd = h.core.round
        out = h.feed(StopRequested(reason=why, host_lost=True))
        assert h.core.state is RunState.TRAINING
        assert [c.text for c in of(out, Notice)] == [  # type: ignore[attr-defined]
            f"stopping ({why}) once averaging round {rnd.number} ends"
        ]
        for rank in range(3):
            out = h.send(
                rank, m.SyncAck(round=rnd.number, steps=h.core.work.steps_since_sync(rank))
            )
    else:
        h.train(0, 2)
        h.feed(RankLost(rank=0, reason="its process, which started the coordinator, is gone"))
        out = h.feed(StopRequested(reason=why, host_lost=True))
    assert h.core.state is RunState.SAVING
    assert [s.reason for s in messages(out, m.ShutdownWithSave)] == ["coordinator_host_lost"]
    assert [c.level for c in of(out, Notice)] == ["error"]  # not "stopping on request"
    out = h.answer_saves()
    (write,) = of(out, WriteMeta)
    assert write.meta.reason is SaveReason.COORDINATOR_HOST_LOST  # type: ignore[attr-defined]
    assert of(out, Finish) == [Finish(outcome="saved_and_shutdown", reason="coordinator_host_lost")]
