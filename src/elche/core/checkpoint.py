"""The checkpoint meta model: what the coordinator knows about a run's position.

A checkpoint bundle is the ranks' model and optimizer files plus this meta
sidecar, written by the coordinator (only it knows the cluster-wide counters
and the balancer's trajectory). The meta is the bundle's commit mark: it is
written last, once the ranks said their files are on disk, and it names each
file with its size and SHA-256, so a resume can refuse files that are not the
ones it was written with. ``resume_from`` reads it back to continue
exactly: same epoch, step and averaging round, same ElChe state and guard
history, and only the samples of the interrupted epoch that no consensus
model has seen yet.

The JSON form carries ``schema_version``; a reader refuses a newer schema.
Every number a meta holds is bounded (``MAX_COUNT`` for counts; an epoch
within its plan, a coverage span within its epoch), and a meta is checked
against the run that resumes it (``check_fits``), so a corrupt or foreign
file is a ``ConfigError`` naming the field, never a hang or a crash.
"""

from __future__ import annotations

import enum
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elche.core.config import RANDOM_SHUFFLE, SHARD_ORDER, CoordinatorConfig, check_order
from elche.core.elche_state import ElCheState, check_range
from elche.core.errors import ConfigError

if TYPE_CHECKING:
    from elche.core.messages import SavedFile

__all__ = [
    "SCHEMA_VERSION",
    "BundleFile",
    "BundleFiles",
    "CheckpointMeta",
    "EpochCoverage",
    "SaveReason",
]

# 2: ``rounds_done`` (was ``sync_round``).
# 3: ``save_seq`` and ``files``: the bundle's numbered files, with sizes and hashes.
# 4: ``order``, how each epoch's order was drawn (older metas: ``random-shuffle``).
# 5: ``order`` ``shards`` for an ``elche.Shards`` run (before: ``numpy-permutation``).
# Metas of schemas 1 and 2 are still read (their files have fixed names).
SCHEMA_VERSION = 5

# Seeds reach torch's generators and the wire as unsigned 64-bit integers.
MAX_SEED = 2**64 - 1


class SaveReason(enum.Enum):
    """Why the bundle was written."""

    GRACEFUL_SHUTDOWN = "graceful_shutdown"
    MAX_FAILURE_EXCEEDED = "max_failure_exceeded"
    SINGLE_SURVIVOR = "single_survivor"
    ALL_RANKS_LOST = "all_ranks_lost"
    REDUCE_STALL = "reduce_stall"
    CHECKPOINT = "checkpoint"
    NONFINITE = "nonfinite"  # a loss or an average went NaN/inf: the last finite consensus
    COORDINATOR_LOST = "coordinator_lost"  # not restartable: the launcher commits the ranks' state
    # The rank whose process started the coordinator (rank 0 under elche run and
    # torchrun) is gone: its orphaned coordinator saves the run and ends.
    COORDINATOR_HOST_LOST = "coordinator_host_lost"
    # No rank could write the completed run's final model: the trained model, as a bundle
    # with nothing left to train (resuming it writes the final model).
    FINAL_MODEL_UNWRITTEN = "final_model_unwritten"


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochCoverage:
    """The samples of ``epoch`` not yet in any consensus model."""

    epoch: int
    total_samples: int
    uncovered: tuple[tuple[int, int], ...]  # (offset, size) in shuffled order

    def __post_init__(self) -> None:
        check_range("epoch", self.epoch, 0)
        check_range("total_samples", self.total_samples, 1)
        for offset, size in self.uncovered:
            if min(offset, size) < 0 or offset + size > self.total_samples:
                raise ConfigError(
                    "coverage",
                    f"uncovered span ({offset}, {size}) of epoch {self.epoch} must lie in "
                    f"[0, {self.total_samples}]",
                )
        spans = sorted(span for span in self.uncovered if span[1])  # an empty one holds none
        for before, after in itertools.pairwise(spans):
            if after[0] < before[0] + before[1]:  # its samples would train twice
                raise ConfigError(
                    "coverage",
                    f"uncovered spans {before} and {after} of epoch {self.epoch} overlap",
                )

    @property
    def uncovered_samples(self) -> int:
        return sum(size for _, size in self.uncovered)


@dataclass(frozen=True, slots=True, kw_only=True)
class BundleFile:
    """One file of a bundle: its name in the meta's folder, size and SHA-256."""

    name: str
    size: int
    sha256: str

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or "\\" in self.name or self.name in (".", ".."):
            raise ConfigError("files", f"{self.name!r} is not a file name in the bundle's folder")
        check_range("files.size", self.size, 0)
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ConfigError("files", f"{self.name}: {self.sha256!r} is not a SHA-256 hex digest")

    @classmethod
    def from_saved(cls, saved: SavedFile) -> BundleFile:
        """The entry of a file a writer reported on disk."""
        return cls(name=saved.name, size=saved.size, sha256=saved.sha256)

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True, slots=True, kw_only=True)
class BundleFiles:
    """What a bundle holds: the canonical model, each rank's optimizer state, and
    the DiLoCo outer momentum (``outer_lr`` runs, once it has a velocity)."""

    model: BundleFile
    optim: tuple[tuple[int, BundleFile], ...] = ()  # (rank, file), by rank
    outer: BundleFile | None = None

    def names(self) -> set[str]:
        """The names of every file the bundle holds."""
        names = {self.model.name, *(f.name for _, f in self.optim)}
        return names | ({self.outer.name} if self.outer is not None else set())

    def optim_of(self, rank: int) -> BundleFile | None:
        """Rank ``rank``'s optimizer state, or None if the bundle has none for it."""
        return dict(self.optim).get(rank)

    def to_json(self) -> dict[str, object]:
        return {
            "model": self.model.to_json(),
            "optim": {str(rank): f.to_json() for rank, f in self.optim},
            "outer": None if self.outer is None else self.outer.to_json(),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointMeta:
    """The coordinator's half of a checkpoint bundle.

    Args:
        epoch: the first epoch that is not finished.
        global_step: optimizer steps folded into the consensus so far.
        rounds_done: averaging rounds completed.
        world_size: ranks at the start of the run.
        reason: why the bundle was written.
        seed: shuffle seed of the run (the permutation of each epoch).
        batch_size: samples per step.
        epochs: epochs planned.
        elche_state: the balancer's state, with the guard's history.
        coverage: one entry per started, unfinished epoch.
        mode: the run's mode (None in metas before schema 3).
        save_seq: the save's number (a resumed run numbers its saves after it).
        files: the files of the bundle (None in metas before schema 3, whose
            files have fixed names: ``STEM.model.pt``, ``STEM.rank<N>.optim.pt``).
        order: how each epoch's order was drawn (``CoordinatorConfig.order``;
            ``random-shuffle`` in metas before schema 4): a resumed run keeps it.

    Raises:
        ConfigError: a count is outside [0, MAX_COUNT] (sizes: [1, MAX_COUNT]),
            ``epoch`` is past ``epochs``, the seed is not a 64-bit unsigned
            integer, or coverage names an epoch twice or one outside
            [``epoch``, ``epochs``).
    """

    epoch: int
    global_step: int
    rounds_done: int
    world_size: int
    reason: SaveReason
    seed: int
    batch_size: int
    epochs: int
    elche_state: ElCheState | None = None
    coverage: tuple[EpochCoverage, ...] = ()
    mode: str | None = None
    save_seq: int = 0
    files: BundleFiles | None = None
    order: str = RANDOM_SHUFFLE
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        check_range("epochs", self.epochs, 1)
        check_range("epoch", self.epoch, 0, self.epochs)
        for field in ("global_step", "rounds_done", "save_seq"):
            check_range(field, getattr(self, field), 0)
        for field in ("world_size", "batch_size"):
            check_range(field, getattr(self, field), 1)
        check_range("seed", self.seed, 0, MAX_SEED)
        epochs = [c.epoch for c in self.coverage]
        if len(set(epochs)) != len(epochs):
            raise ConfigError("coverage", f"names an epoch twice: {epochs}")
        for epoch in epochs:
            if not self.epoch <= epoch < self.epochs:
                raise ConfigError(
                    "coverage",
                    f"epoch {epoch} must be in [{self.epoch}, {self.epochs}) "
                    "(the unfinished epochs of the plan)",
                )

    def check_fits(self, config: CoordinatorConfig, *, accumulate: int = 1) -> None:
        """Refuse to resume ``config`` from a meta another run wrote.

        The seed (each epoch's permutation), the batch size (the span grid)
        and the mode must be the run's; so must each started epoch's length,
        and whether its order was an ``elche.Shards``' (``SHARD_ORDER``;
        told from schema 5 on): the holes are positions of that order.
        The world size may differ: the balancer then starts afresh (its
        state is per rank). ``epochs`` may differ: a run can be resumed to go
        on for longer, or to stop sooner (an ``epoch`` at or past the new
        plan finishes at once).

        Args:
            config: the run to resume.
            accumulate: the run's micro-batches per optimizer step: its
                ``config.batch_size`` is the user's ``batch_size`` times it,
                and a mismatch names both.

        Raises:
            ConfigError: naming the field, with the meta's value and the run's.
        """
        if self.seed != config.seed:
            raise ConfigError(
                "seed", f"the checkpoint was saved with seed={self.seed}, this run has "
                f"seed={config.seed}",
            )  # fmt: skip
        if self.batch_size != config.batch_size:
            saved, ours = f"batch_size={self.batch_size}", f"batch_size={config.batch_size}"
            if accumulate > 1:  # the meta counts samples per optimizer step
                saved = f"batch_size × accumulate = {self.batch_size} samples per optimizer step"
                ours = (
                    f"batch_size={config.batch_size // accumulate} × accumulate={accumulate} "
                    f"= {config.batch_size}"
                )
            raise ConfigError(
                "batch_size", f"the checkpoint was saved with {saved}, this run has {ours}"
            )
        if self.mode is not None and self.mode != config.mode.value:
            raise ConfigError(
                "mode", f"the checkpoint was saved with mode={self.mode}, this run has "
                f"mode={config.mode.value}",
            )  # fmt: skip
        for started in self.coverage:
            if started.total_samples != config.num_samples:
                raise ConfigError(
                    "num_samples",
                    f"the checkpoint's epoch {started.epoch} has {started.total_samples} "
                    f"samples, this run's dataset has {config.num_samples}",
                )
        sharded = self.order == SHARD_ORDER
        if self.coverage and self.schema_version >= 5 and sharded != (config.order == SHARD_ORDER):
            kinds = ("an elche.Shards", "a map-style dataset")
            saved, ours = kinds if sharded else kinds[::-1]
            raise ConfigError(
                "dataset",
                f"the checkpoint was saved mid-epoch by a run on {saved}, this run trains "
                f"{ours}: its epochs' order is another, so the positions left to train "
                "would name other samples",
            )

    def resumed_order(self, config: CoordinatorConfig) -> str:
        """The order the run ``config`` resumed from this meta draws its epochs in.

        The meta's, which an older bundle's ``random-shuffle`` keeps; an
        ``elche.Shards``' own (``SHARD_ORDER``) when either run is sharded
        (``check_fits`` refused a started epoch of the other kind).
        """
        return config.order if SHARD_ORDER in (self.order, config.order) else self.order

    def to_json(self) -> str:
        """Pretty-printed JSON, stable key order."""
        doc: dict[str, object] = {
            "schema_version": self.schema_version,
            "epoch": self.epoch,
            "global_step": self.global_step,
            "rounds_done": self.rounds_done,
            "world_size": self.world_size,
            "save_reason": self.reason.value,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "elche_state": None if self.elche_state is None else self.elche_state.to_json(),
            "coverage": [
                {
                    "epoch": c.epoch,
                    "total_samples": c.total_samples,
                    "uncovered": [list(span) for span in c.uncovered],
                }
                for c in self.coverage
            ],
            "mode": self.mode,
            "save_seq": self.save_seq,
            "files": None if self.files is None else self.files.to_json(),
            "order": self.order,
        }
        return json.dumps(doc, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CheckpointMeta:
        """Parse a meta sidecar.

        Raises:
            ConfigError: the text is not a meta document of a known schema.
        """
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ConfigError("resume_from", f"meta file is not JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise ConfigError("resume_from", "meta file must hold a JSON object")
        version = _int(doc, "schema_version")
        if version > SCHEMA_VERSION:
            raise ConfigError(
                "resume_from",
                f"meta schema {version} is newer than this elche understands "
                f"({SCHEMA_VERSION}); upgrade elche to resume this run",
            )
        # Every key its schema writes, even when null: one missing (a hand edit, a
        # damaged file) would read as nothing left to say, and a missing coverage
        # as every open epoch untrained, whose samples the model already holds.
        written = ("coverage", "elche_state", *(("mode", "files") if version >= 3 else ()))
        for key in written:
            _written(doc, key, "the meta")
        # From schema 3 on, every writer names the mode and the files: a null one would
        # skip the mode's check, or look for the fixed names of a schema-2 bundle.
        for key in ("mode", "files") if version >= 3 else ():
            if doc[key] is None:
                raise ConfigError(
                    key, f"is null in a meta of schema {version}, whose writer always "
                    "names it: the meta is damaged or was edited",
                )  # fmt: skip
        try:
            reason = SaveReason(doc.get("save_reason"))
        except ValueError as exc:
            accepted = ", ".join(r.value for r in SaveReason)
            raise ConfigError("save_reason", f"unknown reason; accepted: {accepted}") from exc
        state = doc.get("elche_state")
        return cls(
            epoch=_int(doc, "epoch"),
            global_step=_int(doc, "global_step"),
            rounds_done=_int(doc, _rounds_key(doc, version)),
            world_size=_int(doc, "world_size"),
            reason=reason,
            seed=_int(doc, "seed"),
            batch_size=_int(doc, "batch_size"),
            epochs=_int(doc, "epochs"),
            elche_state=None
            if state is None
            else ElCheState.from_json(_mapping(state, "elche_state")),
            coverage=tuple(_coverage(c) for c in _list(doc, "coverage")),
            mode=_mode(doc.get("mode")),
            save_seq=_int(doc, "save_seq") if version >= 3 else 0,
            files=None if doc.get("files") is None else _files(doc["files"]),
            order=check_order(doc.get("order")) if version >= 4 else RANDOM_SHUFFLE,
            schema_version=version,
        )


def _rounds_key(doc: Mapping[str, object], version: int) -> str:
    """A meta of schema 1 or older names its rounds ``sync_round``."""
    older = version < 2 and "rounds_done" not in doc and "sync_round" in doc
    return "sync_round" if older else "rounds_done"


def _coverage(raw: object) -> EpochCoverage:
    doc = _mapping(raw, "coverage")
    epoch, total = _int(doc, "epoch"), _int(doc, "total_samples")
    # Without its spans an epoch would read as fully trained: the rest of it, lost.
    _written(doc, "uncovered", f"the coverage of epoch {epoch}")
    spans: list[tuple[int, int]] = []
    for span in _list(doc, "uncovered"):
        if not (
            isinstance(span, Sequence)
            and len(span) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in span)
        ):
            raise ConfigError("coverage", f"bad uncovered span {span!r}")
        spans.append((int(span[0]), int(span[1])))
    return EpochCoverage(epoch=epoch, total_samples=total, uncovered=tuple(spans))


def _mode(raw: object) -> str | None:
    if raw is not None and not isinstance(raw, str):
        raise ConfigError("mode", f"must be a mode name, got {raw!r}")
    return raw


def _file(raw: object, field: str) -> BundleFile:
    doc = _mapping(raw, field)
    name, sha = doc.get("name"), doc.get("sha256")
    if not isinstance(name, str) or not isinstance(sha, str):
        raise ConfigError(field, f"expected name and sha256 strings, got {raw!r}")
    return BundleFile(name=name, size=_int(doc, "size"), sha256=sha)


def _files(raw: object) -> BundleFiles:
    doc = _mapping(raw, "files")
    # Written even when empty or null: one gone would start the ranks' optimizers
    # (or the outer momentum) afresh, a silent change of what the run trains.
    for key in ("optim", "outer"):
        _written(doc, key, "the meta's files", field=f"files.{key}")
    optim = _mapping(doc["optim"], "files.optim")
    ranks: list[tuple[int, BundleFile]] = []
    for key, entry in optim.items():
        if not key.isdigit():
            raise ConfigError("files.optim", f"{key!r} is not a rank")
        ranks.append((int(key), _file(entry, f"files.optim.{key}")))
    outer = doc.get("outer")
    return BundleFiles(
        model=_file(doc.get("model"), "files.model"),
        optim=tuple(sorted(ranks)),
        outer=None if outer is None else _file(outer, "files.outer"),
    )


def _written(doc: Mapping[str, object], key: str, where: str, *, field: str = "") -> None:
    """Refuse ``doc`` (part of a meta) without ``key``, which its writer always writes."""
    if key not in doc:
        what = f"is missing from {where}: it is damaged or was edited"
        raise ConfigError(field or key, what)


def _mapping(raw: object, field: str) -> Mapping[str, object]:
    if not isinstance(raw, dict):
        raise ConfigError(field, f"expected a JSON object, got {raw!r}")
    return raw


def _int(doc: Mapping[str, object], key: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(key, f"must be a non-negative integer, got {value!r}")
    return value


def _list(doc: Mapping[str, object], key: str) -> list[object]:
    value = doc.get(key, [])
    if not isinstance(value, list):
        raise ConfigError(key, f"must be a list, got {value!r}")
    return value
