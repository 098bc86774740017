"""Work-weighted parameter averaging on the ranks (Local SGD).

Ranks train independently and, when the coordinator says so, average their
parameters weighted by the work each did since the last average. This module
is the rank side of both backends (design §3):

- collective (``sync``, ``cadence``): ``collective_average`` all-reduces over
  ``torch.distributed`` (gloo on CPU, NCCL on CUDA), every member calling it;
- coordinator (``cpu-*``): ``snapshot_frames`` uploads a copy of the model as
  raw frames, the coordinator averages them (``elche.runtime.snapshots``,
  torch-free), and ``load_average`` loads the result, optionally as an EASGD
  blend (``cpu-async``).

Theory of operation
-------------------
Mass law (floDl core spec §8.1): *pre-scale at the source, sum, divide once
by the summed mass of the accepted contributions.*

- A rank's parameters weigh ``param_mass(steps, gamma)`` = steps ** gamma
  (0 if it made no step); its floating-point buffers weigh
  ``buffer_mass(steps)`` = 1 if it moved, else 0, so buffers (BatchNorm
  running statistics) are the plain mean over the ranks that moved.
- Integer buffers (BatchNorm's ``num_batches_tracked``) and non-float
  parameters are never averaged: they stay local.
- If no rank carries mass, nothing changes anywhere.

``launch_average`` starts the same all-reduces without waiting
(``InFlight``): the rank trains on while they run, and applies the
consensus C when they land, keeping what it trained since the launch as
``now + (C − S)``, S its tensors at the launch (a delayed correction: the
steps taken meanwhile started from S instead of C). ``collective_average``
waits for them; its ``wait`` lets the driver wait in its own way (taking
messages meanwhile) and give the round up (``RoundDropped``).

The collective path follows the law literally: each rank scales its tensors
by its own mass and packs everything of one (device, dtype) into one flat
buffer, its pair of masses riding at the end of the first; one all-reduce per
buffer sums them (one collective a round for the usual model: a separate
all-reduce of the masses first cost ~1.5 ms a round among three ranks on two
cores, a third of the round for a small MLP), and the sums are divided by the
summed masses. float16/bfloat16 are summed in float32 and rounded once, so
``steps * p`` cannot overflow. An idle rank joins with zeros (not ``0 * p``,
which would spread its NaNs).

Divergence (spec §5.1) is ``‖P − Q‖ / ‖Q‖`` over all parameter tensors, with P
this rank's parameters before the average and Q the consensus: one norm
kernel per tensor accumulating in float64 (P − Q of float32 tensors is taken
in float32), ~5× cheaper than elementwise float64 on a 150k-parameter CNN.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elche.runtime.snapshots import (
    Frame,
    Layout,
    TensorSpec,
    buffer_mass,
    param_mass,
)

__all__ = [
    "Collectives",
    "Divergence",
    "InFlight",
    "Layout",
    "RoundDropped",
    "Wait",
    "buffer_mass",
    "collective_average",
    "divergence",
    "float_buffers",
    "frozen_parameters",
    "launch_average",
    "load_average",
    "param_mass",
    "snapshot_frames",
    "wire_dtype",
]

# (divergence, pre_norm, post_norm), as reported in SyncAck.
Divergence = tuple[float, float, float]

# Below this consensus norm the relative divergence is meaningless (spec §5.1).
_NORM_FLOOR = 1e-10


def _named_float_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]


def _named_float_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]


def float_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The model's floating-point buffers, in ``model.buffers()`` order.

    Integer buffers such as BatchNorm's ``num_batches_tracked`` are left out:
    they are counters, never averaged.
    """
    return [b for _, b in _named_float_buffers(model)]


def divergence(pre: Sequence[torch.Tensor], post: Sequence[torch.Tensor]) -> Divergence:
    """Relative distance of ``pre`` from ``post`` over all tensors (spec §5.1).

    Args:
        pre: P, e.g. this rank's parameters before averaging.
        post: Q, the consensus, same count and shapes (any dtype or device).

    Returns:
        ``(‖P − Q‖ / ‖Q‖, ‖P‖, ‖Q‖)``: global L2 norms in float64; the ratio is
        0 when ‖Q‖ <= 1e-10. Empty sequences give ``(0.0, 0.0, 0.0)``.

    Raises:
        ValueError: Different numbers of tensors, or a pair of different shapes.
    """
    if len(pre) != len(post):
        raise ValueError(f"divergence over {len(pre)} vs {len(post)} tensors")
    if not pre:
        return (0.0, 0.0, 0.0)
    norms: list[torch.Tensor] = []  # per tensor: ‖p − q‖, ‖p‖, ‖q‖, accumulated in float64
    for i, (before, after) in enumerate(zip(pre, post, strict=True)):
        if before.shape != after.shape:
            raise ValueError(f"tensor {i}: shape {tuple(before.shape)} vs {tuple(after.shape)}")
        p, q = before.detach(), after.detach().to(device=before.device)
        exact = p.dtype == q.dtype and p.dtype in (torch.float32, torch.float64)
        diff = p - q if exact else p.to(torch.float64) - q.to(torch.float64)
        for t in (diff, p, q):
            norms.append(torch.linalg.vector_norm(t, dtype=torch.float64).to(pre[0].device))
    total = torch.stack(norms).view(-1, 3).square().sum(dim=0)
    diff_sq, pre_sq, post_sq = total.tolist()  # the one device sync
    pre_norm, post_norm = pre_sq**0.5, post_sq**0.5
    ratio = diff_sq**0.5 / post_norm if post_norm > _NORM_FLOOR else 0.0
    return (ratio, pre_norm, post_norm)


# --- collective backend (spec §8.3) ----------------------------------------------


def _reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _packed(
    tensors: Sequence[torch.Tensor],
    weights: Sequence[float],
    masses: Sequence[float],
    device: torch.device,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``weight · t`` for every tensor, packed into one flat buffer per (device,
    reduce dtype) bucket, the masses riding at the end of the first (a float64
    buffer on ``device`` if there are no tensors).

    Returns:
        Views of the flat buffers shaped like ``tensors``, and the buffers.
    """
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):  # first-appearance order: identical on every rank
        buckets.setdefault((t.device, _reduce_dtype(t.dtype)), []).append(i)
    if not buckets:
        buckets[(device, torch.float64)] = []
    out: list[torch.Tensor] = list(tensors)
    flats: list[torch.Tensor] = []
    for (bucket_device, dtype), members in buckets.items():
        room = len(masses) if not flats else 0  # the masses' slots, first bucket only
        size = sum(tensors[i].numel() for i in members)
        flat = torch.empty(size + room, dtype=dtype, device=bucket_device)
        offset = 0
        for i in members:
            t, n = tensors[i], tensors[i].numel()
            chunk = flat[offset : offset + n]
            if weights[i] == 0:
                chunk.zero_()
            else:
                chunk.copy_(t.detach().reshape(-1)).mul_(weights[i])
            out[i] = chunk.view(t.shape)
            offset += n
        if room:
            flat[size:].copy_(torch.tensor(masses, dtype=dtype))
        flats.append(flat)
    return out, flats


def _summed_masses(flats: Sequence[torch.Tensor], count: int) -> list[float]:
    first = flats[0]
    return first[first.numel() - count :].tolist()


def _weights(
    params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], steps: int, gamma: float
) -> tuple[list[float], tuple[float, float]]:
    """Each tensor's weight and the rank's (parameter, buffer) masses (mass law)."""
    p_mass, b_mass = param_mass(steps, gamma), buffer_mass(steps)
    return [p_mass] * len(params) + [b_mass] * len(buffers), (p_mass, b_mass)


def _consensus(
    sums: Sequence[torch.Tensor], totals: tuple[float, float], num_params: int
) -> list[torch.Tensor]:
    """Divide the summed tensors by their summed mass, in place."""
    for i, summed in enumerate(sums):
        summed.div_(totals[0] if i < num_params else totals[1])
    return list(sums)


class Collectives:
    """Collectives started and not waited for yet, and whether they finished.

    No Python callback is ever attached to them, and no Python thread waits in
    them: one may be given up unfinished (``RoundDropped``) and end only as its
    process exits, and a callback released or a wait returning then, on a
    thread of its own, needs the interpreter that is finalizing: the thread is
    ended mid-destructor and the process aborts (``terminate called``). A
    driver looks at ``completed`` between its other waits, or waits in turns
    (``wait_for``) on its own thread.

    Args:
        works: their ``torch.distributed`` works.
        on_host: they reduce CPU tensors (gloo), not CUDA ones.
    """

    def __init__(self, works: Sequence[Any], *, on_host: bool) -> None:
        self.works = list(works)
        # A CPU collective's future holds its result once done, and gloo marks
        # it done before the work. A CUDA collective's future is done at its
        # launch; only the work knows.
        self._on_host = on_host

    def completed(self) -> bool:
        """Every one has finished (or failed): waiting for them will not wait."""
        if self._on_host:
            return all(work.get_future().done() for work in self.works)
        return all(work.is_completed() for work in self.works)

    def wait_for(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for every one to end (less when they do); whether all have.

        On the host in the works' own timed waits: one that times out leaves
        its collective running, and costs a C++ error (~0.1–0.3 ms of CPU
        here), so the turns should be long. A CUDA work's timed wait may
        abort its communicator: those are looked at every 0.5 ms instead.
        """
        if self._on_host:
            for work in self.works:
                try:
                    work.wait(timedelta(seconds=seconds))
                except RuntimeError:  # timed out, or failed (then completed: land raises it)
                    return self.completed()
            return True
        deadline = time.monotonic() + seconds
        while not self.completed() and time.monotonic() < deadline:
            time.sleep(0.0005)
        return self.completed()


class RoundDropped(RuntimeError):
    """A round's collectives given up unfinished (by ``collective_average``'s
    ``wait``), for ``why``. The model is unchanged; ``pending`` still run in
    their group."""

    def __init__(self, pending: Collectives, why: str) -> None:
        super().__init__(f"dropped unfinished: {why}")
        self.pending = pending
        self.why = why


Wait = Callable[[Collectives], None]  # waits for them, or raises ``RoundDropped``


def collective_average(
    model: nn.Module,
    steps: int,
    *,
    gamma: float = 1.0,
    group: dist.ProcessGroup | None = None,
    wait: Wait | None = None,
) -> Divergence:
    """Replace the model's parameters and float buffers by their weighted mean.

    Every member of ``group`` must call this for the same round, idle ones
    (``steps == 0``) included: they join with mass 0, so their parameters do
    not count, but they receive the consensus. Issues one all-reduce per
    (device, reduce dtype) of the tensors, the masses riding in the first.

    Args:
        model: The rank's replica; tensors stay on their device (gloo: CPU,
            NCCL: CUDA).
        steps: Optimizer steps this rank made since the last average.
        gamma: Work exponent of the parameter mass.
        group: Process group to average over; None for the default group.
        wait: Waits for the all-reduces before the consensus is applied
            (None: blocks until they end), or gives the round up.

    Returns:
        The divergence triple of this rank's parameters before the average
        against the consensus. If every rank was idle: ``(0.0, n, n)`` with
        ``n`` the norm of the unchanged parameters.

    Raises:
        RuntimeError: From ``torch.distributed`` if a collective fails. The
            model is unchanged (tensors are written only after every
            collective returned); the round is redone on a new group (the
            coordinator's ``Regroup``).
        RoundDropped: ``wait`` gave the round up; the model is unchanged.
    """
    flight = _start(model, steps, gamma=gamma, group=group, launch=False)
    if wait is not None:
        wait(flight.collectives)
    result, _ = flight.land(moved=False)
    return result


class InFlight:
    """A collective average started and not applied yet (``launch_average``;
    ``collective_average`` lands its own at once).

    It holds the tensors as they were at the launch (S: a copy, when the
    rank trains on meanwhile) and the buffers being summed. ``land`` waits
    for the sums and applies the consensus C: a rank that did not train
    since the launch takes C as it is, so every member holds the same model;
    one that did keeps its own progress since, ``t + (C − S)``, which
    ``land`` returns for the driver to load once the round's callbacks ran
    on C.
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        num_params: int,
        flight: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[Any]],
    ) -> None:
        self.tensors = tensors
        self.num_params = num_params
        self._launch, self._sums, self._flats, works = flight
        on_host = all(flat.device.type == "cpu" for flat in self._flats)
        self.collectives = Collectives(works, on_host=on_host)

    def completed(self) -> bool:
        """Every collective of the round has finished (or failed): ``land`` will not wait."""
        return self.collectives.completed()

    def land(self, *, moved: bool) -> tuple[Divergence, list[torch.Tensor] | None]:
        """Wait for the sums and put the consensus in the model's tensors.

        Args:
            moved: the rank trained since the launch.

        Returns:
            The divergence triple of the launch snapshot against the consensus,
            and, if the rank moved, its tensors as they are now plus the
            round's correction ``C − S`` (None otherwise). If nobody had
            mass, nothing changes and None is returned.

        Raises:
            RuntimeError: From ``torch.distributed`` if a collective failed;
                the model is unchanged.
        """
        for work in self.collectives.works:
            work.wait()
        n = self.num_params
        total_param, total_buffer = _summed_masses(self._flats, 2)
        launch_params = self._launch[:n]
        if total_param <= 0:
            norm = divergence(launch_params, launch_params)[1]
            return (0.0, norm, norm), None
        averaged = _consensus(self._sums, (total_param, total_buffer), n)
        post = [c.to(t.dtype) for c, t in zip(averaged, self.tensors, strict=True)]
        result = divergence(launch_params, post[:n])
        local = None
        with torch.no_grad():
            if moved:  # now + (C − S), in the sums' precision
                local = [
                    t.detach().to(c.dtype, copy=True).add_(c).sub_(s).to(t.dtype)
                    for t, c, s in zip(self.tensors, averaged, self._launch, strict=True)
                ]
            for t, new in zip(self.tensors, post, strict=True):
                t.copy_(new)
        return result, local


def launch_average(
    model: nn.Module,
    steps: int,
    *,
    gamma: float = 1.0,
    group: dist.ProcessGroup | None = None,
) -> InFlight:
    """Start ``collective_average``'s all-reduces without waiting for them.

    The rank may train on while they are in flight: they sum copies. Every
    member of ``group`` must launch (or call ``collective_average`` for) the
    same round.

    Raises:
        RuntimeError: From ``torch.distributed`` if a collective cannot start.
    """
    return _start(model, steps, gamma=gamma, group=group, launch=True)


def _start(
    model: nn.Module, steps: int, *, gamma: float, group: dist.ProcessGroup | None, launch: bool
) -> InFlight:
    """The round's all-reduces of the model's float tensors, started: on copies
    (``launch``: the rank trains on meanwhile), or with the model's own tensors
    standing for the launch snapshot (nothing moves them before ``land``)."""
    params = [p for _, p in _named_float_params(model)]
    tensors = params + float_buffers(model)
    anchor = next(iter(tensors), None)
    device = anchor.device if anchor is not None else torch.device("cpu")
    weights, masses = _weights(params, tensors[len(params) :], steps, gamma)
    if launch:
        snapshot = [t.detach().to(_reduce_dtype(t.dtype), copy=True) for t in tensors]
    else:
        snapshot = [t.detach() for t in tensors]
    sums, flats = _packed(tensors, weights, masses, device)
    works = [
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True) for flat in flats
    ]
    return InFlight(tensors, len(params), (snapshot, sums, flats, works))


# --- coordinator backend, rank side (spec §8.2, §8.4) ----------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wire_dtype(dtype: torch.dtype, wire: str) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels as on ``wire`` (``"fp32"`` or ``"bf16"``).

    The bf16 wire (``elche.runtime.wire``) casts fp32/fp64 tensors; 2-byte
    floats travel as they are, and integer tensors are never averaged.
    """
    light = wire == "bf16" and dtype in (torch.float32, torch.float64)
    return torch.bfloat16 if light else dtype


def frozen_parameters(model: nn.Module) -> frozenset[str]:
    """The names of ``model``'s frozen parameters (``requires_grad`` False).

    Taken once, from the model as ``model_fn`` built it (alike on every
    rank), they travel in their own dtype for the whole run: every rank holds
    them alike and their average must leave them as they are (rounded to bf16
    and back, they would change). A parameter frozen or thawed later (by an
    ``epoch_fn``) keeps the dtype it travelled in, so every rank's layout stays
    the same.
    """
    return frozenset(n for n, p in model.named_parameters() if not p.requires_grad)


def _layout_of(
    named: list[tuple[str, torch.Tensor]], num_params: int, wire: str, own: frozenset[str]
) -> Layout:
    specs = tuple(
        TensorSpec(
            name=n,
            dtype=_dtype_name(t.dtype if n in own else wire_dtype(t.dtype, wire)),
            shape=tuple(t.shape),
        )
        for n, t in named
    )
    return Layout(tensors=specs, num_params=num_params)


def snapshot_frames(
    model: nn.Module, wire: str = "fp32", own: frozenset[str] = frozenset()
) -> tuple[Layout, list[memoryview]]:
    """Copy the model's float parameters, then float buffers, to CPU frames.

    Each frame is a byte ``memoryview`` over a private contiguous CPU copy
    (it keeps the copy alive), ready for a zero-copy send; training may go on
    while it is in flight. On the ``"bf16"`` wire, fp32/fp64 tensors are
    copied as bfloat16 (the layout says so), but for those named in ``own``
    (``frozen_parameters``), which keep their dtype; the model is untouched.

    Returns:
        The ``Layout`` describing the frames, and the frames.

    Raises:
        ValueError: A tensor's dtype is not one the coordinator averages
            (float16, bfloat16, float32, float64).
    """
    params, buffers = _named_float_params(model), _named_float_buffers(model)
    layout = _layout_of(params + buffers, len(params), wire, own)
    frames = []
    for spec, (_, t) in zip(layout.tensors, params + buffers, strict=True):
        host = t.detach().to(
            "cpu", getattr(torch, spec.dtype), copy=True, memory_format=torch.contiguous_format
        )
        frames.append(host.reshape(-1).view(torch.uint8).numpy().data)
    return layout, frames


def _frame_tensor(spec: TensorSpec, frame: Frame) -> torch.Tensor:
    dtype = getattr(torch, spec.dtype)
    if spec.numel == 0:
        return torch.empty(spec.shape, dtype=dtype)
    # bytearray: a private writable copy (torch warns on read-only buffers).
    return torch.frombuffer(bytearray(frame), dtype=dtype).view(spec.shape)


def _check_alpha(label: str, alpha: float | None) -> None:
    if alpha is not None and not 0 <= alpha <= 1:
        raise ValueError(f"{label} must be None or in [0, 1], got {alpha!r}")


def load_average(
    model: nn.Module,
    frames: Sequence[Frame],
    layout: Layout,
    *,
    alpha: float | None,
    buffers_alpha: float | None = None,
    sent: Sequence[Frame] | None = None,
    wire: str = "fp32",
    own: frozenset[str] = frozenset(),
) -> Divergence:
    """Load the coordinator's average into the model.

    Parameters: ``alpha`` None overwrites them with the average; a float α
    blends, ``p ← p + α·(avg − p)`` (EASGD, spec §8.4), keeping the progress
    the rank made while the average was in flight. Float buffers are
    overwritten, or blended with ``buffers_alpha`` if given. Integer buffers
    are left alone.

    The divergence is measured between P = the snapshot this rank sent
    (``sent``; if None, the model's parameters just before loading, which is
    the same thing when the rank did not train in between) and Q = the
    averaged parameters as received, not the blend.

    Args:
        model: The rank's replica.
        frames: The averaged frames, in ``layout`` order.
        layout: The layout this rank uploaded (from ``snapshot_frames``).
        alpha: EASGD blend weight for parameters, or None to overwrite.
        buffers_alpha: Blend weight for float buffers, or None to overwrite.
        sent: The frames this rank uploaded for this round.
        wire: The wire the frames travelled on (``"fp32"`` or ``"bf16"``);
            bf16 frames are loaded into the model's own dtypes.
        own: The tensors that travelled in their own dtype (``snapshot_frames``).

    Returns:
        The divergence triple ``(‖P − Q‖ / ‖Q‖, ‖P‖, ‖Q‖)``.

    Raises:
        ValueError: An alpha outside [0, 1], ``layout`` not describing this
            model, or frames (or ``sent``) not matching ``layout``. Checked
            before anything is written: the model is unchanged.
    """
    _check_alpha("alpha", alpha)
    _check_alpha("buffers_alpha", buffers_alpha)
    params, buffers = _named_float_params(model), _named_float_buffers(model)
    mine = _layout_of(params + buffers, len(params), wire, own)
    if mine != layout:
        raise ValueError(f"layout does not describe this model: {_first_difference(mine, layout)}")
    layout.check(frames)
    if sent is not None:
        layout.check(sent)
    n = layout.num_params
    average = [_frame_tensor(s, f) for s, f in zip(layout.tensors, frames, strict=True)]
    if sent is None:
        pre = [p for _, p in params]
    else:
        pre = [_frame_tensor(s, f) for s, f in zip(layout.tensors[:n], sent[:n], strict=True)]
    result = divergence(pre, average[:n])
    with torch.no_grad():
        for i, ((_, t), avg) in enumerate(zip(params + buffers, average, strict=True)):
            rate = alpha if i < n else buffers_alpha
            src = avg.to(t.device, t.dtype)  # a bf16 wire's frames into fp32
            if rate is None:
                t.copy_(src)
            else:
                t.lerp_(src, rate)
    return result


def _first_difference(mine: Layout, theirs: Layout) -> str:
    for a, b in zip(mine.tensors, theirs.tensors, strict=False):
        if a != b:
            return f"model has {a}, layout has {b}"
    if mine.num_params != theirs.num_params:
        return f"model has {mine.num_params} parameters, layout {theirs.num_params}"
    return f"model has {len(mine.tensors)} tensors, layout {len(theirs.tensors)}"
