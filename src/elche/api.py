"""``elche.train``: the public entry point.

Theory of operation. ``train`` validates everything up front (a bad value
raises ``ConfigError`` naming the field and what is accepted), then:

- one rank: trains in-process, no coordinator, same semantics (seeded
  per-epoch permutation, ``epoch_fn`` on epoch start, eval after epochs),
  writing its own timeline in the run directory (``runtime.solo_record``);
- several ranks from a plain script: writes the run directory, starts the
  coordinator as its own process (``python -m elche.runtime.host``, which
  never imports torch), spawns one process per rank, shows progress from the
  coordinator's timeline, and collects the result;
- inside a launcher (``elche run`` or ``torchrun``: ``RANK``/``WORLD_SIZE``
  set): this process *is* one rank. The default process group is formed from
  the environment, global rank 0 starts the coordinator and shares its
  address over the group, and every process trains.

The result carries the final averaged ``state_dict``, per-epoch metrics and a
``summary`` with the keys of the ``elche demo --json`` contract, the same on
every rank under a launcher.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import numbers
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elche._files import check_writable
from elche.core.config import (
    NUMPY_PERMUTATION,
    SHARD_ORDER,
    Backend,
    CallbackPolicy,
    CoordinatorConfig,
    Mode,
    SchedulerConfig,
)
from elche.core.errors import ConfigError
from elche.core.faults import FaultPlan
from elche.core.progress import Progress
from elche.runtime.bundle import meta_path, no_meta
from elche.runtime.frames import COORDINATOR_SENDER
from elche.runtime.options import check_options
from elche.runtime.plan import Hooks, Plan, TrainResult, hold_save_path
from elche.runtime.run_dirs import tidy_run_dir
from elche.runtime.shards import Shards, check_dataset

if TYPE_CHECKING:
    from elche.runtime.worker import UserFns

__all__ = ["TrainResult", "train"]

# Ranks give up on a silent coordinator after this long (reference: 30 s).
COORDINATOR_TIMEOUT_S = 30.0
# Where ``elche run`` passes --tensorboard to its ranks (rank 0 writes the log).
TENSORBOARD_ENV = "ELCHE_TENSORBOARD"
# Ranks that may join a running collective run (``elche join``): a few machines
# coming and going; each slot costs the coordinator a few numbers per collaborator.
JOIN_SLOTS = 8


def train(
    model_fn: Callable[..., Any],
    optimizer_fn: Callable[..., Any],
    step_fn: Callable[..., Any],
    dataset: Any,
    *,
    batch_size: int,
    epochs: int,
    mode: str = "cadence",
    ranks: int | None = None,
    speeds: Sequence[float] | None = None,
    speed_base_s: float | None = None,
    devices: Sequence[str] | None = None,
    max_grad_norm: float | None = None,
    epoch_fn: Callable[..., Any] | None = None,
    eval_fn: Callable[..., Any] | None = None,
    eval_dataset: Any = None,
    eval_result_fn: Callable[[int, float], None] | None = None,
    eval_every: int = 1,
    checkpoint_fn: Callable[..., Any] | None = None,
    checkpoint_every: int | None = None,
    metrics_fn: Callable[[dict[str, object]], None] | None = None,
    save_path: str | None = None,
    resume_from: str | None = None,
    callback_rank: str | int = "fastest",
    scheduler: SchedulerConfig | None = None,
    easgd_alpha: float | None = None,
    seed: int = 42,
    heartbeat_timeout_s: float = 30.0,
    formation_timeout_s: float = 60.0,
    max_failures: int | None = None,
    max_coordinator_restarts: int = 3,
    progress: bool = True,
    run_dir: str | None = None,
    crash: Mapping[int, float] | None = None,
    stall: Mapping[int, float] | None = None,
    faults: FaultPlan | None = None,
    outer_lr: float | None = None,
    outer_momentum: float = 0.9,
    nonfinite: str = "stop",
    dashboard: str | None = None,
    tensorboard_dir: str | None = None,
    lr_schedule: Callable[[Progress], float] | None = None,
    accumulate: int = 1,
    precision: str = "fp32",
    wire: str = "fp32",
    overlap: bool = True,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
    drop_last: bool = False,
    batch_sampler: Callable[[list[int]], Iterable[Sequence[int]]] | None = None,
    join_slots: int | None = None,
) -> TrainResult:
    """Train ``model_fn``'s model on ``dataset`` over ``ranks`` unequal workers.

    Args:
        model_fn: ``model_fn(device) -> nn.Module``; must build identical
            initial weights on every rank (seed inside it).
        optimizer_fn: ``optimizer_fn(params) -> torch.optim.Optimizer``.
        step_fn: ``step_fn(model, batch) -> loss`` (a scalar tensor); the
            batch is ``default_collate`` of dataset items, moved to the device.
        dataset: any map-style ``torch.utils.data.Dataset``, or an
            ``elche.Shards`` of streams (files, URLs, sub-datasets): its
            epochs shuffle the shards, items in order (``docs/training.md``).
        batch_size: samples per optimizer step (per rank).
        epochs: passes over the dataset.
        mode: ``sync``, ``cadence`` (default), ``cpu-sync``, ``cpu-cadence``
            or ``cpu-async``.
        ranks: worker processes; default: one per device in ``devices``, or 1.
        speeds: testing aid: run rank r at ``speeds[r]`` of its speed (the
            rank waits ``base × (1/speed − 1)`` after each step, ``base``
            measured once before training). Never on by default.
        speed_base_s: testing aid: the ``base`` every paced rank uses,
            instead of each measuring its own (a benchmark measures it once
            and hands it to every system it compares).
        devices: a list of one device string per rank, e.g. ``["cpu", "cuda:0"]``
            (default ``cpu``); a single string is refused: say ``devices=["cpu"]``.
        max_grad_norm: clip gradients to this norm.
        epoch_fn: ``epoch_fn(epoch, model, optimizer)`` on every rank at the
            start of each epoch (e.g. to set the learning rate).
        eval_fn: ``eval_fn(model, eval_dataset) -> float`` on the eval role
            after every ``eval_every`` epochs and after the last one.
        eval_dataset: passed to ``eval_fn``.
        eval_result_fn: ``eval_result_fn(epoch, metric)`` in this process;
            ``epoch`` is numbered as in ``metrics_fn`` (from 0).
        eval_every: epochs between evals.
        checkpoint_fn: ``checkpoint_fn(version, model)`` on the checkpoint role.
        checkpoint_every: epochs between checkpoints (and bundle writes).
        metrics_fn: called in this process with each finished epoch's
            metrics: ``epoch`` (from 0), ``loss``, ``syncs``, ``lr``,
            ``progress`` and ``per_rank`` (samples, loss, samples/s, share).
        save_path: bundle stem for checkpoints and save-and-shutdown: its
            files are ``STEM.meta.json``, ``STEM.s1.model.pt``, ... beside
            it, so a directory is refused (give ``DIR/run``).
        resume_from: a bundle stem to continue from.
        callback_rank: ``"fastest"`` or a rank to pin the callbacks on.
        scheduler: ElChe knobs (anchor, overhead target, guard, ...): an
            ``elche.SchedulerConfig``, or None for its defaults.
        easgd_alpha: EASGD blend for ``cpu-async`` (default 0.5).
        seed: the per-epoch shuffle seed.
        heartbeat_timeout_s: silence after which a rank is declared dead.
        formation_timeout_s: how long the run waits for every rank to join it
            (each builds its model first: raise it for a ``model_fn`` that loads
            a large model); past it the run fails before training.
        max_failures: save and stop after this many ranks died.
        max_coordinator_restarts: a coordinator process that dies is restarted
            from the run's journal on the same address, this many times at
            most (default 3; 0: never). See ``docs/failure-modes.md``.
        progress: show a live progress display on stderr.
        run_dir: where the run's files go (default: a new temp directory,
            which a completed run trims to its report, timeline and summary,
            and the last bundle ``checkpoint_every`` asked for;
            ``summary["run_dir"]``, ``summary["report"]`` and
            ``summary["bundle"]`` name them). An earlier run's record there
            (not its bundles) is removed as this one starts.
        outer_lr: DiLoCo outer optimizer (Nesterov momentum on the averaged
            pseudo-gradient) in the coordinator, cpu-* modes only; None (the
            default) averages plainly. Suggested: 0.7.
        outer_momentum: its momentum (default 0.9).
        nonfinite: a NaN or infinite loss: ``"stop"`` (the default) saves the
            last finite consensus and raises ``TrainingError`` (its
            ``bundle`` resumes it); ``"skip"`` leaves that step out and goes
            on. Parameters that turn non-finite in an average always stop.
        dashboard: ``"HOST:PORT"`` (or ``"PORT"``, on 127.0.0.1; port 0
            picks a free one) to serve the run's live state there:
            ``/state.json``, ``/metrics`` (Prometheus) and a page at ``/``;
            the address is printed when the run starts. Default: the
            ``ELCHE_DASHBOARD`` environment variable, else none. See
            ``docs/monitoring.md``.
        tensorboard_dir: a directory to write the run's scalars to as
            TensorBoard event files while it goes on (loss, eval metric,
            each rank's samples/s, share and idle %, the anchor, round
            durations). Needs the ``tensorboardX`` package (the
            ``elche[tensorboard]`` extra). Default: the ``ELCHE_TENSORBOARD``
            environment variable, else none.
        lr_schedule: ``lr_schedule(progress) -> factor``: before every
            optimizer step on every rank, each param group's lr is its base
            lr times the factor (``LambdaLR``'s shape). ``progress`` is an
            ``elche.Progress`` (``.fraction`` of the plan, ``.step`` at the
            reference batch ``batch_size × accumulate``, ``.samples``), the
            run's global progress: the same on every rank, exact at each
            average. The factor must be a finite number >= 0; another
            value fails the run (``TrainingError``, naming ``lr_schedule`` and
            the value). See ``docs/training.md``.
        accumulate: micro-batches of ``batch_size`` per optimizer step; the
            loss of each is weighted by its share of the step's samples.
        precision: ``"fp32"`` (default), ``"bf16"`` (autocast around
            ``step_fn``) or ``"fp16"`` (autocast and loss scaling; CUDA only).
        wire: what the averaging payloads travel as: ``"fp32"`` (default)
            or ``"bf16"`` (half the bytes; the collective modes send each
            rank's bf16 update since the last consensus, the ``cpu-*`` modes
            bf16 weights). The model's parameters stay fp32. See
            ``docs/training.md``.
        overlap: True (default): each collective round on the fp32 wire is
            launched and the rank trains on while it travels; what it
            trained meanwhile is applied on top of the consensus the round
            brings (a copy of the model's float tensors is held meanwhile).
            False: every rank waits for each round. See ``docs/design.md``.
        collate_fn: builds a batch from a list of items (default:
            ``default_collate``), as in ``DataLoader``.
        num_workers: loader processes (persistent) that prefetch the rank's
            batches; 0 (default) loads in the training thread.
        pin_memory: batches in pinned memory (for CUDA devices).
        drop_last: a step shorter than ``batch_size × accumulate`` trains nothing.
        batch_sampler: ``batch_sampler(indices) -> batches``: splits the
            dataset indices of one optimizer step into its micro-batches
            (each index exactly once; default: slices of ``batch_size``).
        join_slots: rank ids kept for ranks that join the running run
            (``elche join``; ``docs/launching.md``). Default: 8 for a
            collective run (``sync``, ``cadence``) of two ranks or more, else
            0; 0 keeps none, and no join command is printed.
        crash: testing hook: ``{rank: epoch.fraction}`` — that rank kills
            itself with SIGKILL when its training reaches that point
            (shorthand for ``FaultPlan().kill(rank=r, at_epoch=e)``).
        stall: testing hook: ``{rank: epoch.fraction}`` — that rank hangs
            there (no work, no heartbeat) until it is declared dead
            (shorthand for ``FaultPlan().stall(rank=r, at_epoch=e)``).
        faults: testing hook: an ``elche.FaultPlan`` (kill, stall, slow
            down, failing checkpoints, by progress ``at_epoch`` or by wall
            seconds ``at_s`` since the rank began training), the same plan
            ``elche sim`` replays; ``crash`` and ``stall`` are added after it.

    Returns:
        The final model state, per-epoch metrics and the run summary.

    Raises:
        ConfigError: a bad argument (the message names it and what is accepted).
        TrainingError: the user's code raised on a rank (before its first
            step, or the same exception on every rank): the failing rank, the
            epoch and the user's exception type, message and traceback.
        RuntimeError: the run failed to start or a process crashed.
        Interrupted: SIGINT (Ctrl-C), SIGTERM or SIGHUP stopped the run. The ranks
            saved a bundle first (``Interrupted.bundle``; resume with
            ``resume_from=``) and one line on stderr said where. It is a
            ``KeyboardInterrupt`` and a ``SystemExit(130, 143 or 129)``: uncaught,
            the script stops quietly with the shell's code for that signal.
            A second Ctrl-C stops at once, without saving. A run whose
            training was over when the signal came completes and returns.
            Called on a thread but the main one, where Python delivers the
            signals, a Ctrl-C raises ``KeyboardInterrupt`` on the main thread;
            if that ends it (uncaught), this call is stopped the same way (the
            run saved, the line said, ``Interrupted`` raised on its thread)
            before the interpreter exits. A main thread that catches it leaves
            the run training.
    """
    _check_user_fns(
        model_fn=model_fn, optimizer_fn=optimizer_fn, step_fn=step_fn, epoch_fn=epoch_fn,
        eval_fn=eval_fn, eval_dataset=eval_dataset, eval_result_fn=eval_result_fn,
        checkpoint_fn=checkpoint_fn, metrics_fn=metrics_fn,
    )  # fmt: skip
    save_path = _path("save_path", save_path)
    resume_from = _path("resume_from", resume_from)
    run_dir = _path("run_dir", run_dir)
    devices = _per_rank("devices", devices, "['cpu']")
    if max_grad_norm is not None and not (_finite(max_grad_norm) and max_grad_norm > 0):
        # torch clips to a negative norm by turning every gradient around
        raise ConfigError(
            "max_grad_norm", f"must be a positive finite number or None, got {max_grad_norm!r}"
        )
    dashboard = _dashboard(dashboard)
    tensorboard_dir = _tensorboard_dir(tensorboard_dir)
    options = check_options(
        accumulate=accumulate, precision=precision, lr_schedule=lr_schedule, wire=wire,
        overlap=overlap, collate_fn=collate_fn, num_workers=num_workers, pin_memory=pin_memory,
        drop_last=drop_last, batch_sampler=batch_sampler, devices=devices or ("cpu",),
        planned_samples=_planned(dataset, epochs),
    )  # fmt: skip
    if isinstance(batch_size, int) and not isinstance(batch_size, bool):
        batch_size *= options.accumulate  # the coordinator counts optimizer steps
    plan = _plan(
        dataset=dataset, batch_size=batch_size, epochs=epochs, mode=mode, ranks=ranks,
        speeds=speeds, speed_base_s=speed_base_s, devices=devices,
        callback_rank=callback_rank, scheduler=scheduler,
        easgd_alpha=easgd_alpha, seed=seed, heartbeat_timeout_s=heartbeat_timeout_s,
        formation_timeout_s=formation_timeout_s,
        max_failures=max_failures, has_eval=eval_fn is not None, eval_every=eval_every,
        max_coordinator_restarts=max_coordinator_restarts,
        checkpoint_every=checkpoint_every, save_path=save_path, resume_from=resume_from,
        crash=crash, stall=stall, faults=faults, outer_lr=outer_lr,
        outer_momentum=outer_momentum, nonfinite=nonfinite, join_slots=join_slots,
    )  # fmt: skip
    if options.drop_last and plan.config.num_samples < plan.config.batch_size:
        raise ConfigError(
            "drop_last",
            f"the dataset's {plan.config.num_samples} samples are fewer than one step "
            f"(batch_size × accumulate = {plan.config.batch_size}): drop_last would leave "
            "every sample out and train nothing; give a smaller batch_size or drop_last=False",
        )
    from elche.runtime.worker import UserFns

    fns = UserFns(
        model_fn=model_fn, optimizer_fn=optimizer_fn, step_fn=step_fn, dataset=dataset,
        eval_fn=eval_fn, eval_dataset=eval_dataset, epoch_fn=epoch_fn,
        checkpoint_fn=checkpoint_fn, options=options,
    )  # fmt: skip
    hooks = Hooks(eval_result_fn=eval_result_fn, metrics_fn=metrics_fn)
    from elche.runtime.joining import JOIN_ENV

    # A rank of a launched run (torchrun, elche run) whose own checks refuse the run
    # still meets the others, to tell them (``train_launched``): its peers on other
    # hosts, whose checks passed, waited in the launcher's rendezvous for it for good.
    joining = JOIN_ENV in os.environ  # elche join: one new rank of a running run
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ and not joining
    owner = not launched or os.environ["RANK"] == "0"  # it starts the run
    refused: ConfigError | None = None
    with contextlib.ExitStack() as held:
        try:
            plan = _checked_before_start(plan, fns, run_dir, launched=launched)
            if not joining:  # one run writes at a save path at a time: its starter holds it
                held.enter_context(hold_save_path(plan.config.save_path if owner else None))
        except ConfigError as exc:
            if not launched:
                raise
            refused = exc
        if joining:
            from elche.runtime.joined import train_joined

            return train_joined(plan, fns, hooks, max_grad_norm=max_grad_norm)
        if owner and refused is None:
            _say_replaced_bundle(plan.config.save_path, plan.resume_from)
        if launched:
            from elche.runtime.launched import train_launched

            return train_launched(
                plan, fns, hooks, max_grad_norm=max_grad_norm, run_dir=run_dir,
                dashboard=dashboard, tensorboard_dir=tensorboard_dir, refused=refused,
            )  # fmt: skip
        if plan.config.world_size == 1:
            return _train_one(
                plan, fns, hooks, max_grad_norm=max_grad_norm, run_dir=run_dir,
                dashboard=dashboard, tensorboard_dir=tensorboard_dir,
            )  # fmt: skip
        return _train_cluster(
            plan, fns, hooks, max_grad_norm=max_grad_norm, run_dir=run_dir, progress=progress,
            dashboard=dashboard, tensorboard_dir=tensorboard_dir,
        )  # fmt: skip


def _checked_before_start(plan: Plan, fns: UserFns, run_dir: str | None, *, launched: bool) -> Plan:
    """The plan, resumed from its bundle once that is checked, and its run directory
    checked: before anything starts.

    Raises:
        ConfigError: the bundle does not resume the run, or a run directory is not
            writable.
    """
    if plan.resume_from is not None:
        from elche.runtime.resume import check_resume

        # Said once, by the process that starts the run.
        meta = check_resume(
            plan.resume_from, plan.config, fns.model_fn, fns.optimizer_fn,
            accumulate=fns.options.accumulate, say=os.environ.get("RANK", "0") == "0",
        )  # fmt: skip
        # A resumed run draws each epoch's order as its bundle's run did.
        config = dataclasses.replace(plan.config, order=meta.resumed_order(plan.config))
        plan = dataclasses.replace(plan, config=config, resume_seq=meta.save_seq)
    if run_dir is not None:  # it makes the folder, as the run would
        check_writable(Path(run_dir), "run_dir")
    elif launched and os.environ.get("ELCHE_RUN_DIR"):  # every host keeps one there
        check_writable(Path(os.environ["ELCHE_RUN_DIR"]), "ELCHE_RUN_DIR")
    return plan


def _plan(
    *,
    dataset: Any,
    batch_size: int,
    epochs: int,
    mode: str,
    ranks: int | None,
    speeds: Sequence[float] | None,
    speed_base_s: float | None,
    devices: Sequence[str] | None,
    callback_rank: str | int,
    scheduler: SchedulerConfig | None,
    easgd_alpha: float | None,
    seed: int,
    heartbeat_timeout_s: float,
    formation_timeout_s: float,
    max_failures: int | None,
    max_coordinator_restarts: int,
    has_eval: bool,
    eval_every: int,
    checkpoint_every: int | None,
    save_path: str | None,
    resume_from: str | None,
    crash: Mapping[int, float] | None,
    stall: Mapping[int, float] | None,
    faults: FaultPlan | None,
    outer_lr: float | None,
    outer_momentum: float,
    nonfinite: str,
    join_slots: int | None,
) -> Plan:
    check_dataset(dataset)  # a stream without shards
    try:
        num_samples = len(dataset)
    except TypeError:
        raise ConfigError(
            "dataset", "must be a map-style Dataset with __len__, or an elche.Shards of streams"
        ) from None
    if num_samples == 0:
        raise ConfigError("dataset", "is empty: there is nothing to train on")
    env_world = os.environ.get("WORLD_SIZE")
    speeds = _per_rank("speeds", speeds, "[1.0, 0.5]")
    world = _world_size(ranks, speeds, devices, int(env_world) if env_world else None)
    for s in speeds or ():
        if isinstance(s, bool) or not (isinstance(s, numbers.Real) and 0 < float(s) <= 1):
            raise ConfigError("speeds", f"each speed must be a number in (0, 1], got {s!r}")
    speeds_t = tuple(float(s) for s in speeds) if speeds is not None else (1.0,) * world
    devices_t = tuple(devices) if devices is not None else ("cpu",) * world
    if isinstance(callback_rank, str):
        if callback_rank != "fastest":
            raise ConfigError(
                "callback_rank", f"must be 'fastest' or a rank, got {callback_rank!r}"
            )
        policy, pinned = CallbackPolicy.FASTEST, 0
    else:
        policy, pinned = CallbackPolicy.PINNED, callback_rank
    _check_devices(devices_t)
    low, high = HEARTBEAT_TIMEOUT_RANGE_S
    if not (_finite(heartbeat_timeout_s) and low <= heartbeat_timeout_s <= high):
        raise ConfigError(
            "heartbeat_timeout_s",
            f"must be a number of seconds in [{low:g}, {high:g}] (a live rank beats "
            f"{BEATS_PER_TIMEOUT} times a timeout), got {heartbeat_timeout_s!r}",
        )
    low, high = FORMATION_TIMEOUT_RANGE_S
    if not (_finite(formation_timeout_s) and low <= formation_timeout_s <= high):
        raise ConfigError(
            "formation_timeout_s",
            f"must be a number of seconds in [{low:g}, {high:g}], got {formation_timeout_s!r}",
        )
    if save_path is not None:
        _check_stem(save_path)
        check_writable(Path(save_path).parent, "save_path")
    if resume_from is not None and not meta_path(resume_from).exists():
        raise no_meta(resume_from)
    slots = _join_slots(Mode.parse(mode), world, join_slots)
    _check_sender_ids(world, slots)
    config = CoordinatorConfig(
        mode=Mode.parse(mode), world_size=world, num_samples=num_samples,
        batch_size=batch_size, epochs=epochs, seed=seed,
        order=SHARD_ORDER if isinstance(dataset, Shards) else NUMPY_PERMUTATION,
        scheduler=SchedulerConfig() if scheduler is None else scheduler,
        heartbeat_timeout_s=heartbeat_timeout_s, formation_timeout_s=formation_timeout_s,
        heartbeat_interval_s=_beat_every(heartbeat_timeout_s), max_failures=max_failures,
        callback_policy=policy, callback_rank=pinned,
        has_eval_fn=has_eval, eval_every=eval_every, checkpoint_every=checkpoint_every,
        save_path=save_path, easgd_alpha=easgd_alpha, outer_lr=outer_lr,
        outer_momentum=outer_momentum, nonfinite=nonfinite,
        max_coordinator_restarts=max_coordinator_restarts,
        join_slots=slots,
    )  # fmt: skip
    return Plan(
        config=config, speeds=speeds_t, speed_base_s=_speed_base(speed_base_s),
        devices=devices_t, resume_from=resume_from,
        faults=_faults(faults, crash, stall, world),
    )  # fmt: skip


def _planned(dataset: Any, epochs: Any) -> int:
    """Samples in the plan (``epochs × len(dataset)``); 1 when either is bad (_plan says)."""
    try:
        return max(int(epochs) * len(dataset), 1)
    except (TypeError, ValueError):
        return 1


def _check_user_fns(
    *,
    model_fn: Any,
    optimizer_fn: Any,
    step_fn: Any,
    epoch_fn: Any,
    eval_fn: Any,
    eval_dataset: Any,
    eval_result_fn: Any,
    checkpoint_fn: Any,
    metrics_fn: Any,
) -> None:
    """Mistakes a new user makes, caught before any process starts.

    Raises:
        ConfigError: a model instead of ``model_fn``, a function that is not
            callable, or ``eval_fn`` without ``eval_dataset``.
    """
    if hasattr(model_fn, "state_dict") and hasattr(model_fn, "parameters"):
        raise ConfigError(
            "model_fn",
            "got a model; pass the function that builds it, model_fn(device) -> nn.Module, "
            "defined at the top level of a module so each rank can build its own",
        )
    if not callable(model_fn):
        raise ConfigError("model_fn", f"must be a function model_fn(device), got {model_fn!r}")
    for name, fn in (("optimizer_fn", optimizer_fn), ("step_fn", step_fn)):
        if not callable(fn):
            raise ConfigError(name, f"must be a function, got {fn!r}")
    hooks = (
        ("epoch_fn", epoch_fn), ("eval_fn", eval_fn), ("eval_result_fn", eval_result_fn),
        ("checkpoint_fn", checkpoint_fn), ("metrics_fn", metrics_fn),
    )  # fmt: skip
    for name, fn in hooks:  # called only later (some only on one rank, or at an epoch's end)
        if fn is not None and not callable(fn):
            raise ConfigError(name, f"must be a function or None, got {fn!r}")
    if eval_fn is not None and eval_dataset is None:
        raise ConfigError("eval_dataset", "eval_fn is given but eval_dataset is not")


# Beats per heartbeat timeout, at least: a short timeout (the chaos runs' 2 s)
# must not be spent by one late beat of a loaded machine.
BEATS_PER_TIMEOUT = 4
HEARTBEAT_INTERVAL_S = 1.0  # the rank's beat and the coordinator's timer, at most
# Timeouts a run takes: under a second a loaded machine's scheduling alone declares
# live ranks dead; past a day a lost rank is never noticed (and timers overflow).
HEARTBEAT_TIMEOUT_RANGE_S = (1.0, 86_400.0)
FORMATION_TIMEOUT_RANGE_S = (1.0, 86_400.0)


def _beat_every(heartbeat_timeout_s: float) -> float:
    """How often ranks beat and the coordinator's timer fires, for ``heartbeat_timeout_s``."""
    if not heartbeat_timeout_s > 0:
        return HEARTBEAT_INTERVAL_S  # the config's check names heartbeat_timeout_s
    return min(HEARTBEAT_INTERVAL_S, heartbeat_timeout_s / BEATS_PER_TIMEOUT)


def _check_devices(devices: Sequence[str]) -> None:
    """Every device names one this machine has (imports torch only for non-CPU devices)."""
    if all(device == "cpu" for device in devices):
        return
    import torch

    for device in devices:
        try:
            parsed = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError("devices", f"{device!r} is not a device: {exc}") from None
        if parsed.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if (parsed.index or 0) >= count:
                raise ConfigError("devices", f"{device!r}: this machine has {count} CUDA device(s)")
        elif parsed.type != "cpu":
            raise ConfigError("devices", f"{device!r}: accepted are 'cpu' and 'cuda[:N]'")


def _say_replaced_bundle(save_path: str | None, resume_from: str | None) -> None:
    """Say so when this run's first save will replace an earlier run's bundle at ``save_path``."""
    if save_path is None or not meta_path(save_path).exists():
        return
    if resume_from is not None and Path(resume_from).resolve() == Path(save_path).resolve():
        return
    print(
        f"elche: save_path {save_path} holds the bundle of an earlier run; this run's first "
        f"save replaces it (resume_from={save_path!r} continues that run instead)",
        file=sys.stderr,
        flush=True,
    )


def _finite(value: object) -> bool:
    """A real number (not a bool), neither NaN nor infinite."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_stem(save_path: str) -> None:
    """``save_path`` names a bundle stem (``STEM.meta.json``, ``STEM.s1.model.pt``, ...
    beside it), not a folder: a folder's bundle would be its siblings ``DIR.*``.

    Raises:
        ConfigError: (field ``save_path``) it is empty, ends in a separator or is
            an existing directory.
    """
    if not save_path or save_path.endswith(("/", os.sep)) or Path(save_path).is_dir():
        raise ConfigError(
            "save_path",
            f"is a bundle stem, not a directory: got {save_path!r}; name the bundle "
            f"inside it, e.g. {os.path.join(save_path or '.', 'run')!r} (its files are "
            "STEM.meta.json, STEM.s1.model.pt, ...)",
        )


def _faults(
    plan: FaultPlan | None,
    crash: Mapping[int, float] | None,
    stall: Mapping[int, float] | None,
    world: int,
) -> FaultPlan:
    """The run's fault plan: ``plan``, then the ``crash`` and ``stall`` shorthands."""
    if plan is None:
        plan = FaultPlan()
    elif not isinstance(plan, FaultPlan):
        raise ConfigError("faults", f"must be an elche.FaultPlan or None, got {plan!r}")
    plan.check(world)
    for name, points in (("crash", crash), ("stall", stall)):
        if points is None:
            continue
        shape = f"expects {{rank: epoch.fraction}} with ranks in [0, {world}), got {points!r}"
        if not isinstance(points, Mapping):
            raise ConfigError(name, shape)
        for rank, at in points.items():
            if not (_is_rank(rank, world) and _finite(at) and at >= 0):
                raise ConfigError(name, shape)
            if name == "crash":
                plan = plan.kill(rank=rank, at_epoch=at)
            else:
                plan = plan.stall(rank=rank, at_epoch=at)
    return plan


def _is_rank(value: object, world: int) -> bool:
    """An integer in [0, ``world``) (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < world


def _path(field: str, given: str | os.PathLike[str] | None) -> str | None:
    """``given`` as a path string (None stays None).

    Raises:
        ConfigError: neither a ``str`` nor an ``os.PathLike`` of one.
    """
    if given is None or isinstance(given, str):
        return given
    if isinstance(given, os.PathLike):
        path = os.fspath(given)
        if isinstance(path, str):
            return path
    raise ConfigError(field, f"must be a path (a str or a pathlib.Path) or None, got {given!r}")


def _per_rank(field: str, given: Any, example: str) -> tuple[Any, ...] | None:
    """``given`` as a tuple of one entry per rank (None stays None).

    Raises:
        ConfigError: not a list: a number, a mapping, or a string (which
            would be read letter by letter).
    """
    if given is None:
        return None
    if not isinstance(given, str | bytes | Mapping):
        try:
            return tuple(given)
        except TypeError:
            pass
    raise ConfigError(
        field, f"must be a list with one entry per rank, e.g. {field}={example}, or None; "
        f"got {given!r}",
    )  # fmt: skip


def _speed_base(base_s: float | None) -> float | None:
    if base_s is None:
        return None
    from elche.runtime.pacing import check_speed_base_s  # torch: only when asked for

    return check_speed_base_s(base_s)


def _join_slots(mode: Mode, world: int, given: int | None) -> int:
    """Rank ids kept for ranks that join the run (``elche join``): ``given``, else
    ``JOIN_SLOTS`` for collective runs of two ranks or more (a coordinator and a
    group store), else none. The coordinator's config checks the mode."""
    joinable = mode.backend is Backend.COLLECTIVE and world >= 2
    if given is None:
        return JOIN_SLOTS if joinable else 0
    if world == 1 and given:
        raise ConfigError(
            "join_slots", f"a run of one rank has no coordinator to join; got {given!r}"
        )
    return given


def _check_sender_ids(world: int, join_slots: int) -> None:
    """Refuse more rank ids (``world`` and the joiners' slots) than a frame's sender
    field holds beside the coordinator's (``runtime.frames``), here rather than in
    the coordinator's process, where it failed the launch with a traceback.

    Raises:
        ConfigError: (field ``ranks``) ``world + join_slots`` is ``COORDINATOR_SENDER``
            or more.
    """
    if world + join_slots >= COORDINATOR_SENDER:
        most = COORDINATOR_SENDER - 1 - join_slots
        raise ConfigError(
            "ranks", f"at most {most} ranks fit a frame's sender field (beside {join_slots} "
            f"slots for joining ranks), got {world}"
        )  # fmt: skip


def _world_size(
    ranks: int | None,
    speeds: Sequence[float] | None,
    devices: Sequence[str] | None,
    from_env: int | None,
) -> int:
    candidates = {
        "ranks": ranks,
        "speeds": None if speeds is None else len(speeds),
        "devices": None if devices is None else len(devices),
        "WORLD_SIZE": from_env,
    }
    given = {k: v for k, v in candidates.items() if v is not None}
    if len(set(given.values())) > 1:
        detail = ", ".join(f"{k}={v}" for k, v in given.items())
        raise ConfigError("ranks", f"disagreeing world sizes: {detail}")
    world = next(iter(given.values()), 1)
    if not isinstance(world, int) or world < 1:
        raise ConfigError("ranks", f"must be an integer >= 1, got {world!r}")
    return world


def _dashboard(given: str | None) -> str | None:
    """The dashboard address: the argument, else ``ELCHE_DASHBOARD``, else none.

    Raises:
        ConfigError: not ``[HOST:]PORT``.
    """
    from elche.monitor.address import DASHBOARD_ENV, parse_address

    address = given if given is not None else os.environ.get(DASHBOARD_ENV) or None
    if address is not None:
        parse_address(address)
    return address


def _tensorboard_dir(given: str | None) -> str | None:
    """The TensorBoard log directory: the argument, else ``ELCHE_TENSORBOARD``, else none.

    Raises:
        ConfigError: not a path, or one is asked for and the ``tensorboard``
            package is missing.
    """
    given = _path("tensorboard_dir", given)
    directory = given if given is not None else os.environ.get(TENSORBOARD_ENV) or None
    if directory is not None and importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError(
            "tensorboard_dir",
            "needs the tensorboardX package (pip install 'elche[tensorboard]'), or None",
        )
    return directory


# -- several ranks --------------------------------------------------------------


def _train_one(
    plan: Plan,
    fns: Any,
    hooks: Hooks,
    *,
    max_grad_norm: float | None,
    run_dir: str | None,
    dashboard: str | None,
    tensorboard_dir: str | None,
) -> TrainResult:
    """One rank, in this process, its timeline in ``run_dir`` (or a temporary one)."""
    from elche.runtime.solo import train_solo

    directory = Path(run_dir or tempfile.mkdtemp(prefix="elche-run-"))
    result = train_solo(
        plan, fns, hooks, max_grad_norm=max_grad_norm, run_dir=str(directory),
        dashboard=dashboard, tensorboard_dir=tensorboard_dir,
    )  # fmt: skip
    if run_dir is None:
        tidy_run_dir(result, directory)
    return result


def _train_cluster(
    plan: Plan,
    fns: Any,
    hooks: Hooks,
    *,
    max_grad_norm: float | None,
    run_dir: str | None,
    progress: bool,
    dashboard: str | None,
    tensorboard_dir: str | None,
) -> TrainResult:
    from elche.runtime.launch import check_picklable, launch_local

    check_picklable(fns)  # before anything starts: nothing to clean up
    if isinstance(fns.dataset, Shards):
        fns.dataset.check_sendable()
    directory = Path(run_dir or tempfile.mkdtemp(prefix="elche-run-"))
    result = launch_local(
        plan, fns, hooks, directory, max_grad_norm=max_grad_norm, progress=progress,
        dashboard=dashboard, tensorboard_dir=tensorboard_dir,
    )  # fmt: skip
    if run_dir is None:
        tidy_run_dir(result, directory)
    return result
