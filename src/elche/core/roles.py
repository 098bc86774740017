"""Callback roles: which rank runs epoch_fn, eval_fn and checkpoint_fn.

Rules (the reference coordinator's callback-role election, restated):

1. At start every role is rank 0 under ``FASTEST``, or the pinned rank
   (clamped into range) under ``PINNED``.
2. ``FASTEST`` resolves to the live rank with the lowest smoothed ms/batch
   (strictly lower wins, so ties go to the lowest index); before any rank has
   a timing sample it falls back to the lowest live rank.
3. Roles are *sticky*: they are elected once, at the first round that
   closes calibrated (under ``cadence`` the probe calibrates before it: its
   one or two steps a rank size a window but are too few to rank paces), and
   re-resolved only when the rank holding one dies. Balancer drift never
   moves them (callbacks may keep per-process state).
4. Under ``PINNED`` eval and epoch roles never move; only the checkpoint role
   fails over, to the lowest live rank.
5. The epoch role is pushed to every rank when it changes ("dirty"), before
   the next epoch's work goes out.
6. A checkpoint that succeeds makes its rank the checkpoint role. One that
   fails is retried on the lowest live rank not yet tried for that version;
   when none is left the coordinator gives up loudly (the failure threshold
   still governs the run's health). A checkpoint whose rank *dies* is not a
   failure: it goes to the role rule 2 or 4 just re-resolved, unless that
   rank already failed the version (then the failure rule picks).
7. Every callback report is time-excluded from the rank's window and feeds an
   EWMA (alpha 0.3, seeded by the first sample) of that callback's cost;
   ``epoch_fn`` runs on every rank (elche differs here), so its EWMA is kept
   per rank.
8. The window that holds boundary work has that work's EWMA cost staged as
   *slack* on the rank that runs it, so the balancer shrinks that rank's
   quota instead of stretching the barrier: each rank's own ``epoch_fn``
   cost in the window where it starts an epoch, the eval and checkpoint
   costs on their roles in the window they are asked in (which window that
   is, is ``Tuner``'s call). Only per-rank sums above max(5 % of the anchor
   window, 100 ms) count.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from elche.core.config import CallbackPolicy

__all__ = ["CALLBACK_EWMA_ALPHA", "CallbackCost", "CallbackRoles", "Role", "ewma"]

# Same smoothing the balancer family uses for recent values.
CALLBACK_EWMA_ALPHA = 0.3
# Slack below either floor is noise: 100 ms absolute, 5 % of the anchor window.
SLACK_FLOOR_MS = 100.0
SLACK_FLOOR_FRACTION = 0.05


class Role(enum.Enum):
    EPOCH = "epoch"
    EVAL = "eval"
    CHECKPOINT = "checkpoint"


def ewma(previous: float | None, sample: float, alpha: float = CALLBACK_EWMA_ALPHA) -> float:
    """Exponentially weighted mean; the first sample seeds it."""
    return sample if previous is None else alpha * sample + (1.0 - alpha) * previous


@dataclass(slots=True)
class CallbackCost:
    """EWMA of each callback's wall time, in ms (None or absent until first report)."""

    epoch_fn_ms: dict[int, float] = field(default_factory=dict)  # rank -> EWMA
    eval_ms: float | None = None
    checkpoint_ms: float | None = None


MsOf = Callable[[int], float | None]


@dataclass(slots=True)
class CallbackRoles:
    """Role assignment and callback bookkeeping of one run."""

    policy: CallbackPolicy
    world_size: int
    pinned: int = 0
    roles: dict[Role, int] = field(default_factory=dict)
    epoch_role_dirty: bool = True
    cost: CallbackCost = field(default_factory=CallbackCost)
    checkpoint_tried: dict[int, set[int]] = field(default_factory=dict)
    elected: bool = False

    def __post_init__(self) -> None:
        pinned = min(self.pinned, self.world_size - 1)
        start = 0 if self.policy is CallbackPolicy.FASTEST else pinned
        self.roles = dict.fromkeys(Role, start)

    def holder(self, role: Role) -> int:
        return self.roles[role]

    def resolve_fastest(self, live: Collection[int], ms_of: MsOf) -> int | None:
        """The live rank with the lowest smoothed ms/batch, else the lowest live rank."""
        best: tuple[float, int] | None = None
        for rank in sorted(live):
            ms = ms_of(rank)
            if ms is not None and ms > 0 and (best is None or ms < best[0]):
                best = (ms, rank)
        if best is not None:
            return best[1]
        return min(live) if live else None

    def on_first_calibration(self, live: Collection[int], ms_of: MsOf) -> None:
        """Elect every role on pace, once (``FASTEST`` only)."""
        if self.elected or self.policy is not CallbackPolicy.FASTEST:
            return
        fastest = self.resolve_fastest(live, ms_of)
        if fastest is None or all(ms_of(r) is None for r in live):
            return
        self.elected = True
        self._move(Role, fastest)

    def on_death(self, rank: int, live: Collection[int], ms_of: MsOf) -> None:
        """Re-resolve the roles the dead ``rank`` held."""
        held = [role for role, r in self.roles.items() if r == rank]
        if not held or not live:
            return
        if self.policy is CallbackPolicy.FASTEST:
            successor = self.resolve_fastest(live, ms_of)
            if successor is not None:
                self._move(held, successor)
        elif Role.CHECKPOINT in held:
            self.roles[Role.CHECKPOINT] = min(live)

    def take_dirty_epoch_role(self) -> int | None:
        """The epoch role to broadcast, once per change."""
        if not self.epoch_role_dirty:
            return None
        self.epoch_role_dirty = False
        return self.roles[Role.EPOCH]

    def on_checkpoint_result(
        self, rank: int, version: int, error: str | None, live: Collection[int]
    ) -> int | None:
        """Book a checkpoint report; returns the rank to retry on, if any.

        On success the reporting rank becomes the checkpoint role. On failure
        the lowest live rank not yet tried for ``version`` is returned (and
        becomes the role); ``None`` with a failure means every live rank was
        tried and the version is dropped.
        """
        if error is None:
            self.checkpoint_tried.pop(version, None)
            self.roles[Role.CHECKPOINT] = rank
            return None
        self.checkpoint_tried.setdefault(version, set()).add(rank)
        return self._untried(version, live)

    def checkpoint_target(self, version: int, live: Collection[int]) -> int | None:
        """The rank running ``version`` died: where to run it now.

        Call after ``on_death``. The checkpoint role (re-resolved by the
        policy) if it has not failed ``version``; otherwise the lowest live
        untried rank, which becomes the role; ``None`` when every live rank
        failed it (the version is dropped).
        """
        holder = self.roles[Role.CHECKPOINT]
        if holder in live and holder not in self.checkpoint_tried.get(version, ()):
            return holder
        return self._untried(version, live)

    def _untried(self, version: int, live: Collection[int]) -> int | None:
        tried = self.checkpoint_tried.get(version, set())
        untried = [r for r in sorted(live) if r not in tried]
        if not untried:
            self.checkpoint_tried.pop(version, None)
            return None
        self.roles[Role.CHECKPOINT] = untried[0]
        return untried[0]

    def record_cost(self, role: Role, elapsed_ms: float, *, rank: int) -> None:
        """Fold one callback's wall time on ``rank`` into its EWMA.

        ``epoch_fn`` keeps one EWMA per rank (every rank runs it); eval and
        checkpoint keep one each (only their role runs them).
        """
        cost = self.cost
        if role is Role.EPOCH:
            cost.epoch_fn_ms[rank] = ewma(cost.epoch_fn_ms.get(rank), elapsed_ms)
        elif role is Role.EVAL:
            cost.eval_ms = ewma(cost.eval_ms, elapsed_ms)
        else:
            cost.checkpoint_ms = ewma(cost.checkpoint_ms, elapsed_ms)

    def boundary_slack_ms(
        self,
        *,
        epoch_fn_ranks: Collection[int],
        due: Collection[Role],
        anchor_wall_ms: float,
    ) -> list[float] | None:
        """Per-rank callback cost of the boundary work one window holds.

        Args:
            epoch_fn_ranks: ranks that start an epoch (run ``epoch_fn``) in it.
            due: the eval and checkpoint roles asked to run in it.
            anchor_wall_ms: the anchor window's wall time (the relative floor).

        Returns:
            The slack vector to stage on the balancer, or None when no entry
            clears the noise floor.
        """
        slack = [0.0] * self.world_size
        for rank in epoch_fn_ranks:
            if 0 <= rank < self.world_size:
                slack[rank] += self.cost.epoch_fn_ms.get(rank, 0.0)
        costs = {Role.EVAL: self.cost.eval_ms, Role.CHECKPOINT: self.cost.checkpoint_ms}
        for role in due:
            cost = costs.get(role)
            if cost is not None and 0 <= self.roles[role] < self.world_size:
                slack[self.roles[role]] += cost
        floor = max(SLACK_FLOOR_FRACTION * anchor_wall_ms, SLACK_FLOOR_MS)
        slack = [s if s >= floor else 0.0 for s in slack]
        return slack if any(s > 0 for s in slack) else None

    def _move(self, roles: Iterable[Role], rank: int) -> None:
        for role in roles:
            if role is Role.EPOCH and self.roles[role] != rank:
                self.epoch_role_dirty = True
            self.roles[role] = rank
