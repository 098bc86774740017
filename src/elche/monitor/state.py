"""The run's live state, folded from its timeline: what ``/state.json`` serves.

``RunView.observe`` takes timeline records in order (``t`` is seconds since
the coordinator started) and keeps:

- ``run``: mode, world size, phase (``forming``, ``training``, ``done``),
  epochs completed, the latest loss and learning rate, the anchor, rounds
  done, the outcome once the run is over;
- ``ranks``: one entry per rank, in rank order: host, state (``joining``,
  ``live``, ``lost`` with its reason), samples trained, and from its latest
  ``RankWindow`` its samples/s, share of the batches, compute ms per batch,
  idle % and loss; the callback roles it holds. A rank that joins the
  running run (``elche join``: a ``RankJoined`` past the world, or one of
  ``RunEnd.joined_ranks``) gains an entry then;
- ``series``: loss against time, each rank's samples/s and share against
  time, each round's duration, the anchor; each at most ``MAX_POINTS`` long
  (the oldest tenth goes when full, as the reference's archive does);
- ``alerts``: the ``Alert`` records, newest last, at most ``MAX_ALERTS``.

``RunEnd`` is the coordinator's account, and the view takes it as the truth
where the records before it fall short: each rank's samples become the
samples it put into the consensus (``samples_per_rank``, the summary's
figure: a dead rank's work after the last average is not in it), and a rank
in ``dead_ranks`` is ``lost`` even if no ``RankLost`` said so (a run
interrupted, or ended by a rank's failure).

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
        self._devices = devices or []
        self.ranks: list[dict[str, Any]] = []  # in rank order
        self._by_rank: dict[int, dict[str, Any]] = {}
        self.series: dict[str, Any] = {"loss": [], "round_ms": [], "anchor": [],
                                       "samples_per_s": {}, "share": {}}  # fmt: skip
        for rank in range(world_size):
            self._add_rank(rank)
        self.alerts: list[dict[str, Any]] = []
        self.records = 0

    def observe(self, event: tl.TimelineEvent) -> None:
        """Fold one record in."""
        self.records += 1
        self.run["t"] = max(self.run["t"], event.t)
        match event:
            case tl.RunStart(mode=mode):
                self.run.update(mode=mode, phase="training")
            case tl.RankJoined(rank=rank, host=host) if rank >= 0:
                self._add_rank(rank).update(host=host, state="live")
            case tl.RankLost(rank=rank, reason=reason) if self._valid(rank):
                self._lose(rank, reason)
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
                self._reconcile(event)
            case _:
                pass

    def state(self) -> dict[str, Any]:
        """The state as plain JSON-able data (shared: do not modify it)."""
        return {"run": self.run, "ranks": self.ranks, "series": self.series,
                "alerts": self.alerts, "records": self.records}  # fmt: skip

    def _valid(self, rank: int) -> bool:
        return rank in self._by_rank

    def _add_rank(self, rank: int) -> dict[str, Any]:
        """The entry of ``rank``, made (joining, unmeasured) if it has none yet."""
        entry = self._by_rank.get(rank)
        if entry is not None:
            return entry
        device = self._devices[rank] if rank < len(self._devices) else None
        entry = {
            "rank": rank, "host": None, "device": device, "state": "joining", "reason": None,
            "samples": 0, "samples_per_s": None, "share": None, "compute_ms_per_batch": None,
            "idle_pct": None, "loss": None, "roles": [],
        }  # fmt: skip
        self._by_rank[rank] = entry
        self.ranks.append(entry)
        if len(self.ranks) > 1 and self.ranks[-2]["rank"] > rank:  # joins come in rank order
            self.ranks.sort(key=lambda e: int(e["rank"]))
        self.series["samples_per_s"][str(rank)] = []
        self.series["share"][str(rank)] = []
        return entry

    def _lose(self, rank: int, reason: str) -> None:
        self._by_rank[rank].update(state="lost", reason=reason, samples_per_s=0.0, share=0.0)

    def _reconcile(self, end: tl.RunEnd) -> None:
        """Take the coordinator's account of the ranks: who joined, who died, what counted."""
        for rank in end.joined_ranks:
            if rank >= 0 and not self._valid(rank):
                self._add_rank(rank)["state"] = "live"
        for rank in end.dead_ranks:
            if self._valid(rank) and self._by_rank[rank]["state"] != "lost":
                self._lose(rank, end.reason or "dead at the run's end")
        for rank, samples in enumerate(end.samples_per_rank):
            if self._valid(rank):
                self._by_rank[rank]["samples"] = samples

    def _window(self, w: tl.RankWindow) -> None:
        if not self._valid(w.rank):
            return
        entry = self._by_rank[w.rank]
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
                self._by_rank[rank]["roles"].append(role)

    def _alert(self, alert: tl.Alert) -> None:
        self.alerts.append(
            {"t": alert.t, "severity": alert.severity, "name": alert.name, "path": alert.path,
             "detail": alert.detail, "count": alert.count}
        )  # fmt: skip
        if len(self.alerts) > MAX_ALERTS:
            del self.alerts[0]
