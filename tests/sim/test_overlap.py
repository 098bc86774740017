"""Ranks that train through their collective rounds, in virtual time.

``SimConfig.overlap`` (the runtime's default) launches each round and trains
on; a member killed meanwhile fails the others' rounds at once, as gloo's
closed sockets do. Under a kill grid across the epoch end, where the round
carries the next window's work, every run must end with nothing lost: an
abandoned round once left a survivor holding on a budget counted after an
average that never came while the coordinator waited for its window.
"""

from __future__ import annotations

import dataclasses

import pytest

from elche import FaultPlan, Mode, SimConfig, simulate


def test_training_through_the_rounds_hides_their_cost() -> None:
    waiting = SimConfig(speeds=(1.0, 0.5, 0.25), sync_ms=50.0, overlap=False)
    slow, fast = simulate(waiting), simulate(dataclasses.replace(waiting, overlap=True))
    for result in (slow, fast):
        assert result.outcome == "completed"
        assert (result.lost_samples, result.duplicated_samples) == (0, 0)
    assert fast.virtual_wall_s < slow.virtual_wall_s  # the same work, its rounds hidden
    assert fast.efficiency > slow.efficiency
    # Waiting, the balancer widens the windows to pay 50 ms a round less often;
    # trained through (``SyncAck.through_ms``), the rounds cost it little.
    assert fast.syncs > slow.syncs


@pytest.mark.parametrize("speeds", [(1.0, 0.5, 0.25), (1.0, 0.9, 0.8)])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_rank_killed_while_its_round_travels_leaves_a_run_that_ends_whole(
    seed: int, speeds: tuple[float, ...]
) -> None:
    for step in range(10):
        at = 0.95 + step * 0.01  # around the end of epoch 0, whose round carries epoch 1's work
        config = SimConfig(
            speeds=speeds, mode=Mode.CADENCE, epochs=2, samples=1437, batch_size=32,
            faults=FaultPlan().kill(rank=1, at_epoch=at), heartbeat_timeout_s=5.0,
            sync_ms=20.0, eval_every=1, jitter=0.2, seed=seed, max_virtual_s=1e4,
        )  # fmt: skip
        result = simulate(config)  # SimError if it hangs
        assert result.outcome == "completed", (at, result.reason)
        assert result.dead_ranks == [1]
        assert (result.lost_samples, result.duplicated_samples) == (0, 0), at
