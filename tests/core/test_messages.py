"""The message catalog: round trips, version refusal, and the decoder's one promise.

``decode`` either returns a message or raises ``RemoteProtocolError``,
whatever the bytes (h11 ``fuzz/`` style): the coordinator counts a bad frame,
latches its sender and keeps running, so any other exception would take the
whole run down.
"""

from __future__ import annotations

import math
import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elche.core import messages as m
from elche.core.errors import RemoteProtocolError

# One instance per message type, optional fields set where they exist so the
# round trip covers them; a few defaults-only twins follow.
SAMPLES: list[m.Message] = [
    m.Hello(
        rank=2,
        world_size=4,
        host="gpu-b",
        pid=4242,
        held=m.Held(last_round=3, averaged=((0, 0, 32),), since=((0, 32, 32), (0, 64, 7))),
    ),
    m.BatchDone(epoch=1, offset=128, size=32, batch_ms=41.5, data_ms=2.25, loss=0.73),
    m.Batches(
        items=[
            m.BatchDone(epoch=0, offset=0, size=8, batch_ms=1.5),
            m.BatchDone(epoch=0, offset=8, size=8, batch_ms=1.25, loss=0.5),
        ]
    ),
    m.SyncAck(round=9, steps=12, divergence=0.04, pre_norm=3.5, post_norm=3.25),
    m.SnapshotReady(round=9, steps=12),
    m.Heartbeat(step=77),
    m.LrUpdate(lr=0.001),
    m.EvalResult(epoch=3, metric=0.91, elapsed_ms=812.0, error="nan loss"),
    m.CheckpointResult(version=5, elapsed_ms=12.5, error="disk full"),
    m.EpochFnElapsed(epoch=3, elapsed_ms=140.0),
    m.StateSaved(
        seq=4,
        files=[m.SavedFile(kind="model", name="run.s4.model.pt", size=1200, sha256="ab" * 32)],
        error=None,
    ),
    m.Exiting(reason="user interrupt"),
    m.Failed(error_type="RuntimeError", message="bad loss", traceback="Traceback", epoch=1),
    m.InitialState(fingerprint="ab12"),
    m.AssignChunk(epoch=2, offset=0, size=640, budget=20),
    m.SetBudget(budget=15),
    m.SyncNow(round=10, generation=2),
    m.RequestParams(round=10),
    m.Update(round=10, alpha=0.5),
    m.Regroup(generation=3, members=[0, 2, 3]),
    m.SetEpochCallbackRole(rank=1),
    m.RunCheckpoint(version=5),
    m.RunEval(epoch=3),
    m.EvalBroadcast(epoch=3, metric=0.91),
    m.EpochDone(epoch=3, loss=0.42),
    m.Shutdown(writer=1, seq=7),
    m.SaveState(seq=3, writer=0, keep=2),
    m.DiscardSave(seq=3),
    m.ShutdownWithSave(reason="max_failure_exceeded", writer=0, seq=5, keep=4),
    m.CoordHeartbeat(),
    m.Rejoin(),
    m.GlobalProgress(round=3, samples=640, share=0.25),
]
DEFAULTS_ONLY: list[m.Message] = [
    m.Hello(rank=0, world_size=1),
    m.BatchDone(epoch=0, offset=0, size=1, batch_ms=0.0),
    m.SyncAck(round=0, steps=0),
    m.Heartbeat(),
    m.EvalResult(epoch=0, metric=float("inf"), elapsed_ms=0.0),
    m.StateSaved(seq=0),
    m.Exiting(),
    m.Update(round=0),
    m.Regroup(generation=0, members=[]),
    m.EpochDone(epoch=0),
]
FRAMES = [m.encode(sample) for sample in SAMPLES]
MESSAGE_TYPES = set(typing.get_args(m.Message))


def frame(version: object, body: object) -> bytes:
    """A hand-built frame, for inputs ``encode`` would never produce."""
    return msgspec.msgpack.encode([version, body])


def decode_or_remote_error(data: bytes) -> None:
    """The fuzz invariant: a message, or ``RemoteProtocolError``, nothing else."""
    try:
        message = m.decode(data)
    except RemoteProtocolError:
        return
    assert type(message) in MESSAGE_TYPES


def test_samples_cover_every_message_type() -> None:
    assert {type(s) for s in SAMPLES} == MESSAGE_TYPES
    assert len(SAMPLES) == len(MESSAGE_TYPES)


@pytest.mark.parametrize("message", SAMPLES + DEFAULTS_ONLY, ids=repr)
def test_every_message_round_trips(message: m.Message) -> None:
    decoded = m.decode(m.encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


@pytest.mark.parametrize("message", SAMPLES, ids=lambda s: type(s).__name__)
def test_frame_is_version_then_message_tagged_with_its_class_name(message: m.Message) -> None:
    version, body = msgspec.msgpack.decode(m.encode(message))
    assert version == m.PROTOCOL_VERSION
    assert body["type"] == type(message).__name__


def test_nan_float_round_trips_as_nan() -> None:
    decoded = m.decode(m.encode(m.LrUpdate(lr=float("nan"))))
    assert isinstance(decoded, m.LrUpdate)
    assert math.isnan(decoded.lr)


@pytest.mark.parametrize(
    "version", [0, 1, m.PROTOCOL_VERSION - 1, m.PROTOCOL_VERSION + 1, 17, -1, 2**64 - 1]
)
def test_foreign_protocol_version_is_refused_naming_both_versions(version: int) -> None:
    data = frame(version, {"type": "Shutdown"})
    with pytest.raises(RemoteProtocolError) as info:
        m.decode(data, rank=3)
    text = str(info.value)
    assert f"protocol version {version} " in text
    assert f"version {m.PROTOCOL_VERSION})" in text
    assert info.value.rank == 3


def test_remote_error_carries_the_sender_rank() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        m.decode(b"\xc1", rank=5)
    assert info.value.rank == 5
    assert str(info.value).startswith("rank 5: ")


def test_remote_error_without_rank_has_none() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        m.decode(b"\xc1")
    assert info.value.rank is None


@pytest.mark.parametrize(
    "body",
    [
        {"type": "Hello", "rank": "2", "world_size": 4},
        {"type": "Hello", "rank": True, "world_size": 4},
        {"type": "Hello", "rank": 2.0, "world_size": 4},
        {"type": "Hello", "rank": 2, "world_size": 4, "host": 7},
        {"type": "BatchDone", "epoch": 0, "offset": 0, "size": 1, "batch_ms": "fast"},
        {"type": "BatchDone", "epoch": 0, "offset": 0, "size": 1, "batch_ms": 1.0, "loss": "x"},
        {"type": "SyncAck", "round": None, "steps": 1},
        {"type": "Regroup", "generation": 1, "members": [0, "1"]},
        {"type": "Regroup", "generation": 1, "members": 3},
        {"type": "Update", "round": 1, "alpha": "half"},
        {"type": "ShutdownWithSave", "reason": 1, "writer": 0},
        {"type": "StateSaved", "path": ["a"]},
    ],
    ids=lambda b: f"{b['type']}-{sorted(b)}",
)
def test_wrong_field_type_raises_remote_protocol_error(body: dict[str, object]) -> None:
    with pytest.raises(RemoteProtocolError, match="invalid message"):
        m.decode(frame(m.PROTOCOL_VERSION, body))


@pytest.mark.parametrize(
    "body",
    [
        {"type": "Hello", "world_size": 4},  # rank missing
        {"type": "AssignChunk", "epoch": 0, "offset": 0, "size": 1},  # budget missing
        {"type": "ShutdownWithSave", "reason": "x"},  # writer missing
    ],
)
def test_missing_required_field_raises_remote_protocol_error(body: dict[str, object]) -> None:
    with pytest.raises(RemoteProtocolError, match="invalid message"):
        m.decode(frame(m.PROTOCOL_VERSION, body))


@pytest.mark.parametrize(
    "body",
    [
        {"type": "Goodbye"},
        {"type": "hello", "rank": 0, "world_size": 1},  # tags are case-sensitive
        {"type": "_Msg"},
        {"type": 3},
        {"rank": 0, "world_size": 1},  # no tag at all
        [0, 1],
        "Shutdown",
    ],
    ids=repr,
)
def test_unknown_or_missing_tag_raises_remote_protocol_error(body: object) -> None:
    with pytest.raises(RemoteProtocolError, match="invalid message"):
        m.decode(frame(m.PROTOCOL_VERSION, body))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # reserved msgpack opcode
        msgspec.msgpack.encode({"version": 1}),
        msgspec.msgpack.encode(1),
        msgspec.msgpack.encode([1]),
        msgspec.msgpack.encode([1, {"type": "Shutdown"}, 3]),
        msgspec.msgpack.encode(["1", {"type": "Shutdown"}]),
        msgspec.msgpack.encode([True, {"type": "Shutdown"}]),
        msgspec.msgpack.encode([1.0, {"type": "Shutdown"}]),
    ],
    ids=repr,
)
def test_malformed_envelope_raises_remote_protocol_error(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="malformed frame"):
        m.decode(data)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda s: type(s).__name__)
def test_every_truncation_of_a_valid_frame_raises_remote_protocol_error(
    message: m.Message,
) -> None:
    data = m.encode(message)
    for cut in range(len(data)):
        with pytest.raises(RemoteProtocolError):
            m.decode(data[:cut])


def test_trailing_garbage_after_a_valid_frame_is_refused() -> None:
    with pytest.raises(RemoteProtocolError):
        m.decode(m.encode(m.Shutdown()) + b"\x00")


def test_deeply_nested_body_raises_remote_protocol_error() -> None:
    # Regression: ~5 KB of nested arrays used to escape as RecursionError.
    data = b"\x92\x01" + b"\x91" * 5000 + b"\x90"
    with pytest.raises(RemoteProtocolError):
        m.decode(data)


# --- fuzz: decode or RemoteProtocolError, nothing else ---------------------


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=128))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    decode_or_remote_error(data)


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    """A valid frame with a few bytes flipped, inserted, deleted or cut off."""
    data = bytearray(draw(st.sampled_from(FRAMES)))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        at = draw(st.integers(min_value=0, max_value=max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] = draw(st.integers(min_value=0, max_value=255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[at]
        else:
            del data[at:]
    return bytes(data)


@settings(max_examples=250, deadline=None)
@given(mutated_frames())
def test_fuzz_mutated_valid_frames(data: bytes) -> None:
    decode_or_remote_error(data)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(FRAMES), st.data())
def test_fuzz_truncated_valid_frames_always_raise(data: bytes, draw: st.DataObject) -> None:
    cut = draw.draw(st.integers(min_value=0, max_value=len(data) - 1))
    with pytest.raises(RemoteProtocolError):
        m.decode(data[:cut])


# Well-formed msgpack with the right tags but arbitrary field values: reaches
# the schema validation that random bytes rarely get past.
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
MSGPACK_VALUES = (
    SCALARS
    | st.lists(SCALARS, max_size=3)
    | st.dictionaries(st.text(max_size=4), SCALARS, max_size=2)
)
TAGS = sorted(t.__name__ for t in MESSAGE_TYPES)
FIELD_NAMES = sorted({f.name for t in MESSAGE_TYPES for f in msgspec.structs.fields(t)})


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(TAGS),
    st.dictionaries(st.sampled_from(FIELD_NAMES), MSGPACK_VALUES, max_size=4),
)
def test_fuzz_tagged_bodies_with_arbitrary_fields(tag: str, fields: dict[str, object]) -> None:
    try:
        message = m.decode(frame(m.PROTOCOL_VERSION, {**fields, "type": tag}))
    except RemoteProtocolError:
        return
    assert type(message).__name__ == tag
