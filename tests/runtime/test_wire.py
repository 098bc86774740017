"""The bf16 averaging wire: casts, frames, and the collective delta average.

The unit tests of the collective path run a world of one gloo rank in this
process (a ``FileStore``, no ports), destroyed even on failure; three spawned
gloo ranks are checked in test_gloo_world.py: they agree on one consensus,
within bf16 of the fp32 one, and a stale reference on one rank makes every
rank redo the round in fp32.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import nn

from elche.core.errors import ConfigError
from elche.runtime.averaging import frozen_parameters, load_average, snapshot_frames
from elche.runtime.options import TrainOptions, check_options
from elche.runtime.snapshots import Layout, SnapshotAverager
from elche.runtime.wire import Wire, average_over, wire_dtype

BF16_REL = 2.0**-8  # bfloat16 keeps 8 significant bits: its unit roundoff


def bn_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    with torch.no_grad():
        model[1].running_mean.copy_(torch.randn(3))
        model[1].num_batches_tracked.fill_(41)
    return model


def test_the_bf16_wire_casts_fp32_and_fp64_only() -> None:
    assert wire_dtype(torch.float32, "bf16") == torch.bfloat16
    assert wire_dtype(torch.float64, "bf16") == torch.bfloat16
    assert wire_dtype(torch.float16, "bf16") == torch.float16  # already two bytes: as is
    for dtype in (torch.int64, torch.int32, torch.bool, torch.uint8):
        assert wire_dtype(dtype, "bf16") == dtype  # never cast (never averaged either)
    assert wire_dtype(torch.float64, "fp32") == torch.float64


def test_a_bf16_round_trip_is_within_bf16s_unit_roundoff() -> None:
    source, target = (
        nn.Linear(1000, 1, dtype=torch.float64),
        nn.Linear(1000, 1, dtype=torch.float64),
    )
    layout, frames = snapshot_frames(source, "bf16")
    assert [s.dtype for s in layout.tensors] == ["bfloat16", "bfloat16"]
    load_average(target, frames, layout, alpha=None, wire="bf16")
    got, want = target.weight.detach(), source.weight.detach()
    assert got.dtype == torch.float64
    assert float(((got - want).abs() / want.abs()).max()) <= BF16_REL
    assert not torch.equal(got, want)  # it did travel as bf16


def test_check_options_names_the_wire_and_what_it_accepts() -> None:
    common = dict(
        accumulate=1, precision="fp32", lr_schedule=None, collate_fn=None, num_workers=0,
        pin_memory=False, drop_last=False, batch_sampler=None, devices=("cpu",),
        planned_samples=1,
    )  # fmt: skip
    assert check_options(wire="bf16", **common).wire == "bf16"
    assert TrainOptions().wire == "fp32"
    with pytest.raises(ConfigError, match=r"wire.*'fp32', 'bf16'.*'fp8'"):
        check_options(wire="fp8", **common)


def test_bf16_frames_round_trip_within_bf16_and_keep_integer_buffers() -> None:
    source, target = bn_model(1), bn_model(2)
    layout, frames = snapshot_frames(source, "bf16")
    assert {s.dtype for s in layout.tensors} == {"bfloat16"}
    assert "1.num_batches_tracked" not in [s.name for s in layout.tensors]
    _, full = snapshot_frames(source)
    assert sum(f.nbytes for f in frames) * 2 == sum(f.nbytes for f in full)
    received = msgspec.msgpack.decode(msgspec.msgpack.encode(layout), type=Layout)
    with torch.no_grad():
        target[1].num_batches_tracked.fill_(5)
    load_average(target, frames, received, alpha=None, wire="bf16")
    for (name, got), want in zip(
        target.state_dict().items(), source.state_dict().values(), strict=True
    ):
        if name.endswith("num_batches_tracked"):
            assert int(got) == 5  # integer buffers never travel
            continue
        assert got.dtype == torch.float32  # the model stays fp32
        assert torch.allclose(got, want, rtol=BF16_REL, atol=0)
    with pytest.raises(ValueError, match="layout does not describe"):
        load_average(target, frames, received, alpha=None)  # fp32 expected: refused
    blended = bn_model(3)
    load_average(blended, frames, received, alpha=0.5, wire="bf16")  # lerp across dtypes


def test_a_frozen_parameter_travels_in_its_own_dtype_and_comes_back_as_it_was() -> None:
    # Rounded to bf16 and back on the coordinator modes' wire, it changed on every rank.
    a, b = bn_model(1), bn_model(2)
    for model in (a, b):
        model[0].weight.requires_grad_(False)
        with torch.no_grad():
            model[0].weight.copy_(bn_model(0)[0].weight)  # frozen: alike on every rank
    frozen = a[0].weight.detach().clone()
    own = frozen_parameters(a)
    assert own == {"0.weight"}
    layout, fa = snapshot_frames(a, "bf16", own)
    dtypes = {s.name: s.dtype for s in layout.tensors}
    assert dtypes["0.weight"] == "float32" and dtypes["0.bias"] == "bfloat16"
    a[0].weight.requires_grad_(True)  # thawed later (an epoch_fn): the layout stays
    b[0].weight.requires_grad_(True)
    assert snapshot_frames(b, "bf16", own)[0] == layout
    averager = SnapshotAverager(layout)
    averager.add(3.0, fa)
    averager.add(1.0, snapshot_frames(b, "bf16", own)[1])
    out = averager.result()
    assert out is not None
    load_average(a, out, layout, alpha=None, wire="bf16", own=own)
    assert torch.equal(a[0].weight.detach(), frozen)


def test_coordinator_averages_bf16_frames_in_float64() -> None:
    a, b = bn_model(1), bn_model(2)
    layout, fa = snapshot_frames(a, "bf16")
    _, fb = snapshot_frames(b, "bf16")
    averager = SnapshotAverager(layout)
    averager.add(3.0, fa)
    averager.add(1.0, fb)
    out = averager.result()
    assert out is not None
    target = bn_model(4)
    load_average(target, out, layout, alpha=None, wire="bf16")
    want = (3 * a[0].weight.detach() + b[0].weight.detach()) / 4
    assert torch.allclose(target[0].weight.detach(), want, rtol=2 * BF16_REL, atol=1e-6)


def test_delta_average_keeps_updates_finer_than_bf16_weights(world_of_one: None) -> None:
    model = nn.Linear(64, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)  # bf16's step at 1 is 2**-7: rounded weights lose the update
    wire = Wire("bf16")
    average_over(wire, model, 4)  # no consensus yet: a full fp32 average, then the ref
    assert wire.rounds == 1 and wire.bytes == 64 * 2 + 48 + 64 * 4 + 16
    update = torch.linspace(-1e-3, 1e-3, 64).view(1, 64)
    with torch.no_grad():
        model.weight.add_(update)
    div, _, _ = average_over(wire, model, 4)
    assert wire.rounds == 2 and wire.bytes == 2 * (64 * 2 + 48) + 64 * 4 + 16
    got = model.weight.detach() - 1.0
    assert torch.allclose(got, update, rtol=BF16_REL, atol=1e-7)  # bf16 weights: all 0
    assert div < 1e-5  # P − Q: the update's bf16 rounding, ~1e-6 of the weights
    assert wire.ref is not None and torch.equal(wire.ref[0], model.weight.detach())


def test_delta_average_of_an_idle_rank_changes_nothing(world_of_one: None) -> None:
    model = bn_model(1)
    wire = Wire("bf16")
    average_over(wire, model, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    div, pre, post = average_over(wire, model, 0)
    assert div == 0.0 and pre == post
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


def test_fp32_wire_counts_the_full_payload(world_of_one: None) -> None:
    model = bn_model(1)  # 21 parameters, 6 float buffer values
    wire = Wire()
    average_over(wire, model, 2)
    assert (wire.rounds, wire.bytes) == (1, 27 * 4 + 16)
