"""The coordinator process: the IO shell around ``elche.core.Coordinator``.

Theory of operation. One loop, one thread: wait on the ROUTER socket until the
next timer deadline, turn what arrived into core events (``Joined`` ->
``RankJoined``, ``Received`` -> ``MessageReceived``, ``Rejected`` ->
``FrameRejected``), feed them with the monotonic time, and execute the
commands the core returns, all of them, in order. Averaging for the
coordinator backends happens here, on numpy (``elche.runtime.snapshots``);
its ``AverageComputed`` is queued and fed only once the command list that
asked for it has run to the end, so no command of a later event overtakes
one the core returned earlier. Its main thread never imports torch, so it
starts in a fraction of a second; in the collective modes a thread serves
the store the ranks' groups form through (``elche.runtime.groups``).

Run it as ``python -m elche.runtime.host RUN_DIR`` (a local run forks it
from its fork server instead, torch loaded: ``forked_main``): it reads
``RUN_DIR/coordinator.json`` (the config), binds, prints one line
``ELCHE_COORDINATOR <address> [groups=<port>]`` on stdout for the launcher, and writes
``RUN_DIR/summary.json``, ``RUN_DIR/timeline.jsonl`` and, on save, the meta
sidecar. The run secret comes from ``ELCHE_SECRET``. Its stdin is the
launcher's: ``lost RANK REASON`` and ``stop REASON`` lines, and EOF once the
launcher is gone; SIGINT is ignored and SIGTERM asks it to stop
(``elche.runtime.lifetimes``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TextIO, assert_never

import msgspec
import numpy as np
import zmq

from elche._files import write_text_atomic
from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.checkpoint import BundleFile, BundleFiles, CheckpointMeta, SaveReason
from elche.core.commands import (
    AppendJournal,
    ArmTimer,
    AverageSnapshots,
    Broadcast,
    Command,
    Emit,
    Finish,
    Notice,
    ReformFirstGroup,
    Send,
    WriteMeta,
)
from elche.core.config import Backend, CoordinatorConfig, Mode, SchedulerConfig
from elche.core.coordinator import Coordinator
from elche.core.errors import ConfigError
from elche.core.events import (
    AverageComputed,
    Event,
    FrameRejected,
    MessageReceived,
    MetaWriteFailed,
    RankJoined,
    RankLost,
    Started,
    StopRequested,
    TimerFired,
)
from elche.core.guards import GuardKind
from elche.core.journal import JournalRecord
from elche.core.liveness import lost_for_silence
from elche.monitor.summary import SUMMARY_FILE, RunStats, coordinator_summary
from elche.monitor.timeline import TimelineWriter, read_timeline
from elche.runtime import bundle, joining
from elche.runtime.addresses import BIND_ENV
from elche.runtime.frames import SECRET_ENV, secret_from_env
from elche.runtime.groups import GROUPS_FIELD, GROUPS_PORT_ENV, GroupStoreServer, listen
from elche.runtime.journal_file import JOURNAL_FILE, JournalWriter, read_journal
from elche.runtime.lifetimes import (
    EXIT_ORPHANED,
    ORPHAN_GRACE_S,
    take_environment,
    take_streams,
)
from elche.runtime.lookout import Lookout
from elche.runtime.snapshots import (
    Layout,
    NesterovOuter,
    SnapshotAverager,
    load_outer_state,
)
from elche.runtime.transport import LINGER_MS, CoordinatorEndpoint, Joined, Received, Rejected

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

__all__ = [
    "ADDRESS_LINE",
    "FAILED_EXIT",
    "GIVEN_UP_EXIT",
    "LAUNCHER_RANK_ENV",
    "RESUME_META",
    "RESUME_OUTER",
    "UNWRITABLE_EXIT",
    "GivenUp",
    "Host",
    "config_from_json",
    "config_to_json",
    "forked_main",
    "main",
]

ADDRESS_LINE = "ELCHE_COORDINATOR"
# The coordinator's exit code when the run failed (nothing to save): the
# launcher stops the ranks at once instead of waiting for them.
FAILED_EXIT = 4
# Its exit code when the run directory could not be written (full, read-only):
# the run stops; a successor restored there would fail the same way.
UNWRITABLE_EXIT = 5
# Its exit code when it did not run for longer than its ranks wait for a word
# from it (the process stopped, or starved): they have given it up, each keeping
# what it holds, which no successor gets back; the launcher commits that as the
# run's bundle (``elche.runtime.salvage``) instead of restarting it.
GIVEN_UP_EXIT = 6
# In the run dir: the bundle's outer momentum, copied there by the launcher.
RESUME_OUTER = "resume.outer.npz"
# In the run dir: the resumed bundle's meta, copied there by the launcher (the
# bundle may change or go while the run trains).
RESUME_META = "resume.meta.json"
# The loop never sleeps longer than this, so a lost timer costs at most this.
MAX_WAIT_S = 0.5
# Testing hook: the run's first coordinator SIGKILLs itself at a named point:
# ``round:N`` (round N journaled), ``averaging:N`` (round N's average asked
# for), ``epoch:N`` (epoch N's end written), ``final`` (the final model's save
# ordered), ``save:N`` (save N's files in, its meta not yet written). See
# docs/failure-modes.md.
FAULT_ENV = "ELCHE_FAULT_COORDINATOR"
# Under ``elche run`` and torchrun: the rank whose process started the coordinator
# (rank 0). Its stdin's EOF is that rank's death too, which its heartbeats would
# take ``heartbeat_timeout_s`` to tell: longer than an orphan's grace to save.
LAUNCHER_RANK_ENV = "ELCHE_LAUNCHER_RANK"
FIRST_DISPATCH_FILE = "first_dispatch"  # the first work's monotonic time, for a successor
RUN_START_FILE = "coordinator.started"  # the first coordinator's start, monotonic


class GivenUp(Exception):
    """This process did not run for longer than its ranks wait for a word from it
    (``CoordinatorConfig.rank_patience_s``): they have given it up by now."""

    def __init__(self, silent_s: float, patience_s: float) -> None:
        super().__init__(
            f"this process did not run for {silent_s:.1f} s (stopped, or starved of CPU), "
            f"longer than its ranks wait for a word from it ({patience_s:g} s): they have "
            "given it up, each keeping what it holds; it ends so that its launcher commits "
            "that as the run's bundle"
        )


class Host:
    """Runs one coordinator over a ``CoordinatorEndpoint`` until it finishes.

    Args:
        config: the run's configuration.
        endpoint: the bound control plane.
        run_dir: where the summary and timeline go.
        resume: a meta to continue from.
        restore: the journal's newest record, to go on from where a lost
            coordinator of this run left it (``Coordinator.restore``).
        log: where notices are printed.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        endpoint: CoordinatorEndpoint,
        run_dir: Path,
        *,
        resume: CheckpointMeta | None = None,
        restore: JournalRecord | None = None,
        log: TextIO = sys.stderr,
        groups: GroupStoreServer | None = None,
    ) -> None:
        # The meta at the save path now: its files go once a newer meta is written.
        self._groups = groups  # the group store it serves (collective runs)
        self._committed = bundle.read_meta(config.save_path)
        last = 0 if self._committed is None else self._committed.save_seq
        if restore is not None:
            self.core = Coordinator.restore(config, restore, last_save=last)
            if config.save_path:  # a save its predecessor left without its meta never commits
                bundle.prune(config.save_path, {last})
        else:
            self.core = Coordinator(config, resume=resume, last_save=last)
        self._journal = JournalWriter(run_dir / JOURNAL_FILE)
        self._journal_round = 0  # the round of the last record appended
        self._journal_refused = False  # the run directory refused it (the run stops)
        self._timeline_refused = False  # ... refused the timeline (said once)
        self._kill_at = os.environ.get(FAULT_ENV, "")
        self._writers: dict[str, int] = {}  # a bundle file's name: the rank that wrote it
        self.endpoint = endpoint
        self.run_dir = run_dir
        self.log = log
        self.stats = RunStats()
        self.finish: Finish | None = None
        self._deadline = math.inf
        # Its ranks judge its silence once one has spoken to it (or to its predecessor).
        self._judged = restore is not None
        self._awake_s = math.inf  # when its loop last ran (``_check_awake``)
        self._started = _run_start(run_dir, restored=restore is not None)
        self._snapshots: dict[int, tuple[Layout, list[bytes | memoryview]]] = {}
        self._update: tuple[int, list[bytes | memoryview]] | None = None
        self.outer = (
            NesterovOuter(lr=config.outer_lr, momentum=config.outer_momentum)
            if config.outer_lr is not None
            else None
        )
        self._timeline = TimelineWriter(run_dir, started_s=self._started)
        self.lookout = Lookout(self._write_timeline, log)
        # From the launcher's reader thread and the SIGTERM handler: deque
        # appends are atomic, and a signal handler must not take a lock.
        self._reports: deque[RankLost | StopRequested] = deque()
        # Events the shell produced itself (``AverageComputed``), fed after the
        # command list being executed, in the order they were queued.
        self._followups: deque[Event] = deque()
        saved_outer = run_dir / RESUME_OUTER
        if self.outer is not None and saved_outer.exists():
            load_outer_state(self.outer, saved_outer)
            self._record(tl.OuterMomentumRestored(file=str(saved_outer)))
        if restore is not None:
            self._carry_on_stats()
            self.lookout.coordinator_restored(self.core.coordinator_restarts, time.monotonic())

    def watch(
        self,
        stream: TextIO,
        *,
        on_eof: Callable[[], None] | None = None,
        launcher_rank: int | None = None,
    ) -> None:
        """Read launcher reports from ``stream`` (a pipe) on a daemon thread.

        Each line ``lost RANK REASON…`` becomes a ``RankLost`` event: the
        launcher sees a child process exit long before its heartbeats go
        stale. ``stop REASON…`` becomes ``StopRequested``. EOF means the
        launcher is gone: a ``StopRequested`` too, then ``on_eof`` (on this
        thread). A launcher that was a rank (``launcher_rank``) is lost
        first, so that the stop's save goes to the ranks that are left, and
        its stop is no request but the coordinator's host lost (``host_lost``).
        """

        def read() -> None:
            for line in stream:
                parts = line.split(maxsplit=2)
                if len(parts) >= 2 and parts[0] == "lost" and parts[1].isdigit():
                    reason = parts[2].strip() if len(parts) == 3 else "process exited"
                    self._reports.append(RankLost(rank=int(parts[1]), reason=reason))
                elif parts and parts[0] == "stop":
                    self.request_stop(line.removeprefix("stop").strip() or "asked to stop")
            if launcher_rank is None:
                self.request_stop("the launching process is gone")
            else:
                gone = "its process, which started the coordinator, is gone"
                self._reports.append(RankLost(rank=launcher_rank, reason=gone))
                why = f"rank {launcher_rank}, whose process started the coordinator, is gone"
                self._reports.append(StopRequested(reason=why, host_lost=True))
            if on_eof is not None:
                on_eof()

        threading.Thread(target=read, name="elche-launcher-reports", daemon=True).start()

    def request_stop(self, reason: str) -> None:
        """Ask the run to stop (any thread, or a signal handler): ``StopRequested``."""
        self._reports.append(StopRequested(reason=reason))

    def run(self) -> Finish:
        """Serve until the core says ``Finish``; returns it."""
        try:
            self._feed(Started())
            while self.finish is None:
                now = time.monotonic()
                self._take(min(max(self._deadline - now, 0.0), MAX_WAIT_S))
                while self.finish is None and self._reports:
                    self._feed_report(self._reports.popleft())
                if self.finish is None and time.monotonic() >= self._deadline:
                    # The timer judges silence: first read what came while this loop
                    # was busy (a slow disk under the journal, a starved process), or
                    # ranks that spoke all along would be declared lost.
                    self._take(0.0)
                if self.finish is None and time.monotonic() >= self._deadline:
                    self._deadline = math.inf
                    self._feed(TimerFired())
                self.lookout.tick(time.monotonic())
        finally:
            self.lookout.close()
            self._timeline.close()
            with contextlib.suppress(OSError):  # a failed append was said when it failed
                self._journal.close()
        self._write_summary()
        if self.core.failure is not None:
            self._tell_late_joiners(self.core.failure)
        return self.finish

    def _check_awake(self) -> None:
        """Raise ``GivenUp`` if this loop last ran (``_awake_s``) so long ago that a rank
        may have given it up; else note that it runs now. Looked at before what arrived
        meanwhile is acted on: the ranks' frames, the launcher's reports and the timer
        would be taken on a picture that is no longer true, and every rank that gave it
        up would be lost with its work (the run failed, nothing saved), where what they
        kept is the run's now.

        A rank's silence is this loop's gap and up to one heartbeat before it (and
        one longest wait of the loop), so a gap past the ranks' patience less those
        counts as given up; ending then is safe when some rank did not give up yet:
        it hears of the end (``GONE_FILE``) or the silence, and keeps its state too.
        """
        now = time.monotonic()
        config = self.core.config
        patience_s = config.rank_patience_s
        silent_s = now - self._awake_s
        if self._judged and silent_s > patience_s - config.heartbeat_interval_s - MAX_WAIT_S:
            raise GivenUp(silent_s, patience_s)
        self._awake_s = now

    def _take(self, wait_s: float) -> None:
        """Feed what arrives within ``wait_s`` (until the run finishes)."""
        arrived = self.endpoint.poll(wait_s)
        self._check_awake()
        for inbound in arrived:
            self._feed(self._event(inbound))
            if self.finish is not None:
                return

    def _tell_late_joiners(self, failure: m.Shutdown) -> None:
        """A failed run: tell ranks that join after the end why, for one heartbeat timeout.

        A rank still building its model when another failed joins late; told
        nothing, it would wait for a coordinator that is gone. Ranks that were
        live were told by the core; ranks the launcher reports lost need nothing.
        Ranks still gathering for the first group read it in the group store.
        """
        if self._groups is not None:  # ranks still gathering for the first group
            with contextlib.suppress(Exception):  # a store that failed: they time out
                self._groups.end_run(failure.failure)
        pending = set(range(self.core.config.world_size)) - set(self.core.dead_ranks)
        pending -= set(self.core.live)
        deadline = time.monotonic() + self.core.config.heartbeat_timeout_s
        while pending and (left := deadline - time.monotonic()) > 0:
            for inbound in self.endpoint.poll(min(left, MAX_WAIT_S)):
                if isinstance(inbound, Joined):
                    self._send(inbound.rank, failure)
                    pending.discard(inbound.rank)
            while self._reports:
                report = self._reports.popleft()
                if isinstance(report, RankLost):
                    pending.discard(report.rank)

    def _feed_report(self, event: RankLost | StopRequested) -> None:
        if isinstance(event, StopRequested) or 0 <= event.rank < self.core.config.world_size:
            self._feed(event)

    def _event(self, inbound: Joined | Received | Rejected) -> Event:
        match inbound:
            case Joined(rank=rank, host=host, held=held, layout=layout):
                self._judged = True
                return RankJoined(rank=rank, host=host, held=held, layout=layout)
            case Received(rank=rank, message=message, payload=payload):
                if isinstance(message, m.SnapshotReady) and payload:
                    self._stash_snapshot(rank, payload)
                if isinstance(message, m.StateSaved):  # who wrote which file: where it lies
                    self._writers.update((f.name, rank) for f in message.files)
                return MessageReceived(rank=rank, message=message)
            case Rejected(reason=reason, rank=rank):
                return FrameRejected(reason=reason, rank=rank)
            case _:
                assert_never(inbound)

    def _stash_snapshot(self, rank: int, payload: Sequence[bytes | memoryview]) -> None:
        try:
            layout = msgspec.msgpack.decode(bytes(payload[0]), type=Layout)
        except (msgspec.DecodeError, ValueError) as exc:
            self._print("warning", f"rank {rank} sent an unreadable snapshot layout: {exc}")
            return
        self._snapshots[rank] = (layout, list(payload[1:]))

    def _feed(self, event: Event) -> None:
        """Feed ``event``, execute its commands in order, then any follow-ups."""
        self._followups.append(event)
        while self._followups:
            for command in self.core.handle(self._followups.popleft(), time.monotonic()):
                self._execute(command)
        self._sync_journal()  # the new window's work is out: off the ranks' restart

    def _execute(self, command: Command) -> None:
        committing = isinstance(command, WriteMeta)  # the hook's ``save:N`` kills before it
        if committing:
            self._fault(command)
        match command:
            case Send(rank=rank, message=message):
                self._send(rank, message)
            case Broadcast(ranks=ranks, message=message):
                failed = self.endpoint.broadcast(ranks, message)
                if failed and not isinstance(message, m.Shutdown | m.CoordHeartbeat):
                    self._print("warning", f"{type(message).__name__} did not reach {failed}")
                    self.lookout.control_drop(failed, type(message).__name__, time.monotonic())
            case ArmTimer(deadline_s=deadline):
                self._deadline = deadline
            case AverageSnapshots(round=number, param_mass=param_mass, buffer_mass=buffer_mass):
                self._average(number, dict(param_mass), dict(buffer_mass))
            case WriteMeta(stem=stem, meta=meta):
                self._write_meta(stem, meta)
            case AppendJournal(record=record, compact=compact):
                self._append_journal(record, compact)
            case Notice(level=level, text=text):
                self._print(level, text)
            case Emit(event=event):
                self._record(event)
            case ReformFirstGroup(generation=generation, members=members):
                if self._groups is not None:
                    self._groups.reform_first(generation, members)
            case Finish():
                self.finish = command
            case _:
                assert_never(command)
        if not committing:
            self._fault(command)  # after: what was sent leaves first

    def _fault(self, command: Command) -> None:
        """The testing hook (``FAULT_ENV``): SIGKILL this first coordinator at its point."""
        if self._kill_at and self.core.coordinator_restarts == 0 and _due(self._kill_at, command):
            self.endpoint.close()  # what was sent leaves first: the hook kills after it
            zmq.Context.instance().term()
            os.kill(os.getpid(), signal.SIGKILL)

    def _carry_on_stats(self) -> None:
        """A successor's summary counts what its predecessors saw (the timeline says it)."""
        for event in read_timeline(self.run_dir):
            if not isinstance(event, tl.RunEnd):
                self.stats.observe(event, self._started + event.t)
        with contextlib.suppress(OSError, ValueError):
            first = float((self.run_dir / FIRST_DISPATCH_FILE).read_text(encoding="utf-8"))
            self.stats.first_dispatch_s = first

    def _append_journal(self, record: JournalRecord, compact: bool) -> None:
        """Write ``record`` to the run directory's journal (``_sync_journal`` puts it on
        disk); a failure is said, not fatal."""
        try:
            self._journal.append(record, compact=compact)
        except OSError as exc:
            self._journal_failed(f"journal record of round {record.rounds_done} not written", exc)
        else:
            self._journal_round = record.rounds_done

    def _sync_journal(self) -> None:
        try:
            self._journal.sync()
        except OSError as exc:
            self._journal_failed(
                f"journal record of round {self._journal_round} not kept on disk", exc
            )

    def _journal_failed(self, what: str, exc: OSError) -> None:
        """The run directory refused the journal: the run stops and saves while its
        ranks still can (its summary, its reports and its final model go there too)."""
        with contextlib.suppress(OSError):  # what it still buffered cannot reach the disk
            self._journal.close()
        if self._journal_refused:
            return  # said once; the stop is asked
        self._journal_refused = True
        self._print(
            "error", f"{what} ({exc}); a lost coordinator could not be restarted from it, "
            "so the run stops and saves its state",
        )  # fmt: skip
        self.request_stop(f"the run directory {self.run_dir} cannot be written ({exc})")

    def _write_meta(self, stem: str, meta: CheckpointMeta) -> None:
        """Commit a bundle: its outer momentum, then the meta that names every file.

        The files of the bundle the meta replaces go afterwards (those this
        host can see). A full or read-only disk is reported, not fatal: the
        save is then not committed, its files go (those this host can see; the
        core tells the ranks, ``MetaWriteFailed``), and the meta before stays.
        """
        try:
            if self.outer is not None and meta.files is not None:
                outer = self._write_outer(stem, meta.save_seq)
                meta = dataclasses.replace(meta, files=dataclasses.replace(meta.files, outer=outer))
            bundle.write_meta(stem, meta)
        except OSError as exc:
            bundle.discard(stem, meta.save_seq)
            what = "checkpoint" if meta.reason is SaveReason.CHECKPOINT else "bundle"
            if what == "bundle":
                self.stats.unsaved = f"its meta could not be written ({exc})"
            self._print(
                "error",
                f"could not write the {what} meta {bundle.meta_path(stem)} ({exc}); that {what} "
                "is not resumable and its files are removed"
                + ("; training goes on" if what == "checkpoint" else ""),
            )
            self._followups.append(MetaWriteFailed(seq=meta.save_seq, error=str(exc)))
            return
        self._record(tl.BundleWritten(stem=stem, seq=meta.save_seq, reason=meta.reason.value))
        if meta.reason is not SaveReason.CHECKPOINT and meta.files is not None:
            self._say_where(stem, meta.files)
        self._drop_superseded(stem, meta)

    def _say_where(self, stem: str, files: BundleFiles) -> None:
        """Across hosts, name the host each file of a resumable bundle lies on."""
        hosts = self.core.hosts
        if len({h for h in hosts if h}) < 2:
            return  # one host: the folder holds the bundle (the resume line says so)
        here = f"{hosts[0]} (the coordinator's)"
        placed = [f"{bundle.meta_path(stem).name} on {here}"]
        written = [files.model, *(f for _, f in files.optim)]
        for f in written:
            rank = self._writers.get(f.name)
            placed.append(f"{f.name} on {hosts[rank] if rank is not None else '?'} (rank {rank})")
        if files.outer is not None:
            placed.append(f"{files.outer.name} on {here}")
        text = (
            f"bundle {stem}: its files lie on several hosts: {'; '.join(placed)}. To resume "
            f"elsewhere, copy them into one folder and pass resume_from=FOLDER/{Path(stem).name}"
        )
        self.stats.notices.append(f"info: {text}")
        print(f"elche coordinator: {text}", file=self.log, flush=True)

    def _write_outer(self, stem: str, seq: int) -> BundleFile | None:
        """The outer momentum's file of save ``seq`` (None before it has a velocity)."""
        assert self.outer is not None
        velocity = self.outer.state_dict()["velocity"]
        if not isinstance(velocity, list):
            return None
        path = Path(stem).parent / bundle.outer_name(stem, seq)
        return BundleFile.from_saved(
            bundle.write_file(path, lambda f: np.savez(f, *velocity), kind="outer")
        )

    def _drop_superseded(self, stem: str, meta: CheckpointMeta) -> None:
        old, self._committed = self._committed, meta
        if old is None or old.files is None or meta.files is None:
            return
        folder = Path(stem).parent
        new = meta.files.names()
        for name in old.files.names() - new:
            with contextlib.suppress(OSError):
                (folder / name).unlink()

    def _send(self, rank: int, message: m.CoordMessage) -> None:
        payload: Sequence[bytes | memoryview] = ()
        if isinstance(message, m.Update) and self._update is not None:
            payload = self._update[1]
        if isinstance(message, m.AssignChunk) and self.stats.first_dispatch_s is None:
            self.stats.first_dispatch_s = time.monotonic()
            with contextlib.suppress(OSError):  # for a successor's wall time (same host clock)
                (self.run_dir / FIRST_DISPATCH_FILE).write_text(repr(self.stats.first_dispatch_s))
        try:
            self.endpoint.send(rank, message, payload)
        except Exception as exc:  # a rank that is gone shows up as RankLost later
            self._print("warning", f"could not send {type(message).__name__} to rank {rank}: {exc}")
            self.lookout.control_drop([rank], type(message).__name__, time.monotonic())

    def _average(
        self, number: int, param_mass: dict[int, float], buffer_mass: dict[int, float]
    ) -> None:
        """Average the round's snapshots (the ranks get it with their ``Update``).

        Queues ``AverageComputed``; ``_feed`` hands it to the core once the
        current command list has run to the end.
        """
        frames: list[bytes | memoryview] = []
        layout: Layout | None = None
        averager: SnapshotAverager | None = None
        for rank, mass in sorted(param_mass.items()):
            stashed = self._snapshots.pop(rank, None)
            if stashed is None:
                continue
            layout = stashed[0] if layout is None else layout
            averager = averager or SnapshotAverager(layout)
            try:
                averager.add(mass, stashed[1], buffer_mass=buffer_mass.get(rank, 0.0))
            except ValueError as exc:
                self._print("warning", f"snapshot of rank {rank} left out of round {number}: {exc}")
        result = averager.result(self.outer) if averager is not None else None
        if result is not None and layout is not None:
            frames = [msgspec.msgpack.encode(layout), *result]
        self._update = (number, frames)
        self._snapshots.clear()
        self._followups.append(AverageComputed(round=number))

    def _record(self, event: tl.TimelineEvent) -> None:
        now = time.monotonic()
        self.stats.observe(event, now)
        self._write_timeline(event)
        self.lookout.observe(event, now)
        lost = lost_for_silence(event)
        if lost is not None and self._groups is not None:  # for a joined rank's launcher
            with contextlib.suppress(Exception):  # a store that failed: it waits, as before
                self._groups.say_hung(lost.rank, lost.reason)

    def _write_timeline(self, event: tl.TimelineEvent) -> None:
        try:
            self._timeline.write(event, time.monotonic())
        except OSError as exc:  # the timeline is for watching; the run goes on
            if not self._timeline_refused:  # said once: the next write would say the same
                self._print("warning", f"could not write the timeline: {exc}")
            self._timeline_refused = True

    def _print(self, level: str, text: str) -> None:
        self.stats.notices.append(f"{level}: {text}")
        if level != "info":  # info is for the summary; the user hears it from the launcher
            with contextlib.suppress(OSError):  # a terminal hung up: the run goes on
                print(f"elche coordinator [{level}] {text}", file=self.log, flush=True)

    def _write_summary(self) -> None:
        config = self.core.config
        summary = coordinator_summary(
            self.stats, mode=config.mode.value, world_size=config.world_size
        )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.run_dir / SUMMARY_FILE, json.dumps(summary, indent=2))


def _run_start(run_dir: Path, *, restored: bool) -> float:
    """The monotonic time the run's first coordinator started (the timeline's zero)."""
    path = run_dir / RUN_START_FILE
    if restored:
        with contextlib.suppress(OSError, ValueError):
            return float(path.read_text(encoding="utf-8"))
    now = time.monotonic()
    with contextlib.suppress(OSError):
        path.write_text(repr(now), encoding="utf-8")
    return now


def _due(point: str, command: Command) -> bool:
    """``command`` is where the testing hook ``point`` (``FAULT_ENV``) kills."""
    kind, _, number = point.partition(":")
    message = command.message if isinstance(command, Send | Broadcast) else None
    if kind == "round" and isinstance(command, AppendJournal):
        return command.record.rounds_done >= int(number)
    if kind == "averaging" and isinstance(message, m.SyncNow | m.RequestParams):
        return message.round >= int(number)
    if kind == "epoch" and isinstance(command, Emit) and isinstance(command.event, tl.EpochEnd):
        return command.event.epoch >= int(number)
    if kind == "save" and isinstance(command, WriteMeta):
        return command.meta.save_seq >= int(number)
    if kind == "start":  # its first command: before any rank joined, no journal yet
        return True
    return kind == "final" and isinstance(message, m.Shutdown) and message.writer >= 0


def config_to_json(config: CoordinatorConfig) -> str:
    """Serialise a coordinator config for the host process."""
    doc = {
        field_name: getattr(config, field_name)
        for field_name in config.__dataclass_fields__
        if field_name not in ("mode", "scheduler", "callback_policy")
    }
    doc["mode"] = config.mode.value
    doc["callback_policy"] = config.callback_policy.value
    sched = config.scheduler
    doc["scheduler"] = {
        name: getattr(sched, name) for name in sched.__dataclass_fields__ if name != "guard"
    }
    doc["scheduler"]["guard"] = sched.guard.value
    return json.dumps(doc)


def config_from_json(text: str) -> CoordinatorConfig:
    """Inverse of ``config_to_json``; validation happens in the dataclasses."""
    from elche.core.config import CallbackPolicy

    doc = json.loads(text)
    sched = dict(doc.pop("scheduler"))
    sched["guard"] = GuardKind(sched["guard"])
    doc["mode"] = Mode.parse(doc["mode"])
    doc["callback_policy"] = CallbackPolicy(doc["callback_policy"])
    return CoordinatorConfig(scheduler=SchedulerConfig(**sched), **doc)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the coordinator process."""
    args = list(sys.argv[1:] if argv is None else argv)
    restoring = "--restore" in args  # a lost coordinator's successor: go on from the journal
    args = [a for a in args if a != "--restore"]
    if len(args) != 1:
        print("usage: python -m elche.runtime.host RUN_DIR [--restore]", file=sys.stderr)
        return 2
    # Ctrl-C reaches the launcher's process group, not this one (the launcher
    # starts it in its own); if one comes anyway, the launcher orders the stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stops: list[str] = []  # a SIGTERM before the host exists
    signal.signal(signal.SIGTERM, lambda signum, frame: stops.append("SIGTERM"))
    run_dir = Path(args[0])
    config = config_from_json((run_dir / "coordinator.json").read_text(encoding="utf-8"))
    resume_file = run_dir / RESUME_META
    resume = (
        CheckpointMeta.from_json(resume_file.read_text(encoding="utf-8"))
        if resume_file.exists()
        else None
    )
    try:
        restore = read_journal(run_dir / JOURNAL_FILE) if restoring else None
    except ConfigError as exc:
        print(f"elche coordinator: cannot restart: {exc}", file=sys.stderr)
        return FAILED_EXIT
    bind = os.environ.get(BIND_ENV, "tcp://127.0.0.1:0")
    endpoint = CoordinatorEndpoint(
        world_size=config.world_size,
        secret=secret_from_env(os.environ),
        bind=bind,
        restarts=0 if restore is None else restore.coordinator_restarts + 1,
        join_slots=config.join_slots,
    )
    if SECRET_ENV not in os.environ:
        print("elche coordinator: no ELCHE_SECRET given; generated one", file=sys.stderr)
    (run_dir / "coordinator.pid").write_text(str(os.getpid()))
    collective = config.backend is Backend.COLLECTIVE and config.world_size >= 2
    port = int(os.environ.get(GROUPS_PORT_ENV, "0"))  # a successor's: its predecessor's
    groups = None
    if collective:
        info = joining.store_info(
            config, run_dir, config_to_json(config), address=endpoint.address,
            secret=endpoint.secret,
        )  # fmt: skip
        counters = {joining.JOINED_KEY: _slots_used(config, restore)}
        groups = GroupStoreServer(listen(bind, port), info=info, counters=counters)
    said = f" {GROUPS_FIELD}{groups.port}" if groups is not None else ""
    print(f"{ADDRESS_LINE} {endpoint.address}{said}", flush=True)
    if groups is not None:
        groups.start()
    with endpoint:
        host = Host(config, endpoint, run_dir, resume=resume, restore=restore, groups=groups)
        signal.signal(signal.SIGTERM, lambda signum, frame: host.request_stop("SIGTERM"))
        for reason in stops:
            host.request_stop(reason)
        if not sys.stdin.isatty():
            rank = os.environ.get(LAUNCHER_RANK_ENV, "")
            launcher_rank = int(rank) if rank.isdigit() else None
            host.watch(sys.stdin, on_eof=_exit_after_grace, launcher_rank=launcher_rank)
        try:
            finish = host.run()
        except GivenUp as exc:
            print(f"elche coordinator [error] {exc}", file=sys.stderr, flush=True)
            return GIVEN_UP_EXIT
        except OSError as exc:  # its summary (or timeline) could not be written
            print(
                f"elche coordinator [error] cannot write in the run directory {run_dir} "
                f"({exc}); the run stops",
                file=sys.stderr,
                flush=True,
            )
            return UNWRITABLE_EXIT
    return {"completed": 0, "failed": FAILED_EXIT}.get(finish.outcome, 3)


def _slots_used(config: CoordinatorConfig, restore: JournalRecord | None) -> int:
    """Join slots a restored run's journal shows taken (a successor's store counts on)."""
    if restore is None:
        return 0
    used = [r - config.world_size + 1 for r, n in enumerate(restore.samples_committed) if n]
    return max([0, *used])


def _exit_after_grace() -> None:
    """The launcher is gone: the run has ``ORPHAN_GRACE_S`` to save, then this process ends."""
    time.sleep(ORPHAN_GRACE_S)  # the grace period, not synchronisation
    os._exit(EXIT_ORPHANED)


def forked_main(args: Sequence[str], env: dict[str, str], streams: Sequence[Connection]) -> None:
    """The coordinator forked from a local run's fork server (``runtime.launch``).

    What ``python -m elche.runtime.host`` would be, with torch already
    loaded: a process group of its own, the launcher's environment, and
    ``streams`` as its stdin, stdout and stderr (the launcher's pipes and its
    own stderr).
    """
    os.setpgid(0, 0)  # the stop signals are still ignored here (the fork server's)
    take_environment(env)
    take_streams(streams, first_fd=0)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115  # the process's own
    _end(main(args))


def _end(code: int) -> NoReturn:
    """Exit with ``code`` once the last frames have left.

    Everything this process writes is durable by now (the summary, the
    journal fsynced per record, the timeline closed), and its last frames
    leave as the ZeroMQ context ends (each socket's linger). The
    interpreter's own teardown, with torch loaded for the group store, takes
    1-1.5 s more, which every launcher would wait out after every run: it is
    skipped.
    """
    zmq.Context.instance().destroy(linger=LINGER_MS)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _end(main())
