"""The per-epoch metrics a run returns and hands to ``metrics_fn``.

``EpochLog`` is the list ``TrainResult.epochs`` (one dict per finished
epoch, numbered from 0 as the run numbers its epochs) that also reads the
timeline's per-rank windows and bundle records while the run goes, so that
each epoch's entry carries, besides ``epoch``, ``loss`` and ``syncs``:

- ``lr``: the learning rate a rank last reported;
- ``progress``: ``{"samples", "step", "fraction"}`` of the plan at the end
  of that epoch (``elche.Progress``'s units: every sample of the epochs up
  to it is in the consensus);
- ``per_rank``: ``[{"rank", "samples", "loss", "samples_per_s", "share"}]``
  over the windows served in that epoch (``loss``: the rank's mean training
  loss; ``share``: of the samples trained in them);
- ``eval``: the eval metric after that epoch, when an eval ran.

``bundles`` lists every bundle committed (``{"stem", "seq", "reason"}``).
This module never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from elche.core import timeline as tl

__all__ = ["EpochLog", "with_bundles"]


@dataclass(slots=True)
class _Served:
    samples: int = 0
    span_s: float = 0.0
    loss_sum: float = 0.0  # loss × samples over the windows that reported a loss
    loss_samples: int = 0

    @property
    def loss(self) -> float | None:
        return self.loss_sum / self.loss_samples if self.loss_samples else None


class EpochLog(list[dict[str, object]]):
    """The run's per-epoch metrics (see the module docstring).

    Args:
        epochs: epochs planned.
        num_samples: samples per epoch.
        reference_batch: samples per optimizer step (``batch_size × accumulate``).
    """

    def __init__(self, *, epochs: int = 1, num_samples: int = 1, reference_batch: int = 1) -> None:
        super().__init__()
        self.planned_epochs = max(epochs, 1)
        self.num_samples = num_samples
        self.reference_batch = max(reference_batch, 1)
        self.bundles: list[dict[str, object]] = []
        self._served: dict[int, dict[int, _Served]] = {}  # epoch -> rank -> served

    def note_window(self, record: tl.RankWindow) -> None:
        served = self._served.setdefault(record.epoch, {}).setdefault(record.rank, _Served())
        served.samples += record.samples
        served.span_s += record.span_s
        if record.loss is not None:
            served.loss_sum += record.loss * record.samples
            served.loss_samples += record.samples

    def note_bundle(self, record: tl.BundleWritten) -> None:
        self.bundles.append({"stem": record.stem, "seq": record.seq, "reason": record.reason})

    def ended(self, record: tl.EpochEnd) -> dict[str, object]:
        """The entry of the epoch ``record`` ends, appended to the log."""
        samples = (record.epoch + 1) * self.num_samples
        served = self._served.pop(record.epoch, {})
        total = sum(s.samples for s in served.values())
        entry: dict[str, object] = {
            "epoch": record.epoch,
            "loss": record.loss,
            "syncs": record.rounds_done,
            "lr": record.lr,
            "progress": {
                "samples": samples,
                "step": samples // self.reference_batch,
                "fraction": min((record.epoch + 1) / self.planned_epochs, 1.0),
            },
            "per_rank": [
                {
                    "rank": rank,
                    "samples": s.samples,
                    "loss": s.loss,
                    "samples_per_s": round(s.samples / s.span_s, 2) if s.span_s > 0 else 0.0,
                    "share": round(s.samples / total, 4) if total else 0.0,
                }
                for rank, s in sorted(served.items())
            ],
        }
        self.append(entry)
        return entry

    def evaluated(self, epoch: int, metric: float) -> None:
        """The eval after ``epoch`` (0-based) gave ``metric``."""
        for entry in self:
            if entry["epoch"] == epoch:
                entry["eval"] = metric


def with_bundles(summary: dict[str, object], log: list[dict[str, object]]) -> None:
    """``summary["bundles"]``: every bundle the run committed; ``summary["bundle"]``
    names the last one's stem (the one ``resume_from`` takes) when any was."""
    bundles = log.bundles if isinstance(log, EpochLog) else []
    summary["bundles"] = bundles
    if summary.get("bundle") is None and bundles:
        summary["bundle"] = bundles[-1]["stem"]
