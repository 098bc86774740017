"""Ranks that join a running run, in the coordinator's join slots.

Rules:

- A run keeps ``config.join_slots`` rank ids after its ``world_size`` ranks
  (collective modes only). A slot is ``VACANT`` until a rank says ``Hello``
  in it; the balancer holds it retired and the epoch pools reserve it
  nothing, so an unused slot changes nothing about the run.
- A join is *requested* when its ``Hello`` arrives (``RankJoined``) and
  *admitted* at the next moment no averaging round is in flight, while the
  run trains: the rank is live, the balancer takes it back
  (``ElChe.readmit``) and every live rank is told ``Regroup`` with it among
  the members, so the collective group it forms with the others is the
  one of the next round. A join that arrives while the run forms waits for
  training to begin.
- An admitted rank is *fresh* until a round it is a member of completes: it
  is given no work, the averaging gate does not wait for it, and it takes
  part in that round with zero steps. Work-weighted averaging gives a rank
  without steps zero weight, so the round leaves the consensus in its model
  (its optimizer state is its own, fresh). From the next window on it gets
  work like any rank, at the anchor's count until its first window's timing
  calibrates it in proportion to its speed.
- A join that arrives once training is over (or the run is saving) is
  refused: the rank is told ``Shutdown`` and its slot stays unused. So is
  one whose model has another layout than rank 0's (``Hello.layout`` against
  rank 0's ``InitialState.layout``, kept in the journal): its first average
  would join tensors of other sizes, which gloo aborts on.
- The journal records no joins. A coordinator restored from it waits for
  the slots whose ranks have samples in the consensus as for the run's own
  ranks, and takes back any joined rank that rejoins (``Hello`` with
  ``held``) while it forms; the group re-forms and the roles the journal
  left on a vacant slot move on. A joined rank that rejoins only after the
  restored coordinator formed is refused (the rank stops; its work was
  handed out again), unless it holds no batch: then it is a join like any
  (one admitted just before its coordinator was lost, say).
- Joined ranks are counted in ``RunEnd.joined_ranks``; a joined rank that
  dies is lost like any other (its unaveraged work goes back to the pools).

Theory of operation: the coordinator asks ``request`` on a ``Hello`` in a
vacant slot, ``admit_pending`` after each event while it trains with no
round in flight, and ``averaged`` with a completed round's members; it
skips ``fresh`` ranks when it plans and dispatches work.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.commands import Broadcast, Emit, Notice, Send

if TYPE_CHECKING:
    from elche.core.coordinator import Coordinator
    from elche.core.rounds import Round

__all__ = ["Joins"]

OTHER_MODEL = (
    "its model_fn built another model than the run's (other parameter or buffer names, "
    "shapes or dtypes); it must build the run's model"
)


class Joins:
    """The join slots of one run and the ranks that took them.

    Args:
        core: the coordinator whose slots these are.
        slots: the rank ids kept for joiners.
    """

    def __init__(self, core: Coordinator, slots: Iterable[int]) -> None:
        self.core = core
        self.pending: dict[int, str] = {}  # rank -> host, requested, not admitted yet
        self.layouts: dict[int, str] = {}  # rank -> its model's layout, for those pending
        self.fresh: set[int] = set()  # admitted, not yet in a completed round
        self.joined: list[int] = []  # admitted, in order
        for rank in slots:
            core.elche.retire(rank)
            core.tuner.vacant.add(rank)

    def request(self, rank: int, host: str, held: m.Held | None = None, layout: str = "") -> None:
        """A rank said ``Hello`` in vacant slot ``rank`` (``held``: rejoining with work;
        ``layout``: its model's, hashed)."""
        from elche.core.coordinator import RankState, RunState

        core = self.core
        rejoining = held is not None
        why = None
        if rejoining and core.state is RunState.FORMING and core.restored_round is not None:
            self._take_back(rank)  # a joined rank rejoins the restored coordinator
            core._on_join(rank, host, held)
            return
        if held is not None and (held.averaged or held.since):
            # The restored coordinator formed without it: its work was re-issued.
            why = "a restarted coordinator formed without it; join again"
        elif rank in self.pending:
            why = "it asked twice"
        elif core.state not in (RunState.FORMING, RunState.TRAINING):
            why = "training is over"
        if why is not None:
            self._refuse(rank, why)
            return
        assert core.rank_state[rank] is RankState.VACANT  # the coordinator asks for those only
        self.pending[rank] = host
        self.layouts[rank] = layout
        core.last_seen_s[rank] = core._now

    def _refuse(self, rank: int, why: str) -> None:
        core = self.core
        core._out.append(Notice(level="warning", text=f"refused rank {rank}'s join: {why}"))
        core._out.append(Send(rank=rank, message=m.Shutdown(writer=-1, refused=why)))

    def admit_pending(self) -> None:
        """Admit every requested join (the run trains, no round is in flight)."""
        if not self.pending:
            return
        from elche.core.coordinator import RankState

        core = self.core
        run_layout = core.failures.layouts.get(0, "")  # rank 0's, reported by now
        admitted = False
        for rank, host in sorted(self.pending.items()):
            layout = self.layouts.pop(rank, "")
            if layout and run_layout and layout != run_layout:
                self._refuse(rank, OTHER_MODEL)
                continue
            admitted = True
            core.rank_state[rank] = RankState.LIVE
            core.hosts[rank] = host
            core.last_seen_s[rank] = core._now
            core.elche.readmit(rank)
            core.tuner.vacant.discard(rank)
            self.fresh.add(rank)
            self.joined.append(rank)
            core._out.append(Emit(event=tl.RankJoined(rank=rank, host=host)))
            text = f"rank {rank} joined the running run from {host or 'an unnamed host'}"
            core._out.append(Notice(level="info", text=text))
        self.pending.clear()
        if not admitted:
            return  # every join refused
        core.generation += 1
        live = tuple(core.live)
        regroup = m.Regroup(generation=core.generation, members=list(live))
        core._out.append(Broadcast(ranks=live, message=regroup))

    def expect_rejoins(self) -> None:
        """A coordinator restored from the journal: wait for the slots' ranks that trained.

        The journal keeps no joins, but a slot with samples in the consensus
        had a rank that joined; the restored coordinator waits for it to
        rejoin as for the run's first ranks (or loses it at the deadline).
        """
        from elche.core.coordinator import RankState

        core = self.core
        for rank in range(core.config.world_size, core.config.num_slots):
            if core.rank_state[rank] is RankState.VACANT and core.work.samples_committed[rank]:
                self._take_back(rank)

    def _take_back(self, rank: int) -> None:
        """A slot's rank rejoins a restored coordinator: it is one of the run's ranks again."""
        from elche.core.coordinator import RankState

        core = self.core
        core.rank_state[rank] = RankState.JOINING
        core.elche.readmit(rank)
        core.tuner.vacant.discard(rank)
        if rank not in self.joined:
            self.joined.append(rank)

    def release_roles(self) -> None:
        """A restored coordinator formed: roles its journal left on a join slot move on.

        The journal keeps no joins, so a slot is vacant again while the roles
        it records may still name the rank that had joined there.
        """
        from elche.core.coordinator import RankState

        core = self.core
        for rank, state in enumerate(core.rank_state):
            if state is RankState.VACANT:
                core.roles.on_death(rank, core.workers, core.elche.smoothed_ms_per_batch)

    def averaged(self, rnd: Round) -> None:
        """Round ``rnd`` completed: its fresh members that acknowledged it
        hold the consensus now (one whose collective broke answered
        ``failed`` and still holds no replica's model: the next round).

        What they reported of their models before it (divergence, norm) is
        of a model no replica shared: the guard does not judge it.
        """
        newcomers = self.fresh & set(rnd.acks)
        for rank in newcomers:
            rnd.divergence.pop(rank, None)
            rnd.pre_norms[rank] = 0.0
        self.fresh -= newcomers

    def ranks_used(self) -> int:
        """Rank ids up to the last one that took part (join slots left empty are not)."""
        return max([self.core.config.world_size, *(r + 1 for r in self.joined)])

    def forget(self, rank: int) -> None:
        """``rank`` was lost."""
        self.fresh.discard(rank)
        self.pending.pop(rank, None)
