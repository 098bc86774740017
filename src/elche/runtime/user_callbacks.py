"""The user's ``eval_fn`` and ``checkpoint_fn`` run on a rank: a failure is an answer.

Theory of operation. A callback that raises, or an ``eval_fn`` that returns
something other than a number, must not end the rank: these functions catch
it and return its one-line account (``"TypeError: ..."``). A rank of several
(``elche.runtime.worker``) sends that answer to the coordinator, which logs
it and goes on (``elche.core.callbacks``); one rank (``elche.runtime.solo``)
logs it itself, in the coordinator's words, and goes on the same way.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["checkpoint", "evaluate", "metric_of", "number_of"]


def number_of(value: object) -> float | None:
    """A user function's return value as a float (a number, a one-element tensor, a
    NumPy scalar); None when it is none (a dict, a string, None, a tensor of several)."""
    if isinstance(value, str | bytes):
        return None
    try:
        return float(value)  # type: ignore[arg-type]  # anything with __float__ is a number
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several
        return None


def metric_of(value: object) -> float:
    """``eval_fn``'s return value as a float (``number_of``).

    Raises:
        TypeError: ``value`` is not a number, named in the message.
    """
    number = number_of(value)
    if number is not None:
        return number
    shown = "None" if value is None else f"a {type(value).__name__} ({reprlib.repr(value)})"
    raise TypeError(f"eval_fn returned {shown}, not a number")


def evaluate(
    eval_fn: Callable[[nn.Module, Any], object] | None, dataset: object, model: nn.Module
) -> tuple[float, str | None]:
    """Run ``eval_fn(model, dataset)`` in eval mode without gradients; the model is left
    in training mode.

    Returns:
        ``(metric, None)``, or ``(nan, error)`` when it raised, returned no number,
        or there is no ``eval_fn``.
    """
    try:
        if eval_fn is None:
            raise RuntimeError("no eval_fn on this rank")
        model.eval()
        with torch.no_grad():
            return metric_of(eval_fn(model, dataset)), None
    except Exception as exc:  # a user callback failing must not end the rank
        return math.nan, _account(exc)
    finally:
        model.train()


def checkpoint(
    checkpoint_fn: Callable[[int, nn.Module], object] | None, version: int, model: nn.Module
) -> str | None:
    """Run ``checkpoint_fn(version, model)`` (if any); the error it raised, or None."""
    try:
        if checkpoint_fn is not None:
            checkpoint_fn(version, model)
    except Exception as exc:  # a user callback failing must not end the rank
        return _account(exc)
    return None


def _account(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"
