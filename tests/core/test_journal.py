"""The coordinator's journal: a restored coordinator goes on with the run, exactly once."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from elche.core import messages as m
from elche.core.commands import AppendJournal, Emit, Finish, Notice, Send
from elche.core.config import Mode
from elche.core.coordinator import Coordinator, RankState, RunState
from elche.core.dispatch import ChunkPool
from elche.core.errors import ConfigError
from elche.core.events import RankJoined, RankLost, Started, StopRequested, TimerFired
from elche.core.journal import JournalRecord, rejoin_timeout_s
from elche.core.rank import Hold, RankProtocol, Train
from elche.core.timeline import CheckpointRan, EpochEnd, Eval, RunEnd
from tests.core.harness import Harness, config, messages, of


def records(h: Harness) -> list[JournalRecord]:
    return [c.record for c in of(h.log, AppendJournal)]  # type: ignore[attr-defined]


def restart(h: Harness, record: JournalRecord) -> Harness:
    """A new coordinator from ``record``; the live ranks rejoin with what they hold."""
    h2 = Harness(h.cfg)
    h2.core = Coordinator.restore(h.cfg, record, last_save=0)
    h2.feed(Started())
    for rank in range(h.cfg.world_size):
        h2.last_round[rank] = h.last_round[rank]
        h2.since[rank] = list(h.since[rank])
        if rank not in record.dead_ranks:
            h2.feed(RankJoined(rank=rank, held=h.held(rank)))
    return h2


def assert_exactly_once(h: Harness, *books: Harness) -> None:
    """Every sample of every epoch is in exactly one applied average (the ranks' books)."""
    per_epoch: dict[int, Counter[int]] = {}
    for book in books:
        for epoch, offset, size in book.in_averages:
            per_epoch.setdefault(epoch, Counter()).update(range(offset, offset + size))
    assert sorted(per_epoch) == list(range(h.cfg.epochs))
    for counts in per_epoch.values():
        assert set(counts) == set(range(h.cfg.num_samples))
        assert set(counts.values()) == {1}


def run_end(h: Harness) -> RunEnd:
    ends = [c.event for c in h.log if hasattr(c, "event") and isinstance(c.event, RunEnd)]
    assert len(ends) == 1
    return ends[0]


STOP = 4  # the round a coordinator is lost after: mid-epoch 1 (three averages an epoch)
PACE_MS = {0: 10.0, 1: 20.0, 2: 40.0}


def trained_past_round(mode: Mode, stop: int) -> tuple[Harness, dict[int, float]]:
    """Three ranks of 6,400 samples trained to round ``stop``, then one batch more each
    (the ranks hold unaveraged work when the coordinator goes); and their pace."""
    h = Harness(config(mode=mode, world_size=3, epochs=3, num_samples=6400, seed=3))
    h.form()
    h.run_to_end(PACE_MS, until=lambda: h.core.rounds_done >= stop)
    for rank in h.core.live:  # the ranks train on after the last average
        if h.chunks[rank]:
            h.train(rank, 1, batch_ms=PACE_MS[rank])
    return h, PACE_MS


@pytest.mark.parametrize("mode", [Mode.CADENCE, Mode.SYNC])
@pytest.mark.parametrize("unjournaled", [False, True])
def test_a_restored_coordinator_finishes_the_run_exactly_once(
    mode: Mode, unjournaled: bool
) -> None:
    h, ms = trained_past_round(mode, STOP)
    stop = STOP
    journal = records(h)
    assert journal[-1].rounds_done == h.core.rounds_done
    # Unjournaled: the coordinator died after the ranks applied a round, before its record.
    behind = [r for r in journal if r.rounds_done == stop - 1]
    record = behind[-1] if unjournaled else journal[-1]
    assert any(h.since[r] for r in range(3))  # the ranks hold unaveraged batches

    h2 = restart(h, record)
    assert h2.core.live == [0, 1, 2]
    assert h2.core.state is RunState.TRAINING
    h2.run_to_end(ms)

    assert of(h2.log, Finish) == [Finish(outcome="completed")]
    end = run_end(h2)
    assert end.lost_samples == 0 and end.epochs_completed == 3
    assert sum(h2.core.work.samples_committed) == 3 * 6400
    assert h2.core.coordinator_restarts == 1
    assert_exactly_once(h, h, h2)


def test_a_rank_lost_before_the_restart_stays_lost_and_its_work_is_served_once() -> None:
    h = Harness(world_size=3, epochs=2, num_samples=3840)  # 8 rounds in all
    h.form()
    h.run_to_end(until=lambda: h.core.rounds_done >= 2)
    h.send(2, m.Exiting(reason="killed"))
    h.run_to_end(until=lambda: h.core.rounds_done >= 4)
    record = records(h)[-1]
    assert record.dead_ranks == (2,)

    h2 = restart(h, record)
    assert h2.core.rank_state[2] is RankState.DEAD and h2.core.live == [0, 1]
    h2.run_to_end()
    assert run_end(h2).lost_samples == 0
    assert_exactly_once(h, h, h2)


def test_a_round_after_an_abandoned_one_that_closed_after_the_last_record_is_booked() -> None:
    """Rounds are known by number, and an abandoned round spends one: a rank
    that applied the round tried after it was evicted as "past the journal"."""
    h = Harness(world_size=3, epochs=2, num_samples=3840)
    h.form()
    h.run_to_end(PACE_MS, until=lambda: h.core.rounds_done >= 2)
    h.train_window(PACE_MS)
    assert h.core.round.in_flight
    h.feed(RankLost(rank=2, reason="process killed"))  # before any ack: abandoned
    if not h.core.round.in_flight:
        h.train_window({0: 10.0, 1: 20.0})
    rnd = h.core.round
    assert rnd.in_flight and rnd.number == h.core.last_round + 2  # the abandoned one's spent
    record = records(h)[-1]
    assert record.dead_ranks == (2,) and record.last_round < rnd.number
    for rank in (0, 1):  # they apply it; the coordinator dies before their acks reach it
        steps = h.core.work.steps_since_sync(rank)
        took, h.since[rank] = h.since[rank][:steps], h.since[rank][steps:]
        h.averaged[rank], h.last_round[rank] = took, rnd.number
        h.in_averages += took
    h2 = restart(h, record)
    assert h2.core.live == [0, 1] and h2.core.rounds_done == record.rounds_done + 1
    h2.run_to_end()
    assert run_end(h2).lost_samples == 0
    assert_exactly_once(h, h, h2)


def test_a_rank_that_rejoins_past_the_journal_or_with_nothing_is_evicted() -> None:
    h = Harness(world_size=3, epochs=1, num_samples=960, mode=Mode.SYNC)
    h.form()
    h.run_to_end(until=lambda: h.core.rounds_done >= 3)
    old = [r for r in records(h) if r.rounds_done == 1][-1]
    h2 = Harness(h.cfg)
    h2.core = Coordinator.restore(h.cfg, old, last_save=0)
    h2.feed(Started())
    h2.feed(RankJoined(rank=0, held=h.held(0)))  # at round 3: the journal is at round 1
    h2.feed(RankJoined(rank=1))  # holds nothing
    assert h2.core.rank_state[0] is RankState.ERRORED
    assert h2.core.rank_state[1] is RankState.ERRORED


def test_the_journal_is_compacted_when_the_open_epochs_change_and_bounded_by_them() -> None:
    h = Harness(world_size=2, epochs=3, num_samples=640)
    h.form()
    h.run_to_end()
    appended = of(h.log, AppendJournal)
    compacts = [c for c in appended if c.compact]  # type: ignore[attr-defined]
    assert appended[0].compact  # type: ignore[attr-defined]
    # A compaction whenever the open epochs change: each epoch opens as the
    # round that ends the one before starts (its first work goes out with
    # that round, ``elche.core.ahead``), the old one is settled
    # when the round closes, and the last once training is over. Each is
    # written before the epoch's first chunk.
    opened = [c.record.open_epochs for c in compacts]  # type: ignore[attr-defined]
    assert opened == [(0,), (0, 1), (1,), (1, 2), (2,), ()]
    for epoch in range(3):
        at = next(i for i, c in enumerate(h.log) if c in compacts and epoch in c.record.open_epochs)  # type: ignore[attr-defined]
        first_chunk = next(
            i for i, c in enumerate(h.log)
            if isinstance(c, Send) and isinstance(c.message, m.AssignChunk)
            and c.message.epoch == epoch
        )  # fmt: skip
        assert at < first_chunk
    assert appended[-1].record.rounds_done == h.core.rounds_done  # type: ignore[attr-defined]
    for command in appended:
        assert len(command.record.coverage) <= 2  # type: ignore[attr-defined]
    # (A round that ends an epoch is journaled as it starts too: opened_round tells.)
    keys = [(c.record.rounds_done, c.record.open_epochs, c.record.opened_round) for c in appended]  # type: ignore[attr-defined]
    rounds = [r for r, _, _ in keys]
    assert rounds == sorted(rounds) and len(keys) == len(set(keys))  # each new state once


def test_a_coordinator_restored_after_training_writes_the_final_model() -> None:
    h = Harness(world_size=2, epochs=1, num_samples=640)
    h.form()
    h.run_to_end(final=False)
    assert h.core.state is RunState.CLOSING  # the final save is under way
    h2 = restart(h, records(h)[-1])
    assert h2.core.state is RunState.CLOSING
    assert of(h2.answer_saves(), Finish) == [Finish(outcome="completed")]
    assert run_end(h2).lost_samples == 0


def test_a_restored_coordinator_journals_itself_before_it_sends_anything() -> None:
    # Its successor numbers its frames past the count of coordinators the journal
    # holds; one killed as its ranks rejoined had left that count as it found it.
    h = Harness(world_size=2, epochs=2, num_samples=640)
    h.form()
    h.run_to_end(until=lambda: h.core.rounds_done >= 1)
    record = records(h)[-1]
    core = Coordinator.restore(h.cfg, record, last_save=0)
    first, *_ = core.handle(Started(), 0.0)
    assert isinstance(first, AppendJournal) and first.compact
    assert first.record == dataclasses.replace(record, coordinator_restarts=1)
    again = Coordinator.restore(h.cfg, first.record, last_save=0)
    assert again.coordinator_restarts == 2


def test_a_coordinator_lost_during_the_last_eval_asks_for_it_again_and_takes_one_answer() -> None:
    # Its successor went from the journal straight to the final save: the run
    # completed without its last eval, and nothing said so.
    h = Harness(world_size=2, epochs=1, num_samples=640, has_eval_fn=True)
    h.form()
    h.run_to_end(final=False)
    assert h.core.state is RunState.FINISHING  # the eval asked for, not answered
    h2 = restart(h, records(h)[-1])
    (asked,) = [(r, msg) for r in range(2) for msg in h2.received(r, m.RunEval)]
    rank, run_eval = asked
    assert run_eval == m.RunEval(epoch=1)
    answer = m.EvalResult(epoch=1, metric=0.9, elapsed_ms=5.0)
    h2.send(rank, answer)
    assert records(h2)[-1].pending_evals == ()  # a successor would not ask again
    out = h2.send(rank, answer)  # the lost coordinator's ask, answered late: one eval
    evals = [c.event for c in of(h2.log, Emit) if isinstance(c.event, Eval)]  # type: ignore[attr-defined]
    assert evals == [Eval(epoch=1, metric=0.9, rank=rank, duration_ms=5.0)]
    # The second answer is counted and said, not dropped unseen.
    assert h2.core.stale_messages == 1
    (said,) = of(out, Notice)
    assert said.level == "warning" and f"rank {rank} answered eval_fn after epoch 0" in said.text  # type: ignore[attr-defined]
    assert of(h2.answer_saves(), Finish) == [Finish(outcome="completed")]


def test_a_coordinator_lost_while_a_checkpoint_fn_ran_asks_for_it_again_and_takes_one_answer() -> (
    None
):
    # Its successor knew of no checkpoint asked: the ranks forget their predecessor's
    # orders as they rejoin, so the run went on to the final save without the last
    # checkpoint_fn, and nothing said so.
    h = Harness(world_size=2, epochs=1, num_samples=640, checkpoint_every=1)
    h.form()
    h.run_to_end(final=False)
    assert h.core.state is RunState.FINISHING  # the checkpoint asked for, not answered
    assert records(h)[-1].pending_checkpoints == ((1, h.core.callbacks.pending_checkpoints[1]),)
    h2 = restart(h, records(h)[-1])
    assert h2.core.state is RunState.FINISHING
    (asked,) = [(r, msg) for r in range(2) for msg in h2.received(r, m.RunCheckpoint)]
    rank, run_checkpoint = asked
    assert run_checkpoint == m.RunCheckpoint(version=1)
    answer = m.CheckpointResult(version=1, elapsed_ms=5.0)
    h2.send(rank, answer)
    assert records(h2)[-1].pending_checkpoints == ()  # a successor would not ask again
    # The lost coordinator's ask, answered late (and failed): said, not retried.
    out = h2.send(rank, m.CheckpointResult(version=1, elapsed_ms=5.0, error="disk full"))
    assert h2.core.stale_messages == 1
    assert [n.level for n in of(out, Notice)] == ["warning"] and not of(out, Send)  # type: ignore[attr-defined]
    assert [c.event.version for c in of(h2.log, Emit) if isinstance(c.event, CheckpointRan)] == [1]  # type: ignore[attr-defined]
    assert of(h2.answer_saves(), Finish) == [Finish(outcome="completed")]


def epoch_ends(h: Harness) -> list[EpochEnd]:
    return [c.event for c in of(h.log, Emit) if isinstance(c.event, EpochEnd)]  # type: ignore[attr-defined]


def test_a_coordinator_lost_once_it_wrote_an_epochs_end_is_followed_by_one_that_ends_it_once() -> (
    None
):
    # Its newest record was the round's, before the epoch ended: the successor ended
    # the epoch again, and the run listed it twice (the second time without its loss).
    h = Harness(world_size=2, epochs=2, num_samples=640, has_eval_fn=True)
    h.loss = 0.5
    h.form()
    h.run_to_end(final=False)
    last_end = max(
        i for i, c in enumerate(h.log) if isinstance(c, Emit) and isinstance(c.event, EpochEnd)
    )
    record = [c.record for c in of(h.log[:last_end], AppendJournal)][-1]  # type: ignore[attr-defined]
    assert [e.epoch for e in epoch_ends(h)] == [0, 1]
    h2 = restart(h, record)
    assert epoch_ends(h2) == []
    asked = [(r, ask.epoch) for r in range(2) for ask in h2.received(r, m.RunEval)]  # type: ignore[attr-defined]
    assert sorted(epoch for _, epoch in asked) == [1, 2]  # unanswered: asked again
    for rank, epoch in asked:
        h2.send(rank, m.EvalResult(epoch=epoch, metric=0.9, elapsed_ms=5.0))
    assert of(h2.answer_saves(), Finish) == [Finish(outcome="completed")]


def test_a_coordinator_lost_in_an_epochs_last_round_leaves_the_epochs_loss_to_its_successor() -> (
    None
):
    # The ranks applied the round; its record was never written. The successor ended
    # the epoch with no loss: the losses its batches reported were not in the journal.
    h = Harness(world_size=2, epochs=1, num_samples=6400)
    h.loss = 0.5
    h.form()
    h.run_to_end(final=False)
    record = [r for r in records(h) if r.rounds_done < h.core.rounds_done][-1]
    assert record.rounds_done > 0  # batches reported a loss before it
    h2 = restart(h, record)
    assert [(e.epoch, e.loss) for e in epoch_ends(h2)] == [(0, 0.5)]
    assert of(h2.answer_saves(), Finish) == [Finish(outcome="completed")]


@pytest.mark.parametrize("applied", [False, True])
@pytest.mark.parametrize("epochs", [1, 2])
def test_a_coordinator_lost_in_an_epochs_only_round_leaves_the_epochs_loss_to_its_successor(
    applied: bool, epochs: int
) -> None:
    # Every loss of a one-window epoch is reported after its opening's record; the
    # successor of a coordinator lost in its round ended it with loss null.
    h = Harness(world_size=2, epochs=epochs, num_samples=640)
    h.loss = 0.5
    h.form()
    last = epochs - 1  # the last epoch: no next one opens as its round starts
    h.run_to_end(until=lambda: h.core.round.in_flight and h.core.work.open_epochs() == [last])
    if applied:  # the ranks applied the round; its record was never written
        for rank in range(2):
            h.send(rank, m.SyncAck(round=h.core.round.number, steps=len(h.since[rank])))
        record = [r for r in records(h) if r.rounds_done < h.core.rounds_done][-1]
    else:
        record = records(h)[-1]
    h2 = restart(h, record)
    h2.run_to_end()
    assert [(e.epoch, e.loss) for e in epoch_ends(h2)] == [(last, 0.5)]
    assert of(h2.log, Finish) == [Finish(outcome="completed")]


def test_a_journal_of_another_world_size_is_refused_naming_it() -> None:
    h = Harness(world_size=2, epochs=1, num_samples=640)
    h.form()
    with pytest.raises(ConfigError, match="journal"):
        Coordinator.restore(config(world_size=3), records(h)[-1], last_save=0)


def test_claim_carves_exactly_the_span_out_of_the_reclaimed_queue() -> None:
    pool = ChunkPool.from_uncovered(100, [(0, 50), (70, 30)], batch_size=10, num_ranks=2)
    assert pool.claim(1, (20, 10))
    assert pool.reclaimed_spans() == [(0, 20), (30, 20), (70, 30)]
    assert pool.outstanding_spans(1) == [(20, 10)]
    assert not pool.claim(0, (45, 10))  # straddles a committed span
    assert not pool.claim(0, (20, 5))  # already claimed
    assert pool.commit(1, 10) == 10 and pool.uncovered() == [(0, 20), (30, 20), (70, 30)]


def test_max_coordinator_restarts_must_be_a_count() -> None:
    with pytest.raises(ConfigError, match="max_coordinator_restarts"):
        config(max_coordinator_restarts=-1)
    assert config().max_coordinator_restarts == 3


def test_a_rank_rejoins_with_what_its_model_holds_and_forgets_its_orders() -> None:
    proto = RankProtocol(1, mode=Mode.CADENCE, batch_size=32)
    proto.handle(m.AssignChunk(epoch=0, offset=0, size=320, budget=3, window=3))
    for _ in range(3):
        action = proto.next_action()
        assert isinstance(action, Train)
        proto.trained(action, batch_ms=1.0, data_ms=0.0, loss=None)
    proto.handle(m.SyncNow(round=4, generation=0))
    proto.averaged()
    proto.handle(m.SetBudget(budget=6, window=6))
    for _ in range(2):
        action = proto.next_action()
        assert isinstance(action, Train)
        proto.trained(action, batch_ms=1.0, data_ms=0.0, loss=None)
    proto.handle(m.SyncNow(round=5, generation=0))  # the lost coordinator's last order
    proto.handle(m.Rejoin())
    hello = proto.rejoin(world_size=3, host="h", pid=7)
    assert hello.held == m.Held(
        last_round=4,
        averaged=((0, 0, 32), (0, 32, 32), (0, 64, 32)),
        since=((0, 96, 32), (0, 128, 32)),
    )
    assert (hello.rank, hello.world_size) == (1, 3)
    assert isinstance(proto.next_action(), Hold)  # no chunk, no round: it waits for work


def test_a_rank_that_does_not_rejoin_in_two_heartbeat_timeouts_is_lost_its_work_served() -> None:
    h = Harness(world_size=3, epochs=2, num_samples=3840, heartbeat_timeout_s=5.0)
    h.form()
    h.run_to_end(until=lambda: h.core.rounds_done >= 3)
    record = records(h)[-1]
    h2 = Harness(h.cfg)
    h2.core = Coordinator.restore(h.cfg, record, last_save=0)
    h2.feed(Started(), at=100.0)
    for rank in (0, 1):  # rank 2 is stalled: it never rejoins
        h2.last_round[rank], h2.since[rank] = h.last_round[rank], list(h.since[rank])
        h2.feed(RankJoined(rank=rank, held=h.held(rank)))
    h2.feed(TimerFired(), at=100.0 + 2 * 5.0 - 0.1)
    assert h2.core.state is RunState.FORMING  # still within the rejoin deadline
    assert h2.core.rank_state[2] is RankState.JOINING
    out = h2.feed(TimerFired(), at=100.0 + 2 * 5.0)  # not formation_timeout_s (60 s)
    assert h2.core.rank_state[2] is RankState.DEAD and h2.core.live == [0, 1]
    assert h2.core.state is RunState.TRAINING
    assert any("did not rejoin the restarted coordinator within 10 s" in str(c) for c in out)
    h2.run_to_end()
    assert run_end(h2).lost_samples == 0 and run_end(h2).dead_ranks == (2,)
    assert_exactly_once(h, h, h2)
    assert rejoin_timeout_s(config(heartbeat_timeout_s=40.0)) == 60.0  # formation_timeout_s caps it


def test_a_stop_while_the_ranks_rejoin_a_restored_coordinator_saves_once_they_have() -> None:
    # Ctrl-C just after the coordinator was lost: its successor is forming again, but
    # the ranks hold what the run trained. Failing it as "never formed" lost all of it.
    h, _ = trained_past_round(Mode.CADENCE, STOP)
    saving = dataclasses.replace(h.cfg, save_path="/tmp/bundle")
    record = records(h)[-1]
    h2 = Harness(saving)
    h2.core = Coordinator.restore(saving, record, last_save=0)
    h2.feed(Started())
    out = h2.feed(StopRequested(reason="SIGINT"))
    assert h2.core.state is RunState.FORMING and not of(out, Finish)
    for rank in range(3):
        h2.last_round[rank] = h.last_round[rank]
        h2.since[rank] = list(h.since[rank])
        out = h2.feed(RankJoined(rank=rank, held=h.held(rank)))
    assert h2.core.state is RunState.SAVING
    assert [s.reason for s in messages(out, m.ShutdownWithSave)] == ["graceful_shutdown"]
    assert of(h2.answer_saves(), Finish) == [
        Finish(outcome="saved_and_shutdown", reason="graceful_shutdown")
    ]


def test_the_steps_skipped_before_a_restart_are_still_counted_at_the_runs_end() -> None:
    # The restored coordinator counted from zero: the run's summary said fewer
    # steps and samples were left out for a non-finite loss than were.
    h = Harness(world_size=2, epochs=2, num_samples=1280, nonfinite="skip")
    h.form()
    for rank in (1, 0, 1):  # steps with a NaN loss, left out
        h.train(rank, 1, nonfinite=True)
    h.run_to_end(until=lambda: h.core.rounds_done >= 2)
    record = records(h)[-1]
    assert (record.skipped_steps, record.skipped_samples) == (3, 3 * h.cfg.batch_size)

    h2 = restart(h, record)
    h2.run_to_end()
    end = run_end(h2)
    assert end.outcome == "completed"
    assert (end.skipped_steps, end.skipped_samples) == (3, 3 * h.cfg.batch_size)
