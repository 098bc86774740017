"""How a rank trains and loads its data: ``elche.train``'s step and loader options.

``check_options`` validates them up front (a bad value raises ``ConfigError``
naming the field and what is accepted); ``TrainOptions`` carries them to
every rank (it is pickled with the user's functions). This module never
imports torch.

- ``accumulate``: micro-batches of ``batch_size`` per optimizer step; the
  coordinator hands out and counts optimizer steps of ``batch_size ×
  accumulate`` samples.
- ``precision``: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` (CUDA only:
  its gradients are scaled).
- ``wire``: ``"fp32"`` (default) or ``"bf16"``: what the averaging payloads
  travel as (``elche.runtime.wire``); the model's parameters stay as they are.
- ``overlap``: True (default): a collective round on the fp32 wire is
  launched and the rank trains on while it is in flight, its steps since
  applied on top of the consensus it brings (``elche.runtime.averaging``);
  False: the rank waits for each round.
- ``lr_schedule``: ``lr_schedule(progress) -> factor`` of each param group's
  base learning rate, before every optimizer step (``elche.runtime.stepping``).
- ``collate_fn``, ``num_workers``, ``pin_memory``, ``drop_last`` and
  ``batch_sampler``: as in ``torch.utils.data.DataLoader``, over the sample
  indices elche assigns (``elche.runtime.loading``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from elche.core.errors import ConfigError
from elche.core.progress import Progress
from elche.runtime.sending import SEND_ERRORS, to_ranks

__all__ = [
    "PRECISIONS",
    "WIRES",
    "TrainOptions",
    "check_options",
    "check_picklable",
    "check_wire",
]

PRECISIONS = ("fp32", "bf16", "fp16")
WIRES = ("fp32", "bf16")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainOptions:
    """A rank's step and loader options (see the module docstring)."""

    accumulate: int = 1
    precision: str = "fp32"
    wire: str = "fp32"
    overlap: bool = True
    lr_schedule: Callable[[Progress], float] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    num_workers: int = 0
    pin_memory: bool = False
    drop_last: bool = False
    batch_sampler: Callable[[list[int]], Iterable[Sequence[int]]] | None = None
    planned_samples: int = 1  # epochs × len(dataset): what progress is a fraction of

    @property
    def uses_loader(self) -> bool:
        """Batches go through a ``torch.utils.data.DataLoader`` (workers or pinning)."""
        return self.num_workers > 0 or self.pin_memory


def check_options(
    *,
    accumulate: Any,
    precision: Any,
    lr_schedule: Any,
    wire: Any = "fp32",
    overlap: Any = True,
    collate_fn: Any,
    num_workers: Any,
    pin_memory: Any,
    drop_last: Any,
    batch_sampler: Any,
    devices: Sequence[str],
    planned_samples: int,
) -> TrainOptions:
    """Validate the options into a ``TrainOptions``.

    Raises:
        ConfigError: a bad value; the message names the field and what is accepted.
    """
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ConfigError("accumulate", f"must be an integer >= 1, got {accumulate!r}")
    if precision not in PRECISIONS:
        accepted = ", ".join(repr(p) for p in PRECISIONS)
        raise ConfigError("precision", f"must be one of {accepted}, got {precision!r}")
    if precision == "fp16" and not all(d.startswith("cuda") for d in devices):
        raise ConfigError(
            "precision", "'fp16' needs CUDA devices (its loss scaling); use 'bf16' on CPU"
        )
    check_wire(wire)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError("num_workers", f"must be an integer >= 0, got {num_workers!r}")
    flags = (("overlap", overlap), ("pin_memory", pin_memory), ("drop_last", drop_last))
    for name, value in flags:
        if not isinstance(value, bool):
            raise ConfigError(name, f"must be True or False, got {value!r}")
    for name, fn in (
        ("lr_schedule", lr_schedule),
        ("collate_fn", collate_fn),
        ("batch_sampler", batch_sampler),
    ):
        if fn is not None and not callable(fn):
            raise ConfigError(name, f"must be a function or None, got {fn!r}")
    return TrainOptions(
        accumulate=accumulate, precision=precision, wire=wire, overlap=overlap,
        lr_schedule=lr_schedule, collate_fn=collate_fn, num_workers=num_workers,
        pin_memory=pin_memory, drop_last=drop_last, batch_sampler=batch_sampler,
        planned_samples=max(planned_samples, 1),
    )  # fmt: skip


def check_wire(wire: Any) -> None:
    """Refuse a ``wire`` that is not one of ``WIRES``.

    Raises:
        ConfigError: naming the field and the accepted values.
    """
    if wire not in WIRES:
        accepted = ", ".join(repr(w) for w in WIRES)
        raise ConfigError("wire", f"must be one of {accepted}, got {wire!r}")


def check_picklable(options: TrainOptions) -> None:
    """The options' functions can be sent to rank processes.

    Raises:
        ConfigError: naming the function that cannot be pickled.
    """
    check_sendable(options, ("lr_schedule", "batch_sampler", "collate_fn"))


def check_sendable(holder: object, names: Sequence[str]) -> None:
    """The functions ``holder.<name>`` (those set) can be sent to rank processes.

    Raises:
        ConfigError: naming the first function that cannot be pickled.
    """
    for name in names:
        fn = getattr(holder, name)
        if fn is None:
            continue
        try:
            to_ranks(fn)
        except SEND_ERRORS as exc:
            raise ConfigError(
                name,
                f"{fn!r} cannot be sent to the rank processes ({exc}); define it with def at "
                "the top level of a module (not a lambda or a nested function)",
            ) from None
