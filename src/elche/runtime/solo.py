"""One rank: the same API and semantics in-process, with no coordinator.

The epoch order is the same seeded permutation the cluster uses, ``epoch_fn``
runs at the start of each epoch, evals run after every ``eval_every`` epochs
and after the last, and a resumed run trains only the samples its bundle lists
as still to do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from elche.core.dispatch import epoch_permutation
from elche.core.errors import TrainingError
from elche.runtime.data import fetch, to_device
from elche.runtime.pacing import Pacer, pacer_for
from elche.runtime.plan import Hooks, Plan, TrainResult
from elche.runtime.resume import load_bundle
from elche.runtime.user_errors import describe
from elche.runtime.worker import UserFns

if TYPE_CHECKING:
    from elche.runtime.solo_record import SoloRecord

__all__ = ["train_solo"]

T = TypeVar("T")


@dataclass(slots=True)
class _Solo:
    """The state of an in-process run."""

    plan: Plan
    fns: UserFns
    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    max_grad_norm: float | None
    pacer: Pacer | None = None
    trained: int = 0
    first_step_s: float | None = None
    eval_metric: float | None = None
    epochs: list[dict[str, object]] = field(default_factory=list)
    record: SoloRecord | None = None  # the run's timeline, when it has a run directory
    batches: int = 0  # this epoch's
    compute_s: float = 0.0  # this epoch's, in the steps, the speed injection's waits excluded
    epoch_trained: int = 0  # samples trained before this epoch

    def batch(self, perm: list[int], positions: range) -> Any:
        indices = [perm[i] for i in positions]
        return to_device(fetch(self.fns.dataset, indices, self.fns.collate_fn), self.device)

    def train_epoch(self, epoch: int, spans: Sequence[tuple[int, int]]) -> float | None:
        cfg = self.plan.config
        perm = epoch_permutation(cfg.num_samples, seed=cfg.seed, epoch=epoch)
        losses: list[float] = []
        for offset, size in spans:
            for start in range(offset, offset + size, cfg.batch_size):
                self.first_step_s = self.first_step_s or time.monotonic()
                stop = min(start + cfg.batch_size, offset + size)
                value = self.step(self.batch(perm, range(start, stop)))
                if math.isfinite(value):
                    losses.append(value)
                elif cfg.nonfinite == "stop":  # the step was not applied: the model is finite
                    raise _nonfinite(epoch)
                self.trained += stop - start
        return sum(losses) / len(losses) if losses else None

    def step(self, batch: Any) -> float:
        started_s = time.monotonic()
        injected_s = self.pacer.injected_s if self.pacer is not None else 0.0
        self.batches += 1
        try:
            return self._step(batch)
        finally:
            waited_s = (self.pacer.injected_s if self.pacer is not None else 0.0) - injected_s
            self.compute_s += max(time.monotonic() - started_s - waited_s, 0.0)

    def _step(self, batch: Any) -> float:
        loss = self.fns.step_fn(self.model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())
        if not math.isfinite(value):
            return value  # a NaN/inf loss: the step is not applied
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        if self.pacer is not None:
            self.pacer.after_step()
        return value

    def begin_epoch(self, epoch: int) -> None:
        self.batches, self.compute_s, self.epoch_trained = 0, 0.0, self.trained
        if self.record is not None:
            self.record.epoch_started(epoch)

    def end_epoch(self, epoch: int, loss: float | None) -> None:
        if self.record is not None:
            lr = self.optimizer.param_groups[0].get("lr") if self.optimizer.param_groups else None
            self.record.epoch_ended(
                epoch, loss=loss, lr=float(lr) if isinstance(lr, int | float) else None,
                batches=self.batches, samples=self.trained - self.epoch_trained,
                compute_s=self.compute_s,
            )  # fmt: skip

    def after_epoch(self, epoch: int, loss: float | None, hooks: Hooks) -> None:
        cfg = self.plan.config
        record: dict[str, object] = {"epoch": epoch, "loss": loss}
        done = epoch + 1
        if self.fns.eval_fn is not None and (done % cfg.eval_every == 0 or done == cfg.epochs):
            started_s = time.monotonic()
            self.model.eval()
            with torch.no_grad():
                self.eval_metric = float(self.fns.eval_fn(self.model, self.fns.eval_dataset))
            self.model.train()
            record["eval"] = self.eval_metric
            if self.record is not None:
                duration_ms = 1000 * (time.monotonic() - started_s)
                self.record.evaluated(done, self.eval_metric, duration_ms)
            if hooks.eval_result_fn is not None:
                hooks.eval_result_fn(done, self.eval_metric)
        every = cfg.checkpoint_every
        if self.fns.checkpoint_fn is not None and every and done % every == 0:
            self.fns.checkpoint_fn(done, self.model)
        self.epochs.append(record)
        if hooks.metrics_fn is not None:
            hooks.metrics_fn(record)


def train_solo(
    plan: Plan,
    fns: UserFns,
    hooks: Hooks,
    *,
    max_grad_norm: float | None,
    run_dir: str | None,
    dashboard: str | None = None,
    tensorboard_dir: str | None = None,
) -> TrainResult:
    """Train on one device in this process; see ``elche.train``.

    With a ``run_dir`` the run writes its timeline there (``SoloRecord``),
    served by the dashboard and the TensorBoard log if asked for, and its
    report at the end (``summary["report"]``).
    """
    if run_dir is None:
        return _train_solo(plan, fns, hooks, max_grad_norm=max_grad_norm, run_dir=None)
    from elche.runtime.solo_record import SoloRecord

    record = SoloRecord(plan, Path(run_dir), dashboard=dashboard, tensorboard_dir=tensorboard_dir)
    try:
        result = _train_solo(plan, fns, hooks, max_grad_norm=max_grad_norm, run_dir=run_dir,
                             record=record)  # fmt: skip
    except BaseException as exc:
        record.ended(outcome="failed", reason=f"{type(exc).__name__}: {exc}", epochs=0, samples=0)
        raise
    summary = result.summary
    summary["run_dir"] = run_dir
    summary["report"] = record.ended(
        outcome="completed", reason="", epochs=plan.config.epochs,
        samples=int(summary["per_rank"][0]["samples"]),  # type: ignore[index]  # JSON-shaped
    )  # fmt: skip
    return result


def _train_solo(
    plan: Plan,
    fns: UserFns,
    hooks: Hooks,
    *,
    max_grad_norm: float | None,
    run_dir: str | None,
    record: SoloRecord | None = None,
) -> TrainResult:
    t0 = time.monotonic()
    cfg = plan.config
    device = torch.device(plan.devices[0])
    model = _user(0, lambda: fns.model_fn(device))
    optimizer = _user(0, lambda: fns.optimizer_fn(model.parameters()))
    solo = _Solo(plan, fns, model, optimizer, device, max_grad_norm, record=record)
    start_epoch, holes = _resume(solo, plan.resume_from)
    perm = epoch_permutation(cfg.num_samples, seed=cfg.seed, epoch=0)
    first = _user(0, lambda: solo.batch(perm, range(min(cfg.batch_size, cfg.num_samples))))
    solo.pacer = _user(0, lambda: pacer_for(
        model, solo.optimizer, fns.step_fn, first, speed=plan.speeds[0], base_s=plan.speed_base_s
    ))  # fmt: skip
    for epoch in range(start_epoch, cfg.epochs):
        solo.begin_epoch(epoch)
        if fns.epoch_fn is not None:
            epoch_fn = fns.epoch_fn
            _user(epoch, lambda: epoch_fn(epoch, model, solo.optimizer))  # noqa: B023  # called at once
        spans = holes.get(epoch, ((0, cfg.num_samples),))
        loss = _user(epoch, lambda: solo.train_epoch(epoch, spans))  # noqa: B023  # called at once
        solo.end_epoch(epoch, loss)
        solo.after_epoch(epoch, loss, hooks)
    end = time.monotonic()
    first_step = solo.first_step_s or end
    wall_s = end - first_step
    summary: dict[str, object] = {
        "mode": cfg.mode.value,
        "world_size": 1,
        "epochs_completed": cfg.epochs,
        "wall_s": round(wall_s, 4),
        "startup_s": round(first_step - t0, 4),
        "samples_per_s": round(solo.trained / wall_s, 2) if wall_s > 0 else 0.0,
        "final_loss": solo.epochs[-1]["loss"] if solo.epochs else None,
        "eval_accuracy": solo.eval_metric,
        "syncs": 0,
        "lost_samples": 0,
        "dead_ranks": [],
        "outcome": "completed",
        "per_rank": [{"rank": 0, "speed": plan.speeds[0], "samples": solo.trained, "idle_s": 0.0}],
    }
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return TrainResult(state_dict=state, epochs=solo.epochs, summary=summary, run_dir=run_dir)


def _nonfinite(epoch: int) -> TrainingError:
    return TrainingError(
        rank=0, epoch=epoch, error_type="NonFiniteLoss",
        message=f"the loss is not finite on rank 0 in epoch {epoch}; the model is the last "
        "finite one (nonfinite='skip' skips such steps instead)",
    )  # fmt: skip


def _user(epoch: int, user_code: Callable[[], T]) -> T:
    """Run the user's code in-process; what it raises becomes a ``TrainingError``.

    The same error the cluster raises, so a script behaves alike on one rank
    and on many (``from`` the user's exception, which is right here).
    """
    try:
        return user_code()
    except TrainingError:
        raise
    except Exception as exc:
        error_type, message, text = describe(exc)
        raise TrainingError(
            rank=0, epoch=epoch, error_type=error_type, message=message, traceback=text
        ) from exc


def _resume(solo: _Solo, stem: str | None) -> tuple[int, dict[int, tuple[tuple[int, int], ...]]]:
    """Load a bundle; returns the epoch to start at and the holes to train."""
    if stem is None:
        return 0, {}
    meta = load_bundle(stem, solo.model, solo.optimizer, rank=0, world_size=1, device=solo.device)
    return meta.epoch, {c.epoch: c.uncovered for c in meta.coverage}
