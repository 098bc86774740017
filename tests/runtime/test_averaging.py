"""Work-weighted averaging: masses, divergence, snapshots, EASGD, DiLoCo, collectives.

The unit tests pin the arithmetic by hand-computed values (floDl core spec
§5.1, §8). The real collectives over spawned gloo ranks are checked in
test_gloo_world.py: every rank ends up with the mass-weighted mean.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from torch import nn

from elche.runtime.averaging import (
    divergence,
    float_buffers,
    load_average,
    snapshot_frames,
)
from elche.runtime.snapshots import (
    Layout,
    NesterovOuter,
    SnapshotAverager,
    TensorSpec,
    buffer_mass,
    decode,
    encode,
    load_outer_state,
    param_mass,
    save_outer_state,
)

# --- masses ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "gamma", "expected"),
    [
        (0, 1.0, 0.0),
        (-3, 1.0, 0.0),
        (0, 0.0, 0.0),  # idle is 0 for every gamma, even where 0 ** 0 == 1
        (0, -1.0, 0.0),
        (3, 1.0, 3.0),
        (4, 0.5, 2.0),
        (4, 0.0, 1.0),
        (4, -1.0, 0.25),
    ],
)
def test_param_mass(steps: int, gamma: float, expected: float) -> None:
    assert param_mass(steps, gamma) == expected


@pytest.mark.parametrize(("steps", "expected"), [(-1, 0.0), (0, 0.0), (1, 1.0), (50, 1.0)])
def test_buffer_mass_counts_movers(steps: int, expected: float) -> None:
    assert buffer_mass(steps) == expected


# --- divergence ----------------------------------------------------------------


def test_divergence_hand_computed_half() -> None:
    # P = (2, 1), Q = (2, 0), split over two tensors: ‖P−Q‖ = 1, ‖Q‖ = 2.
    pre = [torch.tensor([2.0]), torch.tensor([1.0])]
    post = [torch.tensor([2.0]), torch.tensor([0.0])]
    assert divergence(pre, post) == pytest.approx((0.5, math.sqrt(5), 2.0), abs=1e-12)


def test_divergence_bfloat16_matches_float32() -> None:
    pre = [torch.tensor([2.0, 1.0], dtype=torch.bfloat16)]
    post = [torch.tensor([2.0, 0.0], dtype=torch.bfloat16)]
    assert divergence(pre, post) == divergence([t.float() for t in pre], [t.float() for t in post])


def test_divergence_zero_post_is_guarded() -> None:
    ratio, pre_norm, post_norm = divergence([torch.tensor([3.0, 4.0])], [torch.zeros(2)])
    assert (ratio, pre_norm, post_norm) == (0.0, 5.0, 0.0)


def test_divergence_empty_is_zero() -> None:
    assert divergence([], []) == (0.0, 0.0, 0.0)


def test_divergence_refuses_mismatches() -> None:
    with pytest.raises(ValueError, match="1 vs 2"):
        divergence([torch.zeros(2)], [torch.zeros(2), torch.zeros(2)])
    with pytest.raises(ValueError, match="shape"):
        divergence([torch.zeros(2)], [torch.zeros(1)])  # would broadcast silently


# --- models --------------------------------------------------------------------


def tiny_model(seed: int, *, poison: bool = False) -> nn.Sequential:
    """Linear + BatchNorm (float and integer buffers) + a float64 and a bf16 parameter.

    ``poison`` puts a NaN in a parameter: harmless on a rank that joins with mass 0.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    model.register_parameter("scale", nn.Parameter(torch.randn(2, dtype=torch.float64)))
    model.register_parameter("low", nn.Parameter(torch.randn(3).to(torch.bfloat16)))
    bn = model[1]
    assert isinstance(bn, nn.BatchNorm1d)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(2))
        bn.running_var.copy_(torch.rand(2) + 0.5)
        bn.num_batches_tracked.fill_(10 * seed + 7)
        if poison:
            model.scale[0] = math.nan
    return model


def float_state(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [
        b.clone() for b in float_buffers(model)
    ]


def test_float_buffers_skip_integer_buffers() -> None:
    bn = nn.BatchNorm1d(3)
    assert [b is bn.running_mean or b is bn.running_var for b in float_buffers(bn)] == [True] * 2
    assert not any(b is bn.num_batches_tracked for b in float_buffers(bn))


# --- snapshots, rank side ------------------------------------------------------


def test_snapshot_frames_round_trip_through_layout_and_load() -> None:
    source, target = tiny_model(1), tiny_model(2)
    layout, frames = snapshot_frames(source)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(layout), type=Layout)
    assert wire == layout
    assert layout.num_params == 6  # the model's own parameters first, then its children's
    assert [s.dtype for s in layout.tensors] == ["float64", "bfloat16"] + ["float32"] * 6
    assert [s.name for s in layout.tensors[6:]] == ["1.running_mean", "1.running_var"]
    assert [f.nbytes for f in frames] == [s.nbytes for s in layout.tensors]

    expected = float_state(source)
    with torch.no_grad():  # the frames are copies: training on does not touch them
        for p in source.parameters():
            p.add_(1.0)
    load_average(target, frames, wire, alpha=None)
    for got, want in zip(float_state(target), expected, strict=True):
        assert torch.equal(got, want)
    assert int(target[1].num_batches_tracked) == 27  # integer buffer stays local


def test_load_average_easgd_blend_and_divergence_against_sent() -> None:
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[2.0, 0.0]]))
    layout, sent = snapshot_frames(model)
    with torch.no_grad():  # the rank trained on while the average was in flight
        model.weight.copy_(torch.tensor([[0.0, 2.0]]))
    avg = encode(layout, [np.array([[2.0, 4.0]])])
    result = load_average(model, avg, layout, alpha=0.5, sent=sent)
    assert model.weight.tolist() == [[1.0, 3.0]]  # p + 0.5 (avg - p)
    # P = sent (2, 0), Q = avg (2, 4): ‖P−Q‖ = 4, ‖Q‖ = √20.
    assert result == pytest.approx((4 / math.sqrt(20), 2.0, math.sqrt(20)))


def test_load_average_buffers_overwrite_unless_blended() -> None:
    bn = nn.BatchNorm1d(1)
    layout, _ = snapshot_frames(bn)
    average = encode(layout, [[1.0], [0.0], [4.0], [8.0]])  # weight, bias, mean, var
    load_average(bn, average, layout, alpha=0.5)
    assert (bn.weight.item(), bn.running_mean.item(), bn.running_var.item()) == (1.0, 4.0, 8.0)
    load_average(bn, encode(layout, [[1.0], [0.0], [0.0], [0.0]]), layout, alpha=0.5,
                 buffers_alpha=0.25)  # fmt: skip
    assert (bn.running_mean.item(), bn.running_var.item()) == (3.0, 6.0)


def test_load_average_refuses_bad_input_and_leaves_model_unchanged() -> None:
    model = tiny_model(0)
    layout, frames = snapshot_frames(model)
    before = float_state(model)
    other, _ = snapshot_frames(nn.Linear(3, 3))
    cases = [
        ({"frames": frames, "layout": other, "alpha": None}, "layout does not describe"),
        ({"frames": frames[:-1], "layout": layout, "alpha": None}, "expected 8 frames"),
        ({"frames": [b"x", *frames[1:]], "layout": layout, "alpha": None}, "scale"),
        ({"frames": frames, "layout": layout, "alpha": 1.5}, "alpha"),
        ({"frames": frames, "layout": layout, "alpha": None, "sent": frames[:2]}, "frames"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            load_average(model, **kwargs)
    for got, want in zip(float_state(model), before, strict=True):
        assert torch.equal(got, want)


# --- snapshots, coordinator side -----------------------------------------------

LAYOUT = Layout(
    tensors=(
        TensorSpec(name="w", dtype="float32", shape=(2, 3)),
        TensorSpec(name="b", dtype="float64", shape=(4,)),
        TensorSpec(name="running_mean", dtype="float32", shape=(3,)),
    ),
    num_params=2,
)


def random_snapshot(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.standard_normal(s.shape).astype(s.dtype) for s in LAYOUT.tensors]


def test_averager_weighted_mean_is_exact() -> None:
    rng = np.random.default_rng(0)
    a, b, idle = random_snapshot(rng), random_snapshot(rng), random_snapshot(rng)
    averager = SnapshotAverager(LAYOUT)
    averager.add(3.0, [x.tobytes() for x in a])
    averager.add(1.0, [memoryview(x.tobytes()) for x in b])
    averager.add(0.0, [x.tobytes() for x in idle])  # accepted, weightless
    assert (averager.total_mass, averager.num_contributions) == (4.0, 3)
    frames = averager.result()
    assert frames is not None
    got = [np.frombuffer(f, dtype=x.dtype).reshape(x.shape) for f, x in zip(frames, a, strict=True)]
    for i in range(2):  # parameters: (3a + b) / 4, computed in float64, rounded once
        want = (3 * a[i].astype(np.float64) + b[i]) / 4
        np.testing.assert_array_equal(got[i], want.astype(a[i].dtype))
    want_buffer = (a[2].astype(np.float64) + b[2]) / 2  # buffers: equal over movers
    np.testing.assert_array_equal(got[2], want_buffer.astype(np.float32))


def test_averager_without_mass_has_no_result() -> None:
    averager = SnapshotAverager(LAYOUT)
    assert averager.result() is None
    averager.add(0.0, [x.tobytes() for x in random_snapshot(np.random.default_rng(1))])
    assert averager.result() is None
    assert averager.mean() is None


def test_averager_refuses_bad_contributions_unchanged() -> None:
    averager = SnapshotAverager(LAYOUT)
    good = [x.tobytes() for x in random_snapshot(np.random.default_rng(2))]
    with pytest.raises(ValueError, match="expected 3 frames"):
        averager.add(1.0, good[:2])
    with pytest.raises(ValueError, match="running_mean: frame has 4 bytes"):
        averager.add(1.0, [*good[:2], b"abcd"])
    for mass in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite"):
            averager.add(mass, good)
    with pytest.raises(ValueError, match="disagree"):
        averager.add(1.0, good, buffer_mass=0.0)
    assert (averager.total_mass, averager.num_contributions, averager.result()) == (0.0, 0, None)


def test_layout_validates_on_decode() -> None:
    bad = {"tensors": [{"name": "x", "dtype": "int64", "shape": [2]}], "num_params": 1}
    with pytest.raises(msgspec.ValidationError, match="unsupported dtype"):
        msgspec.convert(bad, Layout)
    with pytest.raises(ValueError, match="num_params"):
        Layout(tensors=(), num_params=1)


def test_bfloat16_frames_round_like_torch() -> None:
    values = torch.randn(4096, dtype=torch.float32) * 1000
    values[:2] = torch.tensor([math.inf, -math.inf])
    layout = Layout(tensors=(TensorSpec(name="x", dtype="bfloat16", shape=(4096,)),), num_params=1)
    torch_bytes = values.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    assert encode(layout, [values.double().numpy()]) == [torch_bytes]
    decoded = decode(layout, [torch_bytes])[0]
    np.testing.assert_array_equal(decoded, values.to(torch.bfloat16).double().numpy())
    nan = decode(layout, encode(layout, [np.full(4096, math.nan)]))[0]
    assert np.isnan(nan).all()


# --- DiLoCo outer optimizer ----------------------------------------------------


def test_nesterov_worked_example() -> None:
    # Spec §8.5: lr 0.5, mu 0.9; the first window only anchors prev_global.
    outer = NesterovOuter(lr=0.5, momentum=0.9)
    np.testing.assert_array_equal(outer.step([np.array([1.0, 2.0])])[0], [1.0, 2.0])
    np.testing.assert_allclose(outer.step([np.array([0.5, 1.0])])[0], [0.525, 1.05])
    np.testing.assert_allclose(outer.step([np.array([0.5, 1.0])])[0], [0.29875, 0.5975])


def test_nesterov_state_round_trip_keeps_momentum_and_reanchors() -> None:
    outer = NesterovOuter(lr=0.5, momentum=0.9)
    for consensus in ([1.0, 2.0], [0.5, 1.0], [0.5, 1.0]):
        outer.step([np.array(consensus)])
    state = outer.state_dict()
    resumed = NesterovOuter(lr=0.5, momentum=0.9)
    resumed.load_state_dict(state)
    state["velocity"][0][:] = 99.0  # state is a copy
    # After resume the first window re-anchors; the velocity carries on.
    np.testing.assert_array_equal(resumed.step([np.array([0.3, 0.6])])[0], [0.3, 0.6])
    outer.set_global([np.array([0.3, 0.6])])
    for consensus in ([0.2, 0.5], [0.1, 0.1]):
        np.testing.assert_array_equal(
            resumed.step([np.array(consensus)])[0], outer.step([np.array(consensus)])[0]
        )


def test_outer_state_file_round_trip(tmp_path: Path) -> None:
    outer = NesterovOuter(lr=0.5, momentum=0.9)
    path = tmp_path / "bundle" / "run.outer.npz"
    outer.step([np.ones((2, 3)), np.ones(12)])
    assert not save_outer_state(outer, path)  # no velocity before the second step
    assert not path.exists()
    outer.step([np.zeros((2, 3)), np.full(12, 0.5)])
    assert save_outer_state(outer, path)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    resumed = NesterovOuter(lr=0.5, momentum=0.9)
    load_outer_state(resumed, path)
    got, want = resumed.state_dict()["velocity"], outer.state_dict()["velocity"]
    assert isinstance(got, list) and isinstance(want, list)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert not save_outer_state(NesterovOuter(), path)  # a fresh run's bundle, same stem
    assert not path.exists()  # the older momentum is gone, not resumed by mistake
    path.write_bytes(b"not an npz")
    with pytest.raises(ValueError):
        load_outer_state(resumed, path)


def test_nesterov_refuses_bad_input() -> None:
    for kwargs in ({"lr": 0.0}, {"momentum": 1.0}, {"momentum": -0.1}):
        with pytest.raises(ValueError):
            NesterovOuter(**kwargs)
    outer = NesterovOuter()
    outer.step([np.zeros(2)])
    with pytest.raises(ValueError, match="shapes"):
        outer.step([np.zeros(3)])
    with pytest.raises(ValueError, match="velocity"):
        outer.load_state_dict({})


def test_averager_steps_the_outer_optimizer_on_parameters_only() -> None:
    rng = np.random.default_rng(3)
    first, second = random_snapshot(rng), random_snapshot(rng)
    outer, shadow = NesterovOuter(lr=0.5), NesterovOuter(lr=0.5)
    for snapshot in (first, second):
        averager = SnapshotAverager(LAYOUT)
        averager.add(2.0, [x.tobytes() for x in snapshot])
        frames = averager.result(outer)
        assert frames is not None
        want = shadow.step(snapshot[:2])  # the mean of one contribution is itself
        assert frames == encode(LAYOUT, [*want, snapshot[2]])  # the buffer passes through
        shadow.set_global(decode(LAYOUT, frames)[:2])
