"""The averaging wire: what a rank's averaging payload is made of, and what it weighed.

``elche.train(wire=...)`` picks it; every rank holds one ``Wire``:

- ``"fp32"`` (the default): payloads in the tensors' own dtypes, as
  ``elche.runtime.averaging`` always sent them.
- ``"bf16"``: float32/float64 tensors travel as bfloat16, half the bytes of
  fp32. The model's own parameters stay in their dtype; only the payload is
  lighter. Integer and bool tensors (BatchNorm's ``num_batches_tracked``) are
  never cast: they are never averaged at all. float16/bfloat16 tensors travel
  as they are (already two bytes).

Theory of operation
-------------------
Collective modes (``sync``, ``cadence``): a rank all-reduces the bf16 *delta*
of each tensor from the last consensus (``ref``, the fp32 state every member
loaded after the previous round), scaled by its mass, not the bf16 weights.
Rounding full weights to bf16 keeps 8 bits of the weight, so a window's
update smaller than half a bf16 step of the weight (0.2-0.4 % of it) would be
rounded away on every rank alike, and the consensus would snap to the bf16
grid; rounding the delta keeps 8 bits of the *update*, and the consensus
(``ref + Σ mass·delta / Σ mass``, summed back in fp32) keeps fp32 precision
where the model is. gloo sums the bf16 buffer in bf16 (rounding once per hop
of its ring: a relative error of ~2⁻⁸ of the averaged update, not of the
weights). The masses travel beside it in a 48-byte float64 all-reduce,
issued asynchronously before the payload, so the two overlap.

The delta is only right if every member's ``ref`` is the same. Each rank
hashes its ``ref`` (20 bits of a digest of each tensor's exact integer sum
of its bits) and the masses' all-reduce carries ``h`` and ``h²``: the hashes
agree exactly when ``n·Σh² = (Σh)²``, a test every member evaluates on the
same sums, so all take the same branch (two different refs pass it with a
chance of 2⁻²⁰ per round). A rank with no ``ref`` (the first round, a process that
rejoined, a group formed anew after a failure) reports it in the same
buffer. Then the round is redone as a plain fp32 average (its bytes counted)
and every member's ``ref`` is that consensus again.

Coordinator modes (``cpu-*``): snapshots are uploaded as bf16 frames and the
coordinator, which accumulates in float64 whatever the dtype
(``elche.runtime.snapshots``), answers in bf16. There the *weights* travel
(the coordinator folds in snapshots taken at different times and may blend
them, ``cpu-async``, or step an outer optimizer on them, DiLoCo), so the
average a rank loads is rounded to bf16. A parameter frozen in the model
``model_fn`` built travels in its own dtype (``averaging.frozen_parameters``):
alike on every rank, it comes back as it was.

``Wire.bytes`` counts the averaging payload this rank handed to the
transport (collective: the all-reduced buffers; coordinator: its upload plus
the average it received), ``Wire.rounds`` the rounds: the bench's
``wire_bytes_per_round`` is their ratio.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from elche.runtime.averaging import (
    Collectives,
    Divergence,
    InFlight,
    Wait,
    collective_average,
    divergence,
    float_buffers,
    launch_average,
    wire_dtype,
)
from elche.runtime.snapshots import buffer_mass, param_mass

__all__ = ["Wire", "average_over", "launch_over", "wire_dtype"]

_LIGHT = torch.bfloat16
_HASH_MOD = 2**20  # h² summed over 8k ranks stays exact in float64
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _ref_hash(tensors: Sequence[torch.Tensor]) -> int:
    """20 bits of a digest of each tensor's bit sum (an exact integer sum: the same
    on every rank for the same values, whatever order the sum runs in)."""
    digest = hashlib.blake2b(digest_size=8)
    for t in tensors:
        bits = t.detach().contiguous().view(_INT_VIEW[t.element_size()])
        total = int(bits.sum(dtype=torch.int64)) if t.numel() else 0
        digest.update(total.to_bytes(8, "little", signed=True))
    return int.from_bytes(digest.digest(), "little") % _HASH_MOD


class Wire:
    """One rank's averaging wire: its name, byte counts and (bf16) last consensus."""

    def __init__(self, name: str = "fp32", own: frozenset[str] = frozenset()) -> None:
        self.name = name
        self.own = own  # coordinator modes: the tensors that travel in their own dtype
        self.bytes = 0
        self.rounds = 0
        self.ref: list[torch.Tensor] | None = None  # bf16 collective: the last consensus
        self.ref_hash = 0

    @property
    def light(self) -> bool:
        """Payloads travel as bfloat16."""
        return self.name == "bf16"

    def count(self, nbytes: int) -> None:
        """One round's payload of ``nbytes``."""
        self.bytes += nbytes
        self.rounds += 1

    def keep(self, tensors: Sequence[torch.Tensor]) -> None:
        """Hold copies of ``tensors`` (the consensus every member just loaded) as ``ref``."""
        self.ref = [t.detach().clone() for t in tensors]
        self.ref_hash = _ref_hash(self.ref)

    def ref_fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        """``ref`` exists and matches ``tensors`` in count, shapes and dtypes."""
        return self.ref is not None and [(r.shape, r.dtype) for r in self.ref] == [
            (t.shape, t.dtype) for t in tensors
        ]


def average_over(
    wire: Wire,
    model: nn.Module,
    steps: int,
    *,
    gamma: float = 1.0,
    group: dist.ProcessGroup | None = None,
    wait: Wait | None = None,
) -> Divergence:
    """``collective_average`` over ``wire``: fp32 as it is, bf16 as deltas (module
    docstring); ``wait`` as there, for each of its collectives.

    Raises:
        RuntimeError: From ``torch.distributed`` if a collective fails, or
            ``RoundDropped`` from ``wait``; the model and ``wire.ref`` are unchanged.
    """
    tensors = _float_tensors(model)
    if not wire.light:
        result = collective_average(model, steps, gamma=gamma, group=group, wait=wait)
        wire.count(_payload_bytes(tensors) + 16)  # the two float masses ride in the buffer
        return result
    return _delta_average(wire, model, tensors, steps=steps, gamma=gamma, group=group, wait=wait)


def launch_over(
    wire: Wire,
    model: nn.Module,
    steps: int,
    *,
    gamma: float = 1.0,
    group: dist.ProcessGroup | None = None,
) -> InFlight | None:
    """``launch_average`` over an fp32 wire; None on the bf16 wire, whose
    rounds ``average_over`` makes while the rank waits (a member without the
    shared ``ref`` redoes the round in fp32: a second collective).

    Raises:
        RuntimeError: From ``torch.distributed`` if a collective cannot start.
    """
    if wire.light:
        return None
    flight = launch_average(model, steps, gamma=gamma, group=group)
    wire.count(_payload_bytes(flight.tensors) + 16)  # as ``average_over`` counts it
    return flight


def _float_tensors(model: nn.Module) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.is_floating_point()]
    return params + float_buffers(model)


def _payload_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * max(t.element_size(), 4) for t in tensors)  # 2-byte floats sum in fp32


def _delta_average(
    wire: Wire,
    model: nn.Module,
    tensors: list[torch.Tensor],
    *,
    steps: int,
    gamma: float,
    group: dist.ProcessGroup | None,
    wait: Wait | None,
) -> Divergence:
    num_params = sum(1 for p in model.parameters() if p.is_floating_point())
    device = tensors[0].device if tensors else torch.device("cpu")
    masses = (param_mass(steps, gamma), buffer_mass(steps))
    has_ref = wire.ref_fits(tensors)
    h = float(wire.ref_hash if has_ref else 0)
    meta = torch.tensor([*masses, 1.0, 0.0 if has_ref else 1.0, h, h * h], dtype=torch.float64)
    meta = meta.to(device)
    weights = [masses[0] if i < num_params else masses[1] for i in range(len(tensors))]
    flat, chunks = _packed_deltas(wire, tensors, weights if has_ref else None, device)
    works = [
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True) for t in (meta, flat)
    ]
    if wait is not None:
        wait(Collectives(works, on_host=device.type == "cpu"))
    for work in works:
        work.wait()
    total_p, total_b, members, missing, sum_h, sum_h2 = meta.tolist()
    sent = flat.numel() * flat.element_size() + meta.numel() * meta.element_size()
    if missing > 0 or members * sum_h2 != sum_h * sum_h:  # some ref differs: a full average
        result = collective_average(model, steps, gamma=gamma, group=group, wait=wait)
        wire.count(sent + _payload_bytes(tensors) + 16)
        wire.keep(tensors)
        return result
    wire.count(sent)
    params = tensors[:num_params]
    if total_p <= 0:  # nobody moved: nothing changes
        norm = divergence(params, params)[1]
        return (0.0, norm, norm)
    assert wire.ref is not None  # has_ref held on every member
    totals = [total_p if i < num_params else total_b for i in range(len(tensors))]
    post = [
        (ref.float() + chunk.float().div_(total)).to(ref.dtype)
        for ref, chunk, total in zip(wire.ref, chunks, totals, strict=True)
    ]
    result = divergence(params, post[:num_params])
    with torch.no_grad():
        for t, new in zip(tensors, post, strict=True):
            t.copy_(new)
    wire.keep(tensors)
    return result


def _packed_deltas(
    wire: Wire,
    tensors: Sequence[torch.Tensor],
    weights: Sequence[float] | None,
    device: torch.device,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One bf16 buffer of ``weight · (t − ref)`` per tensor (zeros where there is
    no ref or no weight), and its views shaped like the tensors."""
    flat = torch.zeros(sum(t.numel() for t in tensors), dtype=_LIGHT, device=device)
    chunks: list[torch.Tensor] = []
    offset = 0
    for i, t in enumerate(tensors):
        chunk = flat[offset : offset + t.numel()].view(t.shape)
        if weights is not None and weights[i] != 0 and wire.ref is not None:
            chunk.copy_((t.detach().float() - wire.ref[i].float()).mul_(weights[i]))
        chunks.append(chunk)
        offset += t.numel()
    return flat, chunks
