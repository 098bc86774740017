"""Saves that commit: periodic bundles, the bundle before a stop, the final model.

A save is real only once it is on disk, so the coordinator counts nothing as
saved until the ranks that wrote it say so, naming each file with its size and
hash; a bundle's meta, which names those files, is written last.

Rules:

- Every save has a number, ``seq``, increasing through the run (a resumed
  run goes on after its bundle's). Its files carry it in their names, so a
  save never overwrites the files of the bundle the meta on disk names.
- A bundle (``CHECKPOINT``: every ``checkpoint_every`` epochs; ``SHUTDOWN``:
  the run cannot go on) asks every live rank for its optimizer state and the
  writer, the lowest live rank, for the canonical model too. ``FINAL`` asks
  the writer alone for the completed run's model.
- A save is settled when every rank asked has answered or died, or when its
  deadline passed: max(10 heartbeat timeouts, 300 s) per writer, as long as
  the averaging stall's (a big model takes minutes to write; a writer that
  dies is noticed by its heartbeat long before). It is committed when the
  canonical model is among its files; the optimizer states of the ranks that
  answered go with it.
- The writer that dies or fails before its model is in is replaced by the
  lowest live rank not yet tried, asked again; once every live rank was
  tried, the save settles uncommitted. A ``FINAL`` that settles so (unless
  its writers never answered) is followed by a ``SHUTDOWN`` bundle of the
  trained model (``FINAL_MODEL_UNWRITTEN``): the ranks still hold it.
- A bundle that will never commit (it settled without its model, or a stop's
  bundle superseded it) is discarded: every live rank is told
  (``DiscardSave``) and removes that save's files from its folder, so a save
  that failed on a full disk leaves no files to keep it full for the next.
  So is a checkpoint whose meta could not be written (``meta_failed``): the
  last save committed, whose files every rank keeps, is then the one before
  it again. (``committed`` moves as ``commit`` asks for the meta, and moves
  back when the shell says it failed, before the next event: no save order
  goes out in between.) A stop's bundle whose meta fails comes after the
  run's end: only the coordinator's host removes its files; ranks on other
  hosts remove them before their next save at that path.
- The run cannot go on once ``max_failures`` ranks have died, when no rank
  is left, or when fewer ranks are live than the backend needs
  (``min_live_ranks``: a collective group needs two).

Theory of operation: the coordinator starts a save (``checkpoint``, ``stop``,
``final``), feeds it each ``StateSaved`` (``answered``) and each death
(``lost``), and asks ``overdue`` on every timer; each returns the commands to
send. When ``settled`` it acts on the save's ``files`` and ``committed``: it
writes a bundle's meta, finishes the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from elche.core import messages as m
from elche.core.checkpoint import BundleFile, BundleFiles, CheckpointMeta, SaveReason
from elche.core.commands import Broadcast, Command, Notice, Send, WriteMeta
from elche.core.config import CoordinatorConfig
from elche.core.rank import SaveKind

__all__ = ["SAVE_FLOOR_S", "SaveRound", "Saves", "reason_to_stop"]

# The least a writer gets to write its files before the next rank is asked.
SAVE_FLOOR_S = 300.0


def reason_to_stop(config: CoordinatorConfig, num_dead: int, num_live: int) -> SaveReason | None:
    """Why the run cannot go on after a death, or None if it can."""
    limit = config.max_failures
    if limit is not None and num_dead >= limit:
        return SaveReason.MAX_FAILURE_EXCEEDED
    if num_live == 0:
        return SaveReason.ALL_RANKS_LOST
    if num_live < config.min_live_ranks:
        return SaveReason.SINGLE_SURVIVOR
    return None


class SaveRound:
    """One numbered save: who owes an answer, who writes the model, what came back.

    Args:
        kind: what is saved (see ``SaveKind``).
        seq: the save's number.
        live: the ranks asked (the live ranks when it starts).
        now_s: when it starts.
        timeout_s: how long each writer gets before the next one is asked.
        keep: the last committed save, whose files the ranks must keep.
        reason: why a ``SHUTDOWN`` save happens.
        meta: a ``CHECKPOINT``'s meta, taken when it was asked.
    """

    def __init__(
        self,
        kind: SaveKind,
        seq: int,
        live: Sequence[int],
        *,
        now_s: float,
        timeout_s: float,
        keep: int = 0,
        reason: SaveReason | None = None,
        meta: CheckpointMeta | None = None,
    ) -> None:
        self.kind = kind
        self.seq = seq
        self.keep = keep
        self.reason = reason
        self.meta = meta
        self.timeout_s = timeout_s
        self.deadline_s = now_s + timeout_s
        self.asked = tuple(sorted(live))
        self.writer: int | None = min(live) if live else None
        self.tried: set[int] = set()
        # A final save waits for its writer only; the others hold meanwhile.
        final = kind is SaveKind.FINAL
        self.awaiting = {self.writer} if final and self.writer is not None else set(self.asked)
        self.optim: dict[int, BundleFile] = {}
        self.model: BundleFile | None = None
        self.errors: list[str] = []
        self.timed_out = False

    # -- asking ------------------------------------------------------------------

    def order(self) -> list[Command]:
        """The orders that start the save."""
        if self.writer is None:
            return []
        self.tried.add(self.writer)
        return [Broadcast(ranks=self.asked, message=self._message())]

    def _message(self) -> m.CoordMessage:
        writer = -1 if self.writer is None else self.writer
        match self.kind:
            case SaveKind.CHECKPOINT:
                return m.SaveState(seq=self.seq, writer=writer, keep=self.keep)
            case SaveKind.SHUTDOWN:
                reason = (self.reason or SaveReason.GRACEFUL_SHUTDOWN).value
                return m.ShutdownWithSave(
                    reason=reason, writer=writer, seq=self.seq, keep=self.keep
                )
            case SaveKind.FINAL:
                return m.Shutdown(writer=writer, seq=self.seq)

    def _next_writer(self, live: Sequence[int]) -> list[Command]:
        """Ask the lowest live rank not yet tried for the model, or give up."""
        untried = sorted(set(live) - self.tried)
        if not untried:
            self.writer = None
            return []
        self.writer = untried[0]
        self.tried.add(self.writer)
        self.awaiting.add(self.writer)
        text = f"save {self.seq}: rank {self.writer} writes the model instead"
        return [Notice(level="warning", text=text), Send(rank=self.writer, message=self._message())]

    # -- answers -----------------------------------------------------------------

    @property
    def settled(self) -> bool:
        """Nothing more will come: every rank asked answered or died, or time is up."""
        return self.timed_out or not self.awaiting

    @property
    def committed(self) -> bool:
        """The model is on disk: the save happened."""
        return self.model is not None

    def answered(self, rank: int, msg: m.StateSaved, live: Sequence[int]) -> list[Command]:
        """``rank`` answered; returns a notice for a failure and any new writer's order."""
        if msg.seq != self.seq or rank not in self.awaiting:
            return []
        out: list[Command] = []
        if msg.error is not None:
            self.errors.append(f"rank {rank}: {msg.error}")
            text = f"rank {rank} could not write save {self.seq}: {msg.error}"
            out.append(Notice(level="error", text=text))
        for saved in msg.files:
            entry = BundleFile.from_saved(saved)
            if saved.kind == "optim" and self.kind is not SaveKind.FINAL:
                self.optim[rank] = entry
            elif saved.kind in ("model", "final") and rank == self.writer and msg.writer:
                self.model = entry
        if rank == self.writer and not msg.writer:
            return out  # it answered before it was named the writer: that answer follows
        self.awaiting.discard(rank)
        if rank == self.writer and self.model is None:
            out += self._next_writer(live)
        return out

    def lost(self, rank: int, live: Sequence[int]) -> list[Command]:
        """``rank`` died: nobody waits for it; a dead writer is replaced."""
        self.awaiting.discard(rank)
        if rank == self.writer and self.model is None:
            return self._next_writer(live)
        return []

    def overdue(self, now_s: float, live: Sequence[int]) -> list[Command]:
        """Past the deadline: nobody waits for the silent ranks any more. A
        silent writer is replaced (with a new deadline); else the save settles."""
        if self.settled or now_s < self.deadline_s:
            return []
        late = sorted(self.awaiting)
        out: list[Command] = [
            Notice(level="error", text=f"save {self.seq}: ranks {late} never answered")
        ]
        self.awaiting.clear()
        if self.model is None and self.writer in late:
            out += self._next_writer([r for r in live if r not in late])
            self.deadline_s = now_s + self.timeout_s
        self.timed_out = not self.awaiting
        return out

    def files(self) -> BundleFiles:
        """What a committed bundle holds (the coordinator's shell adds the outer momentum)."""
        assert self.model is not None, "only a committed save has files"
        return BundleFiles(model=self.model, optim=tuple(sorted(self.optim.items())))

    def failure(self) -> str:
        """Why a settled save did not commit."""
        if self.errors:
            return "; ".join(self.errors)
        if self.timed_out:
            return "the writer never answered"
        return "no rank was left to write the model"


class Saves:
    """The run's saves in flight, one of each kind at most, and their numbering.

    Args:
        config: the run's configuration (the deadline is one heartbeat timeout).
        last_save: the number of the last save before this run (0: none).
        committed: the save whose meta is at the save path now (default
            ``last_save``): the ranks keep its files until a newer one commits.
    """

    def __init__(
        self, config: CoordinatorConfig, last_save: int = 0, committed: int | None = None
    ) -> None:
        self.config = config
        self.seq = last_save  # the last number given out
        self.committed = last_save if committed is None else committed  # its meta is on disk
        self._before: dict[int, int] = {}  # the save asked to commit: the one committed before
        self.rounds: dict[SaveKind, SaveRound] = {}
        self.unwritten_final = ""  # why no rank could write the final model, once none could

    def __contains__(self, kind: SaveKind) -> bool:
        return kind in self.rounds

    def start(
        self,
        kind: SaveKind,
        live: Sequence[int],
        now_s: float,
        *,
        reason: SaveReason | None = None,
        meta: CheckpointMeta | None = None,
    ) -> list[Command]:
        """Start a save of ``kind``; it replaces one of that kind in flight.

        A stop's bundle (``SHUTDOWN``) also supersedes a periodic one.
        """
        out: list[Command] = []
        if kind is SaveKind.SHUTDOWN and (dropped := self.rounds.pop(SaveKind.CHECKPOINT, None)):
            out += self.discard(dropped, live)
        self.seq += 1
        timeout_s = max(10 * self.config.heartbeat_timeout_s, SAVE_FLOOR_S)
        save = SaveRound(
            kind, self.seq, live, now_s=now_s, timeout_s=timeout_s,
            keep=self.committed, reason=reason, meta=meta,
        )  # fmt: skip
        self.rounds[kind] = save
        return out + save.order()

    def meta_failed(self, seq: int, live: Sequence[int]) -> list[Command]:
        """The meta of save ``seq`` was not written: the save before it stays the
        committed one, and ``seq``'s files go (``DiscardSave``)."""
        before = self._before.pop(seq, None)
        if before is None:
            return []  # no meta of that number was asked for
        if self.committed == seq:
            self.committed = before
        return _discard_order(seq, live)

    def discard(self, save: SaveRound, live: Sequence[int]) -> list[Command]:
        """The orders that remove the files of ``save``, which will never commit.

        A ``FINAL`` save writes no bundle files (its writer removes a model it
        could not finish).
        """
        if save.kind is SaveKind.FINAL:
            return []
        return _discard_order(save.seq, live)

    def answered(self, rank: int, msg: m.StateSaved, live: Sequence[int]) -> list[Command] | None:
        """Book ``rank``'s answer; None if no save in flight has its number (stale)."""
        for save in self.rounds.values():
            if save.seq == msg.seq:
                return save.answered(rank, msg, live)
        return None

    def lost(self, rank: int, live: Sequence[int]) -> list[Command]:
        """``rank`` died: every save in flight stops waiting for it."""
        out: list[Command] = []
        for save in self.rounds.values():
            out += save.lost(rank, live)
        return out

    def overdue(self, now_s: float, live: Sequence[int]) -> list[Command]:
        """What the saves whose deadline passed do about it (``SaveRound.overdue``)."""
        out: list[Command] = []
        for save in self.rounds.values():
            out += save.overdue(now_s, live)
        return out

    def take_settled(self) -> list[SaveRound]:
        """The saves nothing more will come for, taken out of the books."""
        done = [save for save in self.rounds.values() if save.settled]
        for save in done:
            del self.rounds[save.kind]
        return done

    def commit(self, stem: str, meta: CheckpointMeta, save: SaveRound) -> WriteMeta:
        """The command that commits ``save``'s bundle with ``meta``."""
        self._before, self.committed = {save.seq: self.committed}, save.seq
        return WriteMeta(
            stem=stem, meta=dataclasses.replace(meta, save_seq=save.seq, files=save.files())
        )


def _discard_order(seq: int, live: Sequence[int]) -> list[Command]:
    """Tell every live rank to remove save ``seq``'s files (``DiscardSave``)."""
    return [Broadcast(ranks=tuple(sorted(live)), message=m.DiscardSave(seq=seq))] if live else []
