"""Issue 12, "keep every promise off the tested path": the core's half.

Each test is named after the item it pins down and failed before its fix.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.checkpoint import BundleFile, BundleFiles, CheckpointMeta, EpochCoverage, SaveReason
from elche.core.commands import Emit, Finish, Notice, Send
from elche.core.config import CallbackPolicy, Mode
from elche.core.coordinator import Coordinator, RunState
from elche.core.elche_state import ElCheState, Phase
from elche.core.errors import ConfigError
from elche.core.events import AverageComputed, RankJoined, RankLost, Started
from elche.core.roles import Role
from tests.core.harness import Harness, of


def sent(out: list, kind: type) -> list[tuple[int, m.CoordMessage]]:
    return [(c.rank, c.message) for c in of(out, Send) if isinstance(c.message, kind)]  # type: ignore[attr-defined]


def notices(out: list, level: str = "error") -> list[str]:
    return [c.text for c in of(out, Notice) if c.level == level]  # type: ignore[attr-defined]


# -- item 3: no hang in FINISHING ------------------------------------------------


def test_issue12_item03a_pinned_eval_rank_dying_in_the_final_eval_ends_the_run() -> None:
    h = Harness(
        world_size=3,
        num_samples=960,
        has_eval_fn=True,
        callback_policy=CallbackPolicy.PINNED,
        callback_rank=1,
    )
    out = h.form() + h.run_to_end()
    assert h.core.state is RunState.FINISHING
    assert sent(out, m.RunEval) == [(1, m.RunEval(epoch=1))]
    out = h.feed(RankLost(rank=1, reason="process killed"))
    # The pinned policy never moves the eval role: the eval is given up, loudly.
    assert not sent(out, m.RunEval)
    assert any("eval" in text and "rank 1" in text for text in notices(out))
    out += h.answer_saves()  # the final model is on disk
    assert of(out, Finish) == [Finish(outcome="completed")]
    assert h.core.roles.holder(Role.EVAL) == 1


def test_issue12_item03a_pinned_eval_on_a_dead_rank_is_never_sent() -> None:
    h = Harness(
        world_size=3,
        num_samples=960,
        epochs=2,
        has_eval_fn=True,
        callback_policy=CallbackPolicy.PINNED,
        callback_rank=2,
    )
    h.form()
    out = h.feed(RankLost(rank=2, reason="process killed"))
    out += h.run_to_end()
    assert not sent(out, m.RunEval)  # both epochs' evals were owed by the dead rank
    assert sum("eval" in text for text in notices(out)) == 2
    out += h.answer_saves()  # the final model is on disk
    assert of(out, Finish) == [Finish(outcome="completed")]


def test_issue12_item03b_last_checkpoint_retry_dying_ends_the_run() -> None:
    h = Harness(world_size=3, num_samples=960, checkpoint_every=1)
    h.form()
    h.run_to_end()
    assert h.core.state is RunState.FINISHING
    h.send(0, m.CheckpointResult(version=1, elapsed_ms=1.0, error="disk full"))
    out = h.send(1, m.CheckpointResult(version=1, elapsed_ms=1.0, error="disk full"))
    assert sent(out, m.RunCheckpoint) == [(2, m.RunCheckpoint(version=1))]
    out = h.feed(RankLost(rank=2, reason="process killed"))
    assert any("giving up" in text for text in notices(out))
    out += h.answer_saves()  # the final model is on disk
    assert of(out, Finish) == [Finish(outcome="completed")]
    assert h.core.state is RunState.DONE


# -- item 4: checkpoint failover follows the fastest policy --------------------


PACE_MS = {0: 10.0, 1: 40.0, 2: 20.0}  # fastest 0, then 2, then 1


def test_issue12_item04_checkpoint_moves_to_the_fastest_survivor_when_its_rank_dies() -> None:
    h = Harness(world_size=3, num_samples=3200, checkpoint_every=1)
    out = h.form() + h.run_to_end(PACE_MS)
    assert h.core.state is RunState.FINISHING
    assert sent(out, m.RunCheckpoint) == [(0, m.RunCheckpoint(version=1))]
    out = h.feed(RankLost(rank=0, reason="process killed"))
    # Rank 2 is the fastest survivor; rank 1 is only the lowest.
    assert sent(out, m.RunCheckpoint) == [(2, m.RunCheckpoint(version=1))]
    assert h.core.roles.holder(Role.CHECKPOINT) == 2
    out = h.send(2, m.CheckpointResult(version=1, elapsed_ms=1.0))
    out += h.answer_saves()  # the final model is on disk
    assert of(out, Finish) == [Finish(outcome="completed")]


def test_a_failed_checkpoint_still_retries_the_next_untried_rank() -> None:
    h = Harness(world_size=3, num_samples=3200, checkpoint_every=1)
    h.form()
    h.run_to_end(PACE_MS)
    out = h.send(0, m.CheckpointResult(version=1, elapsed_ms=1.0, error="disk full"))
    assert sent(out, m.RunCheckpoint) == [(1, m.RunCheckpoint(version=1))]  # reference rule


def test_issue12_item03b_death_after_failures_skips_the_ranks_that_failed() -> None:
    h = Harness(world_size=3, num_samples=3200, checkpoint_every=1)
    h.form()
    h.run_to_end(PACE_MS)
    h.send(0, m.CheckpointResult(version=1, elapsed_ms=1.0, error="disk full"))  # retry on 1
    h.send(1, m.CheckpointResult(version=1, elapsed_ms=1.0, error="disk full"))  # retry on 2
    h.send(0, m.Heartbeat())
    out = h.feed(RankLost(rank=2, reason="process killed"))
    # Rank 0 is the fastest survivor but failed this version already.
    assert not sent(out, m.RunCheckpoint)
    out += h.answer_saves()  # the final model is on disk
    assert of(out, Finish) == [Finish(outcome="completed")]


# -- item 6: each rank's epoch_fn cost shrinks its own quota, in the right window


Window = tuple[int | None, bool, tuple[int, ...]]  # (serving epoch, epoch tail?, budgets)


def windows(epoch_fn_ms: dict[int, float] | None, mode: Mode = Mode.CADENCE) -> list[Window]:
    """Drive a 2-epoch run at 10 and 20 ms/batch; what each window was.

    Every rank reports its ``epoch_fn`` cost as it starts an epoch, as
    ``RankProtocol`` makes it. Epoch 0's reports arrive as the ranks join,
    before any batch: the ledger's time exclusion, which takes a callback's
    cost out of the batch timings, then has nothing to take it from, and the
    balancer's pace is the same as without ``epoch_fn``.
    """
    ms = {0: 10.0, 1: 20.0}
    h = Harness(num_samples=32 * 120, epochs=2, mode=mode)
    started = [0, 0]
    h.feed(Started())
    for rank in (0, 1):
        h.feed(RankJoined(rank=rank))
        if epoch_fn_ms is not None:
            h.send(rank, m.EpochFnElapsed(epoch=0, elapsed_ms=epoch_fn_ms[rank]))

    def window() -> Window:
        core = h.core
        return (
            core.work.serving_epoch(),
            core.planner.tail_plan is not None,
            tuple(core.planner.budget),
        )

    def quota(rank: int) -> int:  # async: the round is instant, nobody overshoots
        planner = h.core.planner
        return h.quota(rank) if mode is not Mode.CPU_ASYNC else planner.window_steps(rank)

    seen = [window()]
    number = 0
    for _ in range(100):
        if h.core.state is not RunState.TRAINING:
            break
        for rank in (0, 1):
            while (
                not h.averaging(rank)
                and h.chunks[rank]
                and h.core.work.steps_since_sync(rank) < quota(rank)
            ):
                epoch = h.chunks[rank][0][0]
                if epoch_fn_ms is not None and epoch > started[rank]:
                    started[rank] = epoch
                    h.send(rank, m.EpochFnElapsed(epoch=epoch, elapsed_ms=epoch_fn_ms[rank]))
                h.train(rank, 1, batch_ms=ms[rank])
        if h.core.round.in_flight and h.core.round.number != number:
            number = h.core.round.number
            steps = {rank: h.core.work.steps_since_sync(rank) for rank in (0, 1)}
            if mode is Mode.CPU_ASYNC:  # the coordinator backend averages snapshots
                for rank in (0, 1):
                    h.send(rank, m.SnapshotReady(round=number, steps=steps[rank]))
                h.feed(AverageComputed(round=number))
            for rank in (0, 1):
                h.send(rank, m.SyncAck(round=number, steps=steps[rank]))
            seen.append(window())
    assert h.core.state is RunState.CLOSING  # training is over; the final model is next
    return seen


def boundary(seen: list[Window]) -> int:
    """Index of the first window of epoch 1."""
    return next(i for i, (epoch, _, _) in enumerate(seen) if epoch == 1)


def test_issue12_item06_each_ranks_epoch_fn_shrinks_its_own_quota_in_the_boundary_window() -> None:
    plain = windows(None)
    costly = windows({0: 30.0, 1: 150.0})
    b = boundary(plain)
    assert plain[b - 1][:2] == (0, True)  # epoch 0's tail window comes just before
    assert plain[b] == (1, False, (20, 10))  # calibrated: rank 0 runs twice as fast
    # Up to epoch 0's tail every window is planned as if there were no epoch_fn.
    assert costly[:b] == plain[:b]
    # The window that starts epoch 1, where every rank runs epoch_fn, carves
    # out rank 1's own 150 ms (8 of its 20 ms batches); rank 0's 30 ms is
    # under the 100 ms floor.
    assert costly[b] == (1, False, (20, 10 - 8))


def test_issue12_item06_slack_is_not_staged_before_the_boundary() -> None:
    plain = windows(None)
    costly = windows({0: 200.0, 1: 200.0})
    b = boundary(plain)
    assert costly[:b] == plain[:b]  # the tail window is not shrunk
    assert costly[b] == (1, False, (1, 1))  # 200 ms is 20 and 10 batches: clamped at 1


def test_issue12_item06_async_slack_lands_in_the_window_that_crosses_the_boundary() -> None:
    plain = windows(None, Mode.CPU_ASYNC)
    costly = windows({0: 30.0, 1: 150.0}, Mode.CPU_ASYNC)
    b = boundary(plain) - 1  # async streams: the last window serving epoch 0 crosses into 1
    assert costly[:b] == plain[:b]
    fast, slow = plain[b][2]
    assert costly[b] == (0, False, (fast, slow - 8))


# -- item 11: resumes that check -----------------------------------------------


def meta_doc(**overrides: object) -> dict[str, object]:
    """A meta a 2-rank, 640-sample, 3-epoch run saved in epoch 1."""
    raw = json.loads(
        CheckpointMeta(
            epoch=1,
            global_step=30,
            rounds_done=8,
            world_size=2,
            reason=SaveReason.SINGLE_SURVIVOR,
            seed=42,
            batch_size=32,
            epochs=3,
            elche_state=ElCheState(
                anchor=10,
                anchor_rank=1,
                smoothed_ms_per_batch=(10.0, 20.0),
                phase=Phase.WARMUP,
                calibration_count=4,
                trend_history=(0.01,),
            ),
            coverage=(EpochCoverage(epoch=1, total_samples=640, uncovered=((320, 320),)),),
            mode="cadence",
            save_seq=4,
            files=BundleFiles(model=BundleFile(name="run.s4.model.pt", size=8, sha256="0" * 64)),
        ).to_json()
    )
    raw.update(overrides)
    return raw


def with_state(**overrides: object) -> dict[str, object]:
    state = dict(meta_doc()["elche_state"])  # type: ignore[call-overload]  # a JSON object
    state.update(overrides)
    return meta_doc(elche_state=state)


def with_coverage(**overrides: object) -> dict[str, object]:
    entry = {"epoch": 1, "total_samples": 640, "uncovered": [[320, 320]]}
    entry.update(overrides)
    return meta_doc(coverage=[entry])


BIG = 10**30
MAX_COUNT = 2**53  # the bound on a meta's counts (elche.core.elche_state.MAX_COUNT)


@pytest.mark.parametrize(
    ("raw", "field", "accepted"),
    [
        (meta_doc(epoch=10**18), "epoch", "[0, 3]"),
        (meta_doc(epochs=BIG, epoch=BIG), "epochs", f"[1, {MAX_COUNT}]"),
        (meta_doc(global_step=BIG), "global_step", f"[0, {MAX_COUNT}]"),
        (meta_doc(rounds_done=BIG), "rounds_done", f"[0, {MAX_COUNT}]"),
        (meta_doc(world_size=0), "world_size", f"[1, {MAX_COUNT}]"),
        (meta_doc(batch_size=0), "batch_size", f"[1, {MAX_COUNT}]"),
        (meta_doc(seed=2**64), "seed", f"[0, {2**64 - 1}]"),
        (with_coverage(uncovered=[[600, 64]]), "coverage", "[0, 640]"),
        (with_coverage(uncovered=[[BIG, 1]]), "coverage", "[0, 640]"),
        (with_coverage(total_samples=0), "total_samples", f"[1, {MAX_COUNT}]"),
        (with_coverage(total_samples=BIG), "total_samples", f"[1, {MAX_COUNT}]"),
        (with_coverage(epoch=0), "coverage", "[1, 3)"),  # before the meta's epoch
        (with_coverage(epoch=3), "coverage", "[1, 3)"),  # past the plan
        (with_state(anchor=BIG), "anchor", f"[1, {MAX_COUNT}]"),
        (with_state(anchor_rank=BIG), "anchor_rank", f"[0, {MAX_COUNT}]"),
        (with_state(calibration_count=BIG), "calibration_count", f"[0, {MAX_COUNT}]"),
    ],
)
def test_issue12_item11_out_of_range_meta_numbers_are_refused_naming_field_and_range(
    raw: dict[str, object], field: str, accepted: str
) -> None:
    with pytest.raises(ConfigError) as info:
        CheckpointMeta.from_json(json.dumps(raw))
    assert info.value.field == field
    assert accepted in str(info.value)


def test_issue12_item11_two_coverage_entries_for_one_epoch_are_refused() -> None:
    entry = {"epoch": 1, "total_samples": 640, "uncovered": [[0, 32]]}
    with pytest.raises(ConfigError) as info:
        CheckpointMeta.from_json(json.dumps(meta_doc(coverage=[entry, entry])))
    assert info.value.field == "coverage"


def test_issue12_item11_non_finite_trend_history_is_refused() -> None:
    text = json.dumps(with_state(trend_history=[0.01, float("nan")]))
    with pytest.raises(ConfigError) as info:
        CheckpointMeta.from_json(text)
    assert info.value.field == "trend_history"


def resumed(meta: CheckpointMeta, **overrides: object) -> Harness:
    h = Harness(**{"num_samples": 640, "epochs": 3, "seed": 42, **overrides})
    h.core = Coordinator(h.cfg, resume=meta)
    return h


@pytest.mark.parametrize(("field", "saved", "ours"), [("seed", 7, 42), ("batch_size", 16, 32)])
def test_issue12_item11_a_meta_of_another_run_is_refused_naming_both_values(
    field: str, saved: int, ours: int
) -> None:
    meta = CheckpointMeta.from_json(json.dumps(meta_doc(**{field: saved})))
    with pytest.raises(ConfigError) as info:
        resumed(meta)
    assert info.value.field == field
    assert f"{saved}" in str(info.value) and f"{ours}" in str(info.value)


def test_issue12_item11_a_bundle_resumes_on_another_world_size_with_a_fresh_balancer() -> None:
    meta = CheckpointMeta.from_json(json.dumps(meta_doc()))  # saved by 2 ranks
    h = resumed(meta, world_size=3)
    h.form()
    state = h.core.tuner.saved_state()
    assert state.smoothed_ms_per_batch == (0.0, 0.0, 0.0)  # measured afresh
    assert state.phase is Phase.PROBE
    assert h.core.work.open_epochs() == [1]  # the bundle's unfinished epoch goes on
    assert h.core.rounds_done == 8


@pytest.mark.parametrize(
    ("saved", "join_slots", "kept"),
    [
        ((10.0, 20.0), 2, (10.0, 20.0, 0.0, 0.0)),  # saved with join_slots=0, resumed with 2
        ((10.0, 20.0, *[0.0] * 8), 0, (10.0, 20.0)),  # saved with the 8 default slots, with 0
    ],
)
def test_a_bundle_resumes_with_other_join_slots_keeping_each_ranks_balancer_state(
    saved: tuple[float, ...], join_slots: int, kept: tuple[float, ...]
) -> None:
    # The balancer's state has an entry per rank id, joiners' slots included; one of
    # another length crashed the coordinator before the run began ("saved for 10
    # ranks, this run has 2"), and the resume failed as "coordinator_lost".
    meta = CheckpointMeta.from_json(json.dumps(with_state(smoothed_ms_per_batch=list(saved))))
    h = resumed(meta, join_slots=join_slots)
    h.form()
    state = h.core.tuner.saved_state()
    assert state.smoothed_ms_per_batch == kept  # the two ranks' paces go on; slots unmeasured
    assert (state.anchor, state.anchor_rank, state.phase) == (10, 1, Phase.WARMUP)
    assert h.core.work.open_epochs() == [1]


def test_a_balancer_state_naming_an_anchor_past_this_runs_slots_starts_it_unelected() -> None:
    state = ElCheState(
        anchor=10, anchor_rank=5, smoothed_ms_per_batch=(10.0, 20.0, 0.0, 0.0, 0.0, 30.0),
        phase=Phase.WARMUP, calibration_count=4,
    )  # fmt: skip
    assert state.for_slots(2) == dataclasses.replace(
        state, anchor_rank=None, smoothed_ms_per_batch=(10.0, 20.0)
    )
    assert state.for_slots(6) == state


def test_issue12_item11_coverage_of_another_dataset_length_is_refused() -> None:
    meta = CheckpointMeta.from_json(json.dumps(with_coverage(total_samples=1000)))
    with pytest.raises(ConfigError) as info:
        resumed(meta)
    assert info.value.field == "num_samples"
    assert "1000" in str(info.value) and "640" in str(info.value)


def test_issue12_item11_a_finished_runs_meta_completes_at_once() -> None:
    meta = CheckpointMeta.from_json(json.dumps(meta_doc(epoch=3, coverage=[])))
    h = resumed(meta)
    out = h.form()
    out += h.answer_saves()  # the final model is on disk
    assert of(out, Finish) == [Finish(outcome="completed")]
    assert not sent(out, m.AssignChunk)
    assert h.core.epochs_completed == 3


def test_issue12_item11_a_bundle_at_epoch_1_resumed_with_epochs_1_completes_with_1() -> None:
    meta = CheckpointMeta.from_json(json.dumps(meta_doc()))  # epoch 1 of 3, half of it to do
    h = resumed(meta, epochs=1)
    out = h.form()
    out += h.answer_saves()  # the final model is on disk
    assert of(out, Finish) == [Finish(outcome="completed")]
    assert not sent(out, m.AssignChunk)  # epoch 1 is past this run's plan
    ends = [c.event for c in of(out, Emit) if isinstance(c.event, tl.RunEnd)]  # type: ignore[attr-defined]
    assert [(e.epochs_completed, sum(e.samples_per_rank)) for e in ends] == [(1, 0)]
