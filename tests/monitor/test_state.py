"""The run's state and metrics folded from timeline records; the dashboard address."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elche.core import timeline as tl
from elche.core.errors import ConfigError
from elche.monitor.address import parse_address
from elche.monitor.metrics import RunMetrics
from elche.monitor.state import MAX_POINTS, RunView


def _window(rank: int, t: float, share: float, sps: float) -> tl.RankWindow:
    return tl.RankWindow(
        t=t, rank=rank, epoch=0, span_s=1.0, batches=4, samples=128, loss=0.5,
        samples_per_s=sps, share=share, compute_ms_per_batch=10.0, idle_pct=20.0,
    )  # fmt: skip


RECORDS: list[tl.TimelineEvent] = [
    tl.RankJoined(t=0.1, rank=0, host="a"),
    tl.RankJoined(t=0.1, rank=1, host="b"),
    tl.RunStart(t=0.2, world_size=2, mode="cadence"),
    tl.RolesMoved(t=0.2, epoch_rank=0, eval_rank=0, checkpoint_rank=1),
    tl.SyncEnd(t=0.5, round=1, duration_ms=20.0, d_raw=0.0, k_used=6, anchor=10),
    _window(0, 0.5, 0.75, 300.0),
    _window(1, 0.5, 0.25, 100.0),
    tl.EpochEnd(t=1.0, epoch=0, loss=0.4, rounds_done=1, lr=0.1),
    tl.RankLost(t=1.5, rank=1, reason="heartbeat stale"),
    tl.Alert(t=1.5, severity="critical", name="rank_lost", path="rank1", detail="heartbeat stale"),
    tl.RunEnd(
        t=2.0,
        outcome="completed",
        reason="",
        epochs_completed=1,
        rounds_done=1,
        lost_samples=0,
        dead_ranks=(1,),
        rejected_frames=0,
        anchor=12,
        samples_per_rank=(128, 0),  # rank 1 died before a round averaged its window's work
    ),
]


def test_the_view_folds_the_run_the_ranks_the_series_and_the_alerts() -> None:
    view = RunView(2, devices=["cpu", "cuda:0"], run_dir="/r")
    for i, event in enumerate(RECORDS):
        view.observe(event)
        if i == 6:  # mid-run: both ranks live, measured
            ranks = view.state()["ranks"]
            assert [r["state"] for r in ranks] == ["live", "live"]
            assert [r["share"] for r in ranks] == [0.75, 0.25]
    state = view.state()
    assert state["run"] | {"t": 0} == {
        "run_dir": "/r", "mode": "cadence", "world_size": 2, "phase": "done", "t": 0,
        "epochs_completed": 1, "loss": 0.4, "lr": 0.1, "anchor": 12, "rounds": 1,
        "outcome": "completed", "reason": "",
    }  # fmt: skip
    zero, one = state["ranks"]
    assert zero | {} == {
        "rank": 0, "host": "a", "device": "cpu", "state": "live", "reason": None,
        "samples": 128, "samples_per_s": 300.0, "share": 0.75, "compute_ms_per_batch": 10.0,
        "idle_pct": 20.0, "loss": 0.5, "roles": ["epoch", "eval"],
    }  # fmt: skip
    assert (one["state"], one["reason"], one["samples_per_s"], one["share"]) == (
        "lost",
        "heartbeat stale",
        0.0,
        0.0,
    )
    assert one["samples"] == 0  # RunEnd's count, the summary's: its window's work was lost
    assert one["roles"] == ["checkpoint"]
    assert state["series"]["loss"] == [[1.0, 0.4]]
    assert state["series"]["round_ms"] == [[0.5, 20.0]]
    assert state["series"]["samples_per_s"] == {"0": [[0.5, 300.0]], "1": [[0.5, 100.0]]}
    assert [a["name"] for a in state["alerts"]] == ["rank_lost"]


def test_series_drop_their_oldest_tenth_when_full() -> None:
    view = RunView(1)
    for i in range(MAX_POINTS + 1):
        view.observe(tl.SyncEnd(t=float(i), round=i, duration_ms=1.0, d_raw=0.0, k_used=1,
                                anchor=1))  # fmt: skip
    points = view.state()["series"]["round_ms"]
    assert len(points) == MAX_POINTS + 1 - MAX_POINTS // 10
    assert points[-1][0] == float(MAX_POINTS)


def test_records_for_ranks_that_never_joined_are_ignored() -> None:
    view = RunView(1)
    view.observe(_window(5, 0.0, 1.0, 1.0))
    view.observe(tl.RankLost(rank=5, reason="?"))
    view.observe(tl.RankJoined(rank=-1, host="x"))
    view.observe(tl.RolesMoved(epoch_rank=-1, eval_rank=-1, checkpoint_rank=5))
    state = view.state()
    assert [r["rank"] for r in state["ranks"]] == [0]
    assert state["ranks"][0]["state"] == "joining" and state["ranks"][0]["roles"] == []
    assert list(state["series"]["samples_per_s"]) == ["0"]


def _end(**fields: object) -> tl.RunEnd:
    account: dict[str, object] = {
        "t": 9.0, "outcome": "completed", "reason": "", "epochs_completed": 1, "rounds_done": 1,
        "lost_samples": 0, "dead_ranks": (), "rejected_frames": 0, "anchor": 10,
        "samples_per_rank": (),
    }  # fmt: skip
    return tl.RunEnd(**(account | fields))  # type: ignore[arg-type]  # the test's fields


def test_a_rank_that_joins_the_running_run_gains_an_entry_and_series() -> None:
    view = RunView(2, devices=["cpu", "cpu"])
    for event in [*RECORDS[:7], tl.RankJoined(t=0.8, rank=2, host="c"), _window(2, 0.9, 0.5, 50.0)]:
        view.observe(event)
    state = view.state()
    assert [r["rank"] for r in state["ranks"]] == [0, 1, 2]
    joined = state["ranks"][2]
    assert (joined["host"], joined["device"], joined["state"]) == ("c", None, "live")
    assert (joined["samples"], joined["samples_per_s"], joined["share"]) == (128, 50.0, 0.5)
    assert state["series"]["samples_per_s"]["2"] == [[0.9, 50.0]]
    assert state["series"]["share"]["2"] == [[0.9, 0.5]]
    assert state["run"]["world_size"] == 2  # the world it was launched with, as the summary's


def test_the_run_end_adds_a_joined_rank_the_view_missed() -> None:
    view = RunView(1)
    view.observe(_end(joined_ranks=(3,), samples_per_rank=(10, 0, 0, 7)))
    ranks = view.state()["ranks"]
    assert [(r["rank"], r["state"], r["samples"]) for r in ranks] == [
        (0, "joining", 10),
        (3, "live", 7),
    ]


def test_the_run_end_is_the_truth_about_dead_ranks_and_samples() -> None:
    """An interrupted or failed run's RunEnd lists ranks no RankLost named, and
    counts what went into the consensus: the summary's figures."""
    view = RunView(3)
    for event in [*RECORDS[:7], _window(2, 0.5, 0.0, 0.0)]:
        view.observe(event)
    view.observe(_end(outcome="saved_and_shutdown", reason="interrupted", dead_ranks=(1,),
                      samples_per_rank=(100, 0, 28, 0, 0)))  # fmt: skip
    ranks = view.state()["ranks"]
    assert [(r["state"], r["reason"], r["samples"]) for r in ranks] == [
        ("live", None, 100),
        ("lost", "interrupted", 0),
        ("joining", None, 28),
    ]
    assert (ranks[1]["samples_per_s"], ranks[1]["share"]) == (0.0, 0.0)


def test_the_run_end_keeps_the_reason_a_rank_was_lost_for() -> None:
    view = RunView(2)
    for event in [*RECORDS[:9], _end(dead_ranks=(1,))]:
        view.observe(event)
    assert view.state()["ranks"][1]["reason"] == "heartbeat stale"
    view = RunView(2)
    view.observe(_end(dead_ranks=(1,)))  # no reason given: it still says why it is lost
    assert view.state()["ranks"][1]["reason"] == "dead at the run's end"


def test_the_metrics_have_per_rank_series() -> None:
    metrics = RunMetrics()
    for event in RECORDS:
        metrics.observe(event)
    families = {f.name: f for f in text_string_to_metric_families(metrics.text().decode())}

    def value(family: str, sample: str | None = None, **labels: str) -> float:
        return next(
            s.value for s in families[family].samples
            if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items())
        )  # fmt: skip

    assert value("elche_samples_trained", "elche_samples_trained_total", rank="0") == 128
    assert value("elche_rank_samples_per_second", rank="0") == 300.0
    assert value("elche_rank_samples_per_second", rank="1") == 0.0  # lost
    assert value("elche_rank_share", rank="0") == 0.75
    assert value("elche_loss") == 0.4
    assert value("elche_live_ranks") == 0  # the run ended
    count = "elche_round_duration_seconds_count"
    assert value("elche_round_duration_seconds", count) == 1
    rank_lost = {"name": "rank_lost", "severity": "critical"}
    assert value("elche_alerts", "elche_alerts_total", **rank_lost) == 1


def _metric(metrics: RunMetrics, family: str, **labels: str) -> float | None:
    text = metrics.text().decode()
    for found in text_string_to_metric_families(text):
        for sample in found.samples:
            if sample.name == family and sample.labels == labels:
                return float(sample.value)
    return None


def test_a_lost_rank_trains_at_nothing_in_the_metrics() -> None:
    """Its speed and share go to 0 and stay there; its last window still counts its samples."""
    metrics = RunMetrics()
    for event in [*RECORDS[:7], RECORDS[8], _window(1, 1.6, 0.3, 90.0)]:
        metrics.observe(event)
    assert _metric(metrics, "elche_rank_samples_per_second", rank="1") == 0.0
    assert _metric(metrics, "elche_rank_share", rank="1") == 0.0
    assert _metric(metrics, "elche_rank_share", rank="0") == 0.75  # the survivor's stays
    assert _metric(metrics, "elche_samples_trained_total", rank="1") == 256


def test_a_rank_the_run_end_lists_dead_trains_at_nothing_in_the_metrics() -> None:
    metrics = RunMetrics()
    for event in [*RECORDS[:7], _end(dead_ranks=(1,))]:
        metrics.observe(event)
    assert _metric(metrics, "elche_rank_samples_per_second", rank="1") == 0.0
    assert _metric(metrics, "elche_rank_share", rank="1") == 0.0


def test_a_rank_that_joins_again_is_measured_again() -> None:
    metrics = RunMetrics()
    for event in [*RECORDS[:7], RECORDS[8], tl.RankJoined(rank=1, host="b")]:
        metrics.observe(event)
    metrics.observe(_window(1, 2.0, 0.4, 80.0))
    assert _metric(metrics, "elche_rank_share", rank="1") == 0.4


def test_live_ranks_count_joins_and_losses() -> None:
    metrics = RunMetrics()
    for event in [*RECORDS[:2], RECORDS[8], tl.RankLost(rank=1, reason="again")]:
        metrics.observe(event)
    assert "elche_live_ranks 1.0" in metrics.text().decode()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8080", ("127.0.0.1", 8080)), (":0", ("127.0.0.1", 0)), ("0.0.0.0:9000", ("0.0.0.0", 9000)),
     ("[::1]:0", ("::1", 0)), ("localhost:1", ("localhost", 1))],
)  # fmt: skip
def test_dashboard_addresses(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["", "host:", "x:y", "70000", "-1"])
def test_bad_dashboard_addresses_raise(text: str) -> None:
    with pytest.raises(ConfigError, match="dashboard"):
        parse_address(text)


def test_a_lost_ranks_last_window_closing_after_its_loss_leaves_it_at_zero() -> None:
    """The round after a death books the dead rank's last batches: its window
    counts its samples, but the rank trains at nothing now."""
    view = RunView(2)
    for event in [*RECORDS[:7], RECORDS[8], _window(1, 1.6, 0.3, 90.0)]:
        view.observe(event)
    lost = view.state()["ranks"][1]
    assert (lost["state"], lost["samples_per_s"], lost["share"]) == ("lost", 0.0, 0.0)
    assert lost["samples"] == 256  # both its windows
