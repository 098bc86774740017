"""The typed message catalog of the control plane.

Ranks and the coordinator talk in the msgspec structs below: one schema per
message, validated on decode. ``encode`` and ``decode`` frame a message as a
msgpack array ``[PROTOCOL_VERSION, message]``; the transport adds sequence
numbers and an HMAC tag around that (``elche.runtime``).

Decoding never raises anything but ``RemoteProtocolError``: bad bytes, an
unknown tag, a wrong field type and a foreign protocol version all end up
there, so the coordinator can count the frame, drop it and keep running.

Positions in ``AssignChunk``/``BatchDone`` are sample positions in the epoch's
shuffled order (see ``elche.core.dispatch.epoch_permutation``), not dataset
indices.
"""

from __future__ import annotations

import msgspec

from elche.core.errors import RemoteProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "AssignChunk",
    "BatchDone",
    "Batches",
    "CheckpointResult",
    "CoordHeartbeat",
    "CoordMessage",
    "DiscardSave",
    "EpochDone",
    "EpochFnElapsed",
    "EvalBroadcast",
    "EvalResult",
    "Exiting",
    "Failed",
    "GlobalProgress",
    "Heartbeat",
    "Held",
    "Hello",
    "InitialState",
    "LrUpdate",
    "Message",
    "RankMessage",
    "Regroup",
    "Rejoin",
    "RequestParams",
    "RunCheckpoint",
    "RunEval",
    "SaveState",
    "SavedFile",
    "SetBudget",
    "SetEpochCallbackRole",
    "Shutdown",
    "ShutdownWithSave",
    "SnapshotReady",
    "StateSaved",
    "SyncAck",
    "SyncNow",
    "Update",
    "UserError",
    "decode",
    "encode",
]

# Bumped on any incompatible change to a struct below. A frame of another
# version is refused with a message naming both versions.
# 2: the averaging round is `round` in every message (was `cycle`).
# 3: Failed; Shutdown.failure; BatchDone.nonfinite.
# 4: saves are numbered and confirmed (``SaveState``, ``StateSaved.files``).
# 5: a restarted coordinator (``Rejoin``, ``Hello.held``); ``GlobalProgress``.
# 6: ``DiscardSave``: a save that will never commit leaves no files.
# 7: ``Hello.layout``, ``InitialState.layout``: a model of another layout is refused.
PROTOCOL_VERSION = 7


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Base: every message is tagged with its class name on the wire."""


# --- rank -> coordinator ---------------------------------------------------


class Held(msgspec.Struct, frozen=True, kw_only=True):
    """What a rank holds in its model when it rejoins a restarted coordinator.

    ``last_round``: the last averaging round it applied (0: none);
    ``averaged``: its own batches that round averaged; ``since``: the batches
    it trained after it, oldest first. A batch is ``(epoch, offset, size)``.
    """

    last_round: int = 0
    averaged: tuple[tuple[int, int, int], ...] = ()
    since: tuple[tuple[int, int, int], ...] = ()


class Hello(_Msg, frozen=True):
    """A rank joined: first frame on a new connection.

    ``held`` is set when it reconnects after its coordinator was lost.
    ``layout`` is a joiner's (``elche join``): its model's names, shapes and
    dtypes hashed, as ``InitialState.layout``; a join whose model has another
    layout than the run's is refused.
    """

    rank: int
    world_size: int
    host: str = ""
    pid: int = 0
    held: Held | None = None
    layout: str = ""  # ("": not said)


class InitialState(_Msg, frozen=True):
    """Sent once after joining: hashes of the model ``model_fn`` built on this rank.

    Ranks whose ``fingerprint`` differs from rank 0's built different initial
    weights (a ``model_fn`` that does not seed); the coordinator warns, naming
    them. Ranks whose ``layout`` differs built another model (other parameter
    or buffer names, shapes or dtypes); the coordinator ends the run, naming them.
    """

    fingerprint: str  # the state's names, shapes, dtypes and values
    layout: str = ""  # its names, shapes and dtypes ("": not reported)


class BatchDone(_Msg, frozen=True):
    """One optimizer step over ``size`` samples at ``offset`` of ``epoch``."""

    epoch: int
    offset: int
    size: int
    batch_ms: float  # forward + backward + optimizer step, no waits
    data_ms: float = 0.0  # the rest of the step: fetching the batch and the loop between steps
    loss: float | None = None
    nonfinite: bool = False  # the loss was NaN or infinite: the step was not applied


class Batches(_Msg, frozen=True):
    """Several ``BatchDone`` in training order, sent as one frame.

    A rank coalesces its reports (up to its window, its budget, the end of a
    chunk, an averaging request, or a short interval) so the control plane
    carries one frame per window instead of one per step.
    """

    items: list[BatchDone]


class SyncAck(_Msg, frozen=True):
    """The rank finished averaging ``round``; ``steps`` went into it.

    ``through_ms``: how long the rank trained between launching the round and
    acknowledging it (``overlap``): time the round did not cost it.
    ``failed``: the rank's collective broke instead (``steps`` 0): its model
    holds none of the round, its steps count in the next one. A peer lost
    mid-collective can leave some members with the average and others
    waiting out their timeout; this answer is how the round hears of those.
    """

    round: int
    steps: int
    divergence: float | None = None
    pre_norm: float | None = None
    post_norm: float | None = None
    through_ms: float = 0.0
    failed: bool = False


class SnapshotReady(_Msg, frozen=True):
    """Coordinator backend: the rank's snapshot of ``round`` is uploaded."""

    round: int
    steps: int


class Heartbeat(_Msg, frozen=True):
    """Liveness beacon (reference: every second)."""

    step: int = 0


class LrUpdate(_Msg, frozen=True):
    """The rank's current learning rate, for the LR-aware meta-controller."""

    lr: float


class EvalResult(_Msg, frozen=True):
    """``eval_fn`` ran on the eval role."""

    epoch: int
    metric: float
    elapsed_ms: float
    error: str | None = None


class CheckpointResult(_Msg, frozen=True):
    """``checkpoint_fn`` ran on the checkpoint role."""

    version: int
    elapsed_ms: float
    error: str | None = None


class EpochFnElapsed(_Msg, frozen=True):
    """``epoch_fn`` ran on the epoch role at the start of ``epoch``."""

    epoch: int
    elapsed_ms: float


class SavedFile(msgspec.Struct, frozen=True, kw_only=True):
    """One file a rank wrote for a save, as the bundle's meta names it.

    ``kind`` is ``"model"`` (the canonical model), ``"optim"`` (the rank's
    optimizer state) or ``"final"`` (the completed run's model); ``name`` is
    the file's name in the save path's folder (the run dir for ``"final"``).
    """

    kind: str
    name: str
    size: int
    sha256: str


class StateSaved(_Msg, frozen=True):
    """Answer to save ``seq``: the files the rank wrote, durably, or its error.

    ``writer``: the rank answers an order that named it the model's writer.
    """

    seq: int
    files: list[SavedFile] = []
    error: str | None = None
    writer: bool = False


class Exiting(_Msg, frozen=True):
    """Clean exit latch: the rank is leaving on purpose."""

    reason: str = ""


class Failed(_Msg, frozen=True):
    """The user's code raised on this rank (``model_fn``, ``optimizer_fn``,
    ``step_fn``, the collate, ``epoch_fn``); the rank stops after this frame.

    The exception itself cannot cross processes reliably, so its type name,
    message and formatted traceback travel as text.
    """

    error_type: str  # e.g. "RuntimeError"
    message: str
    traceback: str = ""
    epoch: int = 0  # the epoch the rank was in (0 before training)
    before_first_step: bool = False  # it failed before its first training step


# --- coordinator -> rank ---------------------------------------------------


class AssignChunk(_Msg, frozen=True):
    """Train positions ``[offset, offset + size)`` of ``epoch``.

    ``budget`` is the number of steps the rank may take since the last
    average before it must hold for the next one.
    """

    epoch: int
    offset: int
    size: int
    budget: int
    window: int = 0  # steps that complete the rank's window (0: same as budget)


class SetBudget(_Msg, frozen=True):
    """New per-window step budget (see ``AssignChunk``)."""

    budget: int
    window: int = 0


class SyncNow(_Msg, frozen=True):
    """Collective backend: join weighted all-reduce ``round``."""

    round: int
    generation: int


class RequestParams(_Msg, frozen=True):
    """Coordinator backend: upload a snapshot for ``round``."""

    round: int


class Update(_Msg, frozen=True):
    """Coordinator backend: the average of ``round`` is ready.

    ``alpha`` is the EASGD blend weight (None: overwrite).
    """

    round: int
    alpha: float | None = None


class Regroup(_Msg, frozen=True):
    """Abandon any collective in flight and form group ``generation``."""

    generation: int
    members: list[int]


class SetEpochCallbackRole(_Msg, frozen=True):
    """``epoch_fn`` runs on ``rank`` from now on."""

    rank: int


class RunCheckpoint(_Msg, frozen=True):
    """Run ``checkpoint_fn`` for ``version`` (sent to the checkpoint role only)."""

    version: int


class RunEval(_Msg, frozen=True):
    """Run ``eval_fn`` after ``epoch`` epochs (sent to the eval role only)."""

    epoch: int


class EvalBroadcast(_Msg, frozen=True):
    """The elected rank's eval result, for every rank."""

    epoch: int
    metric: float


class EpochDone(_Msg, frozen=True):
    """Every sample of ``epoch`` is in the consensus model."""

    epoch: int
    loss: float | None = None


class UserError(msgspec.Struct, frozen=True, kw_only=True):
    """The user's exception that ended a run, as text (it cannot cross processes)."""

    rank: int
    epoch: int
    error_type: str
    message: str
    traceback: str = ""


class Shutdown(_Msg, frozen=True):
    """Training is over. ``writer`` writes the final model as save ``seq`` and
    answers ``StateSaved``; the others wait for the next ``Shutdown``. With
    ``writer`` -1 every rank exits.

    ``failure`` is not empty when the run failed: why; ``user_error`` is the
    user's exception when that was the cause. ``refused`` is not empty when
    the run goes on without the receiving rank (declared lost, or its join
    refused): why; that rank alone exits. ``saved`` is not empty when the run
    stopped short and its ranks saved it (``ShutdownWithSave``): the reason,
    for a rank that was not asked to save (a joiner not yet in a round, or
    not yet admitted).
    """

    writer: int = -1
    seq: int = 0
    failure: str = ""
    user_error: UserError | None = None
    refused: str = ""
    saved: str = ""


class SaveState(_Msg, frozen=True):
    """A periodic bundle: write this rank's state as save ``seq`` and train on.

    ``writer`` also writes the canonical model. Files of saves other than
    ``seq`` and ``keep`` (the last committed save) may be removed.
    """

    seq: int
    writer: int
    keep: int = 0


class ShutdownWithSave(_Msg, frozen=True):
    """Unrecoverable: write state as save ``seq`` under ``save_path``, then wait.

    ``writer`` is the rank whose model is the canonical one in the bundle; it
    may be sent again naming a new writer when the first dies. A ``Shutdown``
    with writer -1 ends the wait.
    """

    reason: str
    writer: int
    seq: int = 0
    keep: int = 0


class DiscardSave(_Msg, frozen=True):
    """Save ``seq`` will never commit (it failed, or a stop's bundle superseded it):
    remove its files from the save path's folder, whoever wrote them."""

    seq: int


class GlobalProgress(_Msg, frozen=True):
    """The run's progress once ``round`` closed (0: at the start of training).

    ``samples``: samples the consensus holds, cluster-wide, out of the plan
    (``epochs x num_samples``): exact when the round closed, expected when the
    round just started and the next window went out with it; ``share``: the
    receiving rank's share of the cluster's samples in the next window;
    ``horizon``: the samples the consensus will hold once every rank trained
    that window (0: not known). See ``elche.core.progress``.
    """

    round: int
    samples: int
    share: float
    horizon: int = 0


class CoordHeartbeat(_Msg, frozen=True):
    """Coordinator liveness beacon."""


class Rejoin(_Msg, frozen=True):
    """A coordinator restarted from the run's journal heard from a rank that has
    not joined it: the rank says ``Hello`` again, with what it holds (``Held``)."""


RankMessage = (
    Hello
    | BatchDone
    | Batches
    | SyncAck
    | SnapshotReady
    | Heartbeat
    | LrUpdate
    | EvalResult
    | CheckpointResult
    | EpochFnElapsed
    | StateSaved
    | Exiting
    | Failed
    | InitialState
)
CoordMessage = (
    AssignChunk
    | SetBudget
    | SyncNow
    | RequestParams
    | Update
    | Regroup
    | SetEpochCallbackRole
    | RunCheckpoint
    | RunEval
    | EvalBroadcast
    | EpochDone
    | Rejoin
    | Shutdown
    | SaveState
    | ShutdownWithSave
    | DiscardSave
    | CoordHeartbeat
    | GlobalProgress
)
Message = RankMessage | CoordMessage

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(tuple[int, Message])
_HEAD = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])


def encode(message: Message) -> bytes:
    """Frame ``message`` with the protocol version."""
    return _ENCODER.encode((PROTOCOL_VERSION, message))


def decode(data: bytes, *, rank: int | None = None) -> Message:
    """Parse one frame.

    Args:
        data: the frame's bytes (after the transport removed its envelope).
        rank: the sender, when known, for the error message.

    Returns:
        The message.

    Raises:
        RemoteProtocolError: the bytes are not a valid frame of this protocol
            version. Nothing else is raised, whatever the input.
    """
    try:
        version, _ = _HEAD.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
        raise RemoteProtocolError(f"malformed frame: {exc}", rank=rank) from exc
    if version != PROTOCOL_VERSION:
        raise RemoteProtocolError(
            f"protocol version {version} is not supported (this coordinator speaks "
            f"version {PROTOCOL_VERSION}); run the same elche release on every host",
            rank=rank,
        )
    try:
        _, message = _DECODER.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
        raise RemoteProtocolError(f"invalid message: {exc}", rank=rank) from exc
    return message
