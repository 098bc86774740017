"""The timeline's typed catalog: one struct per kind of event a run records.

The coordinator core emits these (``Emit(event=...)``) and the shell adds
its own (``OuterMomentumRestored``); ``elche.monitor`` writes them to
``RUN_DIR/timeline.jsonl``, one JSON object a line, and reads them back as
the same structs. The catalog lives in the core because the core is what
emits most of it, and the core imports nothing above itself.

On disk a record is flat: ``{"kind": "EpochEnd", "epoch": 0, ..., "t": 1.25}``.
``kind`` is the struct's name; ``t`` is seconds since the coordinator
started, stamped by the writer (0 until then). Readers match on the struct
types, never on the ``kind`` string, and ignore fields they do not know, so
adding a field is compatible; renaming or removing one is not.

A float that is not finite (an ``eval_fn`` that returned NaN) is written as
a string, ``"nan"``, ``"inf"`` or ``"-inf"``, and read back as the float:
JSON has no literal for it, and msgspec's default, ``null``, fails the
field's type on the way back, which lost the whole record to every reader.
"""

from __future__ import annotations

import math

import msgspec

from elche.core.messages import UserError

__all__ = [
    "Alert",
    "AnchorChanged",
    "BundleWritten",
    "CheckpointRan",
    "EpochEnd",
    "EpochStart",
    "Eval",
    "EvalFailed",
    "GuardNudge",
    "MetaNudge",
    "OuterMomentumRestored",
    "RankJoined",
    "RankLost",
    "RankWindow",
    "RolesMoved",
    "RunEnd",
    "RunStart",
    "Stalled",
    "SyncEnd",
    "SyncStart",
    "Throttle",
    "TimelineEvent",
    "UserError",
    "decode",
    "encode",
]


class _Record(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag=True):
    """Base of every record: its kind is its class name."""

    t: float = 0.0  # seconds since the coordinator started, stamped by the writer


class RunStart(_Record, frozen=True):
    """Every rank joined; training begins."""

    world_size: int
    mode: str


class EpochStart(_Record, frozen=True):
    """The first work of ``epoch`` was handed out."""

    epoch: int


class EpochEnd(_Record, frozen=True):
    """Every sample of ``epoch`` is in the consensus model."""

    epoch: int
    loss: float | None  # the mean of the ranks' last reported losses in the epoch
    rounds_done: int  # averaging rounds completed so far
    lr: float | None = None  # the learning rate a rank last reported (None: none reported)


class SyncStart(_Record, frozen=True):
    """Averaging round ``round`` was triggered."""

    round: int


class SyncEnd(_Record, frozen=True):
    """Averaging round ``round`` completed on every live member."""

    round: int
    duration_ms: float  # trigger to the last acknowledgement
    d_raw: float  # the largest relative divergence a member reported
    k_used: int  # steps averaged, summed over the members
    anchor: int  # the anchor after this round's feedback


class AnchorChanged(_Record, frozen=True):
    """The balancer moved its anchor (batches of the slowest rank per window)."""

    old: int
    new: int


class GuardNudge(_Record, frozen=True):
    """The convergence guard saw divergence rising and scaled the anchor by ``factor``."""

    factor: float
    old: int
    new: int


class MetaNudge(_Record, frozen=True):
    """The LR-aware meta-controller scaled the anchor by ``factor``."""

    factor: float
    old: int
    new: int


class Eval(_Record, frozen=True):
    """``eval_fn`` after ``epoch`` epochs gave ``metric`` on ``rank``."""

    epoch: int
    metric: float
    rank: int
    duration_ms: float = 0.0  # the eval's wall time on its rank


class EvalFailed(_Record, frozen=True):
    """``eval_fn`` after ``epoch`` epochs raised on ``rank``."""

    epoch: int
    rank: int
    duration_ms: float
    error: str


class CheckpointRan(_Record, frozen=True):
    """``checkpoint_fn`` for ``version`` ran on ``rank``: ``outcome`` ok | failed."""

    version: int
    rank: int
    duration_ms: float
    outcome: str
    error: str | None = None


class BundleWritten(_Record, frozen=True):
    """The shell committed save ``seq``: its meta at ``stem``.meta.json names every file."""

    stem: str
    seq: int
    reason: str  # the meta's SaveReason value


class RankJoined(_Record, frozen=True):
    """``rank`` joined from ``host``."""

    rank: int
    host: str


class Throttle(_Record, frozen=True):
    """``rank`` trained its whole budget and waits for the round (once per window).

    Under ``sync`` every rank waits every step, by design; it is not recorded.
    """

    rank: int
    steps: int  # steps since the last average: its budget


class RolesMoved(_Record, frozen=True):
    """The callback roles' holders changed (rank numbers; -1 for none)."""

    epoch_rank: int
    eval_rank: int
    checkpoint_rank: int


class RankWindow(_Record, frozen=True):
    """What ``rank`` did since its previous record (a few records per epoch).

    The span runs from the previous record (or the run start) to ``t``.
    """

    rank: int
    epoch: int  # the epoch being served when the record was taken
    span_s: float  # wall seconds the record covers
    batches: int
    samples: int
    loss: float | None  # mean training loss over the span (None: no finite loss reported)
    samples_per_s: float
    share: float  # this rank's fraction of all batches trained in the span
    compute_ms_per_batch: float | None  # None: no batch in the span
    idle_pct: float  # 100 x (1 - compute time / span), floored at 0


class Stalled(_Record, frozen=True):
    """No progress for ``silent_s`` while ranks are live: what each is doing, what is awaited."""

    silent_s: float
    waiting_for: str  # what the coordinator waits for, in words
    ranks: tuple[str, ...]  # one line per rank: its state and work


class Alert(_Record, frozen=True):
    """Something a person should look at; repeats within the collapse window are counted.

    ``count`` is how many occurrences this record stands for (the first, or
    the repeats absorbed since the previous record of the same name and path).
    """

    severity: str  # critical | warn
    name: str  # rank_lost | control_drop | drift | overflow | stall
    path: str  # what it is about: "rank2", "root"
    detail: str
    count: int = 1


class RankLost(_Record, frozen=True):
    """``rank`` was declared dead (or evicted) for ``reason``."""

    rank: int
    reason: str


class RunEnd(_Record, frozen=True):
    """The run is over: the coordinator's account of it (the summary's core)."""

    outcome: str  # completed | saved_and_shutdown | failed
    reason: str
    epochs_completed: int
    rounds_done: int  # averaging rounds completed
    lost_samples: int  # samples of completed epochs missing from the consensus (0 unless a bug)
    dead_ranks: tuple[int, ...]
    rejected_frames: int
    anchor: int
    samples_per_rank: tuple[int, ...]  # samples each rank put into the consensus
    user_error: UserError | None = None  # outcome "failed" on the user's own code
    coordinator_restarts: int = 0  # coordinators lost and restarted from the journal
    joined_ranks: tuple[int, ...] = ()  # ranks that joined the running run (``elche join``)
    skipped_steps: int = 0  # steps left out for a non-finite loss (``nonfinite="skip"``)
    skipped_samples: int = 0  # their samples: counted as trained, in no model
    # Authentic messages that came too late to count: from a rank no longer live,
    # a callback answered twice, an answer for no round or save in flight.
    stale_messages: int = 0


class OuterMomentumRestored(_Record, frozen=True):
    """The shell loaded a resumed run's DiLoCo outer momentum from ``file``."""

    file: str


TimelineEvent = (
    RunStart
    | RunEnd
    | EpochStart
    | EpochEnd
    | SyncStart
    | SyncEnd
    | AnchorChanged
    | MetaNudge
    | GuardNudge
    | Eval
    | EvalFailed
    | CheckpointRan
    | BundleWritten
    | RankJoined
    | RankLost
    | Throttle
    | RolesMoved
    | RankWindow
    | Stalled
    | Alert
    | OuterMomentumRestored
)

_ENCODER = msgspec.json.Encoder()
# Not strict: a float field takes the strings that ``encode`` writes for NaN and infinities.
_DECODER = msgspec.json.Decoder(TimelineEvent, strict=False)


def encode(event: TimelineEvent) -> bytes:
    """One record as a JSON line's bytes (no newline); a non-finite float as its text."""
    nonfinite = {
        name: repr(value)  # "nan", "inf", "-inf"
        for name in event.__struct_fields__
        if isinstance(value := getattr(event, name), float) and not math.isfinite(value)
    }
    if not nonfinite:
        return _ENCODER.encode(event)
    return _ENCODER.encode(msgspec.to_builtins(event) | nonfinite)


def decode(line: bytes | str) -> TimelineEvent | None:
    """One record, or None for a kind this release does not know or a damaged line."""
    try:
        return _DECODER.decode(line)
    except msgspec.DecodeError:  # ValidationError (an unknown kind) included
        return None
