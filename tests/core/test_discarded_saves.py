"""Saves that will never commit are discarded: every live rank removes their files.

A save that settled without its model (a full disk), or a periodic one that a
stop's bundle superseded, used to leave the files its ranks had written; on a
nearly full disk they made every later save fail too.
"""

from __future__ import annotations

from elche.core import messages as m
from elche.core.commands import AppendJournal, Broadcast, Command, Finish
from elche.core.config import Mode
from elche.core.coordinator import Coordinator
from elche.core.events import MetaWriteFailed, RankJoined, RankLost, Started
from elche.core.rank import Discard, Done, Hold, RankProtocol, RankStage, Save, SaveKind
from tests.core.harness import Harness, messages, of, state_saved

ENOSPC = "OSError: [Errno 28] No space left on device"


def discards(out: list[Command]) -> list[tuple[tuple[int, ...], int]]:
    return [
        (c.ranks, c.message.seq)
        for c in out
        if isinstance(c, Broadcast) and isinstance(c.message, m.DiscardSave)
    ]


def test_a_checkpoint_that_did_not_commit_is_discarded_by_every_live_rank() -> None:
    h = Harness(world_size=3, num_samples=960, checkpoint_every=1, save_path="/b/run")
    h.form()
    h.run_to_end(periodic=False, final=False)
    save = h.core.saves.rounds[SaveKind.CHECKPOINT]
    h.send(1, state_saved(save, 1))  # rank 1 wrote its optimizer state
    h.send(2, state_saved(save, 2))
    out = h.send(0, state_saved(save, 0, error=ENOSPC))  # the writer could not
    assert messages(out, m.SaveState) == [m.SaveState(seq=1, writer=1, keep=0)]
    assert not discards(out)  # rank 1 may still write the model
    out = h.send(1, state_saved(save, 1, error=ENOSPC))
    assert not discards(out)
    out = h.send(2, state_saved(save, 2, error=ENOSPC))
    assert discards(out) == [((0, 1, 2), 1)]


def test_a_checkpoint_superseded_by_a_stop_is_discarded_before_the_stop_is_saved() -> None:
    h = Harness(world_size=3, num_samples=960, epochs=3, checkpoint_every=1, max_failures=1,
                save_path="/b/run")  # fmt: skip
    h.form()
    h.run_to_end(periodic=False, final=False, until=lambda: SaveKind.CHECKPOINT in h.core.saves)
    assert SaveKind.CHECKPOINT in h.core.saves
    out = h.feed(RankLost(rank=2, reason="killed"))
    assert discards(out) == [((0, 1), 1)]
    orders = [c for c in out if isinstance(c, Broadcast)]
    assert isinstance(orders[0].message, m.DiscardSave)  # its room is free for the stop's
    assert messages(out, m.ShutdownWithSave)[0].seq == 2


def test_a_stop_whose_bundle_failed_is_discarded_before_the_ranks_are_let_go() -> None:
    h = Harness(world_size=2, num_samples=960, max_failures=1, save_path="/b/run")
    h.form()
    h.feed(RankLost(rank=1, reason="exit 1"))  # the run stops; rank 0 alone saves
    save = h.core.saves.rounds[SaveKind.SHUTDOWN]
    out = h.send(0, state_saved(save, 0, error=ENOSPC))
    (finish,) = of(out, Finish)
    assert finish.outcome == "failed"  # type: ignore[attr-defined]
    broadcasts = [c.message for c in out if isinstance(c, Broadcast)]
    failure = finish.reason  # type: ignore[attr-defined]
    assert broadcasts == [m.DiscardSave(seq=1), m.Shutdown(writer=-1, failure=failure)]


def test_a_held_rank_removes_a_discarded_saves_files_before_it_stops() -> None:
    p = RankProtocol(1, mode=Mode.CADENCE, batch_size=32)
    p.handle(m.ShutdownWithSave(reason="single_survivor", writer=0, seq=3, keep=1))
    p.saved()
    assert p.stage is RankStage.HELD
    p.handle(m.DiscardSave(seq=3))
    p.handle(m.Shutdown(writer=-1))
    assert p.next_action() == Discard(seq=3)
    p.discarded()
    assert isinstance(p.next_action(), Done)


def test_a_discarded_checkpoint_not_started_yet_is_not_written() -> None:
    p = RankProtocol(0, mode=Mode.CADENCE, batch_size=32)
    p.handle(m.SaveState(seq=2, writer=0, keep=1))
    assert isinstance(p.next_action(), Save)
    p.handle(m.DiscardSave(seq=2))
    assert p.next_action() == Discard(seq=2)
    p.discarded()
    assert p.next_action() == Hold()
    p.handle(m.ShutdownWithSave(reason="single_survivor", writer=0, seq=3, keep=1))
    p.handle(m.DiscardSave(seq=2))  # while saving the stop's bundle: discarded first
    assert p.next_action() == Discard(seq=2)
    p.discarded()
    assert p.next_action() == Save(kind=SaveKind.SHUTDOWN, seq=3, writer=True, keep=1,
                                   reason="single_survivor")  # fmt: skip


def test_a_checkpoint_whose_meta_was_not_written_leaves_the_one_before_committed() -> None:
    # It counted as committed once its meta was asked for: the next save told the
    # ranks to keep its files only, and they removed those of the bundle on disk.
    h = Harness(world_size=2, num_samples=960, epochs=3, checkpoint_every=1, save_path="/b/run")
    h.form()
    h.run_to_end(until=lambda: h.core.saves.committed == 1)  # save 1 committed
    h.run_to_end(periodic=False, until=lambda: SaveKind.CHECKPOINT in h.core.saves)
    h.answer_saves()
    assert h.core.saves.committed == 2  # its meta is asked for
    out = h.feed(MetaWriteFailed(seq=2, error="[Errno 28] No space left on device"))
    assert discards(out) == [((0, 1), 2)]
    out = h.run_to_end(periodic=False, until=lambda: SaveKind.CHECKPOINT in h.core.saves)
    assert messages(out, m.SaveState) == [m.SaveState(seq=3, writer=0, keep=1)]


def test_a_restored_coordinator_keeps_the_save_the_meta_on_disk_names() -> None:
    # The journal knows the last save number given out, not whether it committed: a
    # successor told the ranks to keep an uncommitted save's files only.
    h = Harness(world_size=2, num_samples=960, epochs=3, checkpoint_every=1, save_path="/b/run")
    h.form()
    h.run_to_end(until=lambda: h.core.saves.committed == 1)
    h.run_to_end(periodic=False, until=lambda: SaveKind.CHECKPOINT in h.core.saves)
    record = [c.record for c in of(h.log, AppendJournal)][-1]  # type: ignore[attr-defined]
    assert record.save_seq == 2  # save 2 in flight when the coordinator is lost
    h2 = Harness(h.cfg)
    h2.core = Coordinator.restore(h.cfg, record, last_save=1)
    h2.feed(Started())
    for rank in (0, 1):
        h2.last_round[rank] = h.last_round[rank]
        h2.since[rank] = list(h.since[rank])
        h2.feed(RankJoined(rank=rank, held=h.held(rank)))
    out = h2.run_to_end(periodic=False, until=lambda: SaveKind.CHECKPOINT in h2.core.saves)
    assert messages(out, m.SaveState) == [m.SaveState(seq=3, writer=0, keep=1)]
