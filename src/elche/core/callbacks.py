"""Callback requests: the eval and checkpoint runs asked of ranks, and their answers.

Who runs each callback is ``elche.core.roles``; this module asks them and
books what comes back.

Rules:

- At the end of epoch ``e`` (``done = e + 1`` epochs finished) the eval role
  is asked to run ``eval_fn`` when ``done`` is a multiple of ``eval_every`` or
  the last epoch, and the checkpoint role to run ``checkpoint_fn`` when
  ``done`` is a multiple of ``checkpoint_every``. A request is *pending* until
  its rank answers.
- Every answer's wall time is taken out of the rank's window timing, so the
  balancer does not read it as the rank being slow, and feeds that
  callback's cost estimate (a checkpoint's only when it succeeded).
- A successful eval is broadcast to every live rank and emitted on the
  timeline; a failed one is only logged.
- A failed checkpoint is retried on a live rank not yet tried for that
  version; once every live rank failed it, the version is given up, loudly
  (training goes on).
- An eval is asked only of a live rank. The eval role of a ``PINNED``
  policy never moves (the reference: a request to a dead pinned rank fails
  loudly rather than re-route), so an eval owed by a dead pinned rank is
  given up with an error notice; under ``FASTEST`` the role has already moved
  to a live rank.
- An answer to a request no longer pending (a restored coordinator asked
  again what its predecessor had asked, and both asks were answered) is
  counted stale and said in a warning; nothing else comes of it (a failed
  one is not retried). Its wall time is still taken out of the rank's window
  timing: the rank spent it on the callback, not training, and the balancer
  would read it as slowness. It does not feed the callback's cost estimate,
  which sizes the slack for one run per epoch end: the first answer gave it.
- A rank that dies with requests pending: its eval is asked again of the
  eval role (already re-resolved) or given up as above; its checkpoint goes
  to the checkpoint role, already re-resolved by the policy, unless that rank
  failed this version, in which case the failure rule picks (a death is not
  a failure: the dead rank does not join the version's tried set).
- The run finishes only when nothing is pending; a death that leaves nothing
  pending lets a finishing run close.
"""

from __future__ import annotations

from collections.abc import Sequence

from elche.core import messages as m
from elche.core import timeline as tl
from elche.core.commands import Broadcast, Command, Emit, Notice, Send
from elche.core.config import CoordinatorConfig
from elche.core.ledger import WindowLedger
from elche.core.roles import CallbackRoles, Role

__all__ = ["Callbacks", "checkpoint_failed_text", "eval_failed_text", "given_up_text"]


class Callbacks:
    """The eval and checkpoint requests in flight, and what their answers do.

    Args:
        config: the run's configuration (which callbacks run, how often).
        roles: who runs each callback.
        ledger: the window timing a callback's wall time is taken out of.
    """

    def __init__(
        self, config: CoordinatorConfig, roles: CallbackRoles, ledger: WindowLedger
    ) -> None:
        self.config = config
        self.roles = roles
        self.ledger = ledger
        self.pending_evals: dict[int, int] = {}  # epoch -> rank asked
        self.pending_checkpoints: dict[int, int] = {}  # version -> rank asked

    @property
    def pending(self) -> bool:
        """Whether some rank still owes an eval or checkpoint answer."""
        return bool(self.pending_evals or self.pending_checkpoints)

    def checkpoint_due(self, done: int) -> bool:
        """Whether a checkpoint is due once ``done`` epochs are finished."""
        every = self.config.checkpoint_every
        return every is not None and done % every == 0

    def due(self, done: int) -> tuple[Role, ...]:
        """The callbacks asked for once ``done`` epochs are finished."""
        cfg = self.config
        roles: tuple[Role, ...] = ()
        if cfg.has_eval_fn and (done % cfg.eval_every == 0 or done == cfg.epochs):
            roles += (Role.EVAL,)
        if self.checkpoint_due(done):
            roles += (Role.CHECKPOINT,)
        return roles

    def at_epoch_end(self, done: int, live: Sequence[int]) -> list[Command]:
        """``done`` epochs are finished: ask for the callbacks due now."""
        due = self.due(done)
        out: list[Command] = []
        if Role.EVAL in due:
            out.append(self._ask_eval(done, live))
        if Role.CHECKPOINT in due:
            out.append(self._ask_checkpoint(done))
        return out

    def on_epoch_fn(self, rank: int, elapsed_ms: float) -> None:
        """``rank`` ran ``epoch_fn`` for ``elapsed_ms``."""
        self.ledger.absorb_callback_cost(rank, elapsed_ms)
        self.roles.record_cost(Role.EPOCH, elapsed_ms, rank=rank)

    def answered_already(self, msg: m.EvalResult | m.CheckpointResult) -> bool:
        """Whether ``msg`` answers a request no longer pending (asked again by a
        restored coordinator and answered twice)."""
        if isinstance(msg, m.EvalResult):
            return msg.epoch not in self.pending_evals
        return msg.version not in self.pending_checkpoints

    def on_answered_twice(self, rank: int, msg: m.EvalResult | m.CheckpointResult) -> Command:
        """``rank`` answered a request answered already: its time is taken out of
        the rank's window timing, the answer goes; returns the warning that says so."""
        self.ledger.absorb_callback_cost(rank, msg.elapsed_ms)
        if isinstance(msg, m.EvalResult):
            what = f"eval_fn after epoch {msg.epoch - 1}"
        else:
            what = f"checkpoint_fn for checkpoint v{msg.version}"
        text = (
            f"rank {rank} answered {what} again (asked again by a restored coordinator); "
            "the first answer stands, this one is ignored"
        )
        return Notice(level="warning", text=text)

    def on_eval_result(self, rank: int, msg: m.EvalResult, live: Sequence[int]) -> list[Command]:
        """``rank`` answered a pending eval request; returns what to tell the others."""
        self.ledger.absorb_callback_cost(rank, msg.elapsed_ms)
        self.roles.record_cost(Role.EVAL, msg.elapsed_ms, rank=rank)
        del self.pending_evals[msg.epoch]
        if msg.error is not None:
            text = eval_failed_text(rank, msg.epoch, msg.error)
            failed = tl.EvalFailed(
                epoch=msg.epoch, rank=rank, duration_ms=msg.elapsed_ms, error=msg.error
            )
            return [Notice(level="error", text=text), Emit(event=failed)]
        out = _broadcast(live, m.EvalBroadcast(epoch=msg.epoch, metric=msg.metric))
        event = tl.Eval(epoch=msg.epoch, metric=msg.metric, rank=rank, duration_ms=msg.elapsed_ms)
        out.append(Emit(event=event))
        return out

    def on_checkpoint_result(
        self, rank: int, msg: m.CheckpointResult, live: Sequence[int]
    ) -> list[Command]:
        """``rank`` answered a pending checkpoint request; returns a retry or a notice."""
        self.ledger.absorb_callback_cost(rank, msg.elapsed_ms)
        ran = tl.CheckpointRan(
            version=msg.version, rank=rank, duration_ms=msg.elapsed_ms,
            outcome="ok" if msg.error is None else "failed", error=msg.error,
        )  # fmt: skip
        out: list[Command] = [Emit(event=ran)]
        if msg.error is None:
            self.roles.record_cost(Role.CHECKPOINT, msg.elapsed_ms, rank=rank)
        else:
            text = checkpoint_failed_text(msg.version, rank, msg.error)
            out.append(Notice(level="error", text=text))
        return out + self._settle_checkpoint(rank, msg.version, msg.error, live)

    def on_death(self, dead: int, live: Sequence[int]) -> list[Command]:
        """``dead`` died: ask again what it owed (roles already re-resolved)."""
        out: list[Command] = []
        for epoch, rank in sorted(self.pending_evals.items()):
            if rank == dead:
                del self.pending_evals[epoch]
                out.append(self._ask_eval(epoch, live))
        for version, rank in sorted(self.pending_checkpoints.items()):
            if rank == dead:
                del self.pending_checkpoints[version]
                out += self._resend_checkpoint(version, live)
        return out

    def ask_again(self, live: Sequence[int]) -> list[Command]:
        """A restored coordinator: ask again for the evals and checkpoints pending
        (the journal's: its predecessor asked for them and never heard back; the
        ranks forgot its orders as they rejoined)."""
        epochs, versions = sorted(self.pending_evals), sorted(self.pending_checkpoints)
        self.pending_evals.clear()  # (a pinned rank gone leaves one unasked, said)
        self.pending_checkpoints.clear()
        out = [self._ask_eval(epoch, live) for epoch in epochs]
        for version in versions:
            out += self._resend_checkpoint(version, live)
        return out

    def _ask_eval(self, epoch: int, live: Sequence[int]) -> Command:
        rank = self.roles.holder(Role.EVAL)
        if rank not in live:
            text = (
                f"eval_fn after epoch {epoch - 1} not run: its pinned rank {rank} is gone "
                "(callback_rank pins the eval role; it does not fail over)"
            )
            return Notice(level="error", text=text)
        self.pending_evals[epoch] = rank
        return Send(rank=rank, message=m.RunEval(epoch=epoch))

    def _ask_checkpoint(self, version: int, rank: int | None = None) -> Command:
        target = self.roles.holder(Role.CHECKPOINT) if rank is None else rank
        self.pending_checkpoints[version] = target
        return Send(rank=target, message=m.RunCheckpoint(version=version))

    def _settle_checkpoint(
        self, rank: int, version: int, error: str | None, live: Sequence[int]
    ) -> list[Command]:
        self.pending_checkpoints.pop(version, None)
        retry = self.roles.on_checkpoint_result(rank, version, error, live)
        if retry is not None:
            return [self._ask_checkpoint(version, retry)]
        return [] if error is None else [_give_up(version)]

    def _resend_checkpoint(self, version: int, live: Sequence[int]) -> list[Command]:
        """The rank running ``version`` died: run it where the roles say now."""
        target = self.roles.checkpoint_target(version, live)
        return [_give_up(version)] if target is None else [self._ask_checkpoint(version, target)]


def eval_failed_text(rank: int, done: int, error: str) -> str:
    """The error notice of ``eval_fn`` failing on ``rank`` after ``done`` epochs (numbered
    from 0 in the text, as ``metrics_fn`` numbers them)."""
    return f"eval_fn failed on rank {rank} after epoch {done - 1}: {error}"


def checkpoint_failed_text(version: int, rank: int, error: str) -> str:
    """The error notice of ``checkpoint_fn`` failing for ``version`` on ``rank``."""
    return f"checkpoint v{version} failed on rank {rank}: {error}"


def given_up_text(version: int) -> str:
    """The error notice of a checkpoint version every live rank failed: it is dropped."""
    return (
        f"checkpoint v{version} failed on every live rank; giving up on this version "
        "(training continues)"
    )


def _give_up(version: int) -> Command:
    return Notice(level="error", text=given_up_text(version))


def _broadcast(live: Sequence[int], message: m.CoordMessage) -> list[Command]:
    ranks = tuple(live)
    return [Broadcast(ranks=ranks, message=message)] if ranks else []
