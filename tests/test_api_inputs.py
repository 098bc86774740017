"""``elche.train`` refuses an argument of the wrong type up front, naming it.

Each of these used to escape as the raw exception of whatever first touched
the value (``AttributeError`` in ``Mode.parse``, ``TypeError`` from
``pathlib`` or ``len()``), or to pass unnoticed until a rank called it (a
hook that is not a function) or to be ignored on one rank and crash the
coordinator of two (a ``dict`` for ``scheduler``). Every refusal here comes
before any user function runs or any process starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import elche
from elche.api import _path, _per_rank
from elche.core.errors import ConfigError


def _never(*args: object) -> Any:
    raise AssertionError("a refused run calls none of the user's functions")


def refusal(**kw: object) -> ConfigError:
    """The ``ConfigError`` of ``elche.train`` with ``kw`` over harmless arguments."""
    args: dict[str, Any] = {
        "model_fn": _never, "optimizer_fn": _never, "step_fn": _never,
        "dataset": list(range(8)), "batch_size": 2, "epochs": 1, "progress": False,
    }  # fmt: skip
    with pytest.raises(ConfigError) as info:
        elche.train(**(args | kw))
    return info.value


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"mode": None}, "mode"),
        ({"mode": 3}, "mode"),
        ({"speeds": ["a"]}, "speeds"),
        ({"speeds": [True]}, "speeds"),
        ({"speeds": 1}, "speeds"),
        ({"speeds": "1"}, "speeds"),
        ({"speeds": {0: 1.0}}, "speeds"),
        ({"devices": "cpu"}, "devices"),
        ({"devices": 5}, "devices"),
        ({"save_path": 123}, "save_path"),
        ({"resume_from": 123}, "resume_from"),
        ({"run_dir": 5}, "run_dir"),
        ({"tensorboard_dir": 5}, "tensorboard_dir"),
        ({"dashboard": 8080}, "dashboard"),
        ({"dashboard": True}, "dashboard"),
        ({"crash": {0: "a"}}, "crash"),
        ({"crash": [0.5]}, "crash"),
        ({"stall": {True: 0.5}}, "stall"),
        ({"crash": {0: float("nan")}}, "crash"),
        ({"scheduler": {"anchor": 2}}, "scheduler"),
        ({"scheduler": {"anchor": 2}, "ranks": 2}, "scheduler"),
        ({"scheduler": "fast"}, "scheduler"),
        ({"scheduler": {}}, "scheduler"),
        ({"optimizer_fn": 3}, "optimizer_fn"),
        ({"step_fn": None}, "step_fn"),
        ({"epoch_fn": 3}, "epoch_fn"),
        ({"eval_fn": 3, "eval_dataset": [1]}, "eval_fn"),
        ({"eval_result_fn": 3}, "eval_result_fn"),
        ({"checkpoint_fn": 3, "checkpoint_every": 1}, "checkpoint_fn"),
        ({"metrics_fn": 3}, "metrics_fn"),
        ({"formation_timeout_s": 0}, "formation_timeout_s"),
        ({"formation_timeout_s": float("inf")}, "formation_timeout_s"),
        ({"formation_timeout_s": "60"}, "formation_timeout_s"),
    ],
    ids=repr,
)
def test_a_wrong_type_is_refused_naming_its_field(kw: dict[str, object], field: str) -> None:
    error = refusal(**kw)
    assert error.field == field
    assert str(error).startswith(f"{field}: ")


@pytest.mark.parametrize(("batch_size", "accumulate"), [(16, 1), (4, 3)])
def test_drop_last_over_a_dataset_shorter_than_one_step_is_refused(
    batch_size: int, accumulate: int
) -> None:
    # It completed with the model as built: every step was short, and left out.
    error = refusal(drop_last=True, batch_size=batch_size, accumulate=accumulate)
    assert error.field == "drop_last"
    assert "8 samples are fewer than one step" in str(error)


@pytest.mark.parametrize(("ranks", "mode"), [(65530, "cadence"), (65535, "cpu-async")])
def test_more_ranks_than_a_frame_can_name_are_refused_before_any_process_starts(
    ranks: int, mode: str
) -> None:
    # elche demo --ranks 100000 failed in the coordinator's process, a traceback and
    # exit 1; a collective run keeps 8 more ids for joining ranks.
    error = refusal(ranks=ranks, mode=mode)
    assert error.field == "ranks" and f"got {ranks}" in str(error)


def test_a_string_of_devices_is_refused_with_the_list_it_meant() -> None:
    # 'cpu' was read letter by letter: "'c' is not a device".
    assert "devices=['cpu']" in str(refusal(devices="cpu"))


def test_a_scheduler_that_is_not_a_scheduler_config_says_what_is() -> None:
    assert "elche.SchedulerConfig(anchor=2)" in str(refusal(scheduler={"anchor": 2}))


def test_a_hook_that_is_not_a_function_is_named_with_what_it_is() -> None:
    assert str(refusal(metrics_fn=3)) == "metrics_fn: must be a function or None, got 3"


def test_paths_are_strings_or_path_likes() -> None:
    assert _path("save_path", None) is None
    assert _path("save_path", "a/b") == "a/b"
    assert _path("save_path", Path("a") / "b") == str(Path("a") / "b")
    with pytest.raises(ConfigError) as info:
        _path("run_dir", b"a/b")  # type: ignore[arg-type]  # bad on purpose
    assert info.value.field == "run_dir"


def test_per_rank_values_are_any_iterable_but_a_string_or_a_mapping() -> None:
    assert _per_rank("speeds", None, "[1.0]") is None
    assert _per_rank("speeds", [1.0, 0.5], "[1.0]") == (1.0, 0.5)
    assert _per_rank("speeds", (s for s in (1.0, 0.5)), "[1.0]") == (1.0, 0.5)


@pytest.mark.parametrize("form", ["dir", "dir/", "missing/"])
def test_a_save_path_that_names_a_directory_is_refused(tmp_path: Path, form: str) -> None:
    # A bundle stem's files go beside it: save_path=DIR wrote DIR.meta.json, DIR.lock and
    # the rest as DIR's siblings, in silence.
    save_path = str(tmp_path / form.rstrip("/")) + ("/" if form.endswith("/") else "")
    (tmp_path / "dir").mkdir()
    error = refusal(save_path=save_path)
    assert error.field == "save_path"
    assert "not a directory" in str(error) and "/run'" in str(error)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]  # no DIR.lock, no DIR.*


class _Transformed(list[int]):
    """A dataset that keeps a lambda (its transform): it cannot be pickled."""

    def __init__(self) -> None:
        super().__init__(range(8))
        self.transform = lambda x: x


@pytest.mark.parametrize("field", ["dataset", "eval_dataset"])
def test_a_dataset_that_cannot_reach_the_ranks_is_refused_before_they_start(
    field: str, tmp_path: Path
) -> None:
    # It escaped as a raw PicklingError from the first rank's start, after the coordinator's.
    run_dir = tmp_path / "run"
    kw: dict[str, object] = {field: _Transformed()}
    if field == "eval_dataset":
        kw["eval_fn"] = _never
    error = refusal(**kw, ranks=2, run_dir=str(run_dir))
    assert error.field == field
    assert "_Transformed cannot be sent to the rank processes" in str(error)
    assert not (run_dir / "coordinator.pid").exists()  # no coordinator started
