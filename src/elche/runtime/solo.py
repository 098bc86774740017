"""One rank: the same API and semantics in-process, with no coordinator.

The epoch order is the same seeded permutation the cluster uses, ``epoch_fn``
runs at the start of each epoch, evals run after every ``eval_every`` epochs
and after the last, and a resumed run trains only the samples its bundle lists
as still to do. It writes the bundles a run of several ranks writes
(``elche.runtime.solo_saves``): every ``checkpoint_every`` epochs, and when
SIGINT, SIGTERM or SIGHUP stops it (between two steps; then ``Interrupted``, as a run
of several ranks raises). A second Ctrl-C stops at once, saving nothing.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from elche.core import messages as m
from elche.core.callbacks import checkpoint_failed_text, eval_failed_text, given_up_text
from elche.core.checkpoint import CheckpointMeta, SaveReason
from elche.core.dispatch import Span
from elche.core.errors import TrainingError
from elche.core.failures import skipped_text
from elche.core.progress import ProgressTracker
from elche.monitor.summary import SUMMARY_FILE
from elche.runtime import bundle
from elche.runtime.current import providing
from elche.runtime.launch import call_hook, interrupted
from elche.runtime.lifetimes import StopSignals
from elche.runtime.loading import Loader, StepPlan
from elche.runtime.pacing import Pacer, pacer_for
from elche.runtime.plan import Hooks, Plan, TrainResult
from elche.runtime.resume import load_bundle
from elche.runtime.shards import epoch_order
from elche.runtime.solo_record import SoloRecord
from elche.runtime.solo_saves import SoloSaves
from elche.runtime.stepping import MicroBatch, Stepper, model_from, optimizer_for
from elche.runtime.user_callbacks import checkpoint, evaluate
from elche.runtime.user_errors import describe
from elche.runtime.worker import UserFns, _with_collate

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
    stepper: Stepper
    loader: Loader
    tracker: ProgressTracker
    pacer: Pacer | None = None
    trained: int = 0
    first_step_s: float | None = None
    eval_metric: float | None = None
    epochs: list[dict[str, object]] = field(default_factory=list)
    record: SoloRecord | None = None  # the run's timeline, when it has a run directory
    batches: int = 0  # this epoch's
    compute_s: float = 0.0  # this epoch's, in the steps, the speed injection's waits excluded
    epoch_trained: int = 0  # samples trained before this epoch
    steps: int = 0  # optimizer steps this run
    holes: dict[int, tuple[Span, ...]] = field(default_factory=dict)  # the resumed bundle's
    saves: SoloSaves | None = None  # None: no save_path and no run directory
    bundles: list[dict[str, object]] = field(default_factory=list)  # those committed
    stop_asked: Callable[[], bool] = lambda: False
    notices: list[str] = field(default_factory=list)  # "level: text", as a cluster's summary
    skipped_steps: int = 0  # steps nonfinite="skip" left out
    skipped_samples: int = 0  # their samples

    def train_epoch(self, epoch: int, spans: Sequence[tuple[int, int]]) -> float | None:
        cfg = self.plan.config
        step = cfg.batch_size  # samples per optimizer step (batch_size × accumulate)
        plan = [
            (epoch, start, min(step, offset + size - start))
            for offset, size in spans
            for start in range(offset, offset + size, step)
        ]
        losses: list[float] = []
        for i, (_, start, size) in enumerate(plan):
            if self.stop_asked():
                raise _Stopped(epoch, [(at, n) for _, at, n in plan[i:]])
            self.first_step_s = self.first_step_s or time.monotonic()
            upcoming = functools.partial(_rest, plan, i)
            value = self.step(self.loader.step(epoch, start, size, upcoming))
            if value is None:  # drop_last left it out
                pass
            elif math.isfinite(value):
                losses.append(value)
            elif cfg.nonfinite == "stop":  # the step was not applied: the model is finite
                rest = [(at, n) for _, at, n in plan[i:]]
                raise _Stopped(epoch, rest, reason=SaveReason.NONFINITE)
            else:
                self.skipped(epoch, size)
            self.trained += size
            self.tracker.trained(size)
        return sum(losses) / len(losses) if losses else None

    def step(self, micro: list[MicroBatch]) -> float | None:
        if not micro:
            return None
        started_s = time.monotonic()
        injected_s = self.pacer.injected_s if self.pacer is not None else 0.0
        self.batches += 1
        self.steps += 1
        try:
            return self._step(micro)
        finally:
            waited_s = (self.pacer.injected_s if self.pacer is not None else 0.0) - injected_s
            self.compute_s += max(time.monotonic() - started_s - waited_s, 0.0)

    def _step(self, micro: list[MicroBatch]) -> float:
        value = self.stepper.step(micro)
        if self.pacer is not None:
            self.pacer.after_step()
        return value

    def skipped(self, epoch: int, size: int) -> None:
        """``nonfinite="skip"`` left out a step of ``size`` samples in ``epoch``."""
        self.skipped_steps += 1
        self.skipped_samples += size
        text = skipped_text(0, epoch, self.skipped_steps)  # the first and every hundredth
        if text is not None:
            self.notice("warning", text)

    def notice(self, level: str, text: str) -> None:
        """Say ``text`` on stderr and keep it for the summary, as a cluster's coordinator does."""
        self.notices.append(f"{level}: {text}")
        print(f"elche [{level}] {text}", file=sys.stderr, flush=True)

    def begin_epoch(self, epoch: int) -> None:
        self.batches, self.compute_s, self.epoch_trained = 0, 0.0, self.trained
        if self.record is not None:
            self.record.epoch_started(epoch)

    def end_epoch(self, epoch: int, loss: float | None) -> None:
        if self.record is not None:
            self.record.epoch_ended(
                epoch, loss=loss, lr=self.stepper.lr,
                batches=self.batches, samples=self.trained - self.epoch_trained,
                compute_s=self.compute_s,
            )  # fmt: skip

    def save(self, reason: SaveReason, epoch: int, holes: dict[int, tuple[Span, ...]]) -> str:
        """Write a bundle (``SoloSaves.save``); what went wrong, or "" once it is committed."""
        if self.saves is None:
            return "the run has no save_path and no run directory to write it in"
        try:
            seq = self.saves.save(
                self.model, self.optimizer, reason=reason, epoch=epoch, holes=holes,
                steps=self.steps,
            )  # fmt: skip
        except (OSError, RuntimeError) as exc:  # torch.save: RuntimeError on a full disk
            what = "checkpoint" if reason is SaveReason.CHECKPOINT else "bundle"
            error = f"the {what} could not be written (rank 0: {type(exc).__name__}: {exc})"
            if reason is SaveReason.CHECKPOINT:  # a stop's error says it itself
                print(f"elche: {error}; training goes on", file=sys.stderr, flush=True)
            return error
        stem = self.saves.stem
        self.bundles.append({"stem": stem, "seq": seq, "reason": reason.value})
        if self.record is not None:
            self.record.saved(stem, seq, reason.value)
        return ""

    def save_stopped(self, stop: _Stopped) -> str:
        """The bundle of a run ``stop`` ended (``save``)."""
        return self.save(stop.reason, stop.epoch, {**self.holes, stop.epoch: stop.rest})

    def after_epoch(
        self, epoch: int, loss: float | None, hooks: Hooks, *, samples: int, span_s: float
    ) -> None:
        cfg = self.plan.config
        done_samples = (epoch + 1) * cfg.num_samples
        record: dict[str, object] = {
            "epoch": epoch, "loss": loss, "syncs": 0, "lr": self.stepper.lr,
            "progress": {
                "samples": done_samples, "step": done_samples // cfg.batch_size,
                "fraction": (epoch + 1) / cfg.epochs,
            },
            "per_rank": [{
                "rank": 0, "samples": samples, "loss": loss, "share": 1.0,
                "samples_per_s": round(samples / span_s, 2) if span_s > 0 else 0.0,
            }],
        }  # fmt: skip
        done = epoch + 1
        if self.fns.eval_fn is not None and (done % cfg.eval_every == 0 or done == cfg.epochs):
            metric = self.evaluate(done)
            if metric is not None:
                record["eval"] = metric
                if hooks.eval_result_fn is not None:  # numbered as metrics_fn numbers epochs
                    call_hook("eval_result_fn", hooks.eval_result_fn, epoch, metric)
        every = cfg.checkpoint_every
        if every and done % every == 0:
            self.checkpoint(done)
            # The last epoch's too, as several ranks save it: a resume for more epochs
            # goes on from it (from the one before, it trained the last epoch again).
            self.save(SaveReason.CHECKPOINT, done, self.holes)
        self.epochs.append(record)
        if hooks.metrics_fn is not None:
            call_hook("metrics_fn", hooks.metrics_fn, record)

    def evaluate(self, done: int) -> float | None:
        """Run ``eval_fn`` after ``done`` epochs; its metric, or None when it failed (said,
        and training goes on, as on several ranks: ``elche.core.callbacks``)."""
        started_s = time.monotonic()
        metric, error = evaluate(self.fns.eval_fn, self.fns.eval_dataset, self.model)
        duration_ms = 1000 * (time.monotonic() - started_s)
        if error is not None:
            self.notice("error", eval_failed_text(0, done, error))
            if self.record is not None:
                self.record.eval_failed(done, error, duration_ms)
            return None
        self.eval_metric = metric
        if self.record is not None:
            self.record.evaluated(done, metric, duration_ms)
        return metric

    def checkpoint(self, version: int) -> None:
        """Run ``checkpoint_fn`` for ``version``; a failure is said and the version dropped
        (no other rank can retry it), and training goes on."""
        if self.fns.checkpoint_fn is None:
            return
        started_s = time.monotonic()
        error = checkpoint(self.fns.checkpoint_fn, version, self.model)
        if self.record is not None:
            self.record.checkpoint_ran(version, error, 1000 * (time.monotonic() - started_s))
        if error is not None:
            self.notice("error", checkpoint_failed_text(version, 0, error))
            self.notice("error", given_up_text(version))


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
    record = None if run_dir is None else SoloRecord(
        plan, Path(run_dir), dashboard=dashboard, tensorboard_dir=tensorboard_dir
    )  # fmt: skip
    with StopSignals() as signals:
        try:
            result = _train_solo(plan, fns, hooks, signals, max_grad_norm=max_grad_norm,
                                 run_dir=run_dir, record=record)  # fmt: skip
        except BaseException as exc:
            if record is not None:
                reason = f"{type(exc).__name__}: {exc}"
                record.ended(outcome="failed", reason=reason, epochs=0, samples=0)
            raise
    if record is not None:
        _end_record(record, result.summary, record.run_dir)
    if signals.received is not None and result.summary["outcome"] != "completed":
        bundle_stem = result.summary["bundle"]
        raise interrupted(
            signals.received, result, str(bundle_stem) if bundle_stem else None,
            resumed_from=plan.resume_from,
        )  # fmt: skip
    return result


def _end_record(record: SoloRecord, summary: dict[str, object], run_dir: Path) -> None:
    """End the timeline, write the report, keep the summary (naming both)."""
    summary["run_dir"] = str(run_dir)
    summary["report"] = record.ended(
        outcome=str(summary["outcome"]), reason=str(summary["reason"]),
        epochs=int(summary["epochs_completed"]),  # type: ignore[call-overload]  # JSON-shaped
        samples=int(summary["per_rank"][0]["samples"]),  # type: ignore[index]  # JSON-shaped
        skipped=(int(summary["skipped_steps"]), int(summary["skipped_samples"])),  # type: ignore[call-overload]  # JSON-shaped
    )  # fmt: skip
    _keep_summary(run_dir, summary)


def _keep_summary(run_dir: Path, summary: dict[str, object]) -> None:
    """``RUN_DIR/summary.json``, as a run of several ranks leaves one; a failure is said:
    the run's result does not depend on it."""
    text = json.dumps(summary, indent=2, default=str).encode()
    try:
        bundle.write_file(run_dir / SUMMARY_FILE, lambda f: f.write(text), kind="summary")
    except OSError as exc:
        print(f"elche: no {SUMMARY_FILE} for this run ({exc})", file=sys.stderr, flush=True)


def _train_solo(
    plan: Plan,
    fns: UserFns,
    hooks: Hooks,
    signals: StopSignals,
    *,
    max_grad_norm: float | None,
    run_dir: str | None,
    record: SoloRecord | None = None,
) -> TrainResult:
    """The run; a stop signal ends it between two steps, its bundle saved."""
    t0 = time.monotonic()
    device = torch.device(plan.devices[0])
    model = _user(0, lambda: model_from(fns.model_fn, device))
    optimizer = _user(0, lambda: optimizer_for(fns.optimizer_fn, model))
    solo = _solo(plan, fns, model, optimizer, max_grad_norm)
    solo.record = record
    solo.stop_asked = lambda: signals.received is not None
    with providing(solo.tracker.now):
        try:
            _train(solo, hooks, run_dir)
        except _Stopped as stop:
            if stop.reason is SaveReason.NONFINITE:
                raise _nonfinite(solo, stop) from None
            return _stopped(solo, stop, t0, run_dir)
    return _result(solo, t0, run_dir)


class _Stopped(BaseException):  # not an Exception: it passes the user's code (``_user``)
    """The run stops for ``reason`` (a stop signal, or a non-finite loss); ``rest`` of
    ``epoch`` is still to train."""

    def __init__(
        self, epoch: int, rest: list[Span], *, reason: SaveReason = SaveReason.GRACEFUL_SHUTDOWN
    ) -> None:
        super().__init__(epoch)
        self.epoch, self.rest, self.reason = epoch, tuple(rest), reason


def _stopped(solo: _Solo, stop: _Stopped, t0: float, run_dir: str | None) -> TrainResult:
    """Save the stopped run's bundle; its result (``saved_and_shutdown``, or ``failed``)."""
    reason = stop.reason
    error = solo.save_stopped(stop)
    result = _result(solo, t0, run_dir)
    result.summary.update(
        outcome="failed" if error else "saved_and_shutdown",
        reason=f"{reason.value}: {error}" if error else reason.value,
        epochs_completed=stop.epoch,
        bundle=None if error else solo.bundles[-1]["stem"],
    )  # fmt: skip
    return result


def _solo(
    plan: Plan,
    fns: UserFns,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
) -> _Solo:
    cfg, options = plan.config, fns.options
    device = torch.device(plan.devices[0])
    tracker = ProgressTracker(
        planned_samples=options.planned_samples, reference_batch=cfg.batch_size, world_size=1
    )
    stepper = Stepper(
        model, optimizer, fns.step_fn, device=device, max_grad_norm=max_grad_norm,
        options=options, progress=tracker.now,
    )  # fmt: skip
    perms: dict[int, Sequence[int]] = {}

    def perm(epoch: int) -> Sequence[int]:
        if epoch not in perms:
            perms.clear()
            perms[epoch] = epoch_order(
                fns.dataset, seed=cfg.seed, epoch=epoch, order=cfg.order,
                num_samples=cfg.num_samples,
            )  # fmt: skip
        return perms[epoch]

    loader = Loader(
        fns.dataset, _with_collate(options, fns.collate_fn),
        micro_size=cfg.batch_size // options.accumulate, step_size=cfg.batch_size, perm=perm,
        device=device,
    )  # fmt: skip
    return _Solo(plan, fns, model, optimizer, device, stepper, loader, tracker)


def _train(solo: _Solo, hooks: Hooks, run_dir: str | None) -> None:
    plan, model = solo.plan, solo.model
    cfg = plan.config
    meta = _resume(solo, plan.resume_from)
    start_epoch = meta.epoch if meta is not None else 0
    stem = cfg.save_path or (str(Path(run_dir) / "checkpoint") if run_dir is not None else None)
    solo.saves = SoloSaves(stem, cfg, meta) if stem is not None else None
    _user(start_epoch, solo.stepper.apply_schedule)  # the first step's lr, for the warm-up too
    first = _user(0, lambda: solo.loader.direct(0, 0, min(cfg.batch_size, cfg.num_samples)))
    solo.pacer = _user(0, lambda: pacer_for(
        model, solo.optimizer, solo.stepper.loss, first, speed=plan.speeds[0],
        base_s=plan.speed_base_s,
    ))  # fmt: skip
    try:
        _epochs(solo, hooks, start_epoch)
    finally:
        solo.loader.close()
    # The progress is the plan's end: the optimizer ends at the schedule's last value.
    solo.tracker.finished()
    _user(cfg.epochs - 1, solo.stepper.apply_schedule)


def _epochs(solo: _Solo, hooks: Hooks, start_epoch: int) -> None:
    cfg, fns, model, holes = solo.plan.config, solo.fns, solo.model, solo.holes
    for epoch in range(start_epoch, cfg.epochs):
        if solo.stop_asked():
            raise _Stopped(epoch, list(holes.get(epoch, ((0, cfg.num_samples),))))
        solo.begin_epoch(epoch)
        if fns.epoch_fn is not None:
            epoch_fn = fns.epoch_fn
            _user(epoch, lambda: epoch_fn(epoch, model, solo.optimizer))  # noqa: B023  # called at once
        spans = holes.get(epoch, ((0, cfg.num_samples),))
        began_s, before = time.monotonic(), solo.trained
        loss = _user(epoch, lambda: solo.train_epoch(epoch, spans))  # noqa: B023  # called at once
        span_s = time.monotonic() - began_s
        solo.end_epoch(epoch, loss)
        solo.after_epoch(epoch, loss, hooks, samples=solo.trained - before, span_s=span_s)


def _result(solo: _Solo, t0: float, run_dir: str | None) -> TrainResult:
    plan, model, cfg = solo.plan, solo.model, solo.plan.config
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
        "eval": solo.eval_metric,
        "syncs": 0,
        "lost_samples": 0,
        "skipped_steps": solo.skipped_steps,
        "skipped_samples": solo.skipped_samples,
        "dead_ranks": [],
        "outcome": "completed",
        "reason": "",
        "bundle": solo.bundles[-1]["stem"] if solo.bundles else None,  # as with more ranks
        "bundles": solo.bundles,
        "notices": solo.notices,
        "per_rank": [
            {"rank": 0, "speed": plan.speeds[0], "samples": solo.trained, "idle_s": 0.0,
             "lr": solo.stepper.lr}
        ],
    }  # fmt: skip
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return TrainResult(state_dict=state, epochs=solo.epochs, summary=summary, run_dir=run_dir)


def _rest(plan: list[StepPlan], first: int) -> list[StepPlan]:
    return plan[first:]


def _nonfinite(solo: _Solo, stop: _Stopped) -> TrainingError:
    """The error a non-finite loss ends the run with, once its bundle is saved (if it can be)."""
    error = solo.save_stopped(stop)
    held = "the bundle holds" if not error else f"no bundle ({error}); the model is"
    return TrainingError(
        rank=0, epoch=stop.epoch, error_type="NonFiniteLoss",
        message=f"the loss is not finite on rank 0 in epoch {stop.epoch}; {held} the last "
        "finite step (nonfinite='skip' skips such steps instead)",
        bundle=None if error else str(solo.bundles[-1]["stem"]),
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


def _resume(solo: _Solo, stem: str | None) -> CheckpointMeta | None:
    """Load a bundle and take its holes (``solo.holes``); its meta (None: a fresh run)."""
    if stem is None:
        return None
    meta = load_bundle(
        stem, solo.model, solo.optimizer, rank=0, world_size=1, device=solo.device,
        seq=solo.plan.resume_seq,
    )  # fmt: skip
    holes = solo.holes = {c.epoch: c.uncovered for c in meta.coverage}
    cfg = solo.plan.config
    to_do = sum(
        sum(size for _, size in holes[e]) if e in holes else cfg.num_samples
        for e in range(meta.epoch, cfg.epochs)
    )
    done = cfg.epochs * cfg.num_samples - to_do
    solo.tracker.confirmed(m.GlobalProgress(round=0, samples=done, share=1.0))
    return meta
