"""Callback roles: the rules of floDl 0.7.0 ``callbacks.rs``, one test per rule.

Each test names the rule it pins (numbers refer to the "Rules" block of
``elche.core.roles``) and asserts the whole role state after each step:
the holder of every role and the epoch-role dirty flag.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest

from elche.core.config import CallbackPolicy
from elche.core.roles import CALLBACK_EWMA_ALPHA, CallbackCost, CallbackRoles, Role, ewma
from elche.core.scheduler import ElChe

FASTEST = CallbackPolicy.FASTEST
PINNED = CallbackPolicy.PINNED


def pace(table: Mapping[int, float | None]) -> Callable[[int], float | None]:
    """An ``ms_of`` lookup: smoothed ms/batch per rank, None where there is no sample."""
    return table.get


NO_PACE = pace({})


def state(roles: CallbackRoles) -> tuple[tuple[int, int, int], bool]:
    """(epoch, eval, checkpoint) holders and the epoch-role dirty flag."""
    held = (roles.holder(Role.EPOCH), roles.holder(Role.EVAL), roles.holder(Role.CHECKPOINT))
    return held, roles.epoch_role_dirty


def fresh(world_size: int = 3, policy: CallbackPolicy = FASTEST, pinned: int = 0) -> CallbackRoles:
    """Roles as constructed, with the initial epoch-role broadcast already taken."""
    roles = CallbackRoles(policy, world_size, pinned)
    roles.take_dirty_epoch_role()
    return roles


# --- rule 1: initial roles ---------------------------------------------------


def test_fastest_starts_every_role_on_rank_zero_and_owes_a_broadcast() -> None:
    roles = CallbackRoles(FASTEST, 4)
    assert state(roles) == ((0, 0, 0), True)


@pytest.mark.parametrize(
    ("world_size", "pinned", "expected"),
    [(4, 2, 2), (4, 3, 3), (3, 5, 2), (1, 0, 0), (1, 7, 0)],
)
def test_pinned_starts_every_role_on_min_of_pin_and_last_rank(
    world_size: int, pinned: int, expected: int
) -> None:
    roles = CallbackRoles(PINNED, world_size, pinned)
    assert state(roles) == ((expected,) * 3, True)


def test_fastest_ignores_the_pin() -> None:
    roles = CallbackRoles(FASTEST, 4, pinned=3)
    assert state(roles) == ((0, 0, 0), True)


# --- rule 2: resolve_fastest -------------------------------------------------


def test_resolve_fastest_picks_the_lowest_smoothed_ms() -> None:
    roles = fresh(4)
    ms = pace({0: 30.0, 1: 12.0, 2: 20.0, 3: 12.5})
    assert roles.resolve_fastest({0, 1, 2, 3}, ms) == 1


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ({0: 10.0, 1: 10.0, 2: 10.0}, 0),
        ({0: 30.0, 1: 10.0, 2: 10.0}, 1),
        ({0: 30.0, 1: 10.0, 2: 9.999}, 2),
    ],
)
def test_resolve_fastest_needs_strictly_lower_so_ties_go_to_the_lowest_index(
    table: dict[int, float], expected: int
) -> None:
    assert fresh().resolve_fastest({0, 1, 2}, pace(table)) == expected


def test_resolve_fastest_ignores_dead_ranks_however_fast() -> None:
    ms = pace({0: 30.0, 1: 1.0, 2: 20.0})
    assert fresh().resolve_fastest({0, 2}, ms) == 2


def test_resolve_fastest_skips_ranks_without_a_sample() -> None:
    ms = pace({0: None, 1: None, 2: 500.0})
    assert fresh().resolve_fastest({0, 1, 2}, ms) == 2


def test_resolve_fastest_falls_back_to_the_lowest_live_rank_when_uncalibrated() -> None:
    # Reference: fastest_role_fallback_to_lowest_live_when_uncalibrated (rank 0 dead -> 1).
    assert fresh().resolve_fastest({2, 1}, NO_PACE) == 1


def test_resolve_fastest_is_none_when_nobody_is_live() -> None:
    assert fresh().resolve_fastest(set(), pace({0: 1.0})) is None


# --- rule 3: first-calibration election, stickiness ------------------------


def test_first_calibration_moves_all_roles_to_the_fast_box() -> None:
    # Reference: fastest_roles_are_elected_on_pace_at_first_calibration.
    # wall=[4000, 4000, 1200] over 10 batches each: 400, 400, 120 ms/batch.
    elche = ElChe(3)
    elche.report_timing([4000.0, 4000.0, 1200.0], [10, 10, 10], 0.0)
    roles = fresh(3)
    roles.on_first_calibration({0, 1, 2}, elche.smoothed_ms_per_batch)
    assert state(roles) == ((2, 2, 2), True)
    assert roles.elected


def test_first_calibration_without_pace_moves_nothing_and_broadcasts_nothing() -> None:
    roles = fresh(3)
    roles.on_first_calibration({0, 1, 2}, ElChe(3).smoothed_ms_per_batch)
    assert state(roles) == ((0, 0, 0), False)
    assert not roles.elected


def test_an_election_without_pace_is_not_spent() -> None:
    roles = fresh(3)
    roles.on_first_calibration({0, 1, 2}, NO_PACE)
    roles.on_first_calibration({0, 1, 2}, pace({0: 400.0, 1: 120.0, 2: 400.0}))
    assert state(roles) == ((1, 1, 1), True)


def test_first_calibration_that_confirms_rank_zero_marks_nothing_dirty() -> None:
    roles = fresh(3)
    roles.on_first_calibration({0, 1, 2}, pace({0: 100.0, 1: 200.0, 2: 300.0}))
    assert state(roles) == ((0, 0, 0), False)
    assert roles.elected


def test_first_calibration_elects_among_live_ranks_only() -> None:
    roles = fresh(3)
    roles.on_first_calibration({0, 2}, pace({0: 400.0, 1: 50.0, 2: 120.0}))
    assert state(roles) == ((2, 2, 2), True)


def test_pinned_ignores_the_calibration_election() -> None:
    # Reference: rank_policy_ignores_the_calibration_election.
    roles = fresh(3, PINNED, pinned=1)
    roles.on_first_calibration({0, 1, 2}, pace({0: 400.0, 1: 400.0, 2: 120.0}))
    assert state(roles) == ((1, 1, 1), False)
    assert not roles.elected


def test_roles_are_sticky_after_the_election() -> None:
    roles = fresh(3)
    roles.on_first_calibration({0, 1, 2}, pace({0: 400.0, 1: 400.0, 2: 120.0}))
    roles.take_dirty_epoch_role()
    # Rank 0 becomes much faster later: the election does not run again.
    roles.on_first_calibration({0, 1, 2}, pace({0: 10.0, 1: 400.0, 2: 120.0}))
    assert state(roles) == ((2, 2, 2), False)


def test_death_of_a_rank_holding_no_role_moves_nothing() -> None:
    roles = fresh(3)
    roles.on_first_calibration({0, 1, 2}, pace({0: 400.0, 1: 400.0, 2: 120.0}))
    roles.take_dirty_epoch_role()
    # Rank 0 is now the fastest survivor, but rank 2 (the holder) is alive.
    roles.on_death(1, {0, 2}, pace({0: 10.0, 2: 120.0}))
    assert state(roles) == ((2, 2, 2), False)


# --- re-resolution on death -------------------------------------------------


def test_fastest_death_of_the_holder_moves_every_role_it_held() -> None:
    # Reference: fastest_re_resolve_on_role_rank_death.
    roles = fresh(3)
    roles.on_death(0, {1, 2}, pace({1: 300.0, 2: 150.0}))
    assert state(roles) == ((2, 2, 2), True)


def test_fastest_death_moves_only_the_roles_the_dead_rank_held() -> None:
    roles = fresh(3)
    roles.on_checkpoint_result(1, version=1, error=None, live={0, 1, 2})
    roles.on_death(1, {0, 2}, pace({0: 300.0, 2: 150.0}))
    assert state(roles) == ((0, 0, 2), False)


def test_fastest_death_uncalibrated_falls_back_to_the_lowest_live_rank() -> None:
    roles = fresh(3)
    roles.on_death(0, {1, 2}, NO_PACE)
    assert state(roles) == ((1, 1, 1), True)


def test_fastest_death_with_no_survivor_leaves_roles_and_flag_alone() -> None:
    roles = fresh(1)
    roles.on_death(0, set(), NO_PACE)
    assert state(roles) == ((0, 0, 0), False)


def test_pinned_death_fails_over_only_the_checkpoint_role() -> None:
    # Reference: rank_policy_skips_fastest_re_resolve; spec §7.1 checkpoint failover.
    roles = fresh(3, PINNED, pinned=1)
    roles.on_death(1, {0, 2}, pace({0: 300.0, 2: 150.0}))
    assert state(roles) == ((1, 1, 0), False)


def test_pinned_death_of_another_rank_moves_nothing() -> None:
    roles = fresh(3, PINNED, pinned=1)
    roles.on_death(2, {0, 1}, pace({0: 10.0, 1: 300.0}))
    assert state(roles) == ((1, 1, 1), False)


# --- rule 5: the dirty epoch role -------------------------------------------


def test_take_dirty_epoch_role_returns_the_role_once() -> None:
    roles = CallbackRoles(FASTEST, 3)
    assert roles.take_dirty_epoch_role() == 0
    assert roles.take_dirty_epoch_role() is None
    assert state(roles) == ((0, 0, 0), False)


def test_take_dirty_epoch_role_reports_the_re_resolved_rank_once() -> None:
    roles = fresh(3)
    roles.on_death(0, {1, 2}, pace({1: 100.0, 2: 200.0}))
    assert roles.take_dirty_epoch_role() == 1
    assert roles.take_dirty_epoch_role() is None


# --- rule 6: checkpoint success and failover --------------------------------


def test_checkpoint_success_makes_the_reporter_the_role_and_clears_tried() -> None:
    roles = fresh(3)
    assert roles.on_checkpoint_result(0, version=4, error="disk full", live={0, 1, 2}) == 1
    assert roles.checkpoint_tried == {4: {0}}
    assert roles.on_checkpoint_result(2, version=4, error=None, live={0, 1, 2}) is None
    assert roles.checkpoint_tried == {}
    assert state(roles) == ((0, 0, 2), False)


def test_checkpoint_failure_retries_on_the_lowest_live_untried_rank() -> None:
    roles = fresh(5)
    live = {0, 2, 3, 4}  # rank 1 is dead
    assert roles.on_checkpoint_result(0, version=1, error="boom", live=live) == 2
    assert state(roles) == ((0, 0, 2), False)
    assert roles.on_checkpoint_result(2, version=1, error="boom", live=live) == 3
    assert state(roles) == ((0, 0, 3), False)
    assert roles.checkpoint_tried == {1: {0, 2}}


def test_checkpoint_failure_on_a_non_lowest_rank_retries_from_the_bottom() -> None:
    roles = fresh(3)
    assert roles.on_checkpoint_result(2, version=1, error="boom", live={0, 1, 2}) == 0


def test_checkpoint_exhausting_every_live_rank_gives_up_and_drops_the_version() -> None:
    roles = fresh(3)
    live = {0, 1, 2}
    assert roles.on_checkpoint_result(0, version=7, error="e", live=live) == 1
    assert roles.on_checkpoint_result(1, version=7, error="e", live=live) == 2
    assert roles.on_checkpoint_result(2, version=7, error="e", live=live) is None
    assert roles.checkpoint_tried == {}
    assert state(roles) == ((0, 0, 2), False)


def test_checkpoint_failure_with_no_other_live_rank_gives_up_at_once() -> None:
    roles = fresh(2)
    assert roles.on_checkpoint_result(0, version=3, error="e", live={0}) is None
    assert roles.checkpoint_tried == {}
    assert state(roles) == ((0, 0, 0), False)


def test_checkpoint_tried_sets_are_per_version() -> None:
    roles = fresh(3)
    live = {0, 1, 2}
    assert roles.on_checkpoint_result(0, version=1, error="e", live=live) == 1
    assert roles.on_checkpoint_result(1, version=1, error="e", live=live) == 2
    # Version 2 has tried nobody yet: rank 1 failing moves it to rank 0.
    assert roles.on_checkpoint_result(1, version=2, error="e", live=live) == 0
    assert roles.checkpoint_tried == {1: {0, 1}, 2: {1}}


# --- rule 7: callback cost EWMA ---------------------------------------------


def test_ewma_alpha_is_point_three() -> None:
    assert CALLBACK_EWMA_ALPHA == 0.3


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        ([10.0], 10.0),  # the first sample seeds it
        ([10.0, 20.0], 13.0),  # 0.3 * 20 + 0.7 * 10
        ([10.0, 20.0, 30.0], 18.1),  # 0.3 * 30 + 0.7 * 13
        # Reference checkpoint_success_round_trip_updates_ewma: one report of
        # 12.5 ms seeds the EWMA at 12.5. A second route to the same value:
        # 0.3 * x + 0.7 * 10 = 12.5  =>  x = 5.5 / 0.3 = 55 / 3.
        ([12.5], 12.5),
        ([10.0, 55.0 / 3.0], 12.5),
    ],
)
def test_ewma_folds_samples(samples: list[float], expected: float) -> None:
    value: float | None = None
    for sample in samples:
        value = ewma(value, sample)
    assert value == pytest.approx(expected, abs=1e-9)


def test_checkpoint_round_trip_reproduces_the_reference_ewma() -> None:
    roles = fresh(2)
    roles.record_cost(Role.CHECKPOINT, 12.5, rank=0)
    assert roles.on_checkpoint_result(0, version=1, error=None, live={0, 1}) is None
    assert roles.cost == CallbackCost(checkpoint_ms=12.5)
    assert roles.checkpoint_tried == {}
    assert roles.holder(Role.CHECKPOINT) == 0


def test_record_cost_feeds_only_that_callbacks_ewma() -> None:
    roles = fresh(2)
    roles.record_cost(Role.EPOCH, 10.0, rank=1)
    roles.record_cost(Role.EPOCH, 20.0, rank=1)
    assert roles.cost == CallbackCost(epoch_fn_ms={1: 13.0})
    roles.record_cost(Role.EVAL, 40.0, rank=0)
    assert roles.cost == CallbackCost(epoch_fn_ms={1: 13.0}, eval_ms=40.0)


def test_record_cost_keeps_one_epoch_fn_ewma_per_rank() -> None:
    roles = fresh(2)
    roles.record_cost(Role.EPOCH, 10.0, rank=0)
    roles.record_cost(Role.EPOCH, 300.0, rank=1)
    roles.record_cost(Role.EPOCH, 20.0, rank=0)
    assert roles.cost.epoch_fn_ms == {0: 13.0, 1: 300.0}


# --- rule 8: boundary slack --------------------------------------------------


def costly(
    world_size: int = 3,
    *,
    epoch_ms: Mapping[int, float] | None = None,
    eval_ms: float | None = 500.0,
    checkpoint_ms: float | None = 700.0,
    eval_role: int = 1,
    checkpoint_role: int = 2,
) -> CallbackRoles:
    roles = fresh(world_size)
    roles.roles = {Role.EPOCH: 0, Role.EVAL: eval_role, Role.CHECKPOINT: checkpoint_role}
    epoch_fn = {0: 300.0, 1: 200.0, 2: 100.0} if epoch_ms is None else dict(epoch_ms)
    roles.cost = CallbackCost(epoch_fn_ms=epoch_fn, eval_ms=eval_ms, checkpoint_ms=checkpoint_ms)
    return roles


@pytest.mark.parametrize(
    ("epoch_fn_ranks", "due", "expected"),
    [
        ((0, 1, 2), (), [300.0, 200.0, 100.0]),  # every rank starts an epoch
        ((), (Role.EVAL, Role.CHECKPOINT), [0.0, 500.0, 700.0]),  # asked, no epoch start
        ((0, 1, 2), (Role.EVAL,), [300.0, 700.0, 100.0]),  # eval on rank 1 adds to its own
        ((1,), (Role.CHECKPOINT,), [0.0, 200.0, 700.0]),  # only live ranks start
        ((), (), None),  # nothing at this boundary
    ],
)
def test_boundary_slack_counts_the_work_the_window_holds(
    epoch_fn_ranks: tuple[int, ...], due: tuple[Role, ...], expected: list[float] | None
) -> None:
    slack = costly().boundary_slack_ms(
        epoch_fn_ranks=epoch_fn_ranks, due=due, anchor_wall_ms=1000.0
    )
    assert slack == expected


def test_boundary_slack_skips_callbacks_with_no_cost_yet() -> None:
    roles = costly(epoch_ms={1: 150.0}, eval_ms=500.0, checkpoint_ms=None)
    slack = roles.boundary_slack_ms(
        epoch_fn_ranks=(0, 1, 2), due=(Role.EVAL, Role.CHECKPOINT), anchor_wall_ms=1000.0
    )
    assert slack == [0.0, 650.0, 0.0]


ALL_DUE = (Role.EVAL, Role.CHECKPOINT)


@pytest.mark.parametrize(
    ("anchor_wall_ms", "expected"),
    [
        # floor = max(5 % of 1000, 100) = 100 (absolute floor binds); 100 itself counts.
        (1000.0, [0.0, 100.0, 150.0]),
        # floor = max(5 % of 2400, 100) = 120; the 100 ms entry drops.
        (2400.0, [0.0, 0.0, 150.0]),
        # floor = max(5 % of 3000, 100) = 150: still kept at equality.
        (3000.0, [0.0, 0.0, 150.0]),
    ],
)
def test_boundary_slack_drops_entries_below_the_noise_floor(
    anchor_wall_ms: float, expected: list[float]
) -> None:
    roles = costly(epoch_ms={0: 99.9}, eval_ms=100.0, checkpoint_ms=150.0)
    slack = roles.boundary_slack_ms(
        epoch_fn_ranks=(0, 1, 2), due=ALL_DUE, anchor_wall_ms=anchor_wall_ms
    )
    assert slack == expected


@pytest.mark.parametrize(
    ("roles", "anchor_wall_ms"),
    [
        (costly(epoch_ms={0: 99.0}, eval_ms=50.0, checkpoint_ms=10.0), 0.0),  # all under 100 ms
        (costly(epoch_ms={0: 400.0}, eval_ms=450.0, checkpoint_ms=499.0), 10_000.0),  # under 5 %
        (costly(epoch_ms={}, eval_ms=None, checkpoint_ms=None), 1000.0),  # nothing measured
    ],
    ids=["absolute-floor", "relative-floor", "no-costs"],
)
def test_boundary_slack_is_none_when_nothing_clears_the_floor(
    roles: CallbackRoles, anchor_wall_ms: float
) -> None:
    slack = roles.boundary_slack_ms(
        epoch_fn_ranks=(0, 1, 2), due=ALL_DUE, anchor_wall_ms=anchor_wall_ms
    )
    assert slack is None


def test_boundary_slack_sums_the_work_one_rank_holds_before_the_floor() -> None:
    # 60 + 50 + 40 = 150 ms on rank 1: each alone is under the 100 ms floor.
    roles = costly(
        epoch_ms={1: 60.0}, eval_ms=50.0, checkpoint_ms=40.0, eval_role=1, checkpoint_role=1
    )
    slack = roles.boundary_slack_ms(epoch_fn_ranks=(0, 1, 2), due=ALL_DUE, anchor_wall_ms=1000.0)
    assert slack == [0.0, 150.0, 0.0]


def test_boundary_slack_ignores_ranks_outside_the_world() -> None:
    roles = costly(epoch_ms={0: 300.0, 3: 900.0}, checkpoint_role=3)
    slack = roles.boundary_slack_ms(epoch_fn_ranks=(0, 3), due=ALL_DUE, anchor_wall_ms=1000.0)
    assert slack == [300.0, 500.0, 0.0]
