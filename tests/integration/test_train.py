"""Real multi-process training on gloo: every mode, callbacks, resume, bad config.

Each test starts a real coordinator process and real rank processes on this
machine (CPU, gloo), on scikit-learn's digits. They are slow (process start-up
imports torch in every rank), so they carry the ``integration`` and ``slow``
markers.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

import elche
from elche.api import _say_replaced_bundle
from elche.core import timeline as tl
from elche.core.errors import ConfigError
from elche.core.faults import FaultPlan
from elche.monitor.timeline import read_timeline
from elche.runtime.launch import rank_context
from elche.workloads import digits
from tests.promises.tiny import bundle_on_disk

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SPEEDS = [1.0, 0.5, 0.25]


@pytest.fixture(scope="module")
def data() -> tuple[object, object]:
    return digits.load_digits_split(seed=0)


def run(data: tuple[object, object], tmp_path: Path, **kw: object) -> elche.TrainResult:
    train_set, test_set = data
    options: dict[str, object] = {
        "batch_size": 32,
        "epochs": 8,
        "speeds": SPEEDS,
        "eval_fn": digits.eval_fn,
        "eval_dataset": test_set,
        "progress": False,
        "run_dir": str(tmp_path / "run"),
    }
    options.update(kw)
    return elche.train(
        digits.make_model, digits.make_optimizer, digits.step_fn, train_set, **options
    )  # type: ignore[arg-type]  # test helper forwards keywords


@pytest.mark.parametrize("mode", ["sync", "cadence", "cpu-sync", "cpu-cadence", "cpu-async"])
def test_every_mode_trains_to_a_sane_accuracy(
    mode: str, data: tuple[object, object], tmp_path: Path
) -> None:
    result = run(data, tmp_path, mode=mode)
    summary = result.summary
    assert summary["outcome"] == "completed"
    assert summary["epochs_completed"] == 8
    assert summary["lost_samples"] == 0
    assert summary["eval_accuracy"] >= 0.9  # type: ignore[operator]  # JSON value
    assert sum(r["samples"] for r in summary["per_rank"]) == 8 * len(data[0])  # type: ignore[attr-defined,index,arg-type]
    assert result.state_dict, "the final averaged model comes back"
    assert [e["epoch"] for e in result.epochs] == list(range(8))


def test_cadence_gives_the_fast_rank_the_most_work(
    data: tuple[object, object], tmp_path: Path
) -> None:
    # A given solo step: the paced speeds, not the machine's other load, set the shares.
    summary = run(data, tmp_path, mode="cadence", speed_base_s=0.004).summary
    samples = [r["samples"] for r in summary["per_rank"]]  # type: ignore[attr-defined]
    assert samples[0] > samples[1] > samples[2]


class _Marker:
    """An eval dataset that records which rank evaluated it."""

    def __init__(self, directory: Path, inner: object) -> None:
        self.directory = directory
        self.inner = inner


def marking_eval(model: object, marker: _Marker) -> float:
    rank = os.environ.get("ELCHE_RANK", "solo")
    (marker.directory / f"eval-on-{rank}").touch()
    with (marker.directory.parent / "evals.log").open("a") as log:  # in the order they ran
        log.write(f"{rank}\n")
    return digits.eval_fn(model, marker.inner)  # type: ignore[arg-type]  # torch module


def test_callbacks_run_on_the_elected_rank_only(
    data: tuple[object, object], tmp_path: Path
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    seen: list[tuple[int, float]] = []
    result = run(
        data, tmp_path, epochs=3, eval_fn=marking_eval,
        eval_dataset=_Marker(marks, data[1]), eval_result_fn=lambda e, m: seen.append((e, m)),
    )  # fmt: skip
    assert result.summary["outcome"] == "completed"
    # The sticky election puts every callback on one rank (the fastest by measured
    # pace, usually rank 0; on a busy machine the pace can say 1). Until it is held,
    # at the first calibrated round's close, the roles are rank 0's: an eval asked as
    # that round started (epoch 0's) runs there. So: rank 0, then one rank, moved once.
    ranks = (tmp_path / "evals.log").read_text().split()
    elected = ranks[-1]
    before = len(ranks) - len(list(itertools.takewhile(lambda r: r == elected, ranks[::-1])))
    assert len(ranks) == 3 and ranks[:before] == ["0"] * before, ranks
    assert [epoch for epoch, _ in seen] == [0, 1, 2]  # numbered as result.epochs and metrics_fn


def test_callbacks_follow_a_pinned_rank(data: tuple[object, object], tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    result = run(
        data, tmp_path, epochs=2, eval_fn=marking_eval, eval_dataset=_Marker(marks, data[1]),
        callback_rank=2,
    )  # fmt: skip
    assert result.summary["outcome"] == "completed"
    assert sorted(p.name for p in marks.iterdir()) == ["eval-on-2"]


def test_a_checkpoint_bundle_resumes_to_the_planned_epoch(
    data: tuple[object, object], tmp_path: Path
) -> None:
    stem = str(tmp_path / "bundle" / "digits")
    first = run(data, tmp_path / "a", epochs=2, checkpoint_every=1, save_path=stem)
    assert first.summary["outcome"] == "completed"
    files = bundle_on_disk(stem)
    assert files.model.exists() and sorted(files.optim) == [0, 1, 2]  # every rank's optimizer
    second = run(data, tmp_path / "b", epochs=4, resume_from=stem)
    assert second.summary["outcome"] == "completed"
    assert second.summary["epochs_completed"] == 4
    assert [e["epoch"] for e in second.epochs] == [2, 3]
    assert second.summary["lost_samples"] == 0
    # A fresh run in that run dir starts afresh. It went on from the copy of the
    # bundle's meta the resumed run left there: with a model of its own, it trained
    # none of epoch 0 (starting at the bundle's epoch 2) and said it completed. Its
    # epochs were the earlier runs' too ([2, 3, 0]): their timeline went on.
    third = run(data, tmp_path / "b", epochs=1, speeds=None, ranks=2, eval_fn=None)
    assert third.summary["outcome"] == "completed" and third.summary["epochs_completed"] == 1
    trained = sum(r["samples"] for r in third.summary["per_rank"])  # type: ignore[attr-defined]
    assert trained == len(data[0])  # type: ignore[arg-type]  # a Dataset
    assert [e["epoch"] for e in third.epochs] == [0]
    timeline = (tmp_path / "b" / "run" / "timeline.jsonl").read_text(encoding="utf-8")
    assert timeline.count('"kind":"RunStart"') == 1, timeline


def probing_epoch_fn(epoch: int, model: object, optimizer: object) -> None:
    Path(os.environ["ELCHE_TEST_ENV_PROBE"], f"rank{os.environ['ELCHE_RANK']}").touch()


def test_ranks_see_the_environment_of_their_launch(
    data: tuple[object, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ranks fork from a fork server started by an earlier run in this
    # process; a variable set since then must still reach them.
    rank_context()  # the fork server, up before the variable is set
    probe = tmp_path / "probe"
    probe.mkdir()
    monkeypatch.setenv("ELCHE_TEST_ENV_PROBE", str(probe))
    result = run(data, tmp_path / "b", epochs=1, epoch_fn=probing_epoch_fn)
    assert result.summary["outcome"] == "completed"
    assert sorted(p.name for p in probe.iterdir()) == ["rank0", "rank1", "rank2"]


def test_a_given_solo_step_paces_the_ranks(data: tuple[object, object], tmp_path: Path) -> None:
    run(data, tmp_path, speeds=[1.0, 0.5], epochs=1, speed_base_s=0.002)
    fast, slow = (json.loads((tmp_path / "run" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (fast["speed_base_s"], fast["injected_s"]) == (None, 0.0)
    assert slow["speed_base_s"] == 0.002  # given, not measured
    assert slow["injected_s"] > 0


def test_one_rank_trains_in_process(data: tuple[object, object], tmp_path: Path) -> None:
    result = run(data, tmp_path, speeds=None, ranks=1, epochs=3, dashboard="127.0.0.1:0",
                 tensorboard_dir=str(tmp_path / "tb"))  # fmt: skip
    assert result.summary["world_size"] == 1
    assert result.summary["eval_accuracy"] >= 0.9  # type: ignore[operator]  # JSON value
    # One rank writes the timeline a coordinator would, and its report and TensorBoard log.
    records = read_timeline(tmp_path / "run")
    windows = [r for r in records if isinstance(r, tl.RankWindow)]
    assert [w.epoch for w in windows] == [0, 1, 2] and all(w.share == 1.0 for w in windows)
    assert sum(w.samples for w in windows) == result.summary["per_rank"][0]["samples"]  # type: ignore[index]
    assert all(0 <= w.idle_pct <= 100 and w.compute_ms_per_batch for w in windows)
    assert [r.epoch for r in records if isinstance(r, tl.Eval)] == [1, 2, 3]  # eval_every=1
    end = records[-1]
    assert isinstance(end, tl.RunEnd) and end.outcome == "completed"
    assert result.summary["report"] == str(tmp_path / "run" / "report.html")
    assert '"phase": "done"' in (tmp_path / "run" / "report.html").read_text(encoding="utf-8")
    kept = json.loads((tmp_path / "run" / "summary.json").read_text(encoding="utf-8"))
    assert kept["outcome"] == "completed" and kept["world_size"] == 1  # as several ranks leave one
    assert kept["report"] == result.summary["report"]
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"mode": "turbo"}, "mode"),
        ({"batch_size": 0}, "batch_size"),
        ({"speeds": [1.0, 0.0]}, "speeds"),
        ({"ranks": 2, "speeds": [1.0, 0.5, 0.25]}, "ranks"),
        ({"callback_rank": "slowest"}, "callback_rank"),
        ({"resume_from": "/nonexistent/stem"}, "resume_from"),
        ({"speed_base_s": -0.001}, "speed_base_s"),
        ({"faults": {1: 0.5}}, "faults"),
        ({"faults": FaultPlan().kill(rank=3, at_epoch=0.5)}, "faults"),
        ({"crash": {3: 0.5}}, "crash"),
        ({"stall": {1: -1.0}}, "stall"),
        ({"join_slots": -1}, "join_slots"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"max_grad_norm": float("nan")}, "max_grad_norm"),
        ({"heartbeat_timeout_s": float("inf")}, "heartbeat_timeout_s"),
        ({"heartbeat_timeout_s": 1e-6}, "heartbeat_timeout_s"),
        ({"heartbeat_timeout_s": 1e12}, "heartbeat_timeout_s"),
        ({"seed": 2**70}, "seed"),
        ({"run_dir": "/proc/version/run"}, "run_dir"),
        ({"join_slots": 2, "mode": "cpu-cadence"}, "join_slots"),
        ({"join_slots": 2, "speeds": None, "ranks": 1}, "join_slots"),
    ],
)
def test_bad_config_fails_fast_naming_the_field(
    kw: dict[str, object], field: str, data: tuple[object, object], tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as info:
        run(data, tmp_path, **kw)
    assert info.value.field == field


def test_a_meta_that_is_not_text_is_refused_naming_resume_from(
    data: tuple[object, object], tmp_path: Path
) -> None:
    stem = tmp_path / "bundle"
    Path(f"{stem}.meta.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError) as info:
        run(data, tmp_path, resume_from=str(stem))
    assert info.value.field == "resume_from" and "not a checkpoint meta" in str(info.value)


def test_a_fresh_run_says_it_will_replace_an_earlier_runs_bundle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stem = str(tmp_path / "bundle")
    _say_replaced_bundle(stem, None)  # nothing there yet
    assert capsys.readouterr().err == ""
    Path(f"{stem}.meta.json").write_text("{}", encoding="utf-8")
    _say_replaced_bundle(stem, str(tmp_path / "." / "bundle"))  # resuming it: nothing to say
    assert capsys.readouterr().err == ""
    _say_replaced_bundle(stem, None)
    err = capsys.readouterr().err
    assert f"save_path {stem} holds the bundle of an earlier run" in err
    assert f"resume_from={stem!r} continues that run instead" in err


def test_diloco_outer_optimizer_trains_and_its_momentum_resumes(
    data: tuple[object, object], tmp_path: Path
) -> None:
    stem = str(tmp_path / "bundle" / "digits")
    diloco: dict[str, object] = {"mode": "cpu-cadence", "outer_lr": 0.7, "outer_momentum": 0.9}
    first = run(data, tmp_path / "a", epochs=6, checkpoint_every=1, save_path=stem, **diloco)
    assert first.summary["outcome"] == "completed"
    assert first.summary["eval_accuracy"] >= 0.9  # type: ignore[operator]  # JSON value
    outer = bundle_on_disk(stem).outer
    assert outer is not None and outer.exists()  # the momentum is part of the bundle
    second = run(data, tmp_path / "b", epochs=8, resume_from=stem, **diloco)
    assert second.summary["outcome"] == "completed"
    assert second.summary["epochs_completed"] == 8
    timeline = (tmp_path / "b" / "run" / "timeline.jsonl").read_text(encoding="utf-8")
    assert '"OuterMomentumRestored"' in timeline
    # A fresh run in that run dir starts with a fresh momentum, not the copy of the
    # bundle's the resumed run left there (its timeline is its own: it starts afresh).
    third = run(data, tmp_path / "b", epochs=1, speeds=None, ranks=2, eval_fn=None, **diloco)
    assert third.summary["outcome"] == "completed"
    timeline = (tmp_path / "b" / "run" / "timeline.jsonl").read_text(encoding="utf-8")
    assert '"OuterMomentumRestored"' not in timeline
