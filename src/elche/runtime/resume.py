"""Checking a bundle before a resume starts anything.

A resume that cannot continue exactly must fail at once, in the process that
called ``elche.train``, with a ``ConfigError`` naming the field and both
values, not after every rank started. ``check_resume`` reads the meta, checks
it fits the run (seed, batch size, mode, world size, dataset size:
``CheckpointMeta.check_fits``), checks each file the meta names is the one it
was written with (size and SHA-256), checks the saved model has the keys
and shapes of the model ``model_fn`` builds, and checks the saved optimizer
state loads into the optimizer ``optimizer_fn`` makes with every
hyperparameter it uses (a bundle of another optimizer class lacks some:
SGD's groups have no ``betas`` for Adam, which failed in the rank's first
step).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from elche.core.checkpoint import CheckpointMeta
from elche.core.config import CoordinatorConfig
from elche.core.errors import ConfigError
from elche.runtime import bundle
from elche.runtime.stepping import model_from

__all__ = ["check_resume", "load_bundle"]

# Keys named in a mismatch message, at most.
_SHOWN = 5


def check_resume(
    stem: str,
    config: CoordinatorConfig,
    model_fn: Callable[[Any], torch.nn.Module],
    optimizer_fn: Callable[[Any], torch.optim.Optimizer],
    *,
    accumulate: int = 1,
    say: bool = True,
) -> CheckpointMeta:
    """The meta of the bundle at ``stem``, once it is known to resume ``config``;
    with ``say``, a line for each way the resumed ranks differ from the saved ones.

    ``accumulate`` is the run's (``config.batch_size`` counts it in); a
    batch size mismatch names it.

    Raises:
        ConfigError: no readable meta (naming it), a mismatch with the run, a
            file that is missing, unreadable or changed, a model of other keys or shapes, or an
            optimizer state that does not fit ``optimizer_fn``'s optimizer.
    """
    where = bundle.meta_path(stem)
    try:
        text = where.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("resume_from", f"no checkpoint meta at {where}: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError("resume_from", f"{where} is not a checkpoint meta (not text)") from None
    try:
        meta = CheckpointMeta.from_json(text)
    except ConfigError as exc:  # truncated, edited, of a newer elche: which file it is
        raise ConfigError(exc.field, f"{exc.message} (in {where})") from None
    meta.check_fits(config, accumulate=accumulate)
    paths = bundle.locate(stem, meta, config.world_size)
    if meta.files is not None:
        bundle.verify(paths.model, meta.files.model, what="model")
        for rank, saved in meta.files.optim:
            bundle.verify(paths.optim[rank], saved, what=f"rank {rank} optimizer state")
        if meta.files.outer is not None and paths.outer is not None:
            bundle.verify(paths.outer, meta.files.outer, what="outer momentum")
    elif not paths.model.exists():
        raise ConfigError("resume_from", f"the bundle's model {paths.model} is missing")
    if say:
        _say_what_resumes(meta, config, sorted(paths.optim))
    model = model_from(model_fn, torch.device("cpu"))
    _check_model(paths.model, model)
    used = [rank for rank in sorted(paths.optim) if rank < config.world_size]
    if used:  # every rank's state came from one optimizer_fn: the first tells
        kept = _check_optimizer(paths.optim[used[0]], model, optimizer_fn)
        if say and kept:
            print(
                f"elche: resuming: the bundle's optimizer state keeps its own {'; '.join(kept)}"
                ": loading it restores them (an epoch_fn can set them)",
                file=sys.stderr, flush=True,
            )  # fmt: skip
    return meta


def _say_what_resumes(meta: CheckpointMeta, config: CoordinatorConfig, saved: list[int]) -> None:
    """One line for each way the resumed run differs from the saved one."""
    lines = []
    if meta.epoch >= config.epochs:  # allowed (docs/failure-modes.md), but not unsaid
        lines.append(
            f"the bundle has {meta.epoch} epoch(s) trained and this run has epochs="
            f"{config.epochs}: nothing is left to train, so the run completes at once "
            f"(epochs={meta.epoch + 1} or more trains on)"
        )
    world_size = config.world_size
    if meta.world_size != world_size:
        lines.append(
            f"the bundle was saved by {meta.world_size} ranks and resumes on {world_size}: "
            "every rank starts from its model, the balancer measures the ranks afresh, and "
            f"rank r takes rank r's optimizer state where the bundle has one"
        )
        ignored = [r for r in saved if r >= world_size]
        if ignored:
            lines.append(f"the optimizer states of ranks {ignored} are not used")
    fresh = [r for r in range(world_size) if r not in saved]
    if fresh:
        lines.append(f"rank(s) {fresh} have no optimizer state in the bundle: theirs starts fresh")
    for line in lines:
        print(f"elche: resuming: {line}", file=sys.stderr, flush=True)


def load_bundle(
    stem: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    seq: int | None = None,
) -> CheckpointMeta:
    """Load the bundle's model, and rank ``rank``'s optimizer state if it has one.

    The files were checked by ``check_resume`` before the run started, at save
    ``seq`` (``Plan.resume_seq``): the one the coordinator plans from.

    Raises:
        ConfigError: another run committed a newer save at ``stem`` since.
    """
    meta = CheckpointMeta.from_json(bundle.meta_path(stem).read_text(encoding="utf-8"))
    bundle.check_unchanged(stem, meta, seq)
    paths = bundle.locate(stem, meta, world_size)
    model.load_state_dict(torch.load(paths.model, map_location=device))
    optim = paths.optim.get(rank)
    if optim is not None:
        optimizer.load_state_dict(torch.load(optim, map_location=device))
    return meta


def _check_model(path: Any, model: torch.nn.Module) -> None:
    try:
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # a truncated or foreign file: torch says which way
        raise ConfigError("resume_from", f"cannot read the bundle's model {path}: {exc}") from None
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in saved.items()}
    problems = [f"missing {k}" for k in sorted(want.keys() - have.keys())]
    problems += [f"unexpected {k}" for k in sorted(have.keys() - want.keys())]
    problems += [
        f"{k}: saved {have[k]}, model_fn builds {want[k]}"
        for k in sorted(want.keys() & have.keys())
        if have[k] != want[k]
    ]
    if problems:
        more = f" and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise ConfigError(
            "resume_from",
            f"the bundle's model {path} does not fit model_fn's model: "
            + "; ".join(problems[:_SHOWN])
            + more,
        )


def _check_optimizer(
    path: Any, model: torch.nn.Module, optimizer_fn: Callable[[Any], torch.optim.Optimizer]
) -> list[str]:
    """The state at ``path`` loads into ``optimizer_fn``'s optimizer of ``model`` and
    gives each param group every key the optimizer's own groups have; returns the
    hyperparameters it sets to other values than ``optimizer_fn`` does (torch's
    ``load_state_dict`` restores them: another ``lr`` would otherwise go unsaid).

    The keys are compared after the load, which fills in the defaults of keys
    newer torch versions added (each optimizer's ``__setstate__``), so only a
    hyperparameter the optimizer would miss in its step refuses. The optimizer
    gets its own state back (``optimizer_fn`` may hand out one it keeps:
    ``elche.Session``'s).

    Raises:
        ConfigError: an unreadable file, other param groups or sizes, or a
            group that lacks a key the optimizer uses.
    """
    try:
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # a truncated or foreign file: torch says which way
        raise ConfigError(
            "resume_from", f"cannot read the bundle's optimizer state {path}: {exc}"
        ) from None
    optimizer = optimizer_fn(model.parameters())
    misfit = f"the bundle's optimizer state {path} does not fit the {type(optimizer).__name__} "
    misfit += "optimizer_fn makes"
    own = optimizer.state_dict()
    wanted = [set(group) for group in optimizer.param_groups]
    try:
        optimizer.load_state_dict(saved)
        loaded = [set(group) for group in optimizer.param_groups]
        kept = _kept(own["param_groups"], optimizer.param_groups)
    except (KeyError, TypeError, ValueError) as exc:  # other groups or sizes: torch says which
        raise ConfigError("resume_from", f"{misfit}: {exc}") from None
    finally:
        optimizer.load_state_dict(own)
    for index, (want, have) in enumerate(zip(wanted, loaded, strict=True)):
        missing = sorted(want - have)
        if missing:
            unused = sorted(have - want - {"initial_lr"})  # initial_lr: lr_schedule's base
            raise ConfigError(
                "resume_from",
                f"{misfit}: its param group {index} has no {', '.join(missing)}"
                + (f" (it has {', '.join(unused)} instead)" if unused else "")
                + "; was it saved with another optimizer? Resume with the optimizer_fn "
                "of the run that saved it",
            )
    return kept


def _kept(made: list[dict[str, Any]], loaded: list[dict[str, Any]]) -> list[str]:
    """``key=saved (optimizer_fn makes made)`` for each hyperparameter that differs;
    the saved ``lr`` is the group's base rate (``initial_lr``: an ``lr_schedule``
    scales it, so the saved ``lr`` is only where the schedule was)."""
    several = len(made) > 1
    kept = []
    for index, (mine, theirs) in enumerate(zip(made, loaded, strict=True)):
        for key in sorted(mine.keys() & theirs.keys() - {"params", "initial_lr"}):
            saved = theirs.get("initial_lr", theirs[key]) if key == "lr" else theirs[key]
            if _differs(mine[key], saved):
                where = f" of param group {index}" if several else ""
                kept.append(f"{key}={saved!r}{where} (optimizer_fn makes {mine[key]!r})")
    return kept


def _differs(mine: object, saved: object) -> bool:
    """Whether two hyperparameters differ; False where they cannot be told apart
    plainly (tensors of several elements, as some optimizers keep)."""
    try:
        return bool(mine != saved)
    except (RuntimeError, TypeError, ValueError):  # a tensor's truth is ambiguous
        return False
