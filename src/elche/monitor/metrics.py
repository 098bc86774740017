"""The run's Prometheus metrics, fed by timeline records: what ``/metrics`` serves.

One registry per run (never the process-global one, so two runs in one
process do not mix). Series, all prefixed ``elche_``:

- ``samples_trained_total{rank}`` — samples each rank trained (counter, from
  its window records; work a dead rank did after the last average included);
- ``rank_samples_per_second{rank}``, ``rank_share{rank}``,
  ``rank_idle_percent{rank}`` — from each rank's latest window record; a
  lost rank's speed and share are 0 from its ``RankLost`` (or the run's end,
  for a rank ``RunEnd`` lists dead) on, and the window that closes after its
  loss counts its samples but moves neither;
- ``loss`` — the latest epoch's mean training loss; ``anchor``;
  ``epochs_completed``;
- ``round_duration_seconds`` — a histogram of averaging rounds, trigger to
  last acknowledgement;
- ``live_ranks``; ``alerts_total{name,severity}`` — alert occurrences, by class;
- ``dashboard_rejected_requests_total`` — HTTP requests the dashboard
  refused as malformed (an oversized header or URL, not HTTP at all): not a
  timeline record, the dashboard counts them here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from elche.core import timeline as tl

__all__ = ["RunMetrics"]

# Rounds take from about a millisecond (a few ranks on loopback) to seconds
# (a large model over a slow link): buckets spread over that range.
ROUND_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RunMetrics:
    """A registry of the run's metrics and the fold that updates it."""

    def __init__(self) -> None:
        self._live: set[int] = set()
        self._lost: set[int] = set()  # their later windows move neither speed nor share
        self.registry = CollectorRegistry()
        reg = self.registry
        self.samples = Counter(
            "elche_samples_trained", "Samples each rank trained", ["rank"], registry=reg
        )
        self.speed = Gauge(
            "elche_rank_samples_per_second", "Each rank's latest throughput", ["rank"],
            registry=reg,
        )  # fmt: skip
        self.share = Gauge(
            "elche_rank_share", "Each rank's latest share of the batches", ["rank"], registry=reg
        )
        self.idle = Gauge(
            "elche_rank_idle_percent", "Each rank's latest idle percentage", ["rank"],
            registry=reg,
        )  # fmt: skip
        self.loss = Gauge("elche_loss", "The latest epoch's mean training loss", registry=reg)
        self.anchor = Gauge("elche_anchor", "The balancer's anchor (batches)", registry=reg)
        self.epochs = Gauge("elche_epochs_completed", "Epochs completed", registry=reg)
        self.rounds = Histogram(
            "elche_round_duration_seconds", "Averaging round duration", buckets=ROUND_BUCKETS_S,
            registry=reg,
        )  # fmt: skip
        self.live = Gauge("elche_live_ranks", "Ranks live now", registry=reg)
        self.alerts = Counter(
            "elche_alerts", "Alert occurrences by class", ["name", "severity"], registry=reg
        )
        self.rejected_requests = Counter(
            "elche_dashboard_rejected_requests", "HTTP requests the dashboard refused as malformed",
            registry=reg,
        )  # fmt: skip

    def observe(self, event: tl.TimelineEvent) -> None:
        """Fold one record in."""
        match event:
            case tl.RankJoined(rank=rank):
                self._live.add(rank)
                self._lost.discard(rank)
                self.live.set(len(self._live))
            case tl.RankLost(rank=rank):
                self._live.discard(rank)
                self.live.set(len(self._live))
                self._lose(rank)
            case tl.RankWindow(rank=rank):
                label = str(rank)
                self.samples.labels(rank=label).inc(event.samples)
                self.idle.labels(rank=label).set(event.idle_pct)
                if rank not in self._lost:  # a lost rank's last window closes after its loss
                    self.speed.labels(rank=label).set(event.samples_per_s)
                    self.share.labels(rank=label).set(event.share)
            case tl.EpochEnd(epoch=epoch, loss=loss):
                self.epochs.set(epoch + 1)
                if loss is not None:
                    self.loss.set(loss)
            case tl.SyncEnd(duration_ms=duration_ms, anchor=anchor):
                self.rounds.observe(duration_ms / 1000.0)
                self.anchor.set(anchor)
            case tl.Alert(name=name, severity=severity, count=count):
                self.alerts.labels(name=name, severity=severity).inc(count)
            case tl.RunEnd(dead_ranks=dead_ranks):
                self._live.clear()
                self.live.set(0)
                for rank in dead_ranks:
                    self._lose(rank)
            case _:
                pass

    def _lose(self, rank: int) -> None:
        self._lost.add(rank)
        self.speed.labels(rank=str(rank)).set(0.0)
        self.share.labels(rank=str(rank)).set(0.0)

    def text(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
