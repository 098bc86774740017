"""Issue 12, "keep every promise off the tested path": the core's half.

Each test is named after the item it pins down and failed before its fix.
"""

from __future__ import annotations

from elche.core import messages as m
from elche.core.commands import Finish, Notice, Send
from elche.core.config import CallbackPolicy
from elche.core.coordinator import RankState, RunState
from elche.core.events import RankLost
from elche.core.roles import Role
from tests.core.harness import Harness, of


def run_to_end(h: Harness, ms: dict[int, float] | None = None) -> list:
    """Train every live rank through every window (rank r at ``ms[r]`` per batch)."""
    out: list = []
    number = 0
    for _ in range(200):
        if h.core.state is not RunState.TRAINING:
            break
        for rank in range(h.cfg.world_size):
            if h.core.rank_state[rank] is RankState.LIVE:
                while (
                    h.chunks[rank]
                    and h.core.work.steps_since_sync(rank) < h.core.planner.budget[rank]
                ):
                    out += h.train(rank, 1, batch_ms=(ms or {}).get(rank, 10.0))
        if h.core.round.in_flight and h.core.round.number != number:
            number = h.core.round.number
            for rank in sorted(h.core.round.members):
                out += h.send(
                    rank, m.SyncAck(round=number, steps=h.core.work.steps_since_sync(rank))
                )
    return out


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
    out = h.form() + run_to_end(h)
    assert h.core.state is RunState.FINISHING
    assert sent(out, m.RunEval) == [(1, m.RunEval(epoch=1))]
    out = h.feed(RankLost(rank=1, reason="process killed"))
    # The pinned policy never moves the eval role: the eval is given up, loudly.
    assert not sent(out, m.RunEval)
    assert any("eval" in text and "rank 1" in text for text in notices(out))
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
    out += run_to_end(h)
    assert not sent(out, m.RunEval)  # both epochs' evals were owed by the dead rank
    assert sum("eval" in text for text in notices(out)) == 2
    assert of(out, Finish) == [Finish(outcome="completed")]


def test_issue12_item03b_last_checkpoint_retry_dying_ends_the_run() -> None:
    h = Harness(world_size=3, num_samples=960, checkpoint_every=1)
    h.form()
    run_to_end(h)
    assert h.core.state is RunState.FINISHING
    h.send(0, m.CheckpointResult(version=1, elapsed_ms=1.0, error="disk full"))
    out = h.send(1, m.CheckpointResult(version=1, elapsed_ms=1.0, error="disk full"))
    assert sent(out, m.RunCheckpoint) == [(2, m.RunCheckpoint(version=1))]
    out = h.feed(RankLost(rank=2, reason="process killed"))
    assert any("giving up" in text for text in notices(out))
    assert of(out, Finish) == [Finish(outcome="completed")]
    assert h.core.state is RunState.DONE


# -- item 4: checkpoint failover follows the fastest policy --------------------


PACE_MS = {0: 10.0, 1: 40.0, 2: 20.0}  # fastest 0, then 2, then 1


def test_issue12_item04_checkpoint_moves_to_the_fastest_survivor_when_its_rank_dies() -> None:
    h = Harness(world_size=3, num_samples=3200, checkpoint_every=1)
    out = h.form() + run_to_end(h, PACE_MS)
    assert h.core.state is RunState.FINISHING
    assert sent(out, m.RunCheckpoint) == [(0, m.RunCheckpoint(version=1))]
    out = h.feed(RankLost(rank=0, reason="process killed"))
    # Rank 2 is the fastest survivor; rank 1 is only the lowest.
    assert sent(out, m.RunCheckpoint) == [(2, m.RunCheckpoint(version=1))]
    assert h.core.roles.holder(Role.CHECKPOINT) == 2
    out = h.send(2, m.CheckpointResult(version=1, elapsed_ms=1.0))
    assert of(out, Finish) == [Finish(outcome="completed")]


def test_a_failed_checkpoint_still_retries_the_next_untried_rank() -> None:
    h = Harness(world_size=3, num_samples=3200, checkpoint_every=1)
    h.form()
    run_to_end(h, PACE_MS)
    out = h.send(0, m.CheckpointResult(version=1, elapsed_ms=1.0, error="disk full"))
    assert sent(out, m.RunCheckpoint) == [(1, m.RunCheckpoint(version=1))]  # reference rule


def test_issue12_item03b_death_after_failures_skips_the_ranks_that_failed() -> None:
    h = Harness(world_size=3, num_samples=3200, checkpoint_every=1)
    h.form()
    run_to_end(h, PACE_MS)
    h.send(0, m.CheckpointResult(version=1, elapsed_ms=1.0, error="disk full"))  # retry on 1
    h.send(1, m.CheckpointResult(version=1, elapsed_ms=1.0, error="disk full"))  # retry on 2
    h.send(0, m.Heartbeat())
    out = h.feed(RankLost(rank=2, reason="process killed"))
    # Rank 0 is the fastest survivor but failed this version already.
    assert not sent(out, m.RunCheckpoint)
    assert of(out, Finish) == [Finish(outcome="completed")]
