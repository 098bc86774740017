"""The checkpoint meta sidecar: JSON round trips and the reader's refusals.

A resume reads a file somebody else wrote, possibly with another elche: every
refusal must be a ``ConfigError`` that names the field at fault, and a newer
schema must say to upgrade rather than misread the run's position.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elche.core.checkpoint import (
    SCHEMA_VERSION,
    BundleFile,
    BundleFiles,
    CheckpointMeta,
    EpochCoverage,
    SaveReason,
)
from elche.core.config import (
    NUMPY_PERMUTATION,
    ORDERS,
    RANDOM_SHUFFLE,
    SHARD_ORDER,
    CoordinatorConfig,
    Mode,
)
from elche.core.elche_state import MAX_COUNT, ElCheState, Phase
from elche.core.errors import ConfigError

STATE = ElCheState(
    anchor=12,
    anchor_rank=1,
    smoothed_ms_per_batch=(120.0, 400.5, 398.0),
    phase=Phase.STABLE,
    calibration_count=7,
    trend_history=(0.01, 0.02, 0.035),
)
COVERAGE = (
    EpochCoverage(epoch=3, total_samples=1000, uncovered=((0, 64), (512, 128))),
    EpochCoverage(epoch=4, total_samples=1000, uncovered=()),
)

# What every writer of schema 3 and later names: the mode and the bundle's files.
FILES = BundleFiles(
    model=BundleFile(name="run.s2.model.pt", size=1024, sha256="ab" * 32),
    optim=((0, BundleFile(name="run.s2.rank0.optim.pt", size=512, sha256="cd" * 32)),),
)


BASE = CheckpointMeta(
    epoch=3,
    global_step=1234,
    rounds_done=88,
    world_size=3,
    reason=SaveReason.MAX_FAILURE_EXCEEDED,
    seed=42,
    batch_size=32,
    epochs=10,
    mode=Mode.CADENCE.value,
    save_seq=2,
    files=FILES,
)


def meta(**overrides: object) -> CheckpointMeta:
    return dataclasses.replace(BASE, **overrides)


def doc(**overrides: object) -> str:
    """A valid meta document with some top-level keys replaced."""
    raw = json.loads(meta(elche_state=STATE, coverage=COVERAGE).to_json())
    raw.update(overrides)
    return json.dumps(raw)


def without(key: str) -> str:
    raw = json.loads(meta(elche_state=STATE, coverage=COVERAGE).to_json())
    del raw[key]
    return json.dumps(raw)


# --- round trips -------------------------------------------------------------


@pytest.mark.parametrize(
    "original",
    [
        meta(),
        meta(elche_state=STATE),
        meta(
            elche_state=ElCheState(
                anchor=1,
                anchor_rank=None,
                smoothed_ms_per_batch=(),
                phase=Phase.PROBE,
                calibration_count=0,
            )
        ),
        meta(coverage=COVERAGE),
        meta(elche_state=STATE, coverage=COVERAGE, reason=SaveReason.CHECKPOINT),
    ],
    ids=["bare", "elche-state", "elche-state-no-history", "coverage", "everything"],
)
def test_meta_round_trips_through_json(original: CheckpointMeta) -> None:
    assert CheckpointMeta.from_json(original.to_json()) == original


@pytest.mark.parametrize("reason", list(SaveReason))
def test_every_save_reason_round_trips(reason: SaveReason) -> None:
    assert CheckpointMeta.from_json(meta(reason=reason).to_json()).reason is reason


def test_save_reasons_are_written_in_snake_case() -> None:
    # Spec §10: the reference's snake_case names.
    assert [r.value for r in SaveReason] == [
        "graceful_shutdown",
        "max_failure_exceeded",
        "single_survivor",
        "all_ranks_lost",
        "reduce_stall",
        "checkpoint",
        "nonfinite",  # elche: a NaN/inf loss or average (issue 12, item 15)
        "coordinator_lost",  # elche: the launcher commits the ranks' state (issue 13)
        "coordinator_host_lost",  # elche: the rank whose process started the coordinator died
        "final_model_unwritten",  # elche: no rank could write the final model
    ]


def test_to_json_is_pretty_printed_with_sorted_keys_and_the_schema_version() -> None:
    text = meta(elche_state=STATE).to_json()
    raw = json.loads(text)
    assert raw["schema_version"] == SCHEMA_VERSION
    assert raw["save_reason"] == "max_failure_exceeded"
    assert raw["elche_state"]["phase"] == "stable"
    assert list(raw) == sorted(raw)
    assert text.startswith('{\n  "batch_size": 32,\n')


def test_coverage_counts_uncovered_samples() -> None:
    assert COVERAGE[0].uncovered_samples == 64 + 128
    assert COVERAGE[1].uncovered_samples == 0


@pytest.mark.parametrize("key", ["coverage", "elche_state", "mode", "files"])
def test_a_key_the_writer_always_writes_is_refused_when_missing(key: str) -> None:
    # A meta without its coverage resumed as if every open epoch were untrained: the
    # samples its model already held were trained twice, and the run said lost 0.
    raw = json.loads(doc())
    del raw[key]
    with pytest.raises(ConfigError, match=rf"^{key}: is missing from the meta"):
        CheckpointMeta.from_json(json.dumps(raw))
    raw[key] = None if key != "coverage" else []  # written as null (or empty)
    if key in ("mode", "files"):  # every writer of schema 3 and later names them
        with pytest.raises(
            ConfigError, match=rf"^{key}: is null in a meta of schema {SCHEMA_VERSION}"
        ):
            CheckpointMeta.from_json(json.dumps(raw))
    else:
        CheckpointMeta.from_json(json.dumps(raw))


@pytest.mark.parametrize("key", ["mode", "files"])
def test_a_null_mode_or_files_still_reads_in_a_meta_older_than_schema_3(key: str) -> None:
    raw = json.loads(doc(schema_version=2))
    raw[key] = None
    assert getattr(CheckpointMeta.from_json(json.dumps(raw)), key) is None


@pytest.mark.parametrize(
    ("part", "key", "field"),
    [("coverage", "uncovered", "uncovered"), ("files", "optim", "files.optim"),
     ("files", "outer", "files.outer")],
)  # fmt: skip
def test_a_nested_key_the_writer_always_writes_is_refused_when_missing(
    part: str, key: str, field: str
) -> None:
    # A coverage entry without its spans read as an epoch fully trained (the rest of
    # it was skipped, lost 0); files without optim started every optimizer afresh.
    files = {"model": {"name": "run.s1.model.pt", "size": 1, "sha256": "0" * 64},
             "optim": {}, "outer": None}  # fmt: skip
    raw = json.loads(doc(files=files))
    entry = raw["coverage"][0] if part == "coverage" else raw["files"]
    CheckpointMeta.from_json(json.dumps(raw))  # whole, it reads
    del entry[key]
    with pytest.raises(ConfigError, match=rf"^{field}: is missing from .*damaged or was edited"):
        CheckpointMeta.from_json(json.dumps(raw))


def test_a_meta_before_schema_3_had_no_mode_nor_files() -> None:
    raw = json.loads(doc(schema_version=2))
    del raw["mode"], raw["files"]
    parsed = CheckpointMeta.from_json(json.dumps(raw))
    assert parsed.mode is None and parsed.files is None


def test_an_older_schema_is_read() -> None:
    parsed = CheckpointMeta.from_json(doc(schema_version=0))
    assert parsed.schema_version == 0
    assert parsed.elche_state == STATE


def test_the_epochs_order_round_trips_and_a_meta_before_schema_4_drew_the_random_shuffle() -> None:
    assert CheckpointMeta.from_json(meta(order=NUMPY_PERMUTATION).to_json()).order == (
        NUMPY_PERMUTATION
    )
    raw = json.loads(meta().to_json())
    raw["schema_version"] = 3
    del raw["order"]  # schema 3 had none: every run then drew random.shuffle's order
    assert CheckpointMeta.from_json(json.dumps(raw)).order == RANDOM_SHUFFLE


# --- refusals ----------------------------------------------------------------


@pytest.mark.parametrize("order", ["sorted", None, 3])
def test_an_unknown_order_is_refused_listing_the_accepted_ones(order: object) -> None:
    with pytest.raises(ConfigError, match="numpy-permutation") as info:
        CheckpointMeta.from_json(doc(order=order))
    assert info.value.field == "order"


def test_a_newer_schema_is_refused_with_upgrade_advice() -> None:
    with pytest.raises(ConfigError, match="upgrade elche") as info:
        CheckpointMeta.from_json(doc(schema_version=SCHEMA_VERSION + 1))
    assert f"meta schema {SCHEMA_VERSION + 1} is newer" in str(info.value)
    assert f"({SCHEMA_VERSION})" in str(info.value)
    assert info.value.field == "resume_from"


@pytest.mark.parametrize(
    "text", ["", "{", "not json", '{"epoch": 1,}', "[]", "3", '"meta"', "null"]
)
def test_bad_json_or_a_non_object_is_refused(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        CheckpointMeta.from_json(text)
    assert info.value.field == "resume_from"


SPAN_DOC = {"epoch": 3, "total_samples": 9}


def case(case_id: str, text: str, field: str) -> object:
    return pytest.param(text, field, id=case_id)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        case("epoch-str", doc(epoch="3"), "epoch"),
        case("epoch-float", doc(epoch=1.5), "epoch"),
        case("epoch-bool", doc(epoch=True), "epoch"),
        case("epoch-negative", doc(epoch=-1), "epoch"),
        case("global_step-null", doc(global_step=None), "global_step"),
        case("rounds_done-list", doc(rounds_done=[1]), "rounds_done"),
        case("world_size-bool", doc(world_size=False), "world_size"),
        case("seed-negative", doc(seed=-5), "seed"),
        case("batch_size-str", doc(batch_size="32"), "batch_size"),
        case("epochs-float", doc(epochs=2.0), "epochs"),
        case("schema_version-str", doc(schema_version="1"), "schema_version"),
        case("schema_version-missing", without("schema_version"), "schema_version"),
        case("epoch-missing", without("epoch"), "epoch"),
        case("seed-missing", without("seed"), "seed"),
        case("coverage-int", doc(coverage=5), "coverage"),
        case("coverage-object", doc(coverage={"epoch": 3}), "coverage"),
        case("uncovered-str", doc(coverage=[{**SPAN_DOC, "uncovered": "0-4"}]), "uncovered"),
        case("span-triple", doc(coverage=[{**SPAN_DOC, "uncovered": [[0, 4, 1]]}]), "coverage"),
        case("span-negative", doc(coverage=[{**SPAN_DOC, "uncovered": [[-1, 4]]}]), "coverage"),
        case("span-float", doc(coverage=[{**SPAN_DOC, "uncovered": [[0, 4.5]]}]), "coverage"),
        case("span-str", doc(coverage=[{**SPAN_DOC, "uncovered": ["ab"]}]), "coverage"),
        case("coverage-epoch-str", doc(coverage=[{"epoch": "3", "total_samples": 9}]), "epoch"),
        case("coverage-total-missing", doc(coverage=[{"epoch": 3}]), "total_samples"),
        case("anchor-str", doc(elche_state={**STATE.to_json(), "anchor": "12"}), "anchor"),
        case("anchor-zero", doc(elche_state={**STATE.to_json(), "anchor": 0}), "anchor"),
        case("phase-case", doc(elche_state={**STATE.to_json(), "phase": "Stable"}), "phase"),
        case(
            "smoothed-str",
            doc(elche_state={**STATE.to_json(), "smoothed_ms_per_batch": [1, "x"]}),
            "smoothed_ms_per_batch",
        ),
        case(
            "trend-str",
            doc(elche_state={**STATE.to_json(), "trend_history": "flat"}),
            "trend_history",
        ),
    ],
)
def test_wrong_types_are_refused_naming_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        CheckpointMeta.from_json(text)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.parametrize("reason", ["bogus", "Checkpoint", "CHECKPOINT", None, 5, ["checkpoint"]])
def test_unknown_save_reason_is_refused_listing_the_accepted_ones(reason: object) -> None:
    with pytest.raises(ConfigError) as info:
        CheckpointMeta.from_json(doc(save_reason=reason))
    assert info.value.field == "save_reason"
    for accepted in SaveReason:
        assert accepted.value in str(info.value)


def test_missing_save_reason_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        CheckpointMeta.from_json(without("save_reason"))
    assert info.value.field == "save_reason"


def test_non_object_elche_state_names_the_field() -> None:
    # Regression: this used to be blamed on "resume_from".
    with pytest.raises(ConfigError) as info:
        CheckpointMeta.from_json(doc(elche_state=5))
    assert info.value.field == "elche_state"


def test_non_object_coverage_entry_names_the_field() -> None:
    # Regression: this used to be blamed on "resume_from".
    with pytest.raises(ConfigError) as info:
        CheckpointMeta.from_json(doc(coverage=[5]))
    assert info.value.field == "coverage"


def test_boolean_in_an_uncovered_span_is_refused() -> None:
    # Regression: spans were checked with isinstance(v, int), which admits bools.
    with pytest.raises(ConfigError) as info:
        CheckpointMeta.from_json(
            doc(coverage=[{"epoch": 3, "total_samples": 9, "uncovered": [[True, 4]]}])
        )
    assert info.value.field == "coverage"


def test_overlapping_uncovered_spans_are_refused() -> None:
    # They resumed to "completed, lost 0" training the shared samples twice.
    spans = [[0, 3000], [1000, 3000]]
    with pytest.raises(ConfigError, match=r"\(0, 3000\) and \(1000, 3000\) of epoch 3 overlap"):
        CheckpointMeta.from_json(
            doc(coverage=[{"epoch": 3, "total_samples": 5000, "uncovered": spans}])
        )
    touching = EpochCoverage(epoch=3, total_samples=5000, uncovered=((2000, 10), (0, 2000)))
    assert touching.uncovered_samples == 2010  # adjacent, in any order: fine


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=6))
def test_coverage_is_refused_exactly_when_two_spans_share_a_sample(
    spans: list[tuple[int, int]],
) -> None:
    taken = [i for offset, size in spans for i in range(offset, offset + size)]
    try:
        EpochCoverage(epoch=0, total_samples=70, uncovered=tuple(spans))
    except ConfigError:
        assert len(taken) != len(set(taken))
    else:
        assert len(taken) == len(set(taken))


def test_deeply_nested_json_is_refused_as_config_error() -> None:
    # Regression: json.loads' RecursionError used to escape from_json.
    with pytest.raises(ConfigError) as info:
        CheckpointMeta.from_json("[" * 100_000)
    assert info.value.field == "resume_from"


# --- property ------------------------------------------------------------------

COUNTS = st.integers(min_value=0, max_value=MAX_COUNT)
FINITE_MS = st.floats(min_value=0.0, max_value=1e9, allow_nan=False, allow_infinity=False)
TRENDS = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def elche_states(draw: st.DrawFn) -> ElCheState:
    world_size = draw(st.integers(min_value=1, max_value=8))
    return ElCheState(
        anchor=draw(st.integers(min_value=1, max_value=10_000)),
        anchor_rank=draw(st.none() | st.integers(min_value=0, max_value=world_size - 1)),
        smoothed_ms_per_batch=tuple(
            draw(st.lists(FINITE_MS, min_size=world_size, max_size=world_size))
        ),
        phase=draw(st.sampled_from(Phase)),
        calibration_count=draw(st.integers(min_value=0, max_value=10_000)),
        trend_history=draw(st.none() | st.lists(TRENDS, max_size=6).map(tuple)),
    )


@st.composite
def coverage_of(draw: st.DrawFn, epoch: int) -> EpochCoverage:
    """A valid coverage entry: disjoint spans inside the epoch."""
    total = draw(st.integers(min_value=1, max_value=MAX_COUNT))
    cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=total), max_size=8)))
    spans = [(a, b - a) for a, b in zip(cuts[::2], cuts[1::2], strict=False)]
    spans = draw(st.permutations(spans))
    return EpochCoverage(epoch=epoch, total_samples=total, uncovered=tuple(spans))


@st.composite
def metas(draw: st.DrawFn) -> CheckpointMeta:
    """Any meta within the bounds: counts to MAX_COUNT, coverage inside the plan."""
    epochs = draw(st.integers(min_value=1, max_value=10_000))
    epoch = draw(st.integers(min_value=0, max_value=epochs))
    started = draw(
        st.lists(st.integers(min_value=epoch, max_value=epochs - 1), unique=True, max_size=3)
        if epoch < epochs
        else st.just([])
    )
    version = draw(st.integers(min_value=0, max_value=SCHEMA_VERSION))
    return CheckpointMeta(
        epoch=epoch,
        global_step=draw(COUNTS),
        rounds_done=draw(COUNTS),
        world_size=draw(st.integers(min_value=1, max_value=4096)),
        reason=draw(st.sampled_from(SaveReason)),
        seed=draw(st.integers(min_value=0, max_value=2**64 - 1)),
        batch_size=draw(st.integers(min_value=1, max_value=65_536)),
        epochs=epochs,
        elche_state=draw(st.none() | elche_states()),
        coverage=tuple(draw(coverage_of(e)) for e in started),
        order=draw(st.sampled_from(ORDERS)) if version >= 4 else RANDOM_SHUFFLE,
        mode=draw(st.sampled_from(Mode)).value if version >= 3 else None,
        files=FILES if version >= 3 else None,
        schema_version=version,
    )


METAS = metas()


@settings(max_examples=100, deadline=None)
@given(METAS)
def test_property_any_meta_round_trips(original: CheckpointMeta) -> None:
    assert CheckpointMeta.from_json(original.to_json()) == original


def test_a_schema_1_meta_names_its_rounds_sync_round_and_still_resumes() -> None:
    raw = json.loads(meta().to_json())
    raw["schema_version"] = 1
    raw["sync_round"] = raw.pop("rounds_done")
    parsed = CheckpointMeta.from_json(json.dumps(raw))
    assert parsed == meta(schema_version=1, save_seq=0)  # numbered saves came in schema 3


# --- fitting the run ---------------------------------------------------------


def run_of(batch_size: int, seed: int = 42) -> CoordinatorConfig:
    return CoordinatorConfig(
        mode=Mode.CADENCE, world_size=3, num_samples=1000, batch_size=batch_size, epochs=10,
        seed=seed,
    )  # fmt: skip


def test_a_batch_size_mismatch_names_both_values() -> None:
    with pytest.raises(ConfigError) as info:
        meta().check_fits(run_of(64))
    assert info.value.field == "batch_size"
    assert str(info.value) == (
        "batch_size: the checkpoint was saved with batch_size=32, this run has batch_size=64"
    )


def test_under_accumulate_a_batch_size_mismatch_names_batch_size_and_accumulate() -> None:
    # The run's config counts samples per optimizer step: batch_size=32, accumulate=2 is 64.
    with pytest.raises(ConfigError) as info:
        meta().check_fits(run_of(64), accumulate=2)
    assert info.value.field == "batch_size"
    assert str(info.value) == (
        "batch_size: the checkpoint was saved with batch_size × accumulate = 32 samples per "
        "optimizer step, this run has batch_size=32 × accumulate=2 = 64"
    )
    meta(batch_size=64).check_fits(run_of(64), accumulate=2)  # 32 × 2 resumes 64 per step


@pytest.mark.parametrize(
    ("saved", "schema", "started", "ours", "refused"),
    [
        (SHARD_ORDER, 5, True, NUMPY_PERMUTATION, True),  # mid-epoch, other kind
        (NUMPY_PERMUTATION, 5, True, SHARD_ORDER, True),
        (RANDOM_SHUFFLE, 5, True, SHARD_ORDER, True),
        (SHARD_ORDER, 5, True, SHARD_ORDER, False),
        (NUMPY_PERMUTATION, 5, True, NUMPY_PERMUTATION, False),
        (SHARD_ORDER, 5, False, NUMPY_PERMUTATION, False),  # at an epoch's end: no holes
        (NUMPY_PERMUTATION, 4, True, SHARD_ORDER, False),  # schema 4 wrote it for shards too
    ],
)
def test_a_started_epoch_resumes_only_on_a_dataset_of_its_kind(
    saved: str, schema: int, started: bool, ours: str, refused: bool
) -> None:
    coverage = COVERAGE if started else ()
    saved_meta = meta(order=saved, schema_version=schema, coverage=coverage)
    run = dataclasses.replace(run_of(32), order=ours)
    if not refused:
        saved_meta.check_fits(run)
        return
    with pytest.raises(ConfigError, match="saved mid-epoch by a run on") as info:
        saved_meta.check_fits(run)
    assert info.value.field == "dataset"


@pytest.mark.parametrize(
    ("saved", "ours", "drawn"),
    [
        (RANDOM_SHUFFLE, NUMPY_PERMUTATION, RANDOM_SHUFFLE),  # an older bundle's order stays
        (NUMPY_PERMUTATION, NUMPY_PERMUTATION, NUMPY_PERMUTATION),
        (NUMPY_PERMUTATION, SHARD_ORDER, SHARD_ORDER),  # a schema-4 bundle of shards
        (SHARD_ORDER, SHARD_ORDER, SHARD_ORDER),
        (SHARD_ORDER, NUMPY_PERMUTATION, NUMPY_PERMUTATION),  # at an epoch's end
    ],
)
def test_a_resumed_run_keeps_its_bundles_order_unless_either_is_sharded(
    saved: str, ours: str, drawn: str
) -> None:
    run = dataclasses.replace(run_of(32), order=ours)
    assert meta(order=saved).resumed_order(run) == drawn


def test_a_seed_mismatch_names_both_values() -> None:
    with pytest.raises(ConfigError) as info:
        meta().check_fits(run_of(32, seed=7))
    assert str(info.value) == "seed: the checkpoint was saved with seed=42, this run has seed=7"
