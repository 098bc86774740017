"""Real collectives: one world of three gloo ranks, spawned once for every scenario.

Each spawned process that imports torch costs seconds of CPU, so the rounds
that need real ranks share one world (a ``FileStore``, no ports): the
work-weighted ``collective_average``, a round where nobody moved, the bf16
delta wire, and a round launched while the ranks train on
(``launch_average``). Each rank runs the scenarios in order, each on fresh
models, and saves each one's results to its own file; the test checks them
all. The unit tests of each piece live in test_averaging.py, test_wire.py and
test_overlap.py.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

from elche.runtime.averaging import collective_average, divergence, launch_average
from elche.runtime.snapshots import param_mass
from elche.runtime.wire import Wire, average_over
from tests.runtime.spawned import run_spawned
from tests.runtime.test_averaging import tiny_model
from tests.runtime.test_overlap import nudge
from tests.runtime.test_wire import BF16_REL

RANKS = 3
SCENARIOS = ("weighted", "idle", "wire", "overlap")

WEIGHTED_STEPS = (3, 1, 0)  # rank 2 idles, with a NaN in its parameters
UPDATE = 1e-3  # each rank's update, far below bf16's step at the weights (2**-7 at 1)
FP32_AT_1 = 4e-7  # a few fp32 steps at 1.0 (2**-23 each): the fp32 rounding of 1 + update
OVERLAP_STEPS = (3, 1, 2)  # each rank's steps in the launched round
MOVERS = (0, 2)  # the ranks that train on while it travels


def _out(out: str, scenario: str, rank: int) -> str:
    return os.path.join(out, f"{scenario}-rank{rank}.pt")


def _start() -> nn.Linear:
    model = nn.Linear(256, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    return model


def _update(rank: int) -> torch.Tensor:
    return torch.randn(1, 256, generator=torch.Generator().manual_seed(rank)) * UPDATE


def _rank(rank: int, store: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, RANKS), rank=rank,
                            world_size=RANKS)  # fmt: skip
    try:
        steps = WEIGHTED_STEPS[rank]
        model = tiny_model(rank, poison=steps == 0)
        result = collective_average(model, steps)
        torch.save({"state": model.state_dict(), "result": result}, _out(out, "weighted", rank))

        model = tiny_model(rank)
        result = collective_average(model, 0)
        torch.save({"state": model.state_dict(), "result": result}, _out(out, "idle", rank))

        wires = {}
        for name in ("fp32", "bf16", "bf16-stale"):
            linear, wire = _start(), Wire("fp32" if name == "fp32" else "bf16")
            average_over(wire, linear, 1)  # the first consensus (and the bf16 ref)
            if name == "bf16-stale" and rank == 2:  # its ref is no longer the consensus
                assert wire.ref is not None
                wire.keep([wire.ref[0] + 1.0])
            with torch.no_grad():
                linear.weight.add_(_update(rank))
            average_over(wire, linear, rank + 1)  # masses 1, 2, 3
            wires[name] = (linear.weight.detach().clone(), wire.bytes, wire.rounds)
        torch.save(wires, _out(out, "wire", rank))

        model = tiny_model(rank)
        flight = launch_average(model, OVERLAP_STEPS[rank])
        if rank in MOVERS:
            nudge(model, seed=10 + rank)
        result, local = flight.land(moved=rank in MOVERS)
        torch.save({"state": model.state_dict(), "result": result, "local": local},
                   _out(out, "overlap", rank))  # fmt: skip
    finally:
        dist.destroy_process_group()


def _check_weighted(results: list[dict[str, Any]]) -> None:
    models = [tiny_model(r, poison=s == 0) for r, s in enumerate(WEIGHTED_STEPS)]
    masses = [param_mass(s) for s in WEIGHTED_STEPS]
    names = [n for n, _ in models[0].named_parameters()]
    for name in names:  # parameters: Σ m_i p_i / Σ m_i; the idle rank weighs 0
        stacked = [dict(m.named_parameters())[name].detach().double() for m in models]
        want = sum(m * p for m, p in zip(masses, stacked, strict=True) if m > 0) / sum(masses)
        for res in results:
            got = res["state"][name]
            assert_close(got, want.to(got.dtype))
            assert torch.equal(got, results[0]["state"][name])
    for name in ("1.running_mean", "1.running_var"):  # buffers: mean over movers
        want = (models[0].state_dict()[name] + models[1].state_dict()[name]) / 2
        for res in results:
            assert_close(res["state"][name], want)
    for rank, res in enumerate(results):  # integer buffers stay local
        assert int(res["state"]["1.num_batches_tracked"]) == 10 * rank + 7
        consensus = [res["state"][n] for n in names]
        pre = [p.detach() for p in models[rank].parameters()]
        assert res["result"] == pytest.approx(divergence(pre, consensus), nan_ok=True)
    assert math.isnan(results[2]["result"][0])  # its own NaN, measured, not spread


def _check_idle(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        model = tiny_model(rank)
        for name, want in model.state_dict().items():
            assert torch.equal(res["state"][name], want)
        norm = divergence(list(model.parameters()), list(model.parameters()))[1]
        assert res["result"] == pytest.approx((0.0, norm, norm))


def _check_wire(results: list[dict[str, Any]]) -> None:
    want = sum((r + 1) * _update(r).double() for r in range(RANKS)) / 6  # the mean update
    # each mass·update is rounded to bf16, and so is each partial sum on gloo's way
    bound = (
        3 * BF16_REL * sum((r + 1) * _update(r).double().abs() for r in range(RANKS)) / 6
        + FP32_AT_1
    )
    for name in ("fp32", "bf16", "bf16-stale"):
        weights = [res[name][0] for res in results]
        assert all(torch.equal(w, weights[0]) for w in weights), name  # one consensus for all
        error = (weights[0].double() - 1.0 - want).abs()
        assert bool((error <= (FP32_AT_1 if name == "fp32" else bound)).all()), name
    fp32_bytes, bf16_bytes = results[0]["fp32"][1], results[0]["bf16"][1]
    assert fp32_bytes == 2 * (256 * 4 + 16)
    assert bf16_bytes == (256 * 2 + 48) * 2 + 256 * 4 + 16  # the first round is a full one
    stale = results[0]["bf16-stale"][1]
    assert stale == bf16_bytes + 256 * 4 + 16  # the stale ref was found: a full round again


def _check_overlap(results: list[dict[str, Any]]) -> None:
    names = [n for n, _ in tiny_model(0).named_parameters()]
    starts = [tiny_model(r) for r in range(RANKS)]
    for name in names:  # every rank holds the mass-weighted mean of the launch models
        stacked = [dict(m.named_parameters())[name].detach().double() for m in starts]
        want = sum(s * p for s, p in zip(OVERLAP_STEPS, stacked, strict=True)) / sum(OVERLAP_STEPS)
        for res in results:
            assert_close(res["state"][name], want.to(res["state"][name].dtype))
            assert torch.equal(res["state"][name], results[0]["state"][name])
    for rank, res in enumerate(results):
        assert int(res["state"]["1.num_batches_tracked"]) == 10 * rank + 7  # stays local
        if rank not in MOVERS:
            assert res["local"] is None
            continue
        added = nudge(tiny_model(rank), seed=10 + rank)
        for name, value in zip(names, res["local"], strict=False):  # C + its own steps
            want = res["state"][name].double() + added[name].double()
            tol = 2e-2 if value.dtype == torch.bfloat16 else 1e-6
            assert_close(value.double(), want, atol=tol, rtol=0)


@pytest.mark.integration
@pytest.mark.slow
def test_three_gloo_ranks_agree_on_weighted_idle_bf16_and_landed_rounds(tmp_path: Path) -> None:
    args = (str(tmp_path / "store"), str(tmp_path))
    # One world and one budget for all four scenarios: a generous one, for a loaded machine.
    run_spawned(_rank, [(r, *args) for r in range(RANKS)], budget_s=90)
    results = {
        scenario: [
            torch.load(_out(str(tmp_path), scenario, r), weights_only=True) for r in range(RANKS)
        ]
        for scenario in SCENARIOS
    }
    # Work-weighted: every rank holds Σ m_i p_i / Σ m_i, buffers are averaged over the
    # ranks that moved, integer buffers stay local, and an idle rank's NaN is not spread.
    _check_weighted(results["weighted"])
    # Nobody moved: no consensus, every rank keeps its model bit for bit.
    _check_idle(results["idle"])
    # The bf16 delta wire: one consensus for all, within bf16 of the fp32 one, and a stale
    # reference on one rank makes every rank redo the round in fp32.
    _check_wire(results["wire"])
    # Launched while the ranks train on: one consensus of the launch models, and each rank
    # that moved meanwhile gets its own steps back on top of it.
    _check_overlap(results["overlap"])
