"""What each completed averaging round teaches the balancer.

Theory of operation, in the order ``Tuner.close_round`` runs it (the order
matters and follows the reference coordinator's finish head):

1. stage callback slack if the next window holds boundary work (an epoch
   start, an eval or checkpoint asked);
2. feed ElChe the window's timing (compute and delivered ms per rank);
   on the first calibration, elect the callback roles on pace (under
   ``cadence`` the first calibration comes earlier, mid-window, from
   ``calibrate_in_window``);
3. ask the convergence guard for a verdict on the round's divergence;
4. let the LR-aware meta-controller observe the round (it may nudge the
   anchor down, discarding a staged growth of the same round);
5. apply the guard's verdict, to ElChe and to the planner (whose async
   overshoot allowance follows it);
6. reset the window ledger.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import assert_never

from elche.core import timeline as tl
from elche.core.callbacks import Callbacks
from elche.core.commands import Command, Emit, Notice
from elche.core.config import CoordinatorConfig, Policy
from elche.core.elche_state import ElCheState
from elche.core.guards import DivergenceReport, build_guard
from elche.core.ledger import WindowLedger
from elche.core.meta import LrEventMeta
from elche.core.planner import Planner
from elche.core.rounds import Round
from elche.core.scheduler import ElChe
from elche.core.verdicts import NudgeDown, Stable, SuppressGrowth, Verdict
from elche.core.work import WorkBook

__all__ = ["Tuner"]


class Tuner:
    """Closes rounds: timing to ElChe, divergence to the guard, LR to the meta.

    Args:
        config: the run's configuration.
        elche: the balancer the rounds' timing and verdicts feed.
        callbacks: the callback requests and their roles (elected at the
            first calibrated round's close).
        planner: told each verdict (the async overshoot allowance).
        work: the work book (how much of the serving epoch is left).
        ledger: the window's timing, recorded by the coordinator; reset here.
        saved: the balancer's trajectory from a checkpoint, with the guard's
            history (``saved_state`` wrote it): ElChe and the guard go on
            from it.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        elche: ElChe,
        callbacks: Callbacks,
        planner: Planner,
        work: WorkBook,
        *,
        ledger: WindowLedger,
        saved: ElCheState | None = None,
    ) -> None:
        sched = config.scheduler
        self.config = config
        self.elche = elche
        self.callbacks = callbacks
        self.roles = callbacks.roles
        self.planner = planner
        self.work = work
        self.ledger = ledger
        self.guard = build_guard(
            sched.guard,
            divergence_threshold=sched.divergence_threshold,
            easgd=config.blend_alpha is not None,
            history=None if saved is None else saved.trend_history,
        )
        if saved is not None:
            elche.restore_from_state(saved)
        self.meta = LrEventMeta() if sched.meta_controller else None
        self._lr: list[float | None] = [None] * config.world_size
        # Slots no rank has joined (the coordinator keeps it): they hold no norms.
        self.vacant: set[int] = set()

    def saved_state(self) -> ElCheState:
        """The balancer's trajectory and the guard's history, for a checkpoint meta."""
        state = self.elche.to_state()
        return dataclasses.replace(state, trend_history=self.guard.trend_history())

    @property
    def lr(self) -> float | None:
        """The learning rate the lowest reporting rank last reported (None: none did)."""
        return next((x for x in self._lr if x is not None), None)

    def note_lr(self, rank: int, lr: float) -> None:
        """``rank`` reported its learning rate (the meta-controller watches it)."""
        self._lr[rank] = lr

    def calibrate_in_window(self, live: Collection[int], dead: Collection[int]) -> bool:
        """The probe's timing, before any average: the first calibration, now.

        Under ``cadence`` the probe goes on as the first window (see
        ``Planner``), so ElChe calibrates from the probe batches the ledger
        holds; the guard and the meta-controller judge the round when it
        closes, as any other, and the callback roles are elected there too,
        on the window's own pace: a probe of one or two steps a rank is
        enough to size a window, but on steps of a millisecond or less it
        named a slower rank the fastest in 2 of 11 runs (and 1 of 10 once
        averaged with the window's), and the roles are sticky. The window's
        timing starts afresh (its steps are kept), so the round's report
        holds only what came after. Returns whether ElChe is calibrated (a
        probe without timing is not).
        """
        report = self.ledger.build_window_report(dead=dead, delivered_capable=True, sync_ms=0.0)
        self.elche.report_window(report)
        if not self.elche.is_calibrated:
            return False
        self.ledger.reset_timing()
        return True

    def close_round(
        self,
        rnd: Round,
        sync_ms: float,
        live: Collection[int],
        dead: Collection[int],
        *,
        planned_ahead: bool = False,
    ) -> tuple[int, list[Command]]:
        """Feed a completed round back; returns (steps it folded in, commands).

        ``planned_ahead``: the coming window was planned as the round started
        (``elche.core.ahead``), which it does only without slack to stage.
        """
        out: list[Command] = []
        old_anchor = self.elche.anchor
        if not planned_ahead:
            self._stage_callback_slack(live)
        report = self.ledger.build_window_report(
            dead=dead,
            delivered_capable=self.config.policy is not Policy.SYNC,
            sync_ms=sync_ms,
        )
        self.elche.report_window(report)
        if self.elche.is_calibrated:  # the first calibrated close elects (once: sticky)
            self.roles.on_first_calibration(live, report.ms_per_batch)
        divergence = self._divergence(rnd)
        k_used = sum(rnd.acks.values())
        verdict = self.guard.report(divergence, k_used, max(rnd.acks.values(), default=0))
        out += self._observe_meta(verdict)
        out += self._apply_verdict(verdict)
        end = tl.SyncEnd(
            round=rnd.number,
            duration_ms=round(sync_ms, 3),
            d_raw=divergence.max_relative_delta(),
            k_used=k_used,
            anchor=self.elche.anchor,
        )
        out.append(Emit(event=end))
        if self.elche.anchor != old_anchor:
            out.append(Emit(event=tl.AnchorChanged(old=old_anchor, new=self.elche.anchor)))
        self.ledger.reset_timing()
        self.ledger.reset_steps()
        return k_used, out

    def _divergence(self, rnd: Round) -> DivergenceReport:
        ws = self.config.world_size
        pre = [rnd.pre_norms.get(r, 0.0 if r in self.vacant else None) for r in range(ws)]
        return DivergenceReport(
            deltas=tuple(rnd.divergence.get(r, 0.0) for r in range(ws)),
            pre_norms=None if any(p is None for p in pre) else tuple(p or 0.0 for p in pre),
            post_norm=rnd.post_norm,
        )

    def _observe_meta(self, verdict: Verdict) -> list[Command]:
        lr = self.lr
        if self.meta is None or lr is None:
            return []
        action = self.meta.observe(lr, self.elche.anchor, verdict, self.elche.phase)
        if action is None:
            return []
        old = self.elche.anchor
        self.elche.apply_verdict(action)
        return [Emit(event=tl.MetaNudge(factor=action.factor, old=old, new=self.elche.anchor))]

    def _apply_verdict(self, verdict: Verdict) -> list[Command]:
        self.planner.note_verdict(verdict)
        match verdict:
            case Stable():
                relax = self.config.policy is Policy.ASYNC and self.config.scheduler.relax_up
                self.elche.apply_verdict(Stable(relax_up=relax))
            case SuppressGrowth():
                self.elche.apply_verdict(verdict)
            case NudgeDown():
                old = self.elche.anchor
                self.elche.apply_verdict(verdict)
                text = (
                    "divergence rising: convergence guard nudged the anchor down "
                    f"(x{verdict.factor:.2f}) to {self.elche.anchor}"
                )
                nudge = tl.GuardNudge(factor=verdict.factor, old=old, new=self.elche.anchor)
                return [Notice(level="warning", text=text), Emit(event=nudge)]
            case _:
                assert_never(verdict)
        return []

    def _stage_callback_slack(self, live: Collection[int]) -> None:
        """Shrink each rank's quota by the callback work the coming window holds.

        That window holds the eval and checkpoint asked for the epochs this
        round finishes, and the ``epoch_fn`` of each rank that starts an
        epoch in it (``_starts_epoch``). Staging it a window early would
        shrink a quota where there is nothing to absorb, and leave the
        boundary window as long as before.
        """
        if not self.elche.is_calibrated or self.work.all_done():
            return
        finishing = self.work.finishing_epochs()
        slack = self.boundary_slack(
            live, finishing, starts_epoch=self._starts_epoch(live, finishing)
        )
        if slack is not None:
            self.elche.apply_callback_slack(slack)

    def boundary_slack(
        self, live: Collection[int], finishing: Sequence[int], *, starts_epoch: bool
    ) -> list[float] | None:
        """The callback slack of the window after the round that finishes ``finishing``
        (None: none), ``starts_epoch`` if the ranks start an epoch in it."""
        return self.roles.boundary_slack_ms(
            epoch_fn_ranks=live if starts_epoch else (),
            due=[role for epoch in finishing for role in self.callbacks.due(epoch + 1)],
            anchor_wall_ms=self.elche.anchor_wall_ms(),
        )

    def _starts_epoch(self, live: Collection[int], finishing: Sequence[int]) -> bool:
        """Whether the ranks start a new epoch in the window about to open.

        Under ``cadence`` and ``sync`` the next epoch opens only once every
        open one is finished, so in the window after the round that finishes
        them. ``async`` streams across the boundary: the ranks cross it in
        the window that hands out the serving epoch's last batches.
        """
        if self.work.next_epoch_to_open() is None:
            return False
        if self.config.policy is not Policy.ASYNC:
            return len(finishing) == len(self.work.open_epochs())
        serving = self.work.serving_epoch()
        if serving is None:
            return True
        total = sum(self.elche.batch_counts[r] for r in live)
        return self.work.pools[serving].remaining_batches() <= total
