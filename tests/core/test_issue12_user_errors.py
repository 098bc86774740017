"""Issue 12, items 2, 14 and 15 in the core: user errors end the run, crashes before
forming don't, non-finite values stop it with the last finite consensus.

Each test is named after the item it pins down and failed before its fix.
"""

from __future__ import annotations

import pytest

from elche.core import failures
from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.commands import Broadcast, Emit, Finish, Notice, ReformFirstGroup, Send
from elche.core.config import Mode
from elche.core.coordinator import RankState, RunState
from elche.core.errors import ConfigError
from elche.core.events import RankJoined, RankLost, Started
from elche.core.rank import Done, RankProtocol, Train
from tests.core.harness import Harness, config, messages, of


def failed(epoch: int = 0, *, first: bool = False, kind: str = "RuntimeError") -> m.Failed:
    return m.Failed(
        error_type=kind,
        message="grad can be implicitly created only for scalar outputs",
        traceback='Traceback (most recent call last):\n  File "train.py", line 9, in step\n',
        epoch=epoch,
        before_first_step=first,
    )


def run_end(out: list) -> tl.RunEnd:
    ends = [c.event for c in of(out, Emit) if isinstance(c.event, tl.RunEnd)]  # type: ignore[attr-defined]
    assert len(ends) == 1, ends
    return ends[0]


def test_issue12_item14_the_same_error_on_every_rank_ends_the_run_with_it() -> None:
    h = Harness(world_size=3, mode=Mode.CPU_CADENCE, num_samples=960)
    h.form()
    h.train(0, 1)
    out = h.send(0, failed(0))
    assert h.core.state is RunState.TRAINING  # one rank failing may be a one-off
    out += h.send(1, failed(0))
    assert h.core.state is RunState.TRAINING
    out += h.send(2, failed(0))
    finish = of(out, Finish)
    assert len(finish) == 1 and finish[0].outcome == "failed"  # type: ignore[attr-defined]
    end = run_end(out)
    assert end.user_error is not None
    assert (end.user_error.rank, end.user_error.epoch) == (2, 0)
    assert end.user_error.error_type == "RuntimeError"
    assert "scalar outputs" in end.user_error.message
    assert "train.py" in end.user_error.traceback
    assert "failed on the user's code" in end.reason


def test_issue12_item14_failures_that_leave_too_few_save_what_the_survivor_holds() -> None:
    # The run used to fail with nothing saved, throwing away the survivor's consensus,
    # where a SIGKILL at the same point saved it.
    h = Harness(world_size=3, num_samples=960, save_path="/tmp/never-written")
    h.form()  # cadence: a collective needs two
    h.train(2, 2)
    h.send(0, failed(1))
    assert h.core.state is RunState.TRAINING
    out = h.send(1, failed(1))
    # Rank 2 alone can only save and stop; both failures are the same user error.
    assert messages(out, m.ShutdownWithSave) == [
        m.ShutdownWithSave(reason="single_survivor", writer=2, seq=1)
    ]
    # The failed rank hears its report is in.
    assert [c.rank for c in of(out, Send) if isinstance(c.message, m.Shutdown)] == [1]  # type: ignore[attr-defined]
    out = h.answer_saves()
    end = run_end(out)
    assert (end.outcome, end.reason) == ("saved_and_shutdown", "single_survivor")
    assert end.user_error is not None
    assert (end.user_error.rank, end.user_error.error_type) == (1, "RuntimeError")
    (meta,) = [c.meta for c in out if type(c).__name__ == "WriteMeta"]  # type: ignore[attr-defined]
    assert sum(c.uncovered_samples for c in meta.coverage) < 960  # rank 2's steps are in it


def test_issue12_item14_a_rank_failing_before_its_first_step_ends_the_run_at_once() -> None:
    h = Harness(world_size=3, mode=Mode.CPU_CADENCE)
    h.feed(Started())
    h.feed(RankJoined(rank=1))
    h.feed(RankJoined(rank=0))  # rank 0 joins only to report: its model_fn raised
    out = h.send(0, failed(first=True, kind="TypeError"))
    assert h.core.state is RunState.DONE
    end = run_end(out)
    assert end.outcome == "failed"
    assert end.user_error is not None and end.user_error.error_type == "TypeError"
    assert end.dead_ranks == (0,)
    assert messages(out, m.Shutdown) and not messages(out, m.AssignChunk)


def test_issue12_item14_a_one_off_error_mid_run_is_survived_as_a_lost_rank() -> None:
    h = Harness(world_size=3, num_samples=960)
    h.form()
    h.train(1, 1)
    out = h.send(1, failed(0, kind="IndexError"))
    assert h.core.state is RunState.TRAINING
    assert h.core.rank_state[1] is RankState.DEAD
    out += h.run_to_end()
    assert of(out, Finish) == [Finish(outcome="completed")]
    assert run_end(out).user_error is None


def test_issue12_item14_different_errors_mid_run_are_not_one_user_error() -> None:
    h = Harness(world_size=3, mode=Mode.CPU_CADENCE, num_samples=960)
    h.form()
    h.send(0, failed(0, kind="IndexError"))
    h.send(1, failed(0, kind="KeyError"))
    assert h.core.state is RunState.TRAINING
    assert h.core.live == [2]


def test_issue12_item02_a_rank_lost_before_the_run_forms_is_survived() -> None:
    h = Harness(world_size=3, num_samples=960)
    h.feed(Started())
    h.feed(RankJoined(rank=0))
    out = h.feed(RankLost(rank=1, reason="process ended (killed by signal 9)"))
    assert h.core.state is RunState.FORMING  # rank 2 has not joined yet
    out += h.feed(RankJoined(rank=2))
    assert h.core.state is RunState.TRAINING
    assert h.received(1, m.AssignChunk) == []
    out += h.run_to_end()
    assert of(out, Finish) == [Finish(outcome="completed")]
    end = run_end(out)
    assert end.dead_ranks == (1,) and end.lost_samples == 0
    assert sum(end.samples_per_rank) == 960 and end.samples_per_rank[1] == 0


def test_issue12_item02_a_collective_run_regroups_without_the_rank_lost_while_forming() -> None:
    h = Harness(world_size=3, num_samples=960)
    h.feed(Started())
    h.feed(RankJoined(rank=0))
    h.feed(RankJoined(rank=2))
    out = h.feed(RankLost(rank=1, reason="process ended (exit code 1)"))
    assert h.core.state is RunState.TRAINING
    regroups = messages(out, m.Regroup)
    assert regroups == [m.Regroup(generation=1, members=[0, 2])]
    first = next(i for i, c in enumerate(out) if isinstance(getattr(c, "message", None), m.Regroup))
    assert all(not isinstance(getattr(c, "message", None), m.AssignChunk) for c in out[:first])
    out += h.run_to_end()
    assert of(out, Finish) == [Finish(outcome="completed")]


def test_a_rank_lost_before_any_joined_has_the_others_form_their_first_group_without_it() -> None:
    # They gather for their first group before they join: told nothing, they waited
    # for the lost rank there until their collective timeout.
    h = Harness(world_size=3, num_samples=960)  # cadence: collective
    h.feed(Started())
    out = h.feed(RankLost(rank=1, reason="process ended (exit code 3)"))
    assert of(out, ReformFirstGroup) == [ReformFirstGroup(generation=1, members=(0, 2))]
    h.feed(RankJoined(rank=0))
    out = h.feed(RankJoined(rank=2))
    assert messages(out, m.Regroup) == [m.Regroup(generation=2, members=[0, 2])]
    out += h.run_to_end()
    assert of(out, Finish) == [Finish(outcome="completed")]


def test_no_first_group_reform_once_a_rank_joined_or_without_collectives() -> None:
    h = Harness(world_size=3, num_samples=960)
    h.feed(Started())
    h.feed(RankJoined(rank=0))  # it joined: the first group had formed, every rank in it
    assert of(h.feed(RankLost(rank=1, reason="process ended")), ReformFirstGroup) == []
    h = Harness(world_size=3, mode=Mode.CPU_CADENCE, num_samples=960)
    h.feed(Started())
    assert of(h.feed(RankLost(rank=1, reason="process ended")), ReformFirstGroup) == []


def test_issue12_item02_too_few_left_before_forming_fails_and_stops_the_joined_ranks() -> None:
    h = Harness(world_size=2)  # cadence: a collective needs two
    h.feed(Started())
    h.feed(RankJoined(rank=0))
    out = h.feed(RankLost(rank=1, reason="process ended (exit code 1)"))
    assert h.core.state is RunState.DONE
    end = run_end(out)
    assert end.outcome == "failed" and "single_survivor" in end.reason
    assert end.user_error is None
    assert [c.ranks for c in of(out, Broadcast) if isinstance(c.message, m.Shutdown)] == [(0,)]  # type: ignore[attr-defined]


# -- item 15: non-finite losses and averages -----------------------------------------


def nan_batch(h: Harness, rank: int) -> list:
    epoch, offset, size = h.chunks[rank][0]
    take = min(h.cfg.batch_size, size)
    h.chunks[rank][0] = [epoch, offset + take, size - take]
    if take == size:
        h.chunks[rank].popleft()
    done = m.BatchDone(epoch=epoch, offset=offset, size=take, batch_ms=10.0, nonfinite=True)
    return h.send(rank, done)


def test_issue12_item15_a_nan_loss_saves_the_last_consensus_and_stops_the_run() -> None:
    h = Harness(world_size=2, num_samples=640, save_path="/tmp/never-written")
    h.form()
    h.train(0, 2)
    out = nan_batch(h, 1)
    orders = messages(out, m.ShutdownWithSave)
    assert orders == [m.ShutdownWithSave(reason="nonfinite", writer=0, seq=1)]
    assert h.core.state is RunState.SAVING
    out += h.answer_saves()
    end = run_end(out)
    assert (end.outcome, end.reason) == ("saved_and_shutdown", "nonfinite")
    assert (end.skipped_steps, end.skipped_samples) == (0, 0)  # stopped, not skipped
    assert end.user_error is not None
    assert (end.user_error.rank, end.user_error.error_type) == (1, "NonFiniteLoss")
    # The writer restored the last consensus: its two unaveraged steps are still to train.
    (meta,) = [c.meta for c in out if type(c).__name__ == "WriteMeta"]  # type: ignore[attr-defined]
    assert sum(c.uncovered_samples for c in meta.coverage) == 640


def test_issue12_item15_skip_leaves_the_step_out_and_goes_on() -> None:
    h = Harness(world_size=2, num_samples=640, nonfinite="skip")
    h.form()
    out = nan_batch(h, 1)
    assert h.core.state is RunState.TRAINING
    assert any("skipped" in c.text for c in of(out, Notice))  # type: ignore[attr-defined]
    out += h.run_to_end()
    assert of(out, Finish) == [Finish(outcome="completed")]


def test_issue12_item15_the_run_end_counts_the_skipped_steps_and_their_samples() -> None:
    h = Harness(world_size=2, num_samples=640, nonfinite="skip")
    h.form()
    out = nan_batch(h, 1) + nan_batch(h, 0) + nan_batch(h, 1)
    said = [c.text for c in of(out, Notice) if "skipped" in c.text]  # type: ignore[attr-defined]
    assert said == [  # the first, then every hundredth
        "rank 1: a non-finite loss in epoch 0; that step was skipped (1 so far, nonfinite='skip')"
    ]
    end = run_end(h.run_to_end())
    assert end.outcome == "completed"
    assert (end.skipped_steps, end.skipped_samples) == (3, 3 * h.cfg.batch_size)


def test_issue12_item15_the_skip_warning_is_said_on_the_first_and_every_hundredth() -> None:
    said = [n for n in range(1, 301) if failures.skipped_text(0, 0, n) is not None]
    assert said == [1, 100, 200, 300]


def test_issue12_item15_a_non_finite_average_stops_even_under_skip() -> None:
    h = Harness(world_size=2, num_samples=640, nonfinite="skip")
    h.form()
    for rank in (0, 1):
        while h.chunks[rank] and h.core.work.steps_since_sync(rank) < h.core.planner.budget[rank]:
            h.train(rank, 1)
    number = h.core.round.number
    assert h.core.round.in_flight
    steps = h.core.work.steps_since_sync(0)
    out = h.send(0, m.SyncAck(round=number, steps=steps, post_norm=float("nan")))
    assert messages(out, m.ShutdownWithSave) == [
        m.ShutdownWithSave(reason="nonfinite", writer=0, seq=1)
    ]


def test_issue12_item15_nonfinite_is_validated_naming_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        config(nonfinite="ignore")
    assert info.value.field == "nonfinite"
    assert "'stop'" in str(info.value) and "'skip'" in str(info.value)


def test_issue12_item15_the_rank_reports_a_step_it_did_not_apply() -> None:
    p = RankProtocol(0, mode=Mode.CADENCE, batch_size=32)
    p.handle(m.AssignChunk(epoch=0, offset=0, size=64, budget=4))
    action = p.next_action()
    assert isinstance(action, Train)
    done = p.trained(action, batch_ms=1.0, data_ms=0.0, loss=None, nonfinite=True)
    assert done.nonfinite and done.loss is None


def test_issue12_item14_the_rank_protocol_reports_whether_it_had_stepped() -> None:
    p = RankProtocol(1, mode=Mode.CADENCE, batch_size=32)
    before = p.failed(error_type="TypeError", message="x", traceback="", epoch=0)
    assert before.before_first_step and isinstance(p.next_action(), Done)
    q = RankProtocol(1, mode=Mode.CADENCE, batch_size=32)
    q.handle(m.AssignChunk(epoch=0, offset=0, size=64, budget=4))
    action = q.next_action()
    assert isinstance(action, Train)
    q.trained(action, batch_ms=1.0, data_ms=0.0, loss=0.5)
    assert not q.failed(
        error_type="TypeError", message="x", traceback="", epoch=0
    ).before_first_step


def test_issue12_item14_a_failed_runs_shutdown_stops_the_rank_with_the_error() -> None:
    p = RankProtocol(2, mode=Mode.CADENCE, batch_size=32)
    error = m.UserError(rank=1, epoch=0, error_type="KeyError", message="'x'")
    p.handle(m.Shutdown(writer=2, failure="rank 1 failed", user_error=error))
    assert p.next_action() == Done(reason="failed: rank 1 failed")
    assert p.user_error == error  # and it writes no final model


def test_issue12_item15_ranks_with_other_initial_weights_are_named_once() -> None:
    h = Harness(world_size=3)
    h.form()
    out = h.send(1, m.InitialState(fingerprint="b"))
    out += h.send(0, m.InitialState(fingerprint="a"))
    assert not of(out, Notice)  # rank 2 has not reported yet
    out += h.send(2, m.InitialState(fingerprint="c"))
    out += h.send(2, m.InitialState(fingerprint="c"))
    texts = [c.text for c in of(out, Notice)]  # type: ignore[attr-defined]
    assert len(texts) == 1 and "ranks [1, 2]" in texts[0] and "rank 0's weights" in texts[0]


@pytest.mark.parametrize("mode", [Mode.CADENCE, Mode.CPU_CADENCE])
def test_ranks_whose_model_has_another_layout_end_the_run_naming_them(mode: Mode) -> None:
    h = Harness(world_size=3, mode=mode)
    h.form()
    out = h.send(0, m.InitialState(fingerprint="a", layout="L"))
    out += h.send(2, m.InitialState(fingerprint="c", layout="W"))
    assert h.core.state is RunState.TRAINING  # rank 1 has not reported yet
    out += h.send(1, m.InitialState(fingerprint="a", layout="L"))
    end = run_end(out)
    assert end.outcome == "failed" and end.user_error is not None
    assert (end.user_error.rank, end.user_error.epoch) == (2, 0)
    assert end.user_error.error_type == "ValueError"
    assert "model_fn built another model on ranks [2] than on rank 0" in end.user_error.message
    ends = [c for c in of(out, Broadcast) if isinstance(c.message, m.Shutdown)]  # type: ignore[attr-defined]
    assert len(ends) == 1 and ends[0].ranks == (0, 1, 2)  # type: ignore[attr-defined]
    assert ends[0].message.user_error == end.user_error  # type: ignore[attr-defined]


def test_issue12_item15_equal_initial_weights_say_nothing() -> None:
    h = Harness(world_size=2, mode=Mode.CPU_CADENCE)
    h.form()
    out = h.send(0, m.InitialState(fingerprint="a")) + h.send(1, m.InitialState(fingerprint="a"))
    assert not of(out, Notice)


def test_issue12_item14_a_failure_during_a_save_lets_the_save_finish() -> None:
    h = Harness(world_size=3, num_samples=960, max_failures=1, save_path="/tmp/never")
    h.form()
    h.feed(RankLost(rank=2, reason="killed"))
    assert h.core.state is RunState.SAVING
    out = h.send(1, failed(0))
    out += h.answer_saves()
    assert run_end(out).outcome == "saved_and_shutdown"
