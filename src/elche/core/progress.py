"""The run's global progress, as every rank sees it.

Rules:

- Progress is counted in samples trained cluster-wide into the consensus,
  out of the run's plan (``epochs × num_samples``). Its other units follow:
  ``step`` is samples over the reference batch (samples per optimizer step,
  ``batch_size × accumulate``), ``fraction`` is samples over the plan.
- The coordinator is the one source of the exact value: when an averaging
  round closes (and when training starts) it sends each live rank
  ``m.GlobalProgress``: the samples the consensus holds after that round, and the
  rank's *share* of the cluster's samples in the next window (its ElChe
  batch count over the live ranks' sum, so the share follows the measured
  speeds).
- Between averages a rank estimates: the last exact value plus its own
  samples since that round's average, divided by its share. In a window
  every rank trains its share in the same wall time, so all ranks' estimates
  advance together and meet the exact value at the next average.
- The estimate never runs past the window the rank trains: each confirmation
  names the samples the consensus will hold once every rank trained the next
  window (its *horizon*), and a rank that trains faster than its share said
  (or trains on while a late peer finishes, ``Planner``'s fill) holds there
  until the round's confirmation, instead of running ahead of its peers.
- Under ``cadence`` the next window goes out as its round starts, and the
  confirmation goes with it: the samples the round averages if every member
  takes part, and the new window's shares and horizon; the round's close
  confirms the exact count. So a rank training through the round counts the
  new window at the new window's share.
- The estimate never runs past the plan, and never backwards: a confirmation
  below the estimate so far holds the estimate until the ranks catch up.

Theory of operation. ``ProgressTracker`` is fed by ``RankProtocol``: every
trained batch (``trained``), every average this rank took part in
(``averaged``, with its round) and every ``m.GlobalProgress`` (``confirmed``).
A confirmation names a round; the rank's own samples at that round's average
are what its later samples are counted from, so a confirmation that arrives
after the rank trained on is still exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from elche.core import messages as m

__all__ = ["Progress", "ProgressTracker"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    """Where the run stands, the same on every rank.

    Attributes:
        samples: samples trained cluster-wide (exact at an average, else estimated).
        step: optimizer steps at the reference batch size (``samples // reference``).
        fraction: ``samples`` over the planned samples, in ``[0, 1]``.
        planned_samples: ``epochs × num_samples``.
        exact_samples: the value the last average confirmed.
    """

    samples: int
    step: int
    fraction: float
    planned_samples: int
    exact_samples: int


class ProgressTracker:
    """One rank's view of the global progress (see the module docstring).

    Args:
        planned_samples: ``epochs × num_samples`` (at least 1).
        reference_batch: samples per optimizer step (at least 1).
        world_size: ranks in the run; the share before the first confirmation is
            ``1 / world_size``.

    Raises:
        ValueError: a count below 1.
    """

    def __init__(self, *, planned_samples: int, reference_batch: int, world_size: int) -> None:
        if min(planned_samples, reference_batch, world_size) < 1:
            raise ValueError("planned_samples, reference_batch and world_size must be >= 1")
        self.planned_samples = planned_samples
        self.reference_batch = reference_batch
        self.own_samples = 0  # this rank's samples trained in this run
        self._share = 1.0 / world_size
        self._exact = 0  # cluster samples the last confirmation named
        self._own_at_exact = 0  # this rank's own samples at that confirmation's average
        self._exact_round = 0  # the round of the last confirmation
        self._own_at_round: dict[int, int] = {}  # averages not confirmed yet
        self._floor = 0  # the estimate never goes below what it showed before
        self._horizon = 0  # where the window being trained ends (0: not known)

    def trained(self, samples: int) -> None:
        """This rank trained ``samples`` more."""
        self.own_samples += samples

    def averaged(self, round_number: int) -> None:
        """This rank's model took part in the average of ``round_number``."""
        self._own_at_round[round_number] = self.own_samples

    def failed(self, round_number: int) -> None:
        """The average of ``round_number`` broke on this rank (it counted the
        round at its launch): it was not part of it after all."""
        self._own_at_round.pop(round_number, None)

    def confirmed(self, message: m.GlobalProgress) -> None:
        """The coordinator's exact count after ``message.round``."""
        self._floor = max(self._floor, self.samples())
        own = self._own_at_round.get(message.round)
        if own is not None:
            self._own_at_exact = own
        elif message.round != self._exact_round:  # an average this rank was not part of
            self._own_at_exact = self.own_samples
        self._exact_round = message.round
        # The round's own count stays: a second word on it (new shares) counts from it too.
        self._own_at_round = {k: v for k, v in self._own_at_round.items() if k >= message.round}
        self._exact = min(max(message.samples, 0), self.planned_samples)
        if message.share > 0:
            self._share = min(message.share, 1.0)
        self._horizon = max(message.horizon, 0)

    def finished(self) -> None:
        """The plan is done (a rank alone knows it): the progress is its end."""
        self._exact = self._floor = self.planned_samples

    def samples(self) -> int:
        """Cluster-wide samples now: exact at an average, estimated between."""
        since = (self.own_samples - self._own_at_exact) / self._share
        estimate = self._exact + int(since)
        if self._horizon > self._exact:
            estimate = min(estimate, self._horizon)
        estimate = max(estimate, self._floor)
        if self._exact >= self.planned_samples:
            return self.planned_samples
        # Short of the coordinator's word that the plan is done, stay below its end.
        return min(estimate, self.planned_samples - 1)

    def now(self) -> Progress:
        """The progress as a value."""
        samples = self.samples()
        return Progress(
            samples=samples,
            step=samples // self.reference_batch,
            fraction=samples / self.planned_samples,
            planned_samples=self.planned_samples,
            exact_samples=self._exact,
        )
