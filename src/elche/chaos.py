"""``elche chaos``: short real training runs under random fault schedules, audited.

Each run is one ``elche.train`` of ``digits-logreg`` (3 ranks, 2 epochs) in a
child process, under a ``FaultPlan`` drawn from the run's seed: ranks
SIGKILLed or stalled, slowed down, a failing ``checkpoint_fn``, the
coordinator killed, SIGTERM to the launcher (the child), the save path filled
up, at random progress points including the start-up (epoch 0.0) and the last
batch before the final save. A run that fills its save path gets a tmpfs of
its own for it, in a private mount namespace (``_child``; root only, else the
run is skipped with the reason). After each run it checks:

- ``bounded``: the run, and the run that resumes its bundle, each ended within
  ``bound_s`` (else it is killed);
- ``outcome``: ``completed``, or ``saved_and_shutdown`` with a bundle that
  a resumed run (no faults) takes to ``completed``; or, where the save path
  filled up, ``failed`` with a reason that names the full disk (``No space
  left on device``);
- ``audit``: from the ranks' own records (``rank<R>.spans.jsonl``, what each
  averaging round took from each rank), every sample of every epoch is in
  exactly one average: 0 lost, 0 trained twice;
- ``evals``: in a run that completed (itself or resumed), the timeline ends
  every epoch once, and every epoch has its eval (the runs pass an
  ``eval_fn``, asked after each epoch);
- ``no_leftovers``: no process the run started outlives it (the runner is
  the subreaper of everything the run starts, so orphans come back to it).

A runner killed mid-run takes its run with it: the run's launcher watches
the runner and stops as at a SIGTERM once it is gone.

``--seed`` reproduces every run's schedule exactly; a failing run's plan is
written next to the runs, with the ``elche sim --faults`` command that replays
it in the simulator (one fault vocabulary: ``elche.core.faults``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elche.core import timeline as tl
from elche.core.errors import ConfigError
from elche.core.faults import FaultPlan
from elche.monitor.timeline import read_timeline
from elche.runtime.filling import FILL_FILE
from elche.runtime.lifetimes import process_state, watch_launcher

__all__ = [
    "WORKLOAD",
    "ChaosRun",
    "audit_evals",
    "audit_spans",
    "draw_plan",
    "print_table",
    "rows_json",
    "run_chaos",
    "sim_command",
]

WORLD_SIZE = 3
EPOCHS = 2
BATCH_SIZE = 32
NUM_SAMPLES = 1437  # digits' training split
HEARTBEAT_TIMEOUT_S = 2.0
WORKLOAD = "digits-logreg"
RESULT_TAG = "CHAOS-RESULT "
KINDS = (
    "kill", "stall", "slow", "fail_checkpoint", "kill_coordinator", "stop_launcher",
    "fill_save_path",
)  # fmt: skip
# The coordinator at most twice (within the default max_coordinator_restarts);
# one SIGTERM ends the run; one full disk is full.
_MAX_OF = {"kill_coordinator": 2, "stop_launcher": 1, "fill_save_path": 1}
TMPFS_SIZE = "1m"  # a run's bundle is ~10 KiB: room for it, filled in a moment
_PR_SET_CHILD_SUBREAPER = 36


@dataclass(slots=True)
class ChaosRun:
    """One run: its schedule, what happened and which invariants broke."""

    index: int
    seed: str  # the plan's seed: ``S:index``
    plan: str  # FaultPlan.to_json
    skipped: str = ""  # why the run was not made (a full disk needs root to mount a tmpfs)
    outcome: str = ""
    resumed: bool = False
    wall_s: float = 0.0
    lost_samples: int = -1
    twice_samples: int = -1
    left_behind: int = 0
    failures: list[str] = field(default_factory=list)
    plan_file: str = ""
    replay: str = ""

    @property
    def ok(self) -> bool:
        return not self.failures


def draw_plan(
    rng: random.Random, *, world_size: int = WORLD_SIZE, epochs: int = EPOCHS
) -> FaultPlan:
    """A random schedule of 1 to 3 faults (``KINDS``) at progress points (``at_epoch``).

    Points are the start-up (0.0), anywhere in the run, or the last batch
    before the final save. At most ``world_size - 1`` ranks are killed or
    stalled (a run with no rank left has nothing to save), the coordinator
    is killed at most twice (within the default ``max_coordinator_restarts``),
    the launcher is sent SIGTERM and the save path filled at most once.
    """
    plan = FaultPlan()
    gone: set[int] = set()
    drawn: list[str] = []
    last = epochs - 1 / NUM_SAMPLES
    for _ in range(rng.randint(1, 3)):
        rank = rng.randrange(world_size)
        at = rng.choice((0.0, last, rng.uniform(0.0, epochs), rng.uniform(0.0, epochs)))
        kind = rng.choice(KINDS)
        if kind in ("kill", "stall") and (rank in gone or len(gone) == world_size - 1):
            kind = "slow"
        if drawn.count(kind) == _MAX_OF.get(kind, world_size):
            kind = "slow"
        drawn.append(kind)
        if kind in ("kill", "stall"):
            gone.add(rank)
        if kind == "stop_launcher":
            plan = plan.stop_launcher(rank=rank, at_epoch=at)
        elif kind == "fill_save_path":
            plan = plan.fill_save_path(rank=rank, at_epoch=at)
        elif kind == "kill":
            plan = plan.kill(rank=rank, at_epoch=at)
        elif kind == "stall":
            plan = plan.stall(rank=rank, at_epoch=at)
        elif kind == "slow":
            plan = plan.slow(rank=rank, at_epoch=at, speed=round(rng.uniform(0.2, 1.0), 2))
        elif kind == "fail_checkpoint":
            plan = plan.fail_checkpoint(rank=rank, at_epoch=at)
        else:
            plan = plan.kill_coordinator(rank=rank, at_epoch=at)
    return plan


def audit_spans(run_dirs: Iterable[Path], *, epochs: int, num_samples: int) -> tuple[int, int]:
    """Samples lost and samples trained twice, from the ranks' own span records.

    Returns:
        ``(lost, twice)``: positions of the ``epochs`` epochs that no
        recorded average holds, and those that more than one holds.
    """
    counts = [[0] * num_samples for _ in range(epochs)]
    for run_dir in run_dirs:
        for record in sorted(run_dir.glob("rank*.spans.jsonl")):
            for line in record.read_text(encoding="utf-8").splitlines():
                for epoch, offset, size in json.loads(line)["spans"]:
                    row = counts[epoch]
                    for position in range(offset, offset + size):
                        row[position] += 1
    lost = sum(row.count(0) for row in counts)
    twice = sum(1 for row in counts for c in row if c > 1)
    return lost, twice


def audit_evals(run_dirs: Iterable[Path], *, epochs: int) -> list[str]:
    """What the runs' timelines say against "each epoch ended once, with its eval".

    Returns:
        One line per epoch of the ``epochs`` that was not ended exactly once
        (``EpochEnd``) or has no ``Eval``, over the run and its resumed run.
    """
    ended: Counter[int] = Counter()
    evaluated: set[int] = set()
    for run_dir in run_dirs:
        for event in read_timeline(run_dir):
            if isinstance(event, tl.EpochEnd):
                ended[event.epoch] += 1
            elif isinstance(event, tl.Eval):
                evaluated.add(event.epoch - 1)  # ``Eval.epoch``: epochs done
    problems = [f"epoch {e} ended {ended[e]} times" for e in range(epochs) if ended[e] != 1]
    return problems + [f"epoch {e} has no eval" for e in range(epochs) if e not in evaluated]


def sim_command(plan_file: Path, mode: str) -> str:
    """The ``elche sim`` line that replays ``plan_file`` on the same run's shape."""
    return (
        f"elche sim --ranks {WORLD_SIZE} --speeds 1,1,1 --samples {NUM_SAMPLES} "
        f"--batch-size {BATCH_SIZE} --epochs {EPOCHS} --mode {mode} "
        f"--heartbeat-timeout {HEARTBEAT_TIMEOUT_S:g} --faults {plan_file}"
    )


def run_chaos(
    *,
    runs: int,
    seed: int,
    mode: str,
    workdir: Path,
    first: int = 0,
    bound_s: float = 90.0,
    on_row: Callable[[ChaosRun], None] | None = None,
) -> list[ChaosRun]:
    """Run ``runs`` audited runs, indices ``first`` on; returns one row each (see
    the module docstring).

    ``on_row`` is given each row as its run ends (a long series shows its
    progress, and what it found survives an interruption). Run ``i`` draws
    its schedule from ``f"{seed}:{i}"`` whatever ``first`` is, so a series
    split in parts (``first=0, runs=100`` and ``first=100, runs=100``) makes
    the runs of the whole.

    Raises:
        ConfigError: ``workdir`` is full or read-only (field ``dir``; ``on_row``
            had the rows before it); ``runs`` below 1 (field ``runs``), ``first`` below 0,
            ``bound_s`` not a finite number > 0; nothing has run.
    """
    if not (bound_s > 0 and math.isfinite(bound_s)):
        raise ConfigError("bound_s", f"must be a finite number of seconds > 0, got {bound_s!r}")
    if runs < 1:
        raise ConfigError("runs", f"must be an integer >= 1, got {runs!r}")
    if first < 0:
        raise ConfigError("first", f"must be an integer >= 0, got {first!r}")
    _become_subreaper()
    workdir.mkdir(parents=True, exist_ok=True)
    rows: list[ChaosRun] = []
    for index in range(first, first + runs):
        plan_seed = f"{seed}:{index}"
        plan = draw_plan(random.Random(plan_seed))
        row = ChaosRun(index=index, seed=plan_seed, plan=plan.to_json())
        try:
            _one(row, mode, workdir / f"run{index}", bound_s)
            if not row.ok:
                plan_file = workdir / f"run{index}.faults.json"
                plan_file.write_text(row.plan, encoding="utf-8")
                row.plan_file, row.replay = str(plan_file), sim_command(plan_file, mode)
        except OSError as exc:  # a full or read-only folder: no run there can be checked
            named = exc.filename is None or Path(exc.filename).is_relative_to(workdir)
            if exc.errno not in _UNWRITABLE or not named:  # (a write names no file)
                raise
            raise ConfigError(
                "dir",
                f"cannot write in {workdir} ({exc.strerror or exc}): run {index} could not "
                "be checked, nor any after it; give a folder with room (--dir)",
            ) from None
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


# The runner's pid, in each run's environment: the run stops once the runner is gone.
_RUNNER_ENV = "ELCHE_CHAOS_RUNNER"
# What a folder that cannot take a run's files says.
_UNWRITABLE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES})


def _one(row: ChaosRun, mode: str, where: Path, bound_s: float) -> None:
    fills = '"fill_save_path"' in row.plan
    row.skipped = _cannot_mount() if fills else ""
    if row.skipped:
        print(f"elche chaos: run {row.index} skipped: {row.skipped}", file=sys.stderr, flush=True)
        return
    started = time.monotonic()
    first, why = _child(where / "a", mode, row.plan, None, bound_s, tmpfs=fills)
    run_dirs = [where / "a" / "run"]
    row.outcome = str(first.get("outcome", "no result"))
    completed = row.outcome == "completed" and not why  # by itself or resumed
    if why:
        row.failures.append(why)
    if row.outcome == "failed" and fills and not why and _says_unwritten(first):
        pass  # the full disk: a clear report of what could not be written
    elif row.outcome == "saved_and_shutdown":
        bundle = first.get("bundle")
        if not bundle:
            row.failures.append("saved_and_shutdown without a bundle")
        else:
            row.resumed = True  # a run of its own: it gets a bound of its own
            resumed, why = _child(where / "b", mode, None, str(bundle), bound_s)
            run_dirs.append(where / "b" / "run")
            if why:
                row.failures.append(f"resume: {why}")
            elif resumed.get("outcome") != "completed":
                row.failures.append(
                    f"resume ended {resumed.get('outcome')}: {resumed.get('reason')}"
                )
            else:
                completed = True
    elif row.outcome != "completed" and not why:
        row.failures.append(f"outcome {row.outcome}: {first.get('reason')}")
    row.wall_s = round(time.monotonic() - started, 2)
    if row.outcome in ("completed", "saved_and_shutdown"):
        row.lost_samples, row.twice_samples = audit_spans(
            run_dirs, epochs=EPOCHS, num_samples=NUM_SAMPLES
        )
        if row.lost_samples or row.twice_samples:
            row.failures.append(
                f"audit: {row.lost_samples} sample(s) lost, {row.twice_samples} trained twice"
            )
    if completed:
        row.failures += [f"evals: {why}" for why in audit_evals(run_dirs, epochs=EPOCHS)]
    row.left_behind = _reap_leftovers()
    if row.left_behind:
        row.failures.append(f"{row.left_behind} process(es) left behind")


def _cannot_mount() -> str:
    """Why this process cannot give a run a tmpfs of its own ('' when it can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "filling the save path needs root (to mount a tmpfs for it)"
    if shutil.which("unshare") is None:
        return "filling the save path needs unshare (util-linux) for a private tmpfs"
    return ""


def _says_unwritten(summary: dict[str, Any]) -> bool:
    """A failed run's reason says that the full disk refused a write.

    "could not be written" alone is no excuse: a run whose writer was lost
    or never answered says it too (``the bundle could not be written (no rank
    was left to write the model)``), and that is a broken run, full disk or not.
    """
    return os.strerror(errno.ENOSPC) in str(summary.get("reason", ""))


def _child(
    where: Path,
    mode: str,
    plan: str | None,
    resume: str | None,
    bound_s: float,
    *,
    tmpfs: bool = False,
) -> tuple[dict[str, Any], str]:
    """One ``elche.train`` in a child process; returns its summary and what went wrong.

    With ``tmpfs`` the child runs in a mount namespace of its own (``unshare``)
    and mounts a ``TMPFS_SIZE`` tmpfs on its save path's folder: the mount
    ends with the namespace's last process, whatever happens to the runner.
    """
    where.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "elche.chaos", str(where), mode, plan or "", resume or ""]
    if tmpfs:
        args = ["unshare", "--mount", "--propagation", "private", *args, "tmpfs"]
    env = dict(os.environ, **{_RUNNER_ENV: str(os.getpid())})  # the child ends with it
    with (where / "stderr.txt").open("w") as err:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        try:
            out, _ = proc.communicate(timeout=bound_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return {}, f"did not end within {bound_s:.0f} s (killed)"
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :]), ""
    return {}, f"exited {proc.returncode} without a result (see {where / 'stderr.txt'})"


def _become_subreaper() -> None:
    """Orphans of the runs (a launcher's children) are re-parented to this process."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _children() -> list[int]:
    """This process's live children (zombies reaped)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return []
        if pid == 0:
            break
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        state = process_state(int(entry.name)) if entry.name.isdigit() else None
        if state is not None and state[1] == me and state[0] != "Z":
            found.append(int(entry.name))
    return found


def _reap_leftovers(grace_s: float = 5.0) -> int:
    """Wait up to ``grace_s`` for a run's processes to end; kill and count the rest."""
    deadline = time.monotonic() + grace_s
    while (left := _children()) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling /proc: a condition with a deadline
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    return len(left)


def rows_json(rows: Sequence[ChaosRun]) -> list[dict[str, Any]]:
    """The rows as ``--json`` prints them."""
    return [{**asdict(row), "ok": row.ok} for row in rows]


def print_table(rows: Sequence[ChaosRun], workdir: Path) -> None:
    """The runs as a table, then each failing run's failures and replay line."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"elche chaos: {len(rows)} run(s) in {workdir}")
    for column in ("run", "seed", "faults", "outcome", "resumed", "wall s", "lost", "twice", "ok"):
        table.add_column(column, justify="right")
    for row in rows:
        faults = ", ".join(
            f"{f['kind']}@r{f['rank']}:{f.get('at_epoch', 0):.2f}"
            for f in json.loads(row.plan)["faults"]
        )
        table.add_row(
            str(row.index), row.seed, faults, row.outcome or ("skipped" if row.skipped else ""),
            "yes" if row.resumed else "",
            f"{row.wall_s:.1f}", str(row.lost_samples), str(row.twice_samples),
            "ok" if row.ok else "[bold red]FAILED[/bold red]",
        )  # fmt: skip
    console = Console(width=max(Console().width, 132))
    console.print(table)
    failed = [row for row in rows if not row.ok]
    for row in failed:
        console.print(f"run {row.index} (seed {row.seed}): " + "; ".join(row.failures))
        console.print(f"  replay in the simulator: {row.replay}")
    skipped = [row for row in rows if row.skipped]
    for row in skipped:
        console.print(f"run {row.index} (seed {row.seed}) skipped: {row.skipped}")
    made = len(rows) - len(skipped)
    held = made - len(failed)
    console.print(f"{held}/{made} run(s) held every invariant ({len(skipped)} skipped)")


def _checkpoint(version: int, model: Any) -> None:
    """The runs' ``checkpoint_fn``: nothing to keep (``FailCheckpoint`` makes it fail)."""


def _train(where: Path, mode: str, plan: str, resume: str) -> dict[str, Any]:
    from elche.api import train  # the child only: the api and torch
    from elche.runtime.lifetimes import Interrupted
    from elche.workloads import digits_logreg as workload

    train_set, test_set = workload.load_split(seed=0)
    try:
        result = train(
            workload.make_model, workload.make_optimizer, workload.step_fn, train_set,
            batch_size=BATCH_SIZE, epochs=EPOCHS, ranks=WORLD_SIZE, mode=mode,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, progress=False,
            run_dir=str(where / "run"), save_path=str(where / "bundle" / "run"),
            checkpoint_fn=_checkpoint, checkpoint_every=1,
            faults=FaultPlan.from_json(plan) if plan else None, resume_from=resume or None,
            eval_fn=workload.eval_fn, eval_dataset=test_set,
        )  # fmt: skip
    except Interrupted as stop:  # the StopLauncher fault: SIGTERM to this process
        if stop.result is None:
            return {"outcome": "interrupted", "reason": "before the run formed"}
        result = stop.result
    return dict(result.summary or {})


def _on_tmpfs(where: Path, train_one: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Train with the save path's folder on a fresh tmpfs (this process's mount
    namespace), then copy the bundle out of it so a resume can read it after."""
    folder = where / "bundle"
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(folder)], check=True
    )
    try:
        summary = train_one()
        if summary.get("bundle"):
            kept = where / "bundle-kept"
            shutil.copytree(folder, kept, ignore=shutil.ignore_patterns(FILL_FILE))
            summary["bundle"] = str(kept / Path(str(summary["bundle"])).name)
        return summary
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=False)


if __name__ == "__main__":
    # The runner gone (killed), this run stops as at a SIGTERM: nothing outlives the runner.
    runner = int(os.environ.get(_RUNNER_ENV) or os.getppid())
    watch_launcher(runner, on_gone=lambda: os.kill(os.getpid(), signal.SIGTERM))
    where_, args_ = Path(sys.argv[1]), sys.argv[2:5]
    if sys.argv[5:] == ["tmpfs"]:
        summary = _on_tmpfs(where_, lambda: _train(where_, *args_))
    else:
        summary = _train(where_, *args_)
    print(RESULT_TAG + json.dumps(summary, default=str), flush=True)
