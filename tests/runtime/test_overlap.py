"""A collective average launched while the rank trains on (``launch_average``).

Landed on a rank that did not move, the round leaves exactly what
``collective_average`` leaves; on a rank that trained meanwhile, the model
holds the consensus C for the round's callbacks and ``land`` returns the
rank's own progress on top of it, ``now + (C − S)``. The unit tests run a gloo
world of one in this process; one integration test spawns three gloo ranks
(a ``FileStore``, no ports).
"""

from __future__ import annotations

import copy
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

from elche.runtime.averaging import collective_average, divergence, launch_average
from elche.runtime.wire import Wire, average_over, launch_over
from tests.runtime.spawned import run_spawned
from tests.runtime.test_averaging import tiny_model


def _float_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _nudge(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
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
    added = _nudge(model, seed=1)  # the steps taken while the round travels
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
    _nudge(model, seed=2)
    trained = _float_state(model)
    (div, pre, post), local = flight.land(moved=True)
    assert local is None and div == 0.0 and pre == post
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name]), name


def test_a_wake_from_the_round_finds_it_completed(world_of_one: None) -> None:
    # gloo runs a collective's future callbacks before it marks the work
    # itself finished: a rank woken from one must see the round land-ready,
    # or it sleeps a whole poll before landing it.
    flight = launch_average(tiny_model(3), 2)
    seen: list[bool] = []
    woken = threading.Event()

    def wake() -> None:
        seen.append(flight.completed())
        woken.set()

    flight.when_completed(wake)
    assert woken.wait(timeout=30)
    flight.land(moved=False)
    assert any(seen), seen


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


# --- real collectives: three gloo ranks ----------------------------------------

STEPS = (3, 1, 2)  # each rank's steps in the launched round
MOVERS = (0, 2)  # the ranks that train on while it travels


def _overlap_rank(rank: int, store: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 3), rank=rank, world_size=3)
    try:
        model = tiny_model(rank)
        flight = launch_average(model, STEPS[rank])
        if rank in MOVERS:
            _nudge(model, seed=10 + rank)
        result, local = flight.land(moved=rank in MOVERS)
        torch.save({"state": model.state_dict(), "result": result, "local": local},
                   os.path.join(out, f"rank{rank}.pt"))  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.slow
def test_three_ranks_land_on_one_consensus_and_keep_their_own_steps(tmp_path: Path) -> None:
    args = (str(tmp_path / "store"), str(tmp_path))
    run_spawned(_overlap_rank, [(r, *args) for r in range(3)], budget_s=60)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(3)]
    names = [n for n, _ in tiny_model(0).named_parameters()]
    starts = [tiny_model(r) for r in range(3)]
    for name in names:  # every rank holds the mass-weighted mean of the launch models
        stacked = [dict(m.named_parameters())[name].detach().double() for m in starts]
        want = sum(s * p for s, p in zip(STEPS, stacked, strict=True)) / sum(STEPS)
        for res in results:
            assert_close(res["state"][name], want.to(res["state"][name].dtype))
            assert torch.equal(res["state"][name], results[0]["state"][name])
    for rank, res in enumerate(results):
        assert int(res["state"]["1.num_batches_tracked"]) == 10 * rank + 7  # stays local
        if rank not in MOVERS:
            assert res["local"] is None
            continue
        added = _nudge(tiny_model(rank), seed=10 + rank)
        for name, value in zip(names, res["local"], strict=False):  # C + its own steps
            want = res["state"][name].double() + added[name].double()
            tol = 2e-2 if value.dtype == torch.bfloat16 else 1e-6
            assert_close(value.double(), want, atol=tol, rtol=0)
