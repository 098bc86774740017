"""The ``elche`` command: its parser and subcommands (``elche run``: ``elche.cli.run``;
``elche sim``: ``elche.cli.sim``; ``elche timeline``: ``elche.cli.timeline``; how a stopped
command ends: ``elche.cli.endings``).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from elche.cli.endings import (
    interrupted_status,
    stdout_closed,
    stdout_to_devnull,
    stop_signals_raise,
)
from elche.cli.run import run_script
from elche.cli.sim import check_reached, check_speeds_given, draw_speeds, read_faults, run_sim
from elche.cli.timeline import run_timeline
from elche.core.config import Mode
from elche.core.errors import ConfigError, TrainingError
from elche.core.faults import FaultPlan

__all__ = ["draw_speeds", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``elche`` console script; returns the exit code.

    Bad input is one line and exit 2. A Ctrl-C (SIGTERM, SIGHUP) that no run
    handled, in start-up say, is one line and 130 (143, 129), as a shell reports
    a process those signals end; a stdout whose reader went away (``elche
    timeline RUN | head``) ends the command quietly with 141 (SIGPIPE's).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    with stop_signals_raise():
        try:
            code: int = args.run(args)
            sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        except ConfigError as exc:
            print(f"elche {args.command}: error: {exc}", file=sys.stderr)
            return 2
        except TrainingError as exc:  # the user's traceback is in it; elche's frames are not
            print(f"elche {args.command}: error: the run failed: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as exc:
            return interrupted_status(args.command, exc)
        except BrokenPipeError:
            if not stdout_closed():
                raise
            stdout_to_devnull()
            return 128 + signal.SIGPIPE
    return code


class _Help(argparse.HelpFormatter):
    """``--help`` names every option's default, unless its help already does."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default is argparse.SUPPRESS
        if not action.option_strings or "default" in text or unset or default == []:
            return action.help
        shown = ",".join(f"{v:g}" for v in default) if isinstance(default, tuple) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})".strip()


def _version() -> str:
    """``elche X (torch Y, Python Z)``, without importing torch (it takes seconds)."""
    from importlib import metadata

    from elche import __version__

    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "not installed"
    python = ".".join(str(part) for part in sys.version_info[:3])
    return f"elche {__version__} (torch {torch}, Python {python})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elche",
        description="Train one model on unequal workers at the speed of their sum.",
        formatter_class=_Help,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    _sim_parser(sub)
    demo = sub.add_parser(
        "demo",
        formatter_class=_Help,
        help="train a real model on this machine with unequal ranks",
        description=(
            "Train a small network on scikit-learn's handwritten digits with several "
            "real processes at different speeds (the slower ones wait after each "
            "step, as slower hardware would), and report what elche achieved."
        ),
    )
    demo.add_argument(
        "--ranks", type=int, default=None, help="rank processes (default: 3, or one per --speeds)"
    )
    demo.add_argument(
        "--speeds",
        type=_speeds,
        default=None,
        help="per-rank speed fractions (default: 1,0.5,0.25)",
    )
    _add_run_args(demo)
    demo.add_argument("--save-path", default=None, help="bundle stem for checkpoints")
    demo.add_argument("--resume-from", default=None, help="bundle stem to resume from")
    demo.add_argument(
        "--crash",
        action="append",
        default=[],
        metavar="RANK@EPOCH.FRACTION",
        help="testing: that rank SIGKILLs itself at that point (e.g. 1@1.5)",
    )
    demo.add_argument(
        "--stall",
        action="append",
        default=[],
        metavar="RANK@EPOCH.FRACTION",
        help="testing: that rank hangs at that point (no work, no heartbeat)",
    )
    demo.add_argument(
        "--faults",
        default=None,
        metavar="FILE.json",
        help="testing: a fault plan (FaultPlan.to_json, as elche sim --faults takes; at_s "
        "counts wall seconds from each rank's start of training); --crash/--stall add to it",
    )
    demo.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="seconds of silence before a rank is declared dead",
    )
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.add_argument("--no-progress", action="store_true", help="no live progress display")
    _add_dashboard_arg(demo)
    demo.set_defaults(run=_run_demo)
    compare = sub.add_parser(
        "compare",
        formatter_class=_Help,
        help="elche demo and torch DDP side by side, with the wall-time ratio",
        description=(
            "Run torch DistributedDataParallel and elche on the same workload, rig and "
            "speed injection in this invocation, and print both and their ratio."
        ),
    )
    compare.add_argument(
        "--speeds", type=_speeds, default=(1.0, 0.5, 0.25),
        help="per-rank speed fractions (default: 1,0.5,0.25)",
    )  # fmt: skip
    _add_run_args(compare)
    compare.add_argument("--json", action="store_true", help="print one JSON object")
    compare.set_defaults(run=_run_compare)
    run = sub.add_parser(
        "run",
        formatter_class=_Help,
        help="run a training script as N local ranks (like torchrun)",
        description=(
            "Start SCRIPT N times with the torch.distributed environment set (RANK, "
            "WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...). Each copy's elche.train call "
            "becomes one rank; rank 0 starts the coordinator."
        ),
    )
    run.add_argument(
        "--nproc", "--nproc-per-node", dest="nproc", type=int, required=True,
        help="ranks to start (torchrun's --nproc-per-node spelling works too)",
    )  # fmt: skip
    _add_dashboard_arg(run)
    run.add_argument("script", help="the Python script that calls elche.train")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for SCRIPT")
    run.set_defaults(run=run_script)
    _join_parser(sub)
    for add_parser in (_timeline_parser, _bench_parser, _chaos_parser):
        add_parser(sub)
    return parser


def _sim_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim = sub.add_parser(
        "sim",
        formatter_class=_Help,
        help="simulate a heterogeneous cluster in virtual time",
        description=(
            "Run elche's coordinator against simulated ranks in virtual time. "
            "Speeds are fractions of the fastest rank's speed."
        ),
    )
    sim.add_argument("--speeds", type=_speeds, help="comma-separated, e.g. 1,0.5,0.25")
    sim.add_argument("--ranks", type=int, help="number of ranks (speeds drawn from --seed)")
    sim.add_argument(
        "--mode",
        default="cadence",
        help="sync, cadence, cpu-sync, cpu-cadence, cpu-async (or async)",
    )
    sim.add_argument("--epochs", type=int, default=3, help="epochs to simulate")
    sim.add_argument("--samples", type=int, default=30_000, help="samples per epoch")
    sim.add_argument("--batch-size", type=int, default=32, help="samples per step")
    sim.add_argument("--base-ms", type=float, default=10.0, help="solo step time of a speed-1 rank")
    sim.add_argument("--sync-ms", type=float, default=5.0, help="cost of one averaging round")
    sim.add_argument(
        "--jitter", type=float, default=0.0, help="relative std-dev of each step's time"
    )
    sim.add_argument("--seed", type=int, default=0, help="seeds the shuffle and the jitter")
    sim.add_argument(
        "--kill",
        action="append",
        default=[],
        metavar="RANK@WHEN",
        help="SIGKILL a rank; WHEN is virtual seconds (1@5) or, after an 'e', training "
        "progress as epoch.fraction (1@e0.5: just before rank 1 trains a batch at or past "
        "epoch 0.5, as elche demo --crash 1@0.5 does); repeatable",
    )
    sim.add_argument(
        "--stall",
        action="append",
        default=[],
        metavar="RANK@WHEN",
        help="hang a rank (no work, no heartbeat); WHEN as for --kill; repeatable",
    )
    sim.add_argument(
        "--faults",
        default=None,
        metavar="FILE.json",
        help="replay a fault plan (FaultPlan.to_json: "
        '{"faults": [{"kind": "kill", "rank": 1, "at_epoch": 0.5}, ...]}); '
        "--kill and --stall add to it",
    )
    sim.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=30.0,
        help="seconds of silence before a rank is declared dead",
    )
    sim.add_argument(
        "--max-failures", type=int, default=None, help="save and stop once this many ranks died"
    )
    sim.add_argument(
        "--cost",
        action="store_true",
        help="time the coordinator's every decision on the real clock and report the "
        "microseconds per batch report and per averaging round",
    )
    sim.add_argument(
        "--anchor",
        type=int,
        default=None,
        help="initial ElChe anchor (default: 1 for sync, 10 otherwise)",
    )
    sim.add_argument(
        "--no-fill-wait",
        dest="fill_wait",
        action="store_false",
        help="cadence: a rank that trained its budget holds for the round (by default it "
        "trains on while a slower peer is expected to finish its own)",
    )
    _add_overlap_arg(sim)
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.set_defaults(run=run_sim)


def _add_run_args(parser: argparse.ArgumentParser) -> None:
    """The training settings ``demo`` and ``compare`` share."""
    parser.add_argument(
        "--mode",
        default="cadence",
        help="sync, cadence, cpu-sync, cpu-cadence, cpu-async",
    )
    parser.add_argument("--epochs", type=int, default=20, help="epochs to train")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step")
    parser.add_argument("--seed", type=int, default=42, help="seeds the models and the shuffle")
    _add_averaging_args(parser)


def _add_averaging_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wire",
        default="fp32",
        help="what elche's averaging payloads travel as: fp32 or bf16 (half the bytes; "
        "the model stays fp32)",
    )
    _add_overlap_arg(parser)


def _add_overlap_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="every rank waits for each collective round (by default, on the fp32 wire, "
        "it trains on while the round travels)",
    )


def _speeds(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--speeds takes comma-separated numbers in (0, 1], got {text!r}"
        ) from None


def _at(text: str, flag: str) -> tuple[int, float]:
    rank, sep, when = text.partition("@")
    try:
        if not sep:
            raise ValueError
        return int(rank), float(when)
    except ValueError:
        raise ConfigError(flag, f"expected RANK@WHEN such as 1@5, got {text!r}") from None


def _points(texts: Sequence[str], flag: str, epochs: int) -> dict[int, float]:
    """``--crash``/``--stall``'s ``RANK@EPOCH.FRACTION`` values as ``{rank: epoch}``.

    Raises:
        ConfigError: (field ``flag``) one is malformed, or at a point a run of
            ``epochs`` never reaches.
    """
    points = {}
    for text in texts:
        rank, at_epoch = _at(text, flag)
        check_reached(flag, text, at_epoch, epochs)
        points[rank] = at_epoch
    return points


def _add_dashboard_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dashboard",
        default=None,
        metavar="[HOST:]PORT",
        help="serve the run's live state at http://HOST:PORT/ (/state.json, /metrics); "
        "port 0 picks a free port, HOST defaults to 127.0.0.1 (default: $ELCHE_DASHBOARD)",
    )
    parser.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="write the run's scalars to DIR as TensorBoard event files "
        "(needs elche[tensorboard]; default: $ELCHE_TENSORBOARD)",
    )


def _join_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    join = sub.add_parser("join", formatter_class=_Help, help="add a rank to a running run",
        description="Start SCRIPT (the run's own, unchanged: its ranks= and speeds= are "
        "ignored) as one more rank of the collective run at ADDRESS, as the run's join line "
        "says; ELCHE_SECRET holds the run's secret. See docs/launching.md.")  # fmt: skip
    join.add_argument("address", help="the coordinator's tcp://HOST:PORT")
    join.add_argument("--store-port", type=int, required=True, help="the run's group store port")
    join.add_argument("--speed", type=float, default=1.0, help="testing: pace, in (0, 1]")
    join.add_argument("script", help="the Python script that calls elche.train")
    join.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for SCRIPT")
    join.set_defaults(run=_run_join)


def _run_join(args: argparse.Namespace) -> int:
    from elche.cli.run import check_script
    from elche.runtime.joining import run_join

    check_script(args.script)
    return run_join(args.address, args.store_port, args.speed, [args.script, *args.script_args])


def _chaos_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    chaos = sub.add_parser(
        "chaos",
        formatter_class=_Help,
        help="short real runs under random fault schedules, each checked for every invariant",
        description=(
            "Run N short elche.train runs (3 ranks, digits-logreg, 2 epochs) under fault "
            "schedules drawn from --seed, and check each: it ends within its bound, it completes "
            "(or saves a bundle that resumes to completion), no sample is lost or trained twice "
            "(from the ranks' own records), no process is left behind. Exit code 1 if any "
            "run broke one; its plan file and the elche sim line that replays it are printed."
        ),
    )
    chaos.add_argument("--runs", type=int, default=10, help="runs to make")
    chaos.add_argument("--seed", type=int, default=0, help="draws every run's schedule")
    chaos.add_argument(
        "--first", type=int, default=0,
        help="the index of the first run (run i draws its schedule from SEED:i): a long "
        "series split across processes, or resumed where it stopped",
    )  # fmt: skip
    chaos.add_argument("--mode", choices=[m.value for m in Mode], default="cadence")
    chaos.add_argument(
        "--dir", default=None, help="where the runs' files go (default: a new temp directory)"
    )
    chaos.add_argument("--bound", type=float, default=90.0, help="seconds one run may take")
    chaos.add_argument("--json", action="store_true", help="print the rows as JSON lines")
    chaos.set_defaults(run=_run_chaos)


def _run_chaos(args: argparse.Namespace) -> int:
    from elche import chaos

    if not (args.bound > 0 and math.isfinite(args.bound)):  # each run would "break" it
        raise ConfigError("bound", f"must be a finite number of seconds > 0, got {args.bound:g}")
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="elche-chaos-"))
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("dir", f"cannot make {workdir}: {exc}") from None

    done: list[chaos.ChaosRun] = []

    def keep_row(row: chaos.ChaosRun) -> None:  # (--json: each row as its run ends)
        done.append(row)
        if args.json:
            print(json.dumps(chaos.rows_json([row])[0]), flush=True)

    try:
        chaos.run_chaos(
            runs=args.runs, seed=args.seed, first=args.first, mode=args.mode, workdir=workdir,
            bound_s=args.bound, on_row=keep_row,
        )  # fmt: skip
    finally:  # stopped (Ctrl-C, a full folder): the runs checked so far, then why
        if done and not args.json:
            chaos.print_table(done, workdir)
    return 0 if all(row.ok for row in done) else 1


def _timeline_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    timeline = sub.add_parser(
        "timeline",
        formatter_class=_Help,
        help="read a run directory's timeline: its records, or a Chrome trace",
        description=(
            "Print RUN_DIR/timeline.jsonl one record a line, or with --chrome write it as a "
            "Chrome trace-event file (open it in Perfetto or chrome://tracing): one track "
            "per rank with its work, idle time, averaging rounds and callbacks."
        ),
    )
    timeline.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    timeline.add_argument(
        "--chrome",
        default=None,
        metavar="OUT.json",
        help="write a Chrome trace to OUT.json (default: print the records, one JSON line each)",
    )
    timeline.set_defaults(run=run_timeline)


def _bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench",
        formatter_class=_Help,
        help="elche's modes, torch DDP, torchft and solo side by side on real workloads",
        description=(
            "Train each suite workload on each rig with torch DDP, torchft's LocalSGD and "
            "DiLoCo (skipped, saying so, without elche[peers]), every elche mode and one "
            "solo rank, in this invocation, and write report.md, results.json and PNG "
            "charts with the ratios against DDP, each system's final eval and its time "
            "to the workload's target eval, and each elche and solo run's own report, "
            "timeline and summary to runs/NN-WORKLOAD-SYSTEM/. Exits 1, naming each, when a "
            "run failed or an output could not be written (the results JSON then goes to "
            "stdout); Ctrl-C or SIGTERM writes what was measured, marked interrupted, and "
            "exits 130 (143)."
        ),
    )
    bench.add_argument(
        "--suite",
        choices=("quick", "full", "gpt", "hosts", "overlap"),
        default="quick",
        help="quick: digits-cnn (compute-bound), digits-mlp (communication-bound) and "
        "tiny-gpt (a quarter epoch) on speeds 1,0.5,0.25, one repeat, cadence and DDP on "
        "digits-cnn and tiny-gpt also on seeds 1 and 2; "
        "full: 5 workloads x 4 rigs; gpt: tiny-gpt (a 1M-parameter transformer) one epoch, "
        "DDP, both torchft peers, cadence and cpu-cadence each on the fp32 and bf16 wire, "
        "DDP and cadence also on seeds 1 and 2; hosts: digits-wide "
        "(1.1 M parameters) on three network-namespace hosts at speeds 1,0.5,0.25, links "
        "shaped to 1000 and 100 Mbit/s, torch DDP against cadence, cpu-cadence and cpu-async "
        "(needs root, ip and unshare); overlap: cadence with and without training through "
        "its rounds (cadence+wait), three repeats on those hosts at 100 Mbit/s "
        "(default: quick)",
    )
    _add_averaging_args(bench)
    bench.add_argument("--out", default=None, help="output dir (default: results/bench-<time>)")
    bench.add_argument("--repeats", type=int, default=None, help="override the suite's repeats")
    bench.add_argument(
        "--dashboard",
        action="store_true",
        help="also run each elche mode with its dashboard served and read every second "
        "(MODE+dashboard), interleaved, and report what it costs",
    )
    bench.add_argument("--json", action="store_true", help="print the results JSON on stdout")
    bench.add_argument("--no-progress", action="store_true", help="no live progress display")
    bench.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    import dataclasses

    from elche._files import check_writable
    from elche.bench import SUITES, default_out_dir, incomplete, run_bench
    from elche.bench.suites import with_dashboard
    from elche.runtime.options import check_wire

    suite = SUITES[args.suite]
    if suite.link_mbit:
        from elche.bench.hosts import refusal

        reason = refusal()
        if reason is not None:
            print(f"elche bench: --suite {args.suite} refused: {reason}", file=sys.stderr)
            return 2
    if args.repeats is not None:
        if args.repeats < 1:
            raise ConfigError("repeats", f"must be >= 1, got {args.repeats}")
        suite = dataclasses.replace(suite, repeats=args.repeats)
    if args.dashboard:
        suite = with_dashboard(suite)
    check_wire(args.wire)
    suite = dataclasses.replace(suite, wire=args.wire, overlap=args.overlap)
    out_dir = Path(args.out) if args.out else default_out_dir()
    check_writable(out_dir, "out")  # now, not after the minutes of runs it is to hold
    command = f"elche bench --suite {args.suite}"
    if args.repeats is not None:
        command += f" --repeats {args.repeats}"
    command += " --dashboard" if args.dashboard else ""
    command += f" --wire {args.wire}" if args.wire != "fp32" else ""
    command += "" if args.overlap else " --no-overlap"
    command += " --json" if args.json else ""
    # SIGTERM and SIGHUP end the bench as Ctrl-C does (``endings.stop_signals_raise``):
    # through its cleanup (a hosts suite's rigs, namespaces and their /etc and /tmp, are
    # removed), what it measured written (``doc["interrupted"]``), 130, 143 or 129 its status.
    doc = run_bench(suite, out_dir, command=command, progress=not args.no_progress)
    results = str(out_dir / "results.json")
    kept = all(u["file"] != results for u in doc["unwritten"])
    if args.json or not kept:
        print(json.dumps(doc))  # a results.json the disk refused is not lost
    lacks = incomplete(doc)
    for line in lacks:
        print(f"elche bench: {line}", file=sys.stderr)
    stop, done = doc["interrupted"], f"{len(doc['runs'])} of {len(doc['runs'] + doc['not_run'])}"
    if lacks or stop:
        where = results if kept else "stdout (the results JSON)"
        said = f"interrupted by {stop} after {done} runs" if stop else "output incomplete"
        print(f"elche bench: {said}; what was measured is in {where}", file=sys.stderr)
        return 128 + signal.Signals[stop] if stop else 1
    if not args.json:
        print(f"elche bench: wrote {out_dir / 'report.md'} and {results}")
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    from elche.baselines.ddp import run_ddp
    from elche.bench.runner import measure_speed_base_s
    from elche.workloads import get as get_workload

    check_speeds_given(args.speeds)
    speeds = list(args.speeds)
    workload = get_workload("digits")
    # One solo step paces both systems' ranks alike (see elche.bench.runner).
    base_s = measure_speed_base_s(workload, workload.load_split(args.seed), args.batch_size)
    ddp = run_ddp(
        speeds=speeds, epochs=args.epochs, batch_size=args.batch_size, seed=args.seed,
        base_step_s=base_s,
    )  # fmt: skip
    ours = _demo_summary(
        speeds=speeds, mode=args.mode, epochs=args.epochs, batch_size=args.batch_size,
        seed=args.seed, progress=False, speed_base_s=base_s, wire=args.wire,
        overlap=args.overlap,
    )  # fmt: skip
    ratio = float(ours["wall_s"]) / float(ddp["wall_s"])  # type: ignore[arg-type]  # JSON numbers
    doc = {
        "speeds": speeds,
        "epochs": args.epochs,
        "elche": ours,
        "torch_ddp": ddp,
        "wall_ratio": round(ratio, 4),
        "accuracy_delta": round(
            float(ours["eval_accuracy"] or 0.0) - float(ddp["eval_accuracy"] or 0.0),  # type: ignore[arg-type]  # JSON numbers
            4,
        ),
    }
    if args.json:
        print(json.dumps(doc))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"speeds {','.join(f'{s:g}' for s in speeds)}, {args.epochs} epochs")
    for column in ("system", "wall s", "samples/s", "eval accuracy", "final loss"):
        table.add_column(column, justify="right")
    for name, row in ((f"elche {args.mode}", ours), ("torch DDP", ddp)):
        table.add_row(
            name,
            f"{row['wall_s']:.3f}",
            f"{row['samples_per_s']:.0f}",
            f"{row['eval_accuracy']:.4f}",
            f"{row['final_loss']:.4f}",
        )
    Console().print(table)
    Console().print(f"elche wall time = [bold]{ratio:.2f} ×[/bold] DDP's")
    return 0


def _demo_summary(
    *, speeds: list[float], mode: str, epochs: int, batch_size: int, seed: int, progress: bool,
    save_path: str | None = None, resume_from: str | None = None,
    crash: dict[int, float] | None = None, stall: dict[int, float] | None = None,
    faults: FaultPlan | None = None, heartbeat_timeout_s: float = 10.0,
    speed_base_s: float | None = None, dashboard: str | None = None,
    tensorboard_dir: str | None = None, wire: str = "fp32", overlap: bool = True,
) -> dict[str, object]:  # fmt: skip
    from elche.api import train
    from elche.workloads import digits

    train_set, test_set = digits.load_digits_split(seed=0)
    result = train(
        digits.make_model,
        digits.make_optimizer,
        digits.step_fn,
        train_set,
        batch_size=batch_size,
        epochs=epochs,
        mode=mode,
        speeds=speeds,
        speed_base_s=speed_base_s,
        eval_fn=digits.eval_fn,
        eval_dataset=test_set,
        eval_every=epochs,
        save_path=save_path,
        resume_from=resume_from,
        seed=seed,
        progress=progress,
        crash=crash,
        stall=stall,
        faults=faults,
        heartbeat_timeout_s=heartbeat_timeout_s,
        dashboard=dashboard,
        tensorboard_dir=tensorboard_dir,
        wire=wire,
        overlap=overlap,
    )
    return result.summary


def _run_demo(args: argparse.Namespace) -> int:
    from elche.runtime.lifetimes import RESUME_HINT, Interrupted
    from elche.runtime.options import check_wire

    check_wire(args.wire)  # before the digits load

    speeds = args.speeds
    check_speeds_given(speeds)
    if args.ranks is not None and args.ranks < 1:
        raise ConfigError("ranks", f"must be >= 1, got {args.ranks}")
    if speeds is None:
        count = 3 if args.ranks is None else args.ranks
        speeds = (1.0, 0.5, 0.25)[:count] if count <= 3 else (1.0,) * count
    if args.ranks is not None and args.ranks != len(speeds):
        raise ConfigError("ranks", f"--ranks {args.ranks} disagrees with {len(speeds)} --speeds")
    resume = (
        f"elche demo --speeds {','.join(f'{s:g}' for s in speeds)} --mode {args.mode} "
        f"--epochs {args.epochs} --batch-size {args.batch_size} --seed {args.seed} "
        + (f"--wire {args.wire} " if args.wire != "fp32" else "")
        + ("" if args.overlap else "--no-overlap ")
        + "--resume-from "
    )
    hint = RESUME_HINT.set(lambda stem: resume + shlex.quote(stem))
    try:
        summary = _demo_summary(
            speeds=list(speeds), mode=args.mode, epochs=args.epochs, batch_size=args.batch_size,
            seed=args.seed, progress=not (args.json or args.no_progress),
            save_path=args.save_path, resume_from=args.resume_from,
            crash=_points(args.crash, "crash", args.epochs),
            stall=_points(args.stall, "stall", args.epochs),
            faults=read_faults(args.faults), heartbeat_timeout_s=args.heartbeat_timeout,
            dashboard=args.dashboard, tensorboard_dir=args.tensorboard, wire=args.wire,
            overlap=args.overlap,
        )  # fmt: skip
    except Interrupted as stop:  # the bundle is saved and the one line said where
        return int(stop.code)  # type: ignore[arg-type]  # Interrupted's code is an int
    finally:
        RESUME_HINT.reset(hint)
    if "joined_as" in summary:  # elche join ... elche demo: one rank's summary, not the run's
        return _joined_demo(summary, as_json=args.json)
    if args.json:
        print(json.dumps(summary))
    else:
        _print_demo(summary)
    if summary.get("outcome") != "completed":
        stem = summary.get("bundle")
        if stem is None:  # nothing was saved: there is nothing to resume
            print(f"elche demo: the run failed ({summary.get('reason')})", file=sys.stderr)
            return 3
        print(f"elche demo: to continue this run: {resume}{stem}", file=sys.stderr)
        return 3
    return 0


def _joined_demo(summary: dict[str, object], *, as_json: bool) -> int:
    """A demo that joined a running run (``elche join``): its rank's summary; 0 if it
    trained to the run's end (the run's own summary is rank 0's)."""
    stopped = summary.get("stopped")
    if as_json:
        print(json.dumps(summary))
    else:
        print(
            f"elche demo: joined the run as rank {summary['joined_as']}, trained "
            f"{summary.get('samples')} samples, stopped: {stopped}"
        )
    return 0 if stopped == "completed" else 3


def _print_demo(summary: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"elche demo — {summary['mode']}, {summary['world_size']} ranks")
    for column in ("rank", "speed", "samples", "idle s"):
        table.add_column(column, justify="right")
    for row in summary["per_rank"]:  # type: ignore[attr-defined]  # list of dicts
        idle = row.get("idle_s")
        table.add_row(
            str(row["rank"]),
            f"{row['speed']:g}",
            str(row["samples"]),
            "-" if idle is None else f"{idle:.2f}",
        )
    console.print(table)
    accuracy = summary.get("eval_accuracy")
    console.print(
        f"outcome [bold]{summary['outcome']}[/bold] · epochs {summary['epochs_completed']} · "
        f"training {summary['wall_s']:.2f} s (+{summary.get('startup_s') or 0:.2f} s start-up) · "
        f"{summary['samples_per_s']:.0f} samples/s · {summary['syncs']} averages · "
        f"final loss {summary['final_loss']} · eval accuracy "
        + ("-" if accuracy is None else f"[bold]{accuracy:.3f}[/bold]")
        + f" · lost {summary['lost_samples']} · dead {summary['dead_ranks']}"
    )
