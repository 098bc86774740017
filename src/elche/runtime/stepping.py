"""One optimizer step, the same on every rank and in the single-rank path.

A step is ``accumulate`` micro-batches (the last step of a chunk may have
fewer, or a short last one): each micro-batch's loss is weighted by its
share of the step's samples before ``backward``, so for a mean-reduced loss
the gradient is the one of the step's samples as one batch. The forward
(``step_fn``) runs under ``torch.autocast`` when ``precision`` is ``bf16`` or
``fp16``; ``fp16`` on CUDA also scales the loss (``torch.amp.GradScaler``),
which skips a step whose gradients overflowed, as its documentation says.

Before every step ``lr_schedule`` (if given) sets each param group's
learning rate to its base rate times ``lr_schedule(progress)``, where
``progress`` is the run's global progress (``elche.core.progress``). The
base rate is kept in the group as ``initial_lr`` (as ``LambdaLR`` keeps it),
so a resumed optimizer, whose state carries it, scales from the same base.

A NaN or infinite loss in any micro-batch leaves the step out: the gradients
are cleared and the optimizer does not step.

The user's mistakes that torch would report as elche's own (an
``AttributeError`` in elche's frames, which the rank's report leaves out) are
named here: a ``step_fn`` (or ``session.step``) given something other than a
tensor (``loss_of``), and an ``optimizer_fn`` that returns no optimizer, or one
over none of the model's parameters, which would train nothing (``optimizer_for``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import reprlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from elche.core.progress import Progress
from elche.runtime.handoff import is_handoff
from elche.runtime.options import TrainOptions
from elche.runtime.user_callbacks import number_of

__all__ = ["MicroBatch", "Stepper", "loss_of", "model_from", "optimizer_for", "schedule_factor"]


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch: the collated batch on the device and its number of samples."""

    batch: Any
    size: int


def schedule_factor(value: Any) -> float:
    """What ``lr_schedule`` returned, as the factor of each group's base lr.

    A tensor or NumPy number of one element counts as its number.

    Raises:
        ValueError: naming ``lr_schedule`` and ``value``, when that is not a
            finite number >= 0: a negative factor turns every step around (the
            model ascends its loss) and a NaN one poisons the parameters.
    """
    factor = number_of(value)
    if factor is None or not (math.isfinite(factor) and factor >= 0):
        raise ValueError(
            f"lr_schedule returned {value!r}; it must return a finite number >= 0 "
            "(the factor of each param group's base lr)"
        )
    return factor


def loss_of(value: object, step_fn: Callable[..., Any]) -> torch.Tensor:
    """What ``step_fn`` returned, as the loss to backpropagate.

    Raises:
        TypeError: ``value`` is not a tensor (a float from ``.item()``, a tuple,
            None), named with ``step_fn`` (``session.step`` for a Session's loop).
    """
    if isinstance(value, torch.Tensor):
        return value
    who = "session.step was given" if is_handoff(step_fn) else "step_fn returned"
    shown = "None" if value is None else f"a {type(value).__name__} ({reprlib.repr(value)})"
    raise TypeError(
        f"{who} {shown}; it takes the loss as a tensor (one element, computed "
        "with gradients), whose backward trains the model"
    )


# What elche uses of an optimizer.
OPTIMIZER_INTERFACE = ("step", "zero_grad", "param_groups", "state_dict", "load_state_dict")


def model_from(model_fn: Callable[[torch.device], Any], device: torch.device) -> nn.Module:
    """``model_fn(device)``, checked to be a model.

    Raises:
        TypeError: it returned something else (a tuple, its state dict, None).
        Exception: whatever ``model_fn`` raises.
    """
    model = model_fn(device)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model_fn returned {reprlib.repr(model)}, not a torch.nn.Module "
            "(model_fn(device) -> the model, on that device)"
        )
    return model


def optimizer_for(optimizer_fn: Callable[..., Any], model: nn.Module) -> torch.optim.Optimizer:
    """``optimizer_fn(model.parameters())``, checked to step some of ``model``'s parameters.

    An optimizer is a ``torch.optim.Optimizer`` or one with its interface
    (``OPTIMIZER_INTERFACE``, as some libraries' wrappers are): elche steps it,
    schedules its groups' learning rates and saves its state.

    Raises:
        TypeError: it returned no optimizer.
        ValueError: its optimizer holds none of ``model``'s parameters (built
            over another model): its steps would leave the model as it was.
        Exception: whatever ``optimizer_fn`` raises.
    """
    optimizer: torch.optim.Optimizer = optimizer_fn(model.parameters())  # or its like
    if not all(hasattr(optimizer, name) for name in OPTIMIZER_INTERFACE):
        raise TypeError(
            f"optimizer_fn returned {reprlib.repr(optimizer)}, not a torch.optim.Optimizer "
            "(optimizer_fn(params) -> an optimizer over those params)"
        )
    own = {id(p) for p in model.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(id(p) in own for p in held):
        raise ValueError(
            f"optimizer_fn returned an optimizer over {len(held)} tensor(s), none of them the "
            "model's parameters: its steps would not train the model. Build it over the "
            "params optimizer_fn(params) is given (a Session's optimizer: over the session "
            "model's parameters)"
        )
    return optimizer


class Stepper:
    """Runs optimizer steps for one rank (see the module docstring).

    Args:
        model: the rank's model.
        optimizer: its optimizer; each group's current ``lr`` becomes its
            base rate unless the group already has an ``initial_lr``.
        step_fn: ``step_fn(model, batch) -> loss``.
        device: where the model lives (autocast's device type).
        max_grad_norm: clip the gradients' norm to this (None: no clipping).
        options: accumulate, precision and lr_schedule.
        progress: the run's global progress now (for ``lr_schedule``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        step_fn: Callable[[nn.Module, Any], torch.Tensor],
        *,
        device: torch.device,
        max_grad_norm: float | None,
        options: TrainOptions,
        progress: Callable[[], Progress],
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.step_fn = step_fn
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.options = options
        self.progress = progress
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(options.precision)
        self._autocast_dtype = dtype
        self.scaler: torch.amp.GradScaler | None = None
        if options.precision == "fp16" and device.type == "cuda":
            self.scaler = torch.amp.GradScaler("cuda")
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group.get("lr"))

    @property
    def lr(self) -> float | None:
        """The first param group's learning rate now."""
        lr = self.optimizer.param_groups[0].get("lr")
        return float(lr) if isinstance(lr, int | float) else None

    def apply_schedule(self) -> None:
        """Set every group's lr to ``initial_lr × lr_schedule(progress)`` (if scheduled).

        Raises:
            ValueError: ``lr_schedule`` returned no finite number >= 0
                (``schedule_factor``); the lrs are left as they were.
            Exception: whatever ``lr_schedule`` raises.
        """
        schedule = self.options.lr_schedule
        if schedule is None:
            return
        factor = schedule_factor(schedule(self.progress()))
        for group in self.optimizer.param_groups:
            base = group.get("initial_lr")
            if isinstance(base, int | float):
                group["lr"] = base * factor

    @contextlib.contextmanager
    def _forward(self) -> Iterator[None]:
        if self._autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self._autocast_dtype):
            yield

    def loss(self, model: nn.Module, micro: Sequence[MicroBatch]) -> torch.Tensor:
        """The step's loss over ``micro`` as one batch (for the pacer's timing)."""
        total = sum(mb.size for mb in micro)
        with self._forward():
            losses = [loss_of(self.step_fn(model, mb.batch), self.step_fn) for mb in micro]
        if len(losses) == 1:
            return losses[0]  # as step_fn made it (a non-scalar loss fails as it would)
        weighted = [loss * (mb.size / total) for loss, mb in zip(losses, micro, strict=True)]
        return functools.reduce(operator.add, weighted)

    def step(self, micro: Sequence[MicroBatch]) -> float:
        """One optimizer step over ``micro``; returns the step's loss (NaN/inf: not applied).

        Raises:
            Exception: whatever the user's ``step_fn``, ``lr_schedule`` or the
                optimizer raise.
        """
        self.apply_schedule()
        self.optimizer.zero_grad(set_to_none=True)
        total = sum(mb.size for mb in micro)
        value = 0.0
        for mb in micro:
            with self._forward():
                loss = loss_of(self.step_fn(self.model, mb.batch), self.step_fn)
            part = float(loss.detach())
            if not math.isfinite(part):
                self.optimizer.zero_grad(set_to_none=True)
                return part  # the step is not applied
            weighted = loss * (mb.size / total)
            value += part * mb.size / total
            scaled = weighted if self.scaler is None else self.scaler.scale(weighted)
            scaled.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        self._apply()
        return value

    def _apply(self) -> None:
        params = self.model.parameters()
        if self.scaler is None:
            if self.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            self.optimizer.step()
            return
        if self.max_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
