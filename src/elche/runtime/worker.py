"""The rank worker: trains what the coordinator assigns, averages when told.

Theory of operation. One process per rank, one training thread plus the IO
bridge (``elche.runtime.bridge``). The rank's protocol rules live in
``elche.core.rank``: between steps the worker drains control messages into
its ``RankProtocol``, asks it for the next action, and does that action's IO
(a torch step, a collective, a snapshot, a callback, a save), reporting it
done to the protocol, which says what to send.

A batch is the positions ``[offset, offset + size)`` of the epoch's seeded
permutation, mapped to dataset indices; every step is reported with
``BatchDone`` (compute time including the injected speed wait, and loss).
``epoch_fn`` runs on every rank when it starts a new epoch, so a learning-rate
schedule stays the same everywhere.

Its saves are ``elche.runtime.rank_saves``'s; its testing hooks (the faults of
``RankSpec.faults``, checked before each batch) are ``elche.runtime.rank_faults``'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, assert_never

import msgspec
import torch
import torch.distributed as dist
from torch import nn

from elche.core import messages as m
from elche.core import rank as r
from elche.core.config import NUMPY_PERMUTATION, Backend, Mode
from elche.core.errors import RankExcluded
from elche.core.faults import (
    Fault,
    SlowDown,
)
from elche.core.progress import Progress
from elche.core.rank import RankProtocol
from elche.monitor.summary import rank_report_file, rank_spans_file
from elche.runtime import bundle, groups, rank_saves, salvage
from elche.runtime.averaging import (
    Collectives,
    InFlight,
    RoundDropped,
    frozen_parameters,
    load_average,
    snapshot_frames,
)
from elche.runtime.bridge import Bridge, CoordinatorLost, Inbound
from elche.runtime.consensus import Consensus, layout_fingerprint, start_from_rank0
from elche.runtime.current import providing
from elche.runtime.data import to_device
from elche.runtime.loading import Loader, StepPlan
from elche.runtime.membership import Membership
from elche.runtime.options import TrainOptions
from elche.runtime.pacing import Pacer, pacer_for
from elche.runtime.rank_faults import RankFaults
from elche.runtime.resume import load_bundle
from elche.runtime.shards import epoch_order
from elche.runtime.snapshots import Layout
from elche.runtime.stepping import MicroBatch, Stepper, model_from, optimizer_for
from elche.runtime.transport import RankEndpoint
from elche.runtime.user_callbacks import checkpoint, evaluate
from elche.runtime.user_errors import failed_report, guarded, training_error, wait_answer
from elche.runtime.wire import Wire, average_over, launch_over

__all__ = ["RankSpec", "UserFns", "Worker", "raise_if_refused", "to_device", "train_rank"]

# Batch reports go out at least this often while a rank trains, even mid-window,
# so the coordinator's view (and the sync gate) never lags far behind.
REPORT_EVERY_S = 0.05
# How often a rank looks for its peers' start marks (wait_peers_started).
STARTUP_POLL_S = 0.01
# The longest a rank waiting for its launched round goes without a look at it
# (a message ends the wait at once). Nothing wakes it when the round ends: a
# Python callback on a collective may abort the process (``Collectives``).
WAIT_SLICE_S = 0.001
# The longest a rank waiting for a round it does not train through goes without
# a look at its messages (the round's end ends the wait at once).
COLLECT_TURN_S = 0.05
# The longest a rank whose group store went silent waits at a time for its
# coordinator's news (a message wakes it at once).
GROUP_NEWS_POLL_S = 0.2

StepFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class UserFns:
    """The user's side of a run; every callable must be picklable (top level)."""

    model_fn: Callable[[torch.device], nn.Module]
    optimizer_fn: Callable[[Any], torch.optim.Optimizer]
    step_fn: StepFn
    dataset: Any
    eval_fn: Callable[[nn.Module, Any], float] | None = None
    eval_dataset: Any = None
    epoch_fn: Callable[[int, nn.Module, torch.optim.Optimizer], None] | None = None
    checkpoint_fn: Callable[[int, nn.Module], None] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    options: TrainOptions = TrainOptions()  # accumulate, precision, lr_schedule, loader


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSpec:
    """What one rank process needs to join a run (picklable)."""

    rank: int
    world_size: int
    address: str
    secret_hex: str
    run_dir: str
    mode: str
    seed: int
    num_samples: int  # len(dataset) when the run started: each epoch's order is of it
    order: str = NUMPY_PERMUTATION  # how each epoch's order is drawn (CoordinatorConfig.order)
    speed: float = 1.0
    speed_base_s: float | None = None  # given instead of measured (benchmarks)
    device: str = "cpu"
    gamma: float = 1.0
    max_grad_norm: float | None = None
    heartbeat_interval_s: float = 1.0
    coordinator_timeout_s: float = 30.0
    save_path: str | None = None
    resume_from: str | None = None
    resume_seq: int | None = None  # the save it was checked at (``Plan.resume_seq``)
    threads: int = 1
    collective_timeout_s: float = 120.0
    faults: tuple[Fault, ...] = ()  # testing: this rank's faults (elche.core.faults)
    group_port: int | None = None  # the coordinator's group store (elche.runtime.groups)
    join_slots: int = 0  # the run's join slots: a joining rank's id lies past world_size

    @property
    def joining(self) -> bool:
        """This rank joins a running run (``elche join``, ``elche.runtime.joining``)."""
        return self.rank >= self.world_size

    launcher_pid: int | None = None  # the process that launched the run (StopLauncher)

    @property
    def slows_later(self) -> bool:
        """A ``SlowDown`` fault is planned: the rank needs a pacer even at full speed."""
        return any(isinstance(f, SlowDown) for f in self.faults)

    def endpoint(self, layout: str = "") -> RankEndpoint:
        """This rank's connection to the coordinator (it says Hello as it opens;
        ``layout``: a joiner's model's, for ``Hello.layout``)."""
        return RankEndpoint(
            address=self.address,
            rank=self.rank,
            world_size=self.world_size,
            join_slots=self.join_slots,
            secret=bytes.fromhex(self.secret_hex),
            host=os.uname().nodename,
            layout=layout,
        )


class Worker:
    """The training loop of one rank (see the module docstring)."""

    def __init__(self, spec: RankSpec, fns: UserFns, batch_size: int) -> None:
        self.spec = spec
        self.fns = fns
        self.mode = Mode.parse(spec.mode)
        self.batch_size = batch_size
        options = fns.options
        self.proto = RankProtocol(
            spec.rank, mode=self.mode, batch_size=batch_size,
            runs_epoch_fn=fns.epoch_fn is not None, planned_samples=options.planned_samples,
            world_size=spec.world_size,
        )  # fmt: skip
        self.device = torch.device(spec.device)
        self.model = model_from(fns.model_fn, self.device)
        self.optimizer = optimizer_for(fns.optimizer_fn, self.model)
        self.stepper = Stepper(
            self.model, self.optimizer, fns.step_fn, device=self.device,
            max_grad_norm=spec.max_grad_norm, options=options, progress=self.progress,
        )  # fmt: skip
        self.loader = Loader(
            fns.dataset, _with_collate(options, fns.collate_fn),
            micro_size=batch_size // options.accumulate, step_size=batch_size, perm=self._perm,
            device=self.device,
        )  # fmt: skip
        self.unreported: list[m.BatchDone] = []
        self.consensus = Consensus()  # restored before a save for a non-finite value
        # What the averaging payloads travel as, and weigh.
        self.wire = Wire(options.wire, own=frozen_parameters(self.model))
        self.reported_s = time.monotonic()
        self._update_payload: Sequence[bytes | memoryview] = ()
        self.snapshot: tuple[Layout, list[memoryview]] | None = None  # the upload in flight
        self._flight: InFlight | None = None  # the collective launched and not landed yet
        self._after_round: deque[Inbound] = deque()  # came while a round was made (_collect)
        # What this rank trained since its flight's launch, set aside while the
        # landed round's callbacks run on the consensus: (the tensors, their values).
        self._local: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.overlapped = 0  # rounds this rank trained on through
        self._through_s = 0.0  # seconds it trained while its flight travelled
        self.membership = Membership(
            spec.rank, spec.address, spec.group_port, spec.collective_timeout_s
        )
        self.pacer: Pacer | None = None
        self.busy_s = 0.0
        self.step_s = 0.0  # training steps (loop + batch fetch + step + injected wait)
        self._step_end: float | None = None  # end of the last step, while training back to back
        self.samples = 0
        self.epoch = 0  # the epoch of the last batch trained
        self.started_s = time.monotonic()
        self.last_loss: float | None = None
        self._perms: dict[int, Sequence[int]] = {}
        self.bridge: Bridge | None = None
        self.faults = RankFaults(spec.faults)  # testing hooks
        self._spans_refused = False  # the run dir refused this rank's span record (said once)

    # -- setup ---------------------------------------------------------------

    def connect(self) -> None:
        spec = self.spec
        self.bridge = Bridge(
            spec.endpoint(layout_fingerprint(self.model) if spec.joining else ""),
            heartbeat_interval_s=spec.heartbeat_interval_s,
            coordinator_timeout_s=spec.coordinator_timeout_s,
            gone_file=Path(spec.run_dir) / salvage.GONE_FILE,
        )

    def join_group(self) -> None:
        """Collective modes: form the torch.distributed group over the coordinator's
        group store, or take a launcher's default group (``Membership.join_first``)."""
        if self.mode.backend is not Backend.COLLECTIVE or self.spec.world_size < 2:
            return
        self.membership.join_first(self.spec.world_size)

    def _regroup(self, generation: int, members: list[int]) -> bool:
        """A rank died: leave the old group and form a new one with the survivors.

        Returns:
            False when the group did not form because the coordinator moved on
            meanwhile (a member was declared lost too: a newer ``Regroup``, or
            the save of a run that cannot go on, came while this rank gathered
            with its peers or waited ``collective_timeout_s`` in the
            rendezvous): the newer order is next. True when it formed, even
            if a newer order came once every member had gathered: that order
            is next then too.

        A store that does not answer (``groups.StoreUnanswered``: its host, the
        coordinator's, is off the network) ends the gathering sooner than the
        control connection finds the coordinator lost; the rank then waits
        ``coordinator_timeout_s`` for that news and follows it (it keeps its
        state), rather than fail on the store's silence.

        Raises:
            RuntimeError: the group did not form and nothing superseded it.
        """
        if self.mode.backend is not Backend.COLLECTIVE:
            return True
        self.membership.leave()
        if len(members) < 2:
            return True
        still = r.FormGroup(generation=generation, members=tuple(members))
        why = "a newer order came while its members gathered"
        try:
            formed = self.membership.form(generation, members, superseded=self._superseded(still))
        except (RuntimeError, groups.StoreUnanswered) as exc:  # torch's DistError is one
            self._drain()
            if isinstance(exc, groups.StoreUnanswered):
                news = self._superseded(still)
                deadline = time.monotonic() + self.spec.coordinator_timeout_s
                while not news(GROUP_NEWS_POLL_S) and time.monotonic() < deadline:
                    pass  # (each look waits for the bridge's news)
            if self.proto.next_action() == still:
                raise  # still the order: the group cannot form
            formed, why = False, type(exc).__name__
        if not formed:
            print(
                f"elche rank {self.spec.rank}: group {generation} of {members} did not form "
                f"({why}); the coordinator has moved on",
                file=sys.stderr,
                flush=True,
            )
        return formed

    def _superseded(self, order: r.FormGroup) -> Callable[[float], bool]:
        """``groups.gather``'s look at the news: whether ``order`` still stands."""

        def superseded(wait_s: float) -> bool:
            assert self.bridge is not None
            if (item := self.bridge.get(wait_s)) is not None:
                self._handle(item)
                self._drain()
            # a restarted coordinator (Rejoin) serves a new store: gather there
            return self.membership.store_lost or self.proto.next_action() != order

        return superseded

    def wait_peers_started(self) -> None:
        """Local coordinator modes: wait until every rank process has started.

        A rank that times its solo step while its peers still import torch
        measures a slower step and then runs slower than its ``speed`` on a
        small machine (the DDP baseline times after its rendezvous). A
        collective group or a launcher's group is that rendezvous already;
        without one, each rank marks ``started.rank<r>`` in the run dir and a
        rank that will time its step waits for the others' marks, at most
        ``coordinator_timeout_s`` (then it times anyway: pacing, not safety).
        """
        spec = self.spec
        if spec.world_size < 2 or dist.is_initialized():
            return
        run_dir = Path(spec.run_dir)
        (run_dir / f"started.rank{spec.rank}").touch()
        if spec.speed >= 1.0 and not spec.slows_later:
            return
        deadline = time.monotonic() + spec.coordinator_timeout_s
        marks = [run_dir / f"started.rank{r}" for r in range(spec.world_size)]
        while not all(mark.exists() for mark in marks) and time.monotonic() < deadline:
            time.sleep(STARTUP_POLL_S)

    def progress(self) -> Progress:
        """The run's global progress as this rank sees it (``elche.core.progress``)."""
        assert self.proto.progress is not None  # the worker's protocol tracks it
        return self.proto.progress.now()

    def warm_up(self, batch: list[MicroBatch]) -> None:
        """Warm the rank's steps up and, on a paced rank, build its pacer."""
        self.pacer = pacer_for(
            self.model, self.optimizer, self.stepper.loss, batch,
            speed=self.spec.speed, base_s=self.spec.speed_base_s,
            slows_later=self.spec.slows_later,
        )  # fmt: skip

    # -- the loop ------------------------------------------------------------

    def run(self) -> str:
        """Train until told to stop; returns why it stopped."""
        assert self.bridge is not None
        self.faults.start()
        try:
            with providing(self.progress):
                return self._loop()
        finally:
            self.loader.close()
            if self._flight is not None:  # stopped with a round in flight (refused, say)
                self.membership.drop(self._flight.collectives)
                self._flight = None

    def _loop(self) -> str:
        proto = self.proto
        while True:
            self._drain()
            action = proto.next_action()
            if self._local is not None and not isinstance(action, r.Callback):
                self._take_up_local()
            match action:
                case r.Done(reason=reason):
                    if reason == "completed":  # the progress is exact: the plan is done
                        self.stepper.apply_schedule()
                    return reason
                case r.Train():
                    self._train_one(action)
                    continue
                case r.StartEpoch(epoch=epoch):
                    self._epoch_fn(epoch)
                    continue
                case r.Hold():
                    self._wait()
                case r.Save():
                    rank_saves.save(self, action)
                case r.Discard():
                    self._discard()
                case r.FormGroup(generation=generation, members=members):
                    if self._regroup(generation, list(members)):
                        proto.regrouped(generation)
                case r.Load():
                    self._apply_update(action)
                case r.Land():
                    self._await_flight()
                case r.Average() | r.Upload():
                    self._report()
                    self._report_lr()  # before the round: the epoch it may end records it
                    self._serve_round(action)
                case r.Callback(request=request):
                    self._report()
                    self._run_callback(request)
                case _:
                    assert_never(action)
            self._step_end = None  # the next step does not follow on from the last

    def _drain(self) -> None:
        assert self.bridge is not None
        while self._after_round:
            self._handle(self._after_round.popleft())
        while (item := self.bridge.get(0.0)) is not None:
            self._handle(item)

    def _wait(self) -> None:
        assert self.bridge is not None
        self._report()
        item = self.bridge.get(0.5)
        if item is not None:
            self._handle(item)

    def _handle(self, item: Any) -> None:
        if isinstance(item, CoordinatorLost):
            rank_saves.coordinator_lost(self, item.reason)
            return
        message, payload = item
        if isinstance(message, m.Update):
            self._update_payload = payload
        self.proto.handle(message)
        if isinstance(message, m.DiscardSave):
            self._discard()  # at once: a wait for something else (a group) goes on
        if isinstance(message, m.Rejoin):
            self._rejoin()

    def _discard(self) -> None:
        """Remove the files of the saves that will never commit (``DiscardSave``)."""
        while isinstance(action := self.proto.next_action(), r.Discard):
            if self.spec.save_path is not None:
                bundle.discard(self.spec.save_path, action.seq)
            self.proto.discarded()

    def _rejoin(self) -> None:
        """A coordinator restarted from the journal: say Hello again with what the model holds."""
        if self._flight is not None:  # as a rank inside the collective would: finish it first
            self._land()
        self._take_up_local()
        self.unreported.clear()  # the Hello's ``held`` says it all
        self.membership.forget_store()  # the lost coordinator's store went with it
        hello = self.proto.rejoin(
            world_size=self.spec.world_size, host=os.uname().nodename, pid=os.getpid()
        )
        assert hello.held is not None
        print(
            f"elche rank {self.spec.rank}: the coordinator restarted; rejoining with "
            f"{len(hello.held.since)} batch(es) since round {hello.held.last_round}",
            file=sys.stderr,
            flush=True,
        )
        self._send(hello)

    def _send(self, message: m.RankMessage, payload: Sequence[memoryview | bytes] = ()) -> None:
        assert self.bridge is not None
        self.bridge.send(message, payload)

    # -- training --------------------------------------------------------------

    def _perm(self, epoch: int) -> Sequence[int]:
        if epoch not in self._perms:
            spec = self.spec
            order = epoch_order(
                self.fns.dataset, seed=spec.seed, epoch=epoch, order=spec.order,
                num_samples=spec.num_samples,
            )  # fmt: skip
            self._perms = {epoch: order}
        return self._perms[epoch]

    def batch_at(self, epoch: int, offset: int, size: int) -> list[MicroBatch]:
        """The micro-batches of one step, fetched now (warm-up)."""
        return self.loader.direct(epoch, offset, size)

    def _upcoming(self) -> list[StepPlan]:
        """Every step of the queued chunks, in training order (the loader's stream)."""
        step = self.batch_size
        return [
            (chunk.epoch, at, min(step, chunk.offset + chunk.size - at))
            for chunk in self.proto.chunks
            for at in range(chunk.cursor, chunk.offset + chunk.size, step)
        ]

    def _train_one(self, action: r.Train) -> None:
        self.faults.before(self, action)
        size = action.size
        # Back to back, a step starts where the last one ended: the loop's own
        # cost (messages, reports) is part of this rank's step rate, which is
        # what the balancer must see to size windows that end together.
        started = self._step_end if self._step_end is not None else time.perf_counter()
        try:  # the user's code: the dataset, the collate, step_fn, the optimizer
            micro = self.loader.step(action.epoch, action.offset, size, self._upcoming)
            loaded = time.perf_counter()
            value = self.stepper.step(micro) if micro else None  # None: drop_last dropped it
        except Exception as exc:
            raise self._user_failed(exc, action.epoch) from exc
        if self.pacer is not None and micro:
            self.pacer.after_step()
        done = self._step_end = time.perf_counter()
        if value is None:
            finite, value = True, None
        else:
            finite = math.isfinite(value)
            self.last_loss = value if finite else self.last_loss
        self.busy_s += done - started
        self.step_s += done - started
        if self._flight is not None:  # trained through the round: no cost of it
            self._through_s += done - started
        self.samples += size
        self.epoch = action.epoch
        assert self.bridge is not None
        self.bridge.step += 1
        self.unreported.append(
            self.proto.trained(
                action,
                batch_ms=(done - loaded) * 1000.0,
                data_ms=(loaded - started) * 1000.0,
                loss=value if finite else None,
                nonfinite=not finite,
            )
        )
        if self.proto.report_due or time.monotonic() - self.reported_s >= REPORT_EVERY_S:
            self._report()
        if self._flight is not None and self._flight.completed():
            self._land()
            self._step_end = None  # the next step does not follow on from this one

    def _user_failed(self, exc: Exception, epoch: int) -> Exception:
        """The user's code raised: tell the coordinator; returns the error to raise."""
        self._report()  # what trained before it still counts
        self._send(report := failed_report(self.proto, exc, epoch))
        assert self.bridge is not None
        wait_answer(self.bridge.get)
        return training_error(self.spec.rank, report)

    def _report(self) -> None:
        """Send the batches trained since the last report, as one frame."""
        self.reported_s = time.monotonic()
        if not self.unreported:
            return
        items, self.unreported = self.unreported, []
        self._send(items[0] if len(items) == 1 else m.Batches(items=items))

    def _epoch_fn(self, epoch: int) -> None:
        assert self.fns.epoch_fn is not None  # the protocol asks only when there is one
        started = time.perf_counter()
        try:
            self.fns.epoch_fn(epoch, self.model, self.optimizer)
        except Exception as exc:
            raise self._user_failed(exc, epoch) from exc
        elapsed_ms = (time.perf_counter() - started) * 1000.0
        lr = self.optimizer.param_groups[0].get("lr")
        for message in self.proto.started_epoch(
            elapsed_ms=elapsed_ms, lr=lr if isinstance(lr, float) else None
        ):
            self._send(message)

    def _report_lr(self) -> None:
        """Under ``lr_schedule``, the lr once per average (the timeline and the
        LR-aware meta-controller read it; a smooth schedule leaves it quiet)."""
        lr = self.stepper.lr
        if self.fns.options.lr_schedule is not None and lr is not None:
            self._send(m.LrUpdate(lr=lr))

    # -- averaging -------------------------------------------------------------

    def _serve_round(self, action: r.Average | r.Upload) -> None:
        if isinstance(action, r.Upload):
            layout, frames = snapshot_frames(self.model, self.wire.name, self.wire.own)
            self.snapshot = (layout, frames)
            self._send(self.proto.uploaded(), [msgspec.msgpack.encode(layout), *frames])
            return
        group = self.membership.group
        if group is None:  # a world of one
            ack = self.proto.averaged()
            self._record_spans()  # the average is in the model: before the coordinator hears
            self._send(ack)
            return
        started = time.perf_counter()
        try:  # launched (the rank trains on while it is in flight), or made at once
            if self.fns.options.overlap:
                self._flight = launch_over(
                    self.wire, self.model, action.steps, gamma=self.spec.gamma, group=group
                )
            if self._flight is not None:
                self.proto.launched()
                self.busy_s += time.perf_counter() - started
                return
            div, pre, post = average_over(
                self.wire, self.model, action.steps, gamma=self.spec.gamma, group=group,
                wait=self._collect,
            )  # fmt: skip
        except RoundDropped as dropped:
            self._give_up(action.round, dropped.pending, dropped.why)
            return
        except RuntimeError as exc:
            # A peer vanished mid-collective. The model is unchanged; the
            # coordinator abandons the round and sends Regroup, or closes it
            # without this rank's steps if others got the average.
            print(f"elche rank {self.spec.rank}: collective failed: {exc}", file=sys.stderr)
            self._send(self.proto.average_failed())
            return
        self.busy_s += time.perf_counter() - started
        self.consensus.keep(self.model, action.round)
        ack = self.proto.averaged(divergence=div, pre_norm=pre, post_norm=post)
        self._record_spans()
        self._send(ack)

    def _await_flight(self) -> None:
        """``Land``: wait for the launched collective, taking messages meanwhile;
        work that arrives (the next window's, behind the round) lets the rank
        train on instead, and lands the round later. A ``Regroup`` (a member
        lost) drops it unless it completed (``Land.regroup``)."""
        assert self.bridge is not None
        while self._flight is not None and not self._flight.completed():
            action = self.proto.next_action()
            if not isinstance(action, r.Land):
                return  # the loop does what is next (training, or a stop)
            if action.regroup:
                self._drop_flight(action.round)
                return
            if (item := self.bridge.get(WAIT_SLICE_S)) is not None:
                self._handle(item)
        if self._flight is not None:  # (a rejoin while it waited lands it itself)
            self._land()

    def _drop_flight(self, number: int) -> None:
        """Give the launched collective up (``_give_up``)."""
        flight, self._flight = self._flight, None
        assert flight is not None
        self._through_s = 0.0
        self._give_up(number, flight.collectives, r.REGROUPED)

    def _collect(self, pending: Collectives) -> None:
        """A round made while the rank waits (``average_over``'s ``wait``): wait
        for its collectives, keeping what comes meanwhile for after the round
        (``_drain``); a message that gives the round up (``r.round_given_up``),
        or the coordinator lost, ends the wait (``RoundDropped``)."""
        assert self.bridge is not None
        while not pending.wait_for(COLLECT_TURN_S):
            while (item := self.bridge.get(0.0)) is not None:
                self._after_round.append(item)
                if isinstance(item, CoordinatorLost):  # (a Land's wait ends for it too)
                    why: str | None = "the coordinator was lost"
                else:
                    why = r.round_given_up(item[0])
                if why is not None and not pending.completed():
                    raise RoundDropped(pending, why)

    def _give_up(self, number: int, pending: Collectives, why: str) -> None:
        """Give round ``number``'s unfinished collectives up, for ``why``: they may
        never end (a member cut off, not dead, holds them to the group's
        timeout). Their group stays alive until they end (``Membership.drop``);
        the model is as the round found it, its steps unaveraged again."""
        self.membership.drop(pending)
        print(
            f"elche rank {self.spec.rank}: round {number}'s collective dropped unfinished: {why}",
            file=sys.stderr,
            flush=True,
        )
        self._send(self.proto.average_failed())

    def _land(self) -> None:
        """Wait for the launched collective and apply it (``InFlight.land``)."""
        flight, self._flight = self._flight, None
        assert flight is not None  # the protocol lands only a launched round
        started = time.perf_counter()
        moved = self.proto.steps_since_sync > 0
        through_ms, self._through_s = self._through_s * 1000.0, 0.0
        try:
            (div, pre, post), local = flight.land(moved=moved)
        except RuntimeError as exc:  # as in _serve_round: the model is unchanged
            print(f"elche rank {self.spec.rank}: collective failed: {exc}", file=sys.stderr)
            self._send(self.proto.average_failed())
            return
        self.busy_s += time.perf_counter() - started
        self.overlapped += moved
        self.consensus.keep(self.model, self.proto.in_flight)
        if local is not None:
            self._local = (flight.tensors, local)
        ack = self.proto.averaged(
            divergence=div, pre_norm=pre, post_norm=post, through_ms=through_ms
        )
        self._record_spans()
        self._send(ack)

    def _take_up_local(self) -> None:
        """Load what this rank trained since its last flight's launch back (``_local``)."""
        if self._local is None:
            return
        (tensors, values), self._local = self._local, None
        with torch.no_grad():
            for t, value in zip(tensors, values, strict=True):
                t.copy_(value)

    def _apply_update(self, action: r.Load) -> None:
        snapshot, self.snapshot = self.snapshot, None
        payload, self._update_payload = self._update_payload, ()
        div: float | None = None
        pre = post = None
        if payload and snapshot is not None:
            layout = msgspec.msgpack.decode(bytes(payload[0]), type=Layout)
            div, pre, post = load_average(
                self.model, list(payload[1:]), layout, alpha=action.alpha, sent=snapshot[1],
                wire=self.wire.name, own=self.wire.own,
            )  # fmt: skip
            self.wire.count(sum(memoryview(f).nbytes for f in (*snapshot[1], *payload[1:])))
            self.consensus.keep(self.model, action.round)
        ack = self.proto.loaded(divergence=div, pre_norm=pre, post_norm=post)
        self._record_spans()
        self._send(ack)

    def _record_spans(
        self, batches: Sequence[tuple[int, int, int]] | None = None, what: int | str | None = None
    ) -> None:
        """Append what the round just applied took from this rank to its own record
        (``rank_spans_file``: the chaos runner audits samples lost or trained twice from it);
        or ``batches``, the unaveraged steps a stop's bundle holds, as ``what``."""
        taken = self.proto.averaged_batches if batches is None else batches
        spans = [list(batch) for batch in taken]
        label = self.proto.last_round if what is None else what
        line = json.dumps({"round": label, "spans": spans})
        record = rank_spans_file(Path(self.spec.run_dir), self.spec.rank)
        try:
            with record.open("a") as f:
                f.write(line + "\n")
        except OSError as exc:  # a full or read-only run dir: its coordinator stops the run,
            if not self._spans_refused:  # and this rank's model goes into the stop's bundle
                self._spans_refused = True
                said = f"cannot write its record in the run directory ({exc}); training goes on"
                print(f"elche rank {self.spec.rank}: {said}", file=sys.stderr, flush=True)

    # -- callbacks and saving -----------------------------------------------------

    def _run_callback(self, request: m.RunEval | m.RunCheckpoint) -> None:
        """Run the user's eval or checkpoint; a failure is reported, not raised
        (``elche.runtime.user_callbacks``).

        Raises:
            TrainingError: the callback changed the model's layout (names, shapes
                or dtypes, e.g. ``model.half()``): this rank's model could not be
                averaged with the others' any more (gloo aborts on the size
                mismatch), so the rank fails on it as on the user's error.
        """
        started = time.perf_counter()
        layout = layout_fingerprint(self.model)
        if isinstance(request, m.RunEval):
            metric, error = evaluate(self.fns.eval_fn, self.fns.eval_dataset, self.model)
            self._check_layout(layout, "eval_fn")
            elapsed_ms = (time.perf_counter() - started) * 1000.0
            self._send(self.proto.evaluated(metric=metric, elapsed_ms=elapsed_ms, error=error))
            return
        checkpoint_fn = self.faults.checkpoint_fn(self.fns.checkpoint_fn)
        error = checkpoint(checkpoint_fn, request.version, self.model)
        self._check_layout(layout, "checkpoint_fn")
        elapsed_ms = (time.perf_counter() - started) * 1000.0
        self._send(self.proto.checkpointed(elapsed_ms=elapsed_ms, error=error))

    def _check_layout(self, before: str, callback: str) -> None:
        if layout_fingerprint(self.model) == before:
            return
        exc = ValueError(
            f"{callback} changed the model's parameters or buffers (names, shapes or dtypes; "
            "e.g. model.half() or a new layer): it runs on one rank, whose model then cannot "
            f"be averaged with the others'. {callback} may read the model, not rebuild it "
            "(work on a copy: copy.deepcopy(model))"
        )
        raise self._user_failed(exc, self.epoch)

    def report(self) -> dict[str, object]:
        wall = time.monotonic() - self.started_s
        return {
            "rank": self.spec.rank,
            "speed": self.spec.speed,
            "speed_base_s": None if self.pacer is None else self.pacer.base_s,
            "injected_s": 0.0 if self.pacer is None else round(self.pacer.injected_s, 4),
            "samples_trained": self.samples,
            "busy_s": round(self.busy_s, 4),
            "step_s": round(self.step_s, 4),
            "idle_s": round(max(wall - self.busy_s, 0.0), 4),
            "stopped": self.proto.stop_reason,
            "user_error": msgspec.to_builtins(self.proto.user_error),  # the run failed on it
            "lr": self.stepper.lr,
            "progress": msgspec.to_builtins(self.progress()),
            "dropped_samples": self.loader.num_dropped,
            "wire": self.wire.name,
            "wire_bytes": self.wire.bytes,
            "wire_rounds": self.wire.rounds,
            "overlapped_rounds": self.overlapped,
        }


def _with_collate(options: TrainOptions, collate_fn: Any) -> TrainOptions:
    """The options with ``UserFns.collate_fn`` when they name none."""
    if options.collate_fn is not None or collate_fn is None:
        return options
    return dataclasses.replace(options, collate_fn=collate_fn)


def train_rank(
    spec: RankSpec, fns: UserFns, batch_size: int
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """Train one rank to the end; returns its report and its final model state."""
    torch.set_num_threads(max(1, spec.threads))
    torch.manual_seed(spec.seed + spec.rank)
    worker = guarded(spec, lambda: Worker(spec, fns, batch_size))  # model_fn, optimizer_fn
    if spec.resume_from is not None:
        load_bundle(
            spec.resume_from, worker.model, worker.optimizer, rank=spec.rank, seq=spec.resume_seq,
            world_size=spec.world_size, device=worker.device,
        )  # fmt: skip
    fingerprint = None
    if not spec.joining:  # a joiner forms the group of its first Regroup, at the next round
        worker.join_group()  # collective modes: the rendezvous, so every peer has started
        # (collective) rank 0's; no reference to the group outlives the call: a
        # left group must be freed, which closes its connections (Membership.leave)
        fingerprint = start_from_rank0(worker.model, worker.membership.group)
        worker.wait_peers_started()  # the same, for coordinator modes
    first = min(batch_size, len(fns.dataset))  # the dataset, collate and step_fn:
    with providing(worker.progress):  # the user's code may ask for it (and lr_schedule does)
        guarded(spec, worker.stepper.apply_schedule)
        guarded(spec, lambda: worker.warm_up(worker.batch_at(0, 0, first)))
    worker.consensus.keep(worker.model)  # the run's start is its first consensus
    worker.connect()
    if fingerprint is not None:  # a joiner takes the consensus in its first round instead
        worker._send(
            m.InitialState(fingerprint=fingerprint, layout=layout_fingerprint(worker.model))
        )
    try:
        worker.run()
    finally:
        assert worker.bridge is not None
        worker.bridge.close()
        worker.membership.close()
    report = worker.report()
    report["last_loss"] = worker.last_loss
    text = json.dumps(report).encode()
    try:
        bundle.write_file(rank_report_file(Path(spec.run_dir), spec.rank), lambda f: f.write(text),
                          kind="report")  # fmt: skip
    except OSError as exc:  # a full or read-only run dir: its coordinator stopped the run
        print(f"elche rank {spec.rank}: cannot write its report in the run directory "
              f"{spec.run_dir} ({exc})", file=sys.stderr, flush=True)  # fmt: skip
    state = {k: v.detach().cpu().clone() for k, v in worker.model.state_dict().items()}
    return report, state


def raise_if_refused(report: dict[str, Any], rank: int) -> None:
    """Raise ``RankExcluded`` when the run went on without this rank (its report says so).

    Raises:
        RankExcluded: the coordinator refused the rank (declared lost while it
            was cut off, or its join refused).
    """
    stopped = report.get("stopped")
    if isinstance(stopped, str) and stopped.startswith(r.REFUSED):
        reason = stopped.removeprefix(r.REFUSED)
        print(f"elche rank {rank}: refused by the coordinator: {reason}", file=sys.stderr)
        raise RankExcluded(rank=rank, reason=reason)
