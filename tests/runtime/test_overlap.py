"""A collective average launched while the rank trains on (``launch_average``).

Landed on a rank that did not move, the round leaves exactly what
``collective_average`` leaves; on a rank that trained meanwhile, the model
holds the consensus C for the round's callbacks and ``land`` returns the
rank's own progress on top of it, ``now + (C − S)``. The unit tests run a gloo
world of one in this process (a ``FileStore``, no ports); three spawned gloo
ranks are checked in test_gloo_world.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from elche.runtime.averaging import collective_average, divergence, launch_average
from elche.runtime.wire import Wire, average_over, launch_over
from tests.runtime.test_averaging import tiny_model


def _float_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def nudge(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Train-like change of every float parameter; returns what was added."""
    gen = torch.Generator().manual_seed(seed)
    added = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            delta = (torch.randn(p.shape, generator=gen) * 0.01).to(p.dtype)
            p.add_(delta)
            added[name] = delta
    return added


def test_a_landed_round_on_a_rank_that_did_not_move_is_the_collective_average(
    world_of_one: None,
) -> None:
    waited, launched = tiny_model(3), tiny_model(3)
    want = collective_average(waited, 4, gamma=0.5)
    flight = launch_average(launched, 4, gamma=0.5)
    got, local = flight.land(moved=False)
    assert local is None
    assert got == want
    for name, value in waited.state_dict().items():
        assert torch.equal(launched.state_dict()[name], value), name


def test_a_rank_that_moved_holds_the_consensus_and_gets_its_progress_on_top(
    world_of_one: None,
) -> None:
    model = tiny_model(5)
    consensus = copy.deepcopy(model)
    collective_average(consensus, 2)  # C: what the round brings (a world of one: S, rounded)
    launch = _float_state(model)
    flight = launch_average(model, 2)
    added = nudge(model, seed=1)  # the steps taken while the round travels
    (div, pre, _), local = flight.land(moved=True)
    for name, value in consensus.state_dict().items():  # the model: C, for the callbacks
        assert torch.equal(model.state_dict()[name], value), name
    assert local is not None and len(local) == len(flight.tensors)
    names = [n for n, _ in model.named_parameters()]
    c_state = consensus.state_dict()
    for name, value in zip(names, local, strict=False):  # now + (C − S)
        want = launch[name].double() + added[name].double() + c_state[name].double()
        want -= launch[name].double()
        assert value.dtype == launch[name].dtype
        assert_close(value.double(), want, atol=2e-2 if value.dtype == torch.bfloat16 else 1e-6,
                     rtol=0)  # fmt: skip
    params_at_launch = [launch[n] for n in names]
    assert (div, pre) == pytest.approx(
        divergence(params_at_launch, [c_state[n] for n in names])[:2]
    )


def test_a_round_nobody_moved_for_changes_nothing_even_on_a_rank_that_trained_since(
    world_of_one: None,
) -> None:
    model = tiny_model(2)
    flight = launch_average(model, 0)  # no mass anywhere: no consensus
    nudge(model, seed=2)
    trained = _float_state(model)
    (div, pre, post), local = flight.land(moved=True)
    assert local is None and div == 0.0 and pre == post
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name]), name


def test_a_round_whose_future_is_done_lands_without_waiting(world_of_one: None) -> None:
    # gloo marks a collective's future done before its work: a rank that looks
    # at its round between its waits must find it land-ready from the future.
    flight = launch_average(tiny_model(3), 2)
    for work in flight.collectives.works:
        work.get_future().wait()
    assert flight.completed()
    flight.land(moved=False)


def test_the_fp32_wire_launches_and_weighs_as_it_averages_and_the_bf16_wire_waits(
    world_of_one: None,
) -> None:
    waited, launched = Wire(), Wire()
    average_over(waited, tiny_model(1), 2)
    flight = launch_over(launched, tiny_model(1), 2)
    assert flight is not None
    flight.land(moved=False)
    assert (launched.bytes, launched.rounds) == (waited.bytes, waited.rounds)
    light = Wire("bf16")
    assert launch_over(light, tiny_model(1), 2) is None
    assert (light.bytes, light.rounds) == (0, 0)  # the rank averages with average_over instead
