"""The benchmark suites: which workloads, rigs and systems ``elche bench`` runs.

Sizes are chosen on the 2-core development machine (CPU only) so that

- every step is compute-dominated where the workload allows it (digits-cnn
  ~5 ms, digits-ae ~3 ms, text-gru ~15 ms a step at batch 32 on one core;
  digits-logreg and digits-mlp stay sub-millisecond and show the
  communication-bound end honestly);
- the quick suite's whole invocation, start-up included, fits in 5 minutes;
- torch DDP and elche get identical work: the same workload, split, seed,
  epochs, per-rank batch size and speed injection.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = [
    "ALL_SYSTEMS",
    "BASELINES",
    "DASHBOARD_SUFFIX",
    "DDP",
    "ELCHE_MODES",
    "EVAL_TARGETS",
    "FULL",
    "GPT",
    "HEADLINE_SYSTEMS",
    "HOSTS",
    "QUICK",
    "SOLO",
    "SUITES",
    "TORCHFT_SYSTEMS",
    "WAIT_SUFFIX",
    "WIRE_SUFFIX",
    "Cell",
    "Suite",
    "WorkloadPlan",
    "split_averaging",
    "split_system",
    "with_dashboard",
]

DDP = "torch-ddp"
SOLO = "solo"
# torchft's two algorithms (``elche.baselines.torchft_peers``; ``elche[peers]``).
TORCHFT_SYSTEMS = ("torchft-localsgd", "torchft-diloco")
BASELINES = (DDP, *TORCHFT_SYSTEMS)  # the peers, run by elche.baselines
ELCHE_MODES = ("sync", "cadence", "cpu-sync", "cpu-cadence", "cpu-async")
ALL_SYSTEMS = (*BASELINES, *ELCHE_MODES)  # per rig; SOLO runs once per workload
# The eval every system must reach for ``time_to_target_s``, per workload, in
# its ``metric`` (accuracy for the digits and text-gru, reconstruction MSE
# for digits-ae, held-out bits per character for tiny-gpt): about what the
# slowest-converging system of its suite reaches within its epochs, so the
# time says who gets there first.
EVAL_TARGETS: dict[str, float] = {
    "digits-logreg": 0.90,
    "digits-mlp": 0.93,
    "digits-cnn": 0.95,
    "digits-ae": 0.03,
    "text-gru": 0.45,
    "digits-wide": 0.93,
    "tiny-gpt": 3.5,  # held-out bits per character (lower is better); one solo epoch: ~3.2
}
# The quick suite's headline: these systems on this workload also run on
# every seed of ``Suite.extra_seeds``, and their rows report the spread.
HEADLINE_SYSTEMS = ("cadence", DDP)
# ``cadence+dashboard``: cadence, its dashboard served and read (``elche bench --dashboard``).
DASHBOARD_SUFFIX = "+dashboard"
# ``cadence+bf16``: cadence with ``wire="bf16"`` whatever the suite's wire (an A/B in one suite).
WIRE_SUFFIX = "+bf16"
# ``cadence+wait``: cadence with ``overlap=False`` (every rank waits for each
# round) whatever the suite says (an A/B in one suite).
WAIT_SUFFIX = "+wait"


@dataclass(frozen=True, slots=True)
class WorkloadPlan:
    """One workload and how long to train it in every cell."""

    name: str
    epochs: int
    batch_size: int = 32  # per rank per step, for every system (DDP's convention)
    # Train on this many of the training set's samples, evenly spaced
    # (``elche.workloads.load_split``); None: all of them. The held-out set stays whole.
    train_samples: int | None = None
    # The eval ``time_to_target_s`` waits for; None: the workload's ``EVAL_TARGETS`` entry.
    target: float | None = None

    @property
    def target_eval(self) -> float | None:
        """The eval this plan's rows time the systems to."""
        return self.target if self.target is not None else EVAL_TARGETS.get(self.name)


@dataclass(frozen=True, slots=True)
class Cell:
    """One training run of a suite: ``system`` trains ``plan`` on the rig ``speeds``."""

    plan: WorkloadPlan
    system: str
    speeds: tuple[float, ...]  # solo: (1.0,), one rank at speed 1
    repeat: int
    seed: int
    link_mbit: float | None = None  # across namespace hosts at this rate; None: this host
    extra_seed: bool = False  # one of ``Suite.seed_jobs``, run after the repeats

    @property
    def name(self) -> str:
        """The system, and the seed of an extra-seed run: ``cadence-seed1``."""
        return f"{self.system}-seed{self.seed}" if self.extra_seed else self.system

    def label(self) -> str:
        """How the progress and the report name it: ``digits-cnn [1,0.5] cadence (repeat 1)``."""
        rig = ",".join(f"{s:g}" for s in self.speeds)
        link = "" if self.link_mbit is None else f" {self.link_mbit:g} Mbit/s"
        when = f"seed {self.seed}" if self.extra_seed else f"repeat {self.repeat + 1}"
        return f"{self.plan.name} [{rig}]{link} {self.system} ({when})"

    def to_json(self) -> dict[str, object]:
        """The cell as ``results.json`` lists one not run."""
        return {
            "workload": self.plan.name, "system": self.system, "speeds": list(self.speeds),
            "link_mbit": self.link_mbit, "repeat": self.repeat, "seed": self.seed,
            "cell": self.label(),
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Suite:
    """A benchmark: every workload × rig × system, ``repeats`` times.

    Within a repeat, each workload first trains ``solo`` (the efficiency
    denominator), then every rig runs every system; odd repeats run the
    systems in reverse order, so DDP and elche are interleaved and neither
    always goes first.
    """

    name: str
    workloads: tuple[WorkloadPlan, ...]
    rigs: tuple[tuple[float, ...], ...]
    systems: tuple[str, ...] = ALL_SYSTEMS
    repeats: int = 1
    seed: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)
    # The headline cells (``HEADLINE_SYSTEMS`` on these workloads) also run
    # once on each of these seeds (split and shuffle), after the repeats:
    # their rows report the spread over seeds.
    extra_seeds: tuple[int, ...] = ()
    headline_workloads: tuple[str, ...] = ()
    # Seconds the rig's paced ranks train at once, alone, to measure what
    # the machine delivers to them (``bench.capacity``); 0 skips it.
    capacity_s: float = 3.0
    # Link rates in Mbit/s: non-empty, every multi-rank run trains across
    # namespace hosts (``bench.hosts``), one rig per rate; empty, on this host.
    link_mbit: tuple[float, ...] = ()
    # Every elche mode's averaging wire, but MODE+bf16's (``elche bench --wire``).
    wire: str = "fp32"
    # Every elche mode's collective rounds overlap training (``elche bench --no-overlap``).
    overlap: bool = True

    def links(self) -> tuple[float | None, ...]:
        """The link rates the rigs run at; ``(None,)`` for a suite on this host."""
        return self.link_mbit or (None,)

    def num_runs(self) -> int:
        """How many training runs the suite makes (solo included)."""
        return len(self.cells())

    def cells(self) -> list[Cell]:
        """Every training run of the suite, in running order (``bench.runner.run_suite``).

        Each repeat trains each workload ``solo``, then every rig and link rate
        every system (odd repeats in reverse order); the ``seed_jobs`` follow.
        """
        cells: list[Cell] = []
        for repeat in range(self.repeats):
            order = self.systems if repeat % 2 == 0 else tuple(reversed(self.systems))
            for plan in self.workloads:
                cells.append(Cell(plan, SOLO, (1.0,), repeat, self.seed))
                cells += [
                    Cell(plan, system, rig, repeat, self.seed, link)
                    for rig in self.rigs
                    for link in self.links()
                    for system in order
                ]
        return cells + [
            Cell(plan, system, rig, 0, seed, extra_seed=True)
            for seed, plan, system, rig in self.seed_jobs()
        ]

    def seed_jobs(self) -> list[tuple[int, WorkloadPlan, str, tuple[float, ...]]]:
        """``(seed, plan, system, rig)`` of every extra-seed run, in running order."""
        plans = [p for p in self.workloads if p.name in self.headline_workloads]
        systems = [s for s in self.systems if split_system(s)[0] in HEADLINE_SYSTEMS]
        return [
            (seed, plan, system, rig)
            for seed in self.extra_seeds
            for plan in plans
            for rig in self.rigs
            for system in systems
            if not split_system(system)[1]
        ]


# The quick suite covers both ends of the spectrum on the rig, and a
# transformer:
#
# - digits-cnn, compute-bound: ~5 ms a step, 45 steps an epoch for one
#   speed-1 rank; ~0.98 test accuracy within 15 epochs in every system, so eval
#   compares converged models. DDP trains ~6 s on [1, 0.5, 0.25], cadence
#   ~2.6 s. With communication free, no system beats 0.429 × DDP here (the
#   lock-step bound, ``metrics.lockstep_ratio``).
# - digits-mlp, communication-bound: a ~0.5 ms step, so DDP's all-reduce per
#   step is most of its wall (~2.2 s against cadence's ~0.7 s), as it is for
#   a large model across hosts.
#
# - tiny-gpt, a transformer: one epoch over a quarter of its training set
#   (1,024 of the 4,096 windows, evenly spaced: 128 steps of 8 for one
#   rank), evaluated on the whole held-out split. A full epoch of every
#   system is 5-6 minutes alone (the gpt suite's); this cut is ~105 s with
#   the capacity, DDP training ~9 s, cadence ~4.5 s (quiet machine).
#   Its target, 4.0 bits per character, is about what the lock-step systems
#   reach in it.
#
# Every system's ranks (and elche's coordinator) fork from elche's warm fork
# server (torch loaded), so a multi-rank run pays ~0.2–0.7 s of process
# start-up (DDP's spawned ranks paid 4.5 s, 20–40 s on a loaded machine). One repeat: three
# interleaved repeats of the digits alone took 4m49s with both torchft peers
# (quiet machine, 2026-12-02); the headline cells (digits-cnn and tiny-gpt)
# show their spread over three seeds instead. The whole invocation took
# 3 minutes on the quiet machine with one seed, ~3m40s with three.
QUICK = Suite(
    name="quick",
    workloads=(
        WorkloadPlan("digits-cnn", epochs=15),
        WorkloadPlan("digits-mlp", epochs=20),
        WorkloadPlan("tiny-gpt", epochs=1, batch_size=8, train_samples=1024, target=4.0),
    ),
    rigs=((1.0, 0.5, 0.25),),
    extra_seeds=(1, 2),
    headline_workloads=("digits-cnn", "tiny-gpt"),
)

FULL = Suite(
    name="full",
    workloads=(
        WorkloadPlan("digits-logreg", epochs=20),
        WorkloadPlan("digits-mlp", epochs=20),
        WorkloadPlan("digits-cnn", epochs=20),
        WorkloadPlan("digits-ae", epochs=20),
        WorkloadPlan("text-gru", epochs=4),
    ),
    rigs=((1.0, 1.0), (1.0, 0.5), (1.0, 0.5, 0.25), (1.0, 0.9, 0.3, 0.3)),
    notes=(
        "[1, 0.9, 0.3, 0.3] asks for 2.5 cores of compute on a 2-core machine: "
        "ranks contend for CPU, which no speed injection models.",
    ),
)

# Several hosts at limited bandwidth (issue 14 item 6): three namespace hosts,
# one rank each, links shaped to 1000 and 100 Mbit/s, and digits-wide, a
# 1.1 M-parameter MLP (4.5 MB a copy) stepping in ~17 ms: at 100 Mbit/s one
# gradient all-reduce of it takes ~0.5 s, so DDP, which all-reduces every
# step, is bound by the link, and elche, which averages about once an epoch,
# is not. Every run starts torchrun on each host (25-60 s of start-up measured
# on the loaded 2-core machine); 5 epochs keep the training ~3 minutes in all.
HOSTS = Suite(
    name="hosts",
    workloads=(WorkloadPlan("digits-wide", epochs=5),),
    rigs=((1.0, 0.5, 0.25),),
    systems=(DDP, "cadence", "cpu-cadence", "cpu-async"),
    link_mbit=(1000.0, 100.0),
    notes=(
        "Every multi-rank run: one network-namespace host per rank on one machine, "
        "links shaped both ways with tc tbf, one torchrun agent per host; solo runs "
        "on the machine itself.",
    ),
)


# The gpt suite: tiny-gpt, a 1 M-parameter transformer whose step is 62 ms on
# one core of the quiet 2-core machine (106-168 ms when it is busy): a
# one-epoch run of every system would take 5-6 minutes on its own, more than
# the quick suite's five beside the digits. One epoch (4,096 windows of 64
# characters), one repeat; torch DDP, both torchft peers, cadence and
# cpu-cadence each on the fp32 and the bf16 wire (the wire's effect on
# held-out bits per character, in the same invocation), and DDP and cadence
# again on two more seeds (the spread of the headline).
GPT = Suite(
    name="gpt",
    workloads=(WorkloadPlan("tiny-gpt", epochs=1, batch_size=8),),
    rigs=((1.0, 0.5, 0.25),),
    systems=(
        *BASELINES,
        "cadence",
        "cadence" + WIRE_SUFFIX,
        "cpu-cadence",
        "cpu-cadence" + WIRE_SUFFIX,
    ),
    extra_seeds=(1, 2),
    headline_workloads=("tiny-gpt",),
)


def with_dashboard(suite: Suite) -> Suite:
    """``suite`` with each elche mode's twin that serves and is watched by its dashboard.

    The twin runs right after its mode (before it, in reversed repeats), so
    the two see the same machine as nearly as the suite allows.
    """
    systems: list[str] = []
    for system in suite.systems:
        systems.append(system)
        if system in ELCHE_MODES:
            systems.append(system + DASHBOARD_SUFFIX)
    note = (
        f"MODE{DASHBOARD_SUFFIX}: MODE with its dashboard on 127.0.0.1 and a watcher in the "
        "bench process reading /state.json and /metrics every second."
    )
    return dataclasses.replace(suite, systems=tuple(systems), notes=(*suite.notes, note))


def split_averaging(system: str, wire: str, overlap: bool) -> tuple[str, str, bool]:
    """A system's name as (the system without its ``+bf16`` and ``+wait``, the
    wire its elche mode uses, whether its rounds overlap training); ``wire``
    and ``overlap`` are the suite's."""
    while system.endswith((WIRE_SUFFIX, WAIT_SUFFIX)):
        if system.endswith(WIRE_SUFFIX):
            system, wire = system.removesuffix(WIRE_SUFFIX), "bf16"
        else:
            system, overlap = system.removesuffix(WAIT_SUFFIX), False
    return system, wire, overlap


def split_system(system: str) -> tuple[str, bool]:
    """A system's name as (the system without its dashboard suffix, whether it had it)."""
    if system.endswith(DASHBOARD_SUFFIX):
        return system.removesuffix(DASHBOARD_SUFFIX), True
    return system, False


# Training through the round, A/B (issue 17 item 3): cadence with and without
# ``overlap`` across three namespace hosts at 100 Mbit/s, where one round of
# digits-wide (4.5 MB a copy) takes ~0.5 s against a ~17 ms step; three
# repeats, the two systems in turn (reversed every other repeat), nothing else
# (a run across hosts spends 25-60 s starting torchrun on a loaded machine).
OVERLAP = Suite(
    name="overlap",
    workloads=(WorkloadPlan("digits-wide", epochs=5),),
    rigs=((1.0, 0.5, 0.25),),
    systems=("cadence", "cadence" + WAIT_SUFFIX),
    repeats=3,
    link_mbit=(100.0,),
    notes=(
        "Every multi-rank run: one network-namespace host per rank on one machine, "
        "links shaped both ways with tc tbf, one torchrun agent per host; solo runs "
        "on the machine itself.",
        f"MODE{WAIT_SUFFIX}: MODE with overlap=False: every rank waits for each averaging "
        "round instead of training on while it travels.",
    ),
)

SUITES = {suite.name: suite for suite in (QUICK, FULL, GPT, HOSTS, OVERLAP)}
