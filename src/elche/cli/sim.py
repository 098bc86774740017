"""``elche sim``: the coordinator core against simulated ranks, in virtual time.

It prints what a real cluster of those speeds would achieve (``--json``: the
``SimResult`` document). Its fault flags and ``--faults FILE.json`` (a
``FaultPlan.to_json`` document) speak the same fault vocabulary as
``elche demo`` and ``elche.train(faults=...)``; ``read_faults`` reads that
file for both.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable

from elche.core.config import Mode, SchedulerConfig
from elche.core.errors import ConfigError
from elche.core.faults import FaultPlan
from elche.monitor.progress import Progress
from elche.sim.engine import SimConfig, SimError, Simulation
from elche.sim.result import SimResult

__all__ = [
    "SHOW_AFTER_S",
    "SimProgress",
    "check_reached",
    "check_speeds_given",
    "draw_speeds",
    "print_table",
    "reached",
    "read_faults",
    "run_sim",
    "sim_faults",
    "trigger",
]


SHOW_AFTER_S = 1.0  # a simulation that ends sooner shows no progress


class SimProgress:
    """A long simulation's progress on stderr: the epochs it has ended and its virtual
    time, drawn from ``SHOW_AFTER_S`` of real time on (``Simulation.run``'s ``tick``).

    Args:
        epochs: the run's epochs (the bar's total).
        enabled: draw it at all (stderr a terminal, the output not JSON).
        clock: the real clock, in seconds.
    """

    def __init__(
        self, epochs: int, *, enabled: bool, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.epochs, self.enabled, self.clock = epochs, enabled, clock
        self.started = clock()
        self.display: Progress | None = None
        self.seen = 0  # timeline records shown

    def __call__(self, sim: Simulation) -> None:
        if not self.enabled or self.clock() - self.started < SHOW_AFTER_S:
            return
        if self.display is None:
            self.display = Progress(self.epochs, enabled=True)
        for event in sim.timeline[self.seen :]:
            self.display.show(event)
        self.seen = len(sim.timeline)
        self.display.describe(f"simulating, {sim.now:,.2f} virtual s")

    def close(self) -> None:
        if self.display is not None:
            self.display.close()


def trigger(text: str, flag: str) -> tuple[int, dict[str, float]]:
    """``RANK@SECONDS`` or ``RANK@eEPOCH`` as a rank and its trigger's keywords."""
    rank_text, sep, when = text.partition("@")
    key = "at_epoch" if when[:1] in ("e", "E") else "at_s"
    try:
        if not sep:
            raise ValueError
        return int(rank_text), {key: float(when[1:] if key == "at_epoch" else when)}
    except ValueError:
        raise ConfigError(
            flag, f"expected RANK@SECONDS (1@5) or RANK@eEPOCH (1@e0.5), got {text!r}"
        ) from None


def read_faults(path: str | None) -> FaultPlan:
    """The plan in ``path`` (``FaultPlan.to_json``), or an empty plan for None."""
    if path is None:
        return FaultPlan()
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError("faults", f"cannot read {path}: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError("faults", f"{path} is not a fault plan (not UTF-8 text)") from None
    return FaultPlan.from_json(text)


def sim_faults(args: argparse.Namespace) -> FaultPlan:
    """``--faults``, then ``--kill`` and ``--stall``, as one plan.

    Raises:
        ConfigError: a bad file or flag (named), or a ``--kill``/``--stall`` at
            an epoch the run never reaches; a file's such fault is only warned of
            (a replayed plan may hold one).
    """
    plan = read_faults(args.faults)
    for fault in plan.faults:
        if fault.at_s is None and not reached(fault.at_epoch, args.epochs):
            print(f"elche sim: warning: {fault} in {args.faults} is at epoch "
                  f"{fault.at_epoch:g}, and the run ends at epoch {args.epochs}: it will "
                  "not fire", file=sys.stderr)  # fmt: skip
    for text in args.kill:
        rank, when = trigger(text, "kill")
        check_reached("kill", text, when.get("at_epoch"), args.epochs)
        plan = plan.kill(rank=rank, **when)
    for text in args.stall:
        rank, when = trigger(text, "stall")
        check_reached("stall", text, when.get("at_epoch"), args.epochs)
        plan = plan.stall(rank=rank, **when)
    return plan


def reached(at_epoch: float | None, epochs: int) -> bool:
    """Whether a run of ``epochs`` trains a batch at or past ``at_epoch`` (its last batch
    starts before ``epochs``); True too where ``epochs`` is itself bad (reported as such)."""
    return at_epoch is None or epochs < 1 or at_epoch < epochs


def check_reached(flag: str, text: str, at_epoch: float | None, epochs: int) -> None:
    """Refuse a fault flag's point that a run of ``epochs`` never reaches.

    Raises:
        ConfigError: (field ``flag``) ``at_epoch`` is ``epochs`` or past it.
    """
    if not reached(at_epoch, epochs):
        raise ConfigError(
            flag,
            f"{text} is at epoch {at_epoch:g}, and the run ends at epoch {epochs} (its last "
            f"batch starts before it), so it would never fire; give a point below {epochs}",
        )


def check_speeds_given(speeds: tuple[float, ...] | None) -> None:
    """Refuse a ``--speeds`` that held no number (``--speeds ,``).

    Raises:
        ConfigError: (field ``speeds``) ``speeds`` is empty.
    """
    if speeds is not None and not speeds:
        raise ConfigError(
            "speeds", "needs one speed per rank, comma-separated numbers in (0, 1] such as "
            "1,0.5,0.25; got none"
        )  # fmt: skip


def draw_speeds(num_ranks: int, seed: int) -> tuple[float, ...]:
    """Speeds of a mixed fleet: one rank at 1.0, the rest uniform in [0.25, 1]."""
    rng = random.Random(seed)
    return (1.0, *(round(rng.uniform(0.25, 1.0), 3) for _ in range(num_ranks - 1)))


def run_sim(args: argparse.Namespace) -> int:
    check_speeds_given(args.speeds)
    if args.speeds is None and args.ranks is None:
        speeds: tuple[float, ...] = (1.0, 0.5, 0.25)
    elif args.speeds is None:
        if args.ranks < 1:
            raise ConfigError("ranks", f"must be >= 1, got {args.ranks}")
        speeds = draw_speeds(args.ranks, args.seed)
    else:
        speeds = args.speeds
        if args.ranks is not None and args.ranks != len(speeds):
            raise ConfigError(
                "ranks", f"--ranks {args.ranks} disagrees with {len(speeds)} --speeds"
            )
    plan = sim_faults(args)
    config = SimConfig(
        speeds=speeds,
        mode=Mode.parse(args.mode),
        epochs=args.epochs,
        samples=args.samples,
        batch_size=args.batch_size,
        base_ms=args.base_ms,
        sync_ms=args.sync_ms,
        jitter=args.jitter,
        seed=args.seed,
        faults=plan,
        heartbeat_timeout_s=args.heartbeat_timeout,
        max_failures=args.max_failures,
        scheduler=SchedulerConfig(anchor=args.anchor, fill_wait=args.fill_wait),
        overlap=args.overlap,
    )
    timed = None
    if args.cost:
        from elche.bench.coordinator_cost import TimedCoordinator

        timed = TimedCoordinator(config.coordinator_config(), resume=config.resume)
    started = time.perf_counter()
    progress = SimProgress(config.epochs, enabled=sys.stderr.isatty() and not args.json)
    try:
        result = Simulation(config, core=timed).run(tick=progress)
    except SimError as exc:
        print(f"elche sim: {exc}", file=sys.stderr)
        return 1
    finally:
        progress.close()
    real_s = time.perf_counter() - started
    cost = None if timed is None else timed.report(result.syncs)
    if args.json:
        doc = result.to_json()
        doc["real_s"] = round(real_s, 3)
        if cost is not None:
            doc["coordinator_cost"] = cost
        print(json.dumps(doc))
    else:
        print_table(result, real_s)
        if cost is not None:
            print(
                f"coordinator: {cost['batch_report_us']} µs per batch report, "
                f"{cost['round_us']} µs per averaging round, {cost['total_s']} s in all"
            )
    return 0


def print_table(result: SimResult, real_s: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"elche sim — {result.mode}, {result.world_size} ranks")
    for column in ("rank", "speed", "samples", "busy s", "idle s", "idle %"):
        table.add_column(column, justify="right")
    for r in result.per_rank[:32]:
        alive = r.busy_s + r.idle_s
        idle_pct = 100.0 * r.idle_s / alive if alive else 0.0
        table.add_row(
            str(r.rank),
            f"{r.speed:g}",
            str(r.samples),
            f"{r.busy_s:.2f}",
            f"{r.idle_s:.2f}",
            f"{idle_pct:.1f}",
        )
    console.print(table)
    if len(result.per_rank) > 32:
        console.print(f"(… {len(result.per_rank) - 32} more ranks)")
    console.print(
        f"outcome [bold]{result.outcome}[/bold]"
        + (f" ({result.reason})" if result.reason else "")
        + f" · epochs {result.epochs_completed} · {result.samples_trained} samples in "
        f"{result.virtual_wall_s:.2f} virtual s · throughput {result.throughput:.0f}/s of "
        f"{result.ideal_throughput:.0f}/s ideal · efficiency [bold]{result.efficiency:.1%}"
        f"[/bold] · {result.syncs} averages · lost {result.lost_samples} · duplicated "
        f"{result.duplicated_samples} · dead {result.dead_ranks} · {real_s:.2f} s real"
    )
