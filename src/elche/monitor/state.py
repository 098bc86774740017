"""The run's live state, folded from its timeline: what ``/state.json`` serves.

``RunView.observe`` takes timeline records in order (``t`` is seconds since
the coordinator started) and keeps:

- ``run``: mode, world size, phase (``forming``, ``training``, ``done``),
  epochs completed, the latest loss and learning rate, the anchor, rounds
  done, the outcome once the run is over;
- ``ranks``: one entry per rank: host, state (``joining``, ``live``,
  ``lost`` with its reason), samples trained, and from its latest
  ``RankWindow`` its samples/s, share of the batches, compute ms per batch,
  idle % and loss; the callback roles it holds;
- ``series``: loss against time, each rank's samples/s and share against
  time, each round's duration, the anchor; each at most ``MAX_POINTS`` long
  (the oldest tenth goes when full, as the reference's archive does);
- ``alerts``: the ``Alert`` records, newest last, at most ``MAX_ALERTS``.

Pure: no clock, no IO, no threads; the dashboard serialises access.
"""

from __future__ import annotations

from typing import Any

from elche.core import timeline as tl

__all__ = ["MAX_ALERTS", "MAX_POINTS", "RunView"]

# A point every round of a long run would grow without bound; 5000 points
# draw a chart as well as a million do.
MAX_POINTS = 5000
# The alert book keeps at most 200 live entries; the view keeps as many reports.
MAX_ALERTS = 200

Point = list[float]


def _push(series: list[Point], point: Point, limit: int = MAX_POINTS) -> None:
    series.append(point)
    if len(series) > limit:
        del series[: max(1, limit // 10)]


class RunView:
    """Folds timeline records into the run's state.

    Args:
        world_size: ranks in the run.
        devices: each rank's device, when the launcher knows them.
        run_dir: the run directory, shown in the state.
    """

    def __init__(
        self, world_size: int, *, devices: list[str] | None = None, run_dir: str = ""
    ) -> None:
        self.run: dict[str, Any] = {
            "run_dir": run_dir, "mode": None, "world_size": world_size, "phase": "forming",
            "t": 0.0, "epochs_completed": 0, "loss": None, "lr": None, "anchor": None,
            "rounds": 0, "outcome": None, "reason": None,
        }  # fmt: skip
        self.ranks: list[dict[str, Any]] = [
            {
                "rank": r, "host": None, "device": devices[r] if devices else None,
                "state": "joining", "reason": None, "samples": 0, "samples_per_s": None,
                "share": None, "compute_ms_per_batch": None, "idle_pct": None, "loss": None,
                "roles": [],
            }
            for r in range(world_size)
        ]  # fmt: skip
        self.series: dict[str, Any] = {
            "loss": [], "round_ms": [], "anchor": [],
            "samples_per_s": {str(r): [] for r in range(world_size)},
            "share": {str(r): [] for r in range(world_size)},
        }  # fmt: skip
        self.alerts: list[dict[str, Any]] = []
        self.records = 0

    def observe(self, event: tl.TimelineEvent) -> None:
        """Fold one record in."""
        self.records += 1
        self.run["t"] = max(self.run["t"], event.t)
        match event:
            case tl.RunStart(mode=mode):
                self.run.update(mode=mode, phase="training")
            case tl.RankJoined(rank=rank, host=host) if self._valid(rank):
                self.ranks[rank].update(host=host, state="live")
            case tl.RankLost(rank=rank, reason=reason) if self._valid(rank):
                self.ranks[rank].update(state="lost", reason=reason, samples_per_s=0.0, share=0.0)
            case tl.RankWindow():
                self._window(event)
            case tl.EpochEnd(epoch=epoch, loss=loss, lr=lr):
                self.run["epochs_completed"] = max(self.run["epochs_completed"], epoch + 1)
                self.run["lr"] = lr if lr is not None else self.run["lr"]
                if loss is not None:
                    self.run["loss"] = loss
                    _push(self.series["loss"], [event.t, loss])
            case tl.SyncEnd(duration_ms=duration_ms, anchor=anchor):
                self.run.update(rounds=self.run["rounds"] + 1, anchor=anchor)
                _push(self.series["round_ms"], [event.t, duration_ms])
                _push(self.series["anchor"], [event.t, anchor])
            case tl.RolesMoved():
                self._roles(event)
            case tl.Alert():
                self._alert(event)
            case tl.RunEnd(outcome=outcome, reason=reason, anchor=anchor):
                self.run.update(phase="done", outcome=outcome, reason=reason, anchor=anchor)
            case _:
                pass

    def state(self) -> dict[str, Any]:
        """The state as plain JSON-able data (shared: do not modify it)."""
        return {"run": self.run, "ranks": self.ranks, "series": self.series,
                "alerts": self.alerts, "records": self.records}  # fmt: skip

    def _valid(self, rank: int) -> bool:
        return 0 <= rank < len(self.ranks)

    def _window(self, w: tl.RankWindow) -> None:
        if not self._valid(w.rank):
            return
        entry = self.ranks[w.rank]
        entry["samples"] += w.samples
        entry.update(
            idle_pct=w.idle_pct, compute_ms_per_batch=w.compute_ms_per_batch,
            loss=w.loss if w.loss is not None else entry["loss"],
        )  # fmt: skip
        if entry["state"] != "lost":  # a lost rank's last window closes after its loss
            entry.update(samples_per_s=w.samples_per_s, share=w.share)
        _push(self.series["samples_per_s"][str(w.rank)], [w.t, w.samples_per_s])
        _push(self.series["share"][str(w.rank)], [w.t, w.share])

    def _roles(self, event: tl.RolesMoved) -> None:
        for entry in self.ranks:
            entry["roles"] = []
        for role, rank in (
            ("epoch", event.epoch_rank), ("eval", event.eval_rank),
            ("checkpoint", event.checkpoint_rank),
        ):  # fmt: skip
            if self._valid(rank):
                self.ranks[rank]["roles"].append(role)

    def _alert(self, alert: tl.Alert) -> None:
        self.alerts.append(
            {"t": alert.t, "severity": alert.severity, "name": alert.name, "path": alert.path,
             "detail": alert.detail, "count": alert.count}
        )  # fmt: skip
        if len(self.alerts) > MAX_ALERTS:
            del self.alerts[0]
