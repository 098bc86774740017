"""Benchmark runs across namespace hosts: ``elche bench --suite hosts``.

Theory of operation. A suite with ``link_mbit`` rates trains every
multi-rank system on a ``elche.testing.hosts.Rig``: one namespace host per
rank, one rig per rate, every host's link shaped to that rate both ways, so
each all-reduce and every control message crosses a link of limited
bandwidth. Every system starts the same way, as a user would start it on
real hosts: one ``torchrun`` agent per host (static rendezvous, node rank
``i`` on host ``i``, rank 0's host the master), each starting
``elche.bench.on_host`` with the system's name. Host ``i``'s rank runs at
``speeds[i]``, paced by the shared solo step. Every host keeps its files in
its own ``/tmp``; the parent reads them where the rig keeps them
(``Rig.tmp(i)``): DDP's per-rank reports from the ranks' output, elche's
timeline from rank 0's host and each rank's report from its own host.

A run that fails or outlives ``HOSTS_TIMEOUT_S`` raises ``RuntimeError``
with the tail of every host's output; its processes are killed.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elche.bench.on_host import REPORT_PREFIX, SUMMARY_PREFIX, HostRun
from elche.bench.suites import DDP, ELCHE_MODES, WorkloadPlan

if TYPE_CHECKING:
    from elche.testing.hosts import Rig

__all__ = ["HOSTS_TIMEOUT_S", "refusal", "run_on_hosts"]

HOSTS_TIMEOUT_S = 600.0  # one run; a hung one must not hang the suite
POLL_S = 0.1  # how often the parent looks at its torchrun agents
TAIL_CHARS = 2000  # of each host's output, in an error


def refusal() -> str | None:
    """Why the hosts suite cannot run here (the rig's ``missing()``), or None."""
    from elche.testing.hosts import missing

    return missing()


def run_on_hosts(
    system: str,
    plan: WorkloadPlan,
    speeds: Sequence[float],
    *,
    seed: int,
    speed_base_s: float,
    rig: Rig,
    wire: str = "fp32",
    overlap: bool = True,
) -> dict[str, Any]:
    """Train ``plan`` with ``system`` across ``rig``'s hosts, one rank per host.

    ``wire`` and ``overlap`` are an elche mode's (``elche.train``'s).

    Returns:
        The run record's numbers, as ``runner.run_one`` merges them.
    """
    from elche.baselines.ddp import _Plan, _summarize
    from elche.bench.runner import _baseline_record, elche_record

    if system not in (DDP, *ELCHE_MODES):
        accepted = ", ".join((DDP, *ELCHE_MODES))
        raise ValueError(f"across hosts the bench runs {accepted}; not {system!r}")
    if len(rig.hosts) != len(speeds):
        raise ValueError(f"a rig of {len(rig.hosts)} hosts for {len(speeds)} ranks")
    run_dir = f"/tmp/elche-bench-{secrets.token_hex(4)}"  # every host's own /tmp
    run = HostRun(system, plan.name, plan.epochs, plan.batch_size, seed,
                  tuple(speeds), speed_base_s, run_dir, plan.train_samples, wire,
                  overlap)  # fmt: skip
    launched_at = time.time()  # compared with rank 0's clock: one machine, one clock
    logs = _torchrun(rig, run)
    if system == DDP:
        reports = [_line(log, REPORT_PREFIX) for log in logs]
        train_set, test_set = run.split()
        ddp_plan = _Plan(tuple(speeds), plan.epochs, plan.batch_size, seed, plan.name,
                         train_set, test_set, "", HOSTS_TIMEOUT_S, speed_base_s)  # fmt: skip
        return _baseline_record(_summarize(ddp_plan, reports, launched_at))
    from elche.monitor.summary import rank_report_file
    from elche.monitor.timeline import read_timeline

    summary = _line(logs[0], SUMMARY_PREFIX)
    dirs = [rig.tmp(i) / Path(run_dir).name for i in range(len(speeds))]
    timeline = read_timeline(dirs[0])
    reports = [_json_file(rank_report_file(dirs[r], r)) for r in range(len(speeds))]
    return elche_record(system, summary, timeline, reports)


def _torchrun(rig: Rig, run: HostRun) -> list[str]:
    """Start one torchrun agent per host, wait for all; every host's output."""
    port = rig.free_port(0)
    world = len(run.speeds)
    paths = [rig.tmp(i) / f"{Path(run.run_dir).name}.log" for i in range(world)]
    procs = []
    for i, path in enumerate(paths):
        with path.open("w") as log:
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(world),
                    "--node-rank", str(i), "--nproc-per-node", "1", "--master-addr",
                    rig.hosts[0].name, "--master-port", str(port), "-m", "elche.bench.on_host",
                    *run.argv()]  # fmt: skip
            env = {"OMP_NUM_THREADS": "1"}
            procs.append(rig.spawn(i, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + HOSTS_TIMEOUT_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break  # one host failed: the others would wait on it until their timeout
        time.sleep(POLL_S)  # polling the agents, bounded by the deadline
    failed = [i for i, p in enumerate(procs) if p.poll() != 0]
    for i in range(len(procs)):
        rig.kill_host(i)
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in paths]
    if failed:
        tails = "\n".join(f"--- host {i}:\n{texts[i][-TAIL_CHARS:]}" for i in failed)
        raise RuntimeError(
            f"{run.system} across hosts: hosts {failed} failed or timed out\n{tails}"
        )
    return texts


def _line(text: str, prefix: str) -> dict[str, Any]:
    """The JSON of the last ``prefix`` line of a host's output."""
    found = [line for line in text.splitlines() if line.startswith(prefix)]
    if not found:
        raise RuntimeError(f"a host printed no {prefix.strip()} line:\n{text[-TAIL_CHARS:]}")
    loaded: dict[str, Any] = json.loads(found[-1].removeprefix(prefix))
    return loaded


def _json_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    loaded: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return loaded
