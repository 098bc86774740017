"""The hand-off between a script's loop and a rank's training thread, without a run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from elche.runtime.handoff import Handoff, is_handoff

JOIN_S = 10.0


def start_rank(handoff: Handoff, batches: list[int], seen: list[Any]) -> threading.Thread:
    """A stand-in rank: asks a loss for each batch, records it, ends with their sum."""

    def rank() -> None:
        try:
            for batch in batches:
                seen.append(handoff.step_fn(None, batch))
        except BaseException as exc:
            handoff.fail(exc)
        else:
            handoff.finish(sum(seen))

    thread = threading.Thread(target=rank, daemon=True)
    thread.start()
    return thread


def loop(handoff: Handoff, loss: Callable[[int], Any]) -> list[int]:
    """The script's loop: a loss for every batch, until the run ends."""
    got = []
    while True:
        try:
            batch = handoff.next_batch()
        except StopIteration:
            return got
        got.append(batch)
        handoff.give_loss(loss(batch))


def test_every_batch_gets_its_loss_in_order_and_the_run_ends_with_its_result() -> None:
    handoff, seen = Handoff(), []
    thread = start_rank(handoff, [1, 2, 3], seen)
    assert loop(handoff, lambda b: b * 10) == [1, 2, 3]
    thread.join(JOIN_S)
    assert seen == [10, 20, 30]
    assert handoff.ended == ("result", 60)
    with pytest.raises(StopIteration):  # and stays ended
        handoff.next_batch()


def test_the_rank_waits_in_give_loss_until_it_asks_again() -> None:
    handoff, seen = Handoff(), []
    start_rank(handoff, [1, 2], seen)
    handoff.next_batch()
    handoff.give_loss(5)
    assert seen == [5]  # the rank used the loss before give_loss returned
    handoff.next_batch()
    handoff.give_loss(6)
    assert handoff.wait_ended() == ("result", 11)


def test_a_loop_error_is_raised_by_the_ranks_step_fn_now_and_later() -> None:
    handoff = Handoff()
    raised = []

    def rank() -> None:
        for _ in range(2):
            try:
                handoff.step_fn(None, 0)
            except ValueError as exc:
                raised.append(exc)
        handoff.fail(raised[0])

    thread = threading.Thread(target=rank, daemon=True)
    thread.start()
    handoff.next_batch()
    error = ValueError("bad batch")
    handoff.abandon(error)
    kind, value = handoff.wait_ended()
    thread.join(JOIN_S)
    assert (kind, value) == ("error", error)
    assert raised == [error, error]


def test_the_runs_error_comes_out_of_next_batch() -> None:
    handoff = Handoff()
    handoff.fail(KeyError("boom"))
    with pytest.raises(KeyError, match="boom"):
        handoff.next_batch()
    assert handoff.ended is not None and handoff.ended[0] == "error"


def test_a_batch_needs_exactly_one_loss() -> None:
    handoff, seen = Handoff(), []
    start_rank(handoff, [1, 2], seen)
    with pytest.raises(RuntimeError, match="once after each batch"):
        handoff.give_loss(1)  # no batch out yet
    handoff.next_batch()
    with pytest.raises(RuntimeError, match="once for every batch"):
        handoff.next_batch()  # the last one's loss is not back
    handoff.give_loss(1)
    handoff.next_batch()
    handoff.give_loss(2)
    assert handoff.wait_ended() == ("result", 3)


def test_a_sessions_step_fn_is_known_by_its_handoff() -> None:
    assert is_handoff(Handoff().step_fn)
    assert not is_handoff(lambda model, batch: 0.0)
    assert not is_handoff(loop)
