"""Running a suite: one training run per workload × rig × system × repeat.

Theory of operation. ``run_suite`` loads each workload's split once, then
for every repeat and workload trains ``solo`` (``elche.train(ranks=1)`` at
speed 1, one thread: the fastest rank alone, the efficiency denominator),
then for every rig every system in turn — torch DDP through ``run_ddp``,
torchft's LocalSGD and DiLoCo through ``run_torchft`` and each elche mode
through ``elche.train`` — with the same workload, split, seed, epochs,
per-rank batch size and speed injection. Odd repeats reverse the system
order. After the repeats, the headline cell (``Suite.seed_jobs``) runs once
on each extra seed, with that seed's split and shuffle.

Every system evaluates after every epoch, for the time to a target eval,
and every one after its clock: the baselines copy rank 0's weights at each
epoch end; elche and solo run ``eval_fn`` with ``eval_every=1`` as a user
would, and the bench's ``eval_fn`` is ``KeepWeights``, which copies the
model it is given on elche's eval role (``bench.kept_weights``). The
copies are evaluated once the run is over.

Speed injection is shared, not just alike: the solo step time ``base`` that
a paced rank's wait is made of is measured once per workload, here, before
its first run (``measure_base_step_s``, 20 timed steps, one thread, nothing
else running), and every system's ranks pace by that value
(``speed_base_s``). Measured by each rank as it starts, ``base`` varies with
what its neighbours happen to do at that moment: one DDP run's 0.25-speed
rank once timed 9.1 ms for a 4.9 ms step and ran at half its speed, which
made that cell's ratio a measure of the accident. Every record carries the
value as ``speed_base_s``. Each run becomes one JSON-ready ``Run`` record:

``workload, system, speeds, repeat, seed, ranks, epochs, batch_size,
train_samples (the plan's cut of the training set, or all of it),
speed_base_s, link_mbit, wall_s, startup_s, total_s, samples, samples_per_s,
final_loss, eval, syncs, lost_samples, wire, overlap, wire_bytes_per_round,
per_epoch[{epoch, t, loss, eval}], per_rank[{rank, speed, samples, busy_s}],
capacity, error``

Across hosts. A suite with ``link_mbit`` rates builds one ``Rig`` of
namespace hosts per rig size and rate before its first run and keeps it to
the end; every multi-rank run of that rate trains across it
(``bench.hosts``: torchrun on every host), and its record's ``link_mbit``
is the rate. ``solo`` trains here, on the machine itself (``link_mbit``
None), as do all runs of a suite without rates.

``capacity`` is the rig's record from ``bench.capacity`` (what the machine
delivers to the rig's paced ranks training alone at once, measured once per
workload and rig before its first run; the solo run, of no rig, carries None),
or None when the suite skips it (``capacity_s`` 0).

Clocks. ``wall_s`` is each system's own training clock (first batch to the
end of training: elche's final average, DDP's closing barrier); ``total_s``
is the whole call, process start-up and teardown included. Per-epoch times
come from the same clock: elche's coordinator timeline (``EpochEnd`` minus
``RunStart``, which is stamped as the first batch is dispatched), DDP's
rank-0 epoch ends, and solo's own epoch callbacks. ``busy_s`` of a rank is
its time in training steps including the injected wait: measured by elche's
worker (``step_s``); for DDP, ``steps × base_step_s + injected_s`` because
its gradient all-reduce runs inside the backward pass and cannot be timed
apart. ``syncs`` counts averaging rounds for elche and gradient all-reduces
(steps) for DDP.

A run that raises is recorded with ``error`` set and no numbers; the suite
goes on.

Stops. Ctrl-C, SIGTERM or SIGHUP stops the run in progress, which is not
recorded, and the suite. One that comes once an elche or solo run has
trained, while its kept copies are evaluated (as ``elche.train`` finishes a
run whose training was over), waits for the record: the run is recorded
whole, then the suite stops (``StoppedAfterTraining``). A second Ctrl-C
stops at once.

Run directories. Given ``runs_dir``, each elche and solo run writes its files
to ``runs_dir/NN-WORKLOAD-SYSTEM`` (``NN`` its place in the suite) and a
completed one is trimmed to its record (report, timeline, summary: what
``elche timeline`` and a browser read), which its ``Run``'s ``run_dir`` names;
a failed or stopped one keeps every file. Without it each run writes to a temporary
directory that goes with the run. Either way the runs are not joinable
(``join_slots=0``): a rank joining a measured run would change what it measures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elche.bench.capacity import measure_capacity
from elche.bench.kept_weights import KeepWeights, evaluate_kept, keeping
from elche.bench.suites import (
    DDP,
    SOLO,
    TORCHFT_SYSTEMS,
    Suite,
    WorkloadPlan,
    split_averaging,
    split_system,
)
from elche.core import timeline as tl
from elche.monitor.summary import rank_report_file
from elche.monitor.timeline import read_timeline
from elche.runtime.lifetimes import RESUME_HINT, StopSignals
from elche.workloads import Workload, load_split
from elche.workloads import get as get_workload

if TYPE_CHECKING:
    from elche.testing.hosts import Rig

__all__ = [
    "DDP_TIMEOUT_S",
    "Run",
    "StoppedAfterTraining",
    "available_suite",
    "elche_record",
    "measure_speed_base_s",
    "run_one",
    "run_suite",
]

Run = dict[str, Any]  # one JSON-ready run record (see the module docstring)
DDP_TIMEOUT_S = 900.0  # a hung baseline must not hang the suite; ~10× a full-suite run
Split = tuple[Any, Any]


class StoppedAfterTraining(KeyboardInterrupt):
    """A stop signal came once a run had trained; it waited for the run's record.

    Attributes:
        run: the run's record, whole (``run_one``'s, once it passes through).
        signum: the signal, for the caller to raise once it has kept ``run``.
    """

    def __init__(self, run: Run, signum: int) -> None:
        super().__init__(signum)
        self.run = run
        self.signum = signum


def run_suite(
    suite: Suite,
    *,
    progress: bool = True,
    on_run: Callable[[Run], None] | None = None,
    runs_dir: Path | None = None,
) -> list[Run]:
    """Run every cell of ``suite``; return the runs in the order they ran.

    Args:
        suite: what to run.
        progress: show a live display on stderr (cell, elapsed time).
        on_run: called with each run record as soon as it exists.
        runs_dir: where each elche and solo run keeps its record (see the
            module docstring); None: nowhere.

    Returns:
        One ``Run`` per training run, ``suite.num_runs()`` in all.

    Raises:
        KeyboardInterrupt: Ctrl-C, SIGTERM or SIGHUP (``elche.Interrupted`` from
            an elche or solo run): the run in progress was stopped as that signal
            stops it, its processes ended, and is not recorded; ``on_run`` had
            every run before it, in order, as ``suite.cells()`` lists them. A
            signal that came once that run had trained is raised once ``on_run``
            has had it too (see the module docstring).
    """
    runs: list[Run] = []
    splits: dict[WorkloadPlan, Split] = {}
    bases: dict[str, float] = {}
    capacities: dict[tuple[str, tuple[float, ...]], dict[str, Any] | None] = {}
    with _display(suite.num_runs(), enabled=progress) as show, contextlib.ExitStack() as stack:
        rigs = _host_rigs(suite, stack)
        for cell in suite.cells():
            plan = cell.plan
            if plan not in splits:
                workload = get_workload(plan.name)
                splits[plan] = _load(plan, suite.seed)
                bases[plan.name] = measure_speed_base_s(workload, splits[plan], plan.batch_size)
                for rig in suite.rigs:
                    show(f"{plan.name} [{_rig(rig)}] capacity ({suite.capacity_s:g} s)")
                    capacities[plan.name, rig] = _capacity(suite, plan, rig, bases[plan.name])
            show(cell.label())
            link = cell.link_mbit
            late: StoppedAfterTraining | None = None
            try:
                run = run_one(
                    cell.system, plan, cell.speeds, seed=cell.seed,
                    split=_load(plan, cell.seed) if cell.extra_seed else splits[plan],
                    speed_base_s=bases[plan.name],
                    hosts=rigs.get((len(cell.speeds), link)) if link is not None else None,
                    wire=suite.wire, overlap=suite.overlap,
                    run_dir=_named(runs_dir, len(runs), plan.name, cell.name),
                )  # fmt: skip
            except StoppedAfterTraining as stop:
                run, late = stop.run, stop
            run["repeat"] = cell.repeat
            run["capacity"] = capacities.get((plan.name, cell.speeds))  # solo: None
            runs.append(run)
            if on_run is not None:
                on_run(run)
            if late is not None:
                signal.raise_signal(late.signum)  # as it came (KeyboardInterrupt, Terminated)
                raise late
    return runs


def _named(runs_dir: Path | None, index: int, workload: str, system: str) -> Path | None:
    """The directory of the suite's ``index``-th run in ``runs_dir``, if any."""
    return None if runs_dir is None else runs_dir / f"{index:02d}-{workload}-{system}"


def _load(plan: WorkloadPlan, seed: int) -> Split:
    return load_split(plan.name, seed, train_samples=plan.train_samples)


def _host_rigs(suite: Suite, stack: contextlib.ExitStack) -> dict[tuple[int, float], Rig]:
    """One ``Rig`` per rig size and link rate of a hosts suite, closed with ``stack``."""
    from elche.testing.hosts import Rig, sweep_stale

    swept = sweep_stale()  # a killed bench's rigs: their processes died with it
    if swept:
        print(f"elche bench: removed {len(swept)} namespace(s) of host rigs whose bench is gone",
              file=sys.stderr, flush=True)  # fmt: skip
    rigs: dict[tuple[int, float], Rig] = {}
    for size in dict.fromkeys(len(rig) for rig in suite.rigs):
        for link in suite.link_mbit:
            rigs[size, link] = stack.enter_context(Rig(size, rate_mbit=link))
    return rigs


def _capacity(
    suite: Suite, plan: WorkloadPlan, rig: tuple[float, ...], speed_base_s: float
) -> dict[str, Any] | None:
    """The rig's capacity record on this machine, or None when skipped or failed."""
    if suite.capacity_s <= 0:
        return None
    try:
        return measure_capacity(
            plan.name, rig, speed_base_s=speed_base_s, batch_size=plan.batch_size,
            seconds=suite.capacity_s,
        ).to_json()  # fmt: skip
    except Exception as exc:  # the bench goes on; its rows say there is no capacity
        return {"error": f"{type(exc).__name__}: {exc}"}


def available_suite(suite: Suite, say: Callable[[str], None]) -> Suite:
    """``suite`` without the systems this machine cannot run, each said with its reason.

    torchft's systems need ``elche[peers]``; without it they are dropped, the
    reason goes to ``say`` and into the suite's notes.
    """
    from elche.baselines.torchft_peers import available

    ok, reason = available()
    missing = [s for s in suite.systems if s in TORCHFT_SYSTEMS]
    if ok or not missing:
        return suite
    note = f"{', '.join(missing)} skipped: {reason}"
    say(f"elche bench: {note}")
    return dataclasses.replace(
        suite,
        systems=tuple(s for s in suite.systems if s not in TORCHFT_SYSTEMS),
        notes=(*suite.notes, note),
    )


def run_one(
    system: str,
    plan: WorkloadPlan,
    speeds: Sequence[float],
    *,
    seed: int,
    split: Split | None = None,
    speed_base_s: float | None = None,
    hosts: Rig | None = None,
    wire: str = "fp32",
    overlap: bool = True,
    run_dir: Path | None = None,
) -> Run:
    """Train ``plan`` once with ``system`` on the rig ``speeds``.

    Args:
        system: ``torch-ddp``, ``solo`` or an elche mode name.
        plan: the workload, epochs and per-rank batch size.
        speeds: the rig (``solo`` ignores it and runs one rank at speed 1).
        seed: the split's and the shuffle's seed.
        split: the workload's ``(train, test)`` for ``seed``; loaded if None.
        speed_base_s: the solo step time every paced rank waits by; None:
            each paced rank measures its own.
        hosts: a rig of one namespace host per rank: the run trains across
            its hosts (``bench.hosts``; not ``solo``); None: on this host.
        wire: an elche mode's averaging wire (``MODE+bf16`` is bf16 whatever it says).
        overlap: an elche mode's collective rounds overlap training (``elche.train``;
            ``MODE+wait`` waits for them whatever it says).
        run_dir: where an elche or solo run on this host keeps its record
            (replaced if it exists; the record's ``run_dir``); None: a
            temporary directory.

    Returns:
        The run record; ``error`` holds the message if the run failed.

    Raises:
        StoppedAfterTraining: a stop signal came once an elche or solo run had
            trained; it carries the run's whole record.
        KeyboardInterrupt: any other stop signal; the run is not recorded.
    """
    workload = get_workload(plan.name)
    data = split if split is not None else _load(plan, seed)
    record: Run = {
        "workload": plan.name,
        "system": system,
        "speeds": [1.0] if system == SOLO else list(speeds),
        "ranks": 1 if system == SOLO else len(speeds),
        "epochs": plan.epochs,
        "batch_size": plan.batch_size,
        "train_samples": len(data[0]),
        "metric": workload.metric,
        "higher_is_better": workload.higher_is_better,
        "speed_base_s": speed_base_s,
        "seed": seed,
        "link_mbit": hosts.rate_mbit if hosts is not None and system != SOLO else None,
        "error": None,
    }
    started = time.perf_counter()
    hint = RESUME_HINT.set(None)  # a stopped run says where it is saved: the bench resumes none
    try:
        if hosts is not None and system != SOLO:
            named, wire, overlap = split_averaging(system, wire, overlap)
            if named != DDP:
                record.update(wire=wire, overlap=overlap)
            on_hosts = _on_hosts(
                named, plan, speeds, seed=seed, speed_base_s=speed_base_s, rig=hosts,
                wire=wire, overlap=overlap,
            )  # fmt: skip
            record.update(on_hosts)
        elif system == DDP:
            record.update(_torch_ddp(plan, speeds, seed, speed_base_s))
        elif system in TORCHFT_SYSTEMS:
            record.update(_torchft(system, plan, speeds, seed, speed_base_s))
        elif system == SOLO:
            record.update(_solo(workload, plan, seed, data, run_dir))
        else:
            named, dashboard = split_system(system)
            mode, wire, overlap = split_averaging(named, wire, overlap)
            record.update(wire=wire, overlap=overlap)
            record.update(
                _elche(
                    workload, plan=plan, mode=mode, speeds=speeds, seed=seed, split=data,
                    speed_base_s=speed_base_s, dashboard=dashboard, wire=wire, overlap=overlap,
                    keep_in=run_dir,
                )
            )  # fmt: skip
    except StoppedAfterTraining as late:
        record.update(late.run, total_s=round(time.perf_counter() - started, 3))
        late.run = record
        raise
    except Exception as exc:  # a failed cell is reported, the suite goes on
        record["error"] = _error(exc)
    finally:
        RESUME_HINT.reset(hint)
    record["total_s"] = round(time.perf_counter() - started, 3)
    return record


def measure_speed_base_s(workload: Workload, split: Split, batch_size: int) -> float:
    """The solo step time of ``workload`` on this machine, one thread, in seconds.

    The fastest of 20 timed steps (after 2 untimed) on the training split's
    first batch, on copies of a fresh model and optimizer.
    """
    import torch

    from elche.runtime.data import fetch
    from elche.runtime.pacing import measure_base_step_s

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank process runs
    try:
        model = workload.make_model("cpu")
        optimizer = workload.make_optimizer(model.parameters())
        batch = fetch(split[0], range(min(batch_size, len(split[0]))))
        return measure_base_step_s(model, optimizer, workload.step_fn, batch, repeats=20)
    finally:
        torch.set_num_threads(threads)


def _torch_ddp(
    plan: WorkloadPlan, speeds: Sequence[float], seed: int, speed_base_s: float | None
) -> Run:
    from elche.baselines.ddp import run_ddp

    result = run_ddp(
        speeds=list(speeds), epochs=plan.epochs, batch_size=plan.batch_size, seed=seed,
        workload=plan.name, timeout_s=DDP_TIMEOUT_S, base_step_s=speed_base_s,
        train_samples=plan.train_samples,
    )  # fmt: skip
    return _baseline_record(result)


def _on_hosts(
    system: str, plan: WorkloadPlan, speeds: Sequence[float], *, seed: int,
    speed_base_s: float | None, rig: Rig, wire: str, overlap: bool,
) -> Run:  # fmt: skip
    from elche.bench.hosts import run_on_hosts

    if speed_base_s is None:
        raise ValueError("a run across hosts paces by one shared solo step: give speed_base_s")
    return run_on_hosts(system, plan, speeds, seed=seed, speed_base_s=speed_base_s, rig=rig,
                        wire=wire, overlap=overlap)  # fmt: skip


def _torchft(
    system: str, plan: WorkloadPlan, speeds: Sequence[float], seed: int, speed_base_s: float | None
) -> Run:
    from elche.baselines.torchft_peers import run_torchft

    result = run_torchft(
        system, speeds=list(speeds), epochs=plan.epochs, batch_size=plan.batch_size, seed=seed,
        workload=plan.name, timeout_s=DDP_TIMEOUT_S, base_step_s=speed_base_s,
        train_samples=plan.train_samples,
    )  # fmt: skip
    return _baseline_record(result)


def _baseline_record(result: dict[str, Any]) -> Run:
    """A run record from ``run_ddp``'s (or ``run_torchft``'s) result."""
    ranks = result["per_rank"]
    assert isinstance(ranks, list)
    per_rank = [
        {
            "rank": r["rank"],
            "speed": r["speed"],
            "samples": r["samples"],
            "busy_s": r["steps"] * r["base_step_s"] + r["injected_s"],
        }
        for r in ranks
    ]
    return {
        "wall_s": result["wall_s"],
        "startup_s": result["startup_s"],
        "samples": sum(r["samples"] for r in per_rank),
        "samples_per_s": result["samples_per_s"],
        "final_loss": result["final_loss"],
        "eval": result["eval"],
        "syncs": result.get("syncs", ranks[0]["steps"]),
        "lost_samples": 0,
        "per_epoch": result["per_epoch"],
        "per_rank": per_rank,
    }


def _solo(
    workload: Workload, plan: WorkloadPlan, seed: int, split: Split, keep_in: Path | None
) -> Run:
    """One rank in this process, one thread, speed 1; eval after the clock."""
    import torch

    from elche.api import train

    first_step: list[float] = []
    epoch_ends: list[tuple[float, object, object]] = []

    def step(model: Any, batch: Any) -> Any:
        if not first_step:
            first_step.append(time.perf_counter())
        return workload.step_fn(model, batch)

    def on_epoch(record: dict[str, object]) -> None:
        epoch_ends.append((time.perf_counter(), record.get("loss"), record.get("eval")))

    record: Run = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank process runs (honest efficiency denominator)
    try:
        with contextlib.ExitStack() as trained:
            with _run_dir(keep_in) as tmp, keeping(tmp / "kept") as kept:  # as elche's runs
                result = train(
                    workload.make_model, workload.make_optimizer, step, split[0],
                    batch_size=plan.batch_size, epochs=plan.epochs, ranks=1, speeds=[1.0],
                    seed=seed, eval_fn=KeepWeights(str(kept)), eval_dataset=split[1],
                    eval_every=1, metrics_fn=on_epoch, progress=False, run_dir=str(tmp),
                )  # fmt: skip
                trained.enter_context(_stops_wait(record))
                evals, metric = evaluate_kept(plan.name, kept, split[1], final=result.state_dict)
                _trim(result, keep_in)
            t0 = first_step[0] if first_step else 0.0
            record.update(_solo_record(result.summary, t0, epoch_ends, evals, metric))
            record["run_dir"] = None if keep_in is None else str(keep_in)
    finally:
        torch.set_num_threads(threads)
    return record


def _solo_record(
    summary: dict[str, Any],
    t0: float,
    epoch_ends: Sequence[tuple[float, object, object]],
    evals: Sequence[float],
    metric: float,
) -> Run:
    """A solo run's numbers: its summary's, each epoch end's (``t`` from ``t0``, its
    first step) with its kept copy's eval, and the final model's ``metric``."""
    samples = int(summary["per_rank"][0]["samples"])
    return {
        "wall_s": summary["wall_s"],
        "startup_s": summary["startup_s"],
        "samples": samples,
        "samples_per_s": summary["samples_per_s"],
        "final_loss": summary["final_loss"],
        "eval": metric,
        "syncs": 0,
        "lost_samples": 0,
        "per_epoch": _kept_evals(
            [
                {"epoch": e, "t": round(t - t0, 4), "loss": loss, "eval": kept}
                for e, (t, loss, kept) in enumerate(epoch_ends)
            ],
            evals,
        ),
        "per_rank": [{"rank": 0, "speed": 1.0, "samples": samples, "busy_s": summary["wall_s"]}],
    }


def _elche(
    workload: Workload,
    *,
    plan: WorkloadPlan,
    mode: str,
    speeds: Sequence[float],
    seed: int,
    split: Split,
    speed_base_s: float | None,
    dashboard: bool = False,
    wire: str = "fp32",
    overlap: bool = True,
    keep_in: Path | None = None,
) -> Run:
    from elche.api import train
    from elche.bench.watch import Watch, watched_dashboard

    record: Run = {}
    watching = watched_dashboard() if dashboard else contextlib.nullcontext(None)
    with contextlib.ExitStack() as trained:
        with _run_dir(keep_in) as run_dir, watching as watch, keeping(run_dir / "kept") as kept:
            result = train(
                workload.make_model, workload.make_optimizer, workload.step_fn, split[0],
                batch_size=plan.batch_size, epochs=plan.epochs, mode=mode, speeds=list(speeds),
                speed_base_s=speed_base_s, eval_fn=KeepWeights(str(kept)), eval_dataset=split[1],
                eval_every=1, join_slots=0,
                seed=seed, progress=False, run_dir=str(run_dir), wire=wire, overlap=overlap,
                dashboard=watch.address if isinstance(watch, Watch) else None,
            )  # fmt: skip
            trained.enter_context(_stops_wait(record))
            timeline = read_timeline(run_dir)
            reports = [_read_json(rank_report_file(run_dir, r)) for r in range(len(speeds))]
            evals, final = evaluate_kept(plan.name, kept, split[1], final=result.state_dict)
            _trim(result, keep_in)
        record.update(elche_record(mode, dict(result.summary), timeline, reports))
        record["per_epoch"] = _kept_evals(record["per_epoch"], evals)
        record["eval"] = final
        record["dashboard_polls"] = watch.polls if isinstance(watch, Watch) else None
        record["run_dir"] = None if keep_in is None else str(keep_in)
    return record


@contextmanager
def _stops_wait(record: Run) -> Iterator[None]:
    """From here on (a run has trained), a stop signal waits for ``record``, filled
    meanwhile: on the way out it raises ``StoppedAfterTraining`` with it, or with the
    error of a failure meanwhile (see the module docstring)."""
    with StopSignals() as late:
        try:
            yield
        except Exception as exc:
            if late.received is None:
                raise
            record.clear()
            record["error"] = _error(exc)
    if late.received is not None:
        raise StoppedAfterTraining(record, late.received)


def _error(exc: Exception) -> str:
    """A failed run's ``error``."""
    return f"{type(exc).__name__}: {exc}"


@contextmanager
def _run_dir(keep_in: Path | None) -> Iterator[Path]:
    """Where one run writes: ``keep_in``, emptied first, or a temporary directory."""
    if keep_in is None:
        with tempfile.TemporaryDirectory(prefix="elche-bench-") as tmp:
            yield Path(tmp)
        return
    shutil.rmtree(keep_in, ignore_errors=True)  # an earlier bench's run of this name
    keep_in.mkdir(parents=True)
    yield keep_in


def _trim(result: Any, keep_in: Path | None) -> None:
    """A kept run directory of a completed run, trimmed to its record (``tidy_run_dir``)."""
    from elche.runtime.run_dirs import tidy_run_dir

    if keep_in is not None:
        tidy_run_dir(result, keep_in)


def _kept_evals(per_epoch: list[dict[str, Any]], evals: Sequence[float]) -> list[dict[str, Any]]:
    """``per_epoch`` with each eval, a kept copy's number (``KeepWeights``), made that copy's eval.

    Raises:
        ValueError: a number names no kept copy.
    """
    for row in per_epoch:
        if row["eval"] is not None:
            number = int(row["eval"])
            if not 0 <= number < len(evals):
                raise ValueError(f"epoch {row['epoch']}: copy {number} of {len(evals)} kept")
            row["eval"] = evals[number]
    return per_epoch


def elche_record(
    mode: str,
    summary: dict[str, Any],
    timeline: Sequence[tl.TimelineEvent],
    reports: Sequence[dict[str, Any]],
) -> Run:
    """A run record's numbers from an elche run's summary, timeline and rank reports."""
    if summary.get("outcome") != "completed":
        raise RuntimeError(f"elche {mode}: {summary.get('outcome')} ({summary.get('reason')})")
    ranks: list[dict[str, Any]] = summary["per_rank"]
    per_rank = [
        {
            "rank": r["rank"],
            "speed": r["speed"],
            "samples": r["samples"],
            "busy_s": reports[i].get("step_s"),
        }
        for i, r in enumerate(ranks)
    ]
    return {
        "wall_s": summary["wall_s"],
        "startup_s": summary["startup_s"],
        "samples": sum(int(r["samples"]) for r in per_rank),
        "samples_per_s": summary["samples_per_s"],
        "final_loss": summary["final_loss"],
        "eval": summary["eval_accuracy"],
        "syncs": summary["syncs"],
        "lost_samples": summary["lost_samples"],
        "per_epoch": _epochs_from_timeline(timeline),
        "per_rank": per_rank,
        "wire_bytes_per_round": _wire_bytes_per_round(reports),
    }


def _wire_bytes_per_round(reports: Sequence[dict[str, Any]]) -> float | None:
    """The ranks' mean averaging bytes per round (``elche.runtime.wire``); None without rounds."""
    per_rank = [r["wire_bytes"] / r["wire_rounds"] for r in reports if r.get("wire_rounds")]
    return round(sum(per_rank) / len(per_rank), 1) if per_rank else None


def _epochs_from_timeline(events: Sequence[tl.TimelineEvent]) -> list[dict[str, Any]]:
    """``EpochEnd`` times relative to ``RunStart`` (the first dispatch), with their evals.

    An ``Eval`` record's ``epoch`` counts the epochs done, so it belongs to the
    ``EpochEnd`` one before it; its time is the epoch end's.
    """
    t0 = next((e.t for e in events if isinstance(e, tl.RunStart)), 0.0)
    evals = {e.epoch - 1: e.metric for e in events if isinstance(e, tl.Eval)}
    return [
        {"epoch": e.epoch, "t": round(e.t - t0, 4), "loss": e.loss, "eval": evals.get(e.epoch)}
        for e in events
        if isinstance(e, tl.EpochEnd)
    ]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    loaded: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return loaded


def _rig(speeds: Sequence[float]) -> str:
    return ",".join(f"{s:g}" for s in speeds)


@contextmanager
def _display(total: int, *, enabled: bool) -> Iterator[Callable[[str], None]]:
    """A rich progress display on stderr; yields ``show(cell)`` to call per run."""
    if not enabled:
        yield lambda _cell: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("[bold]elche bench[/bold] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )
    task = bar.add_task("starting", total=total)
    started = [False]

    def show(cell: str) -> None:
        if started[0]:
            bar.advance(task)
        started[0] = True
        bar.update(task, description=cell)

    with bar:
        yield show
        bar.update(task, completed=total, description="done")
