"""Coordinator-side averaging of parameter snapshots, on raw bytes with numpy.

The coordinator process never imports torch (it must start in well under a
second, design §4), so the CPU modes (``cpu-sync``, ``cpu-cadence``,
``cpu-async``) average here: ranks upload their tensors as raw little-endian
frames described once by a ``Layout``; the coordinator folds them into float64
accumulators and sends back one frame per tensor, in the tensor's own dtype.
The rank side (torch) lives in ``elche.runtime.averaging``.

Theory of operation
-------------------
Mass law (floDl core spec §8.1): *pre-scale at the source, sum, divide once
by the summed mass of the accepted contributions.* Here the "source" is
``SnapshotAverager.add``: ranks ship unscaled frames (zero-copy, native
dtype) and each accepted frame is scaled by its mass as it is folded in, so
the sum never has to be redone and nothing is divided until ``mean``.

- Parameters weigh ``param_mass(steps, gamma)`` (steps ** gamma, 0 if idle).
- Floating-point buffers weigh ``buffer_mass(steps)``: equal over the ranks
  that moved (1 if steps > 0, else 0); buffers are never gamma-weighted.
- An idle rank (mass 0) is accepted but contributes nothing. If no accepted
  contribution carries mass, there is no average (``None``): every rank keeps
  its own parameters.
- Accumulation is float64 whatever the tensor dtype; the result is rounded
  once, to the tensor's dtype (bfloat16 included, round-to-nearest-even, as
  torch rounds).

DiLoCo (``NesterovOuter``) turns the consensus into the next global model
(spec §8.5), on the float64 mean of the parameters only; buffers pass through.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = [
    "SUPPORTED_DTYPES",
    "Layout",
    "NesterovOuter",
    "SnapshotAverager",
    "TensorSpec",
    "buffer_mass",
    "decode",
    "encode",
    "load_outer_state",
    "param_mass",
    "save_outer_state",
]

Frame = bytes | bytearray | memoryview
F64Array = npt.NDArray[np.float64]

# dtype name (torch's, without the "torch." prefix) -> bytes per element.
# Frames are little-endian, as torch stores tensors on every platform we run on.
SUPPORTED_DTYPES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}


# --- masses (spec §8.1) ------------------------------------------------------


def param_mass(steps: int, gamma: float = 1.0) -> float:
    """Weight of a rank's parameters: ``steps ** gamma``, 0 for an idle rank.

    Args:
        steps: Optimizer steps since the last average (the true count).
        gamma: Work exponent; 1 weighs parameters by steps (design §3).

    Returns:
        0.0 if ``steps <= 0``, else ``steps`` (gamma 1) or ``steps ** gamma``.
    """
    if steps <= 0:
        return 0.0
    if gamma == 1.0:
        return float(steps)
    return math.pow(steps, gamma)


def buffer_mass(steps: int) -> float:
    """Weight of a rank's floating-point buffers: 1 if it moved, else 0.

    Args:
        steps: Optimizer steps since the last average.

    Returns:
        1.0 if ``steps > 0`` else 0.0.
    """
    return 1.0 if steps > 0 else 0.0


# --- layout ------------------------------------------------------------------


class TensorSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One tensor of a snapshot: its name in the model, dtype and shape."""

    name: str
    dtype: str  # a key of SUPPORTED_DTYPES, e.g. "float32"
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{self.name}: unsupported dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"{self.name}: negative dimension in shape {self.shape}")

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the tensor's frame in bytes."""
        return self.numel * SUPPORTED_DTYPES[self.dtype]


class Layout(msgspec.Struct, frozen=True, kw_only=True):
    """What a rank's snapshot frames hold, sent once per rank (and per model).

    ``tensors`` lists the floating-point parameters first, then the
    floating-point buffers; the first ``num_params`` entries are parameters.
    Decoding a malformed layout raises ``msgspec.ValidationError``.
    """

    tensors: tuple[TensorSpec, ...]
    num_params: int

    def __post_init__(self) -> None:
        if not 0 <= self.num_params <= len(self.tensors):
            raise ValueError(f"num_params {self.num_params} outside 0..{len(self.tensors)}")

    def check(self, frames: Sequence[Frame]) -> None:
        """Check that ``frames`` match this layout in count and sizes.

        Raises:
            ValueError: Wrong number of frames, or a frame of the wrong size
                (the message names the tensor).
        """
        if len(frames) != len(self.tensors):
            raise ValueError(f"expected {len(self.tensors)} frames, got {len(frames)}")
        for spec, frame in zip(self.tensors, frames, strict=True):
            size = memoryview(frame).nbytes
            if size != spec.nbytes:
                raise ValueError(f"{spec.name}: frame has {size} bytes, expected {spec.nbytes}")


# --- bytes <-> float64 -------------------------------------------------------


def _decode_one(spec: TensorSpec, frame: Frame) -> F64Array:
    if spec.dtype == "bfloat16":
        # bfloat16 is the top half of a float32: widen the bits, then reinterpret.
        top = np.frombuffer(frame, dtype="<u2").astype(np.uint32) << 16
        values = top.view(np.float32)
    else:
        values = np.frombuffer(frame, dtype=_NUMPY_DTYPES[spec.dtype])
    return values.astype(np.float64).reshape(spec.shape)


def _encode_one(spec: TensorSpec, array: F64Array) -> bytes:
    if spec.dtype != "bfloat16":
        return np.ascontiguousarray(array, dtype=_NUMPY_DTYPES[spec.dtype]).tobytes()
    # float64 -> float32 -> bfloat16, each step round-to-nearest-even like torch.
    with np.errstate(over="ignore"):  # beyond float32's range is inf, as in torch
        bits = np.ascontiguousarray(array, dtype="<f4").reshape(-1).view(np.uint32)
    # Round half to even on the dropped 16 bits; only NaN payloads can wrap
    # around 2**32 here, and they are replaced below.
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    halves = np.where(np.isnan(array.reshape(-1)), 0x7FC0, rounded).astype("<u2")
    return halves.tobytes()


def decode(layout: Layout, frames: Sequence[Frame]) -> list[F64Array]:
    """Frames to float64 arrays shaped as ``layout`` says.

    Raises:
        ValueError: ``frames`` do not match ``layout``.
    """
    layout.check(frames)
    return [_decode_one(s, f) for s, f in zip(layout.tensors, frames, strict=True)]


def encode(layout: Layout, arrays: Sequence[npt.ArrayLike]) -> list[bytes]:
    """Arrays to frames, each rounded once to its tensor's dtype.

    Raises:
        ValueError: Wrong number of arrays, or an array of the wrong shape.
    """
    if len(arrays) != len(layout.tensors):
        raise ValueError(f"expected {len(layout.tensors)} arrays, got {len(arrays)}")
    frames = []
    for spec, raw in zip(layout.tensors, arrays, strict=True):
        array = np.asarray(raw, dtype=np.float64)
        if array.shape != spec.shape:
            raise ValueError(f"{spec.name}: shape {array.shape}, expected {spec.shape}")
        frames.append(_encode_one(spec, array))
    return frames


# --- the averager --------------------------------------------------------------


class SnapshotAverager:
    """Mass-weighted mean of the snapshots of one averaging round.

    One averager per round: ``add`` each rank's frames with its masses (as
    ``AverageSnapshots`` lists them), then ``result``. Memory: one float64
    accumulator per tensor (twice a float32 model).
    """

    def __init__(self, layout: Layout) -> None:
        """Start an empty round for snapshots shaped as ``layout``."""
        self.layout = layout
        self._sums = [np.zeros(s.shape, dtype=np.float64) for s in layout.tensors]
        self._param_mass = 0.0
        self._buffer_mass = 0.0
        self.num_contributions = 0

    @property
    def total_mass(self) -> float:
        """Summed parameter mass of the contributions accepted so far."""
        return self._param_mass

    def add(
        self, mass: float, frames: Sequence[Frame], *, buffer_mass: float | None = None
    ) -> None:
        """Fold in one rank's snapshot.

        Args:
            mass: Parameter mass (``param_mass(steps, gamma)``); 0 for an idle rank.
            frames: The rank's frames, in ``layout`` order.
            buffer_mass: Buffer mass; defaults to 1 if ``mass > 0`` else 0.
                It must be positive exactly when ``mass`` is.

        Raises:
            ValueError: A mass is negative or not finite, the masses disagree on
                whether the rank moved, or ``frames`` do not match the layout.
                The averager is unchanged.
        """
        b_mass = (1.0 if mass > 0 else 0.0) if buffer_mass is None else buffer_mass
        for label, value in (("mass", mass), ("buffer_mass", b_mass)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{label} must be finite and >= 0, got {value!r}")
        if (mass > 0) != (b_mass > 0):
            raise ValueError(f"mass {mass} and buffer_mass {b_mass} disagree on whether it moved")
        self.layout.check(frames)
        self.num_contributions += 1
        if mass == 0:
            return  # accepted, weightless: its bytes are never read
        n = self.layout.num_params
        for i, (spec, frame) in enumerate(zip(self.layout.tensors, frames, strict=True)):
            weight = mass if i < n else b_mass
            self._sums[i] += weight * _decode_one(spec, frame)
        self._param_mass += mass
        self._buffer_mass += b_mass

    def mean(self) -> list[F64Array] | None:
        """The float64 weighted means, parameters then buffers; None if massless."""
        if self._param_mass <= 0:
            return None
        n = self.layout.num_params
        return [
            s / (self._param_mass if i < n else self._buffer_mass) for i, s in enumerate(self._sums)
        ]

    def result(self, outer: NesterovOuter | None = None) -> list[bytes] | None:
        """The averaged frames to send back, or None if no contribution had mass.

        Args:
            outer: DiLoCo outer optimizer, stepped on the parameters' mean
                (buffers pass through). Not stepped when the result is None.

        Returns:
            One frame per tensor in ``layout`` order and dtype, or None: then
            every rank keeps its own parameters.
        """
        means = self.mean()
        if means is None:
            return None
        n = self.layout.num_params
        if outer is not None:
            means[:n] = outer.step(means[:n])
        frames = encode(self.layout, means)
        if outer is not None:
            # The ranks start the next window from the rounded values, so the
            # next pseudo-gradient must be measured from those too.
            params = Layout(tensors=self.layout.tensors[:n], num_params=n)
            outer.set_global(decode(params, frames[:n]))
        return frames


# --- DiLoCo outer optimizer (spec §8.5) ----------------------------------------


class NesterovOuter:
    """Nesterov-momentum outer step from the consensus to the next global model.

    With the pseudo-gradient ``g = prev_global - consensus``: ``v = g`` on the
    first step, else ``v = momentum * v + g``; then
    ``new = prev_global - lr * (momentum * v + g)``. The first call (no
    ``prev_global``, also right after ``load_state_dict``) returns the
    consensus unchanged and remembers it; the velocity is left as it was.
    Parameters only; state in float64.
    """

    # DiLoCo resets the inner optimizer's state after each outer step.
    resets_inner: ClassVar[bool] = True

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        """Create the optimizer.

        Args:
            lr: Outer learning rate (DiLoCo suggests 0.7; floDl's doc too).
            momentum: Nesterov momentum (DiLoCo: 0.9).

        Raises:
            ValueError: ``lr <= 0`` or ``momentum`` outside [0, 1).
        """
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        self.lr = lr
        self.momentum = momentum
        self._prev: list[F64Array] | None = None
        self._velocity: list[F64Array] | None = None

    def step(self, consensus: Sequence[npt.ArrayLike]) -> list[F64Array]:
        """Turn this round's consensus into the new global parameters.

        Args:
            consensus: The weighted mean of the parameters, one array per tensor.

        Returns:
            The new global parameters (float64), which also become ``prev_global``.

        Raises:
            ValueError: The shapes differ from the previous global or the
                velocity. The optimizer is unchanged.
        """
        cons = [np.array(c, dtype=np.float64) for c in consensus]
        if self._prev is None:
            self._prev = [c.copy() for c in cons]
            return cons
        self._check_shapes(cons, self._prev, "previous global")
        if self._velocity is not None:
            self._check_shapes(cons, self._velocity, "velocity")
        mu = self.momentum
        grads = [p - c for p, c in zip(self._prev, cons, strict=True)]
        if self._velocity is None:
            velocity = grads
        else:
            velocity = [mu * v + g for v, g in zip(self._velocity, grads, strict=True)]
        new = [
            p - self.lr * (mu * v + g) for p, v, g in zip(self._prev, velocity, grads, strict=True)
        ]
        self._velocity = velocity
        self._prev = [x.copy() for x in new]
        return new

    def set_global(self, params: Sequence[npt.ArrayLike]) -> None:
        """Replace ``prev_global`` with the parameters the ranks actually hold."""
        self._prev = [np.array(p, dtype=np.float64) for p in params]

    def state_dict(self) -> dict[str, object]:
        """The state that survives a resume: the velocity (copies), or None."""
        velocity = None if self._velocity is None else [v.copy() for v in self._velocity]
        return {"velocity": velocity}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore the velocity; ``prev_global`` is unset and re-anchors next step.

        Raises:
            ValueError: ``state`` has no ``velocity`` list (or None). The
                optimizer is unchanged.
        """
        velocity = state.get("velocity", "missing")
        if not (velocity is None or isinstance(velocity, list | tuple)):
            raise ValueError(f"velocity must be a list of arrays or None, got {velocity!r}")
        self._velocity = None if velocity is None else [np.array(v, np.float64) for v in velocity]
        self._prev = None

    @staticmethod
    def _check_shapes(new: list[F64Array], old: list[F64Array], what: str) -> None:
        shapes, expected = [a.shape for a in new], [a.shape for a in old]
        if shapes != expected:
            raise ValueError(f"consensus shapes {shapes} differ from the {what} {expected}")


def save_outer_state(outer: NesterovOuter, path: Path) -> bool:
    """Write the outer optimizer's velocity to ``path`` (``.npz``), atomically.

    Returns:
        False if there is no velocity yet (before the second outer step): then
        no file is left at ``path``, so an older one cannot be resumed with a
        newer bundle. True otherwise.
    """
    velocity = outer.state_dict()["velocity"]
    if velocity is None:
        path.unlink(missing_ok=True)
        return False
    assert isinstance(velocity, list)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        np.savez(f, *velocity)
    os.replace(tmp, path)
    return True


def load_outer_state(outer: NesterovOuter, path: Path) -> None:
    """Restore the velocity :func:`save_outer_state` wrote to ``path``.

    Raises:
        OSError: ``path`` cannot be read.
        ValueError: it is not such a file. The optimizer is unchanged.
    """
    with np.load(path, allow_pickle=False) as saved:
        names = sorted(saved.files, key=lambda n: int(n.removeprefix("arr_")))
        velocity = [saved[n] for n in names]
    outer.load_state_dict({"velocity": velocity})
