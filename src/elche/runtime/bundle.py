"""A bundle's files on disk: durable writes, numbered names, checks on resume.

Theory of operation. A bundle at stem ``P`` is the meta ``P.meta.json`` (the
commit mark, written last by the coordinator) and the files it names, in
``P``'s folder: ``P.s<N>.model.pt`` (the canonical model),
``P.s<N>.rank<R>.optim.pt`` (each rank's optimizer state) and, for
``outer_lr`` runs, ``P.s<N>.outer.npz``, where ``N`` is the save's number. A
file is written to a temporary name, flushed to disk (``fsync``), renamed
into place and its folder flushed, then hashed from disk; only then does its
rank report it. Because every save has its own names, a save that dies half
way leaves the bundle the meta names untouched. A save that will never
commit is discarded (``discard``: every live rank removes its files from its
folder), and before a rank writes a save it removes the files of every save
but the last committed one (``prune``: those of older saves, and any a
discard missed, a rank killed mid-write included), so a folder holds at most
two saves' files.

Metas of schema 2 and older have no ``files``: their files have fixed names
(``P.model.pt``, ``P.rank<R>.optim.pt``, ``P.outer.npz``) and no hashes.

This module never imports torch: the coordinator process uses it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from elche.core.checkpoint import BundleFile, CheckpointMeta
from elche.core.errors import ConfigError
from elche.core.messages import SavedFile

__all__ = [
    "FINAL_MODEL",
    "BundlePaths",
    "check_unchanged",
    "discard",
    "fsync_dir",
    "locate",
    "meta_path",
    "model_name",
    "next_seq",
    "no_meta",
    "optim_name",
    "outer_name",
    "prune",
    "read_meta",
    "rename_file",
    "verify",
    "write_file",
    "write_meta",
    "write_whole",
]

# Read in pieces this large when hashing, so a big model is never held twice.
_HASH_CHUNK = 1 << 20
# In the run dir: the completed run's model, written by the final writer.
FINAL_MODEL = "final_model.pt"


def meta_path(stem: str) -> Path:
    """Where the meta (the commit mark) of bundle ``stem`` lives."""
    return Path(f"{stem}.meta.json")


def model_name(stem: str, seq: int) -> str:
    """The file name of save ``seq``'s canonical model."""
    return f"{Path(stem).name}.s{seq}.model.pt"


def optim_name(stem: str, seq: int, rank: int) -> str:
    """The file name of rank ``rank``'s optimizer state in save ``seq``."""
    return f"{Path(stem).name}.s{seq}.rank{rank}.optim.pt"


def outer_name(stem: str, seq: int) -> str:
    """The file name of save ``seq``'s DiLoCo outer momentum."""
    return f"{Path(stem).name}.s{seq}.outer.npz"


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the platform allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # a platform without directory handles
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the rename stands
    finally:
        os.close(fd)


def write_file(path: Path, write: Callable[[BinaryIO], object], *, kind: str) -> SavedFile:
    """Write ``path`` durably through ``write`` and describe it for the meta.

    The bytes go to ``path.tmp``, are fsynced, renamed into place, and the
    folder is fsynced; the hash is read back from disk.

    Raises:
        OSError: as ``write_whole``.
    """
    write_whole(path, write, sync=True)
    fsync_dir(path.parent)
    size, digest = _digest(path)
    return SavedFile(kind=kind, name=path.name, size=size, sha256=digest)


def write_whole(path: Path, write: Callable[[BinaryIO], object], *, sync: bool) -> None:
    """Write ``path`` through ``write``, whole or not at all: to ``path.tmp`` (fsynced
    if ``sync``), then renamed into place.

    Raises:
        OSError: the folder is full, read-only or gone (the temporary file is
            removed), naming ``path``: also when ``write`` turned the file's
            error into its own (``torch.save`` raises ``RuntimeError:
            [enforce fail at inline_container.cc] unexpected pos`` on a full
            disk). ``write``'s other exceptions pass through.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as raw:
            f = _Watched(raw)
            try:
                write(f)  # type: ignore[arg-type]  # a file in all that write uses
                f.flush()
                if sync:
                    os.fsync(raw.fileno())
            except Exception as exc:
                with contextlib.suppress(OSError):  # what it still buffers cannot be written
                    raw.close()
                cause = f.error or exc
                if not isinstance(cause, OSError):
                    raise
                raise OSError(cause.errno, cause.strerror, str(path)) from exc
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if not isinstance(exc, OSError) or exc.filename == str(path):
            raise
        # The temporary file could not be opened or renamed: the user's file is ``path``.
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


class _Watched:
    """A file that keeps the first ``OSError`` its writes raised, for ``write_file``."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.raw.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        try:
            self.raw.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> object:
        return getattr(self.raw, name)


def write_meta(stem: str, meta: CheckpointMeta) -> None:
    """Commit a bundle: write the meta that names its files, durably, last.

    Raises:
        OSError: the folder is full, read-only or gone (the meta before stays).
    """
    text = meta.to_json().encode("utf-8")
    write_file(meta_path(stem), lambda f: f.write(text), kind="meta")


def no_meta(stem: str) -> ConfigError:
    """The error for ``resume_from=stem`` where ``stem`` has no meta, saying what
    ``stem`` is instead where that is plain: the meta itself, a folder of bundles,
    another file (a model, a run's ``final_model.pt``)."""
    where, path = meta_path(stem), Path(stem)
    said = f"no checkpoint meta at {where}"
    if stem.endswith(".meta.json") and path.is_file():
        return ConfigError(
            "resume_from",
            f"{said}: {stem!r} is the meta itself; pass its bundle's stem, "
            f"resume_from={stem.removesuffix('.meta.json')!r}",
        )
    if path.is_dir():
        inside = sorted(
            str(p.with_name(p.name.removesuffix(".meta.json"))) for p in path.glob("*.meta.json")
        )
        named = f", e.g. {inside[0]!r}" if inside else " (it holds no STEM.meta.json)"
        return ConfigError(
            "resume_from",
            f"{said}: {stem!r} is a folder; a bundle is a stem, STEM.meta.json and the files it "
            f"names beside it: name the bundle inside it{named}",
        )
    if path.is_file():
        return ConfigError(
            "resume_from",
            f"{said}: {stem!r} is a file, not a bundle's stem (STEM.meta.json and the files it "
            "names); a run's final model is no bundle: it holds the weights only (torch.load "
            "it), and a run resumes from the bundles it saved (save_path, checkpoint_every)",
        )
    return ConfigError("resume_from", said)


def check_unchanged(stem: str, meta: CheckpointMeta, seq: int | None) -> None:
    """``meta``, read at ``stem`` now, is of the save the run was checked at (``seq``).

    Every save has its own number and files, so a bundle that another run
    saved over since names other files and other coverage: starting from it
    would train its samples again, or skip others.

    Raises:
        ConfigError: it is another save.
    """
    if seq is not None and meta.save_seq != seq:
        raise ConfigError(
            "resume_from",
            f"the bundle at {stem} changed after this run checked it (save {seq} then, save "
            f"{meta.save_seq} now): another run saved there; resume again to start from it",
        )


def read_meta(stem: str | None) -> CheckpointMeta | None:
    """The meta at ``stem`` if there is a readable one."""
    if stem is None:
        return None
    try:
        return CheckpointMeta.from_json(meta_path(stem).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ConfigError, or not text
        return None


def next_seq(stem: str, at_least: int) -> int:
    """A save number above ``at_least`` that no file or meta at ``stem`` uses yet."""
    seen = [at_least, *(seq for seq, _ in _save_files(stem))]
    if (meta := read_meta(stem)) is not None:
        seen.append(meta.save_seq)
    return max(seen) + 1


def rename_file(src: Path, dst: Path, *, kind: str) -> SavedFile:
    """Move a file already on disk to ``dst`` durably and describe it for the meta.

    Raises:
        OSError: ``src`` is gone, or the rename failed.
    """
    os.replace(src, dst)
    fsync_dir(dst.parent)
    size, digest = _digest(dst)
    return SavedFile(kind=kind, name=dst.name, size=size, sha256=digest)


def _digest(path: Path) -> tuple[int, str]:
    sha = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def prune(stem: str, keep: set[int]) -> None:
    """Remove the files of saves not in ``keep`` from ``stem``'s folder, whoever
    wrote them: models, optimizer states, outer momenta and the temporary
    files of writes that never finished. ``keep`` must hold the save the meta
    at ``stem`` names. Errors are ignored: a file left behind costs space,
    never correctness."""
    _remove(stem, lambda seq: seq not in keep)


def discard(stem: str, seq: int) -> None:
    """Remove the files of save ``seq`` (one that will never commit) from
    ``stem``'s folder, as ``prune`` does."""
    _remove(stem, lambda other: other == seq)


def _remove(stem: str, doomed: Callable[[int], bool]) -> None:
    for seq, entry in _save_files(stem):
        if doomed(seq):
            with contextlib.suppress(OSError):
                entry.unlink()


def _save_files(stem: str) -> list[tuple[int, Path]]:
    """The files of numbered saves at ``stem`` (``STEM.sN.…``), with their numbers;
    none where its folder cannot be read."""
    base = Path(stem)
    pattern = re.compile(rf"{re.escape(base.name)}\.s(\d+)\..+")
    try:
        entries = list(base.parent.iterdir())
    except OSError:
        return []
    return [
        (int(match.group(1)), entry)
        for entry in entries
        if (match := pattern.fullmatch(entry.name)) is not None
    ]


@dataclass(frozen=True, slots=True)
class BundlePaths:
    """Where a bundle's files are on this host."""

    model: Path
    optim: dict[int, Path]  # rank -> file, for the ranks the bundle has
    outer: Path | None


def locate(stem: str, meta: CheckpointMeta, world_size: int) -> BundlePaths:
    """The files of the bundle at ``stem`` that ``meta`` names."""
    folder = Path(stem).parent
    files = meta.files
    if files is None:  # schema 2 and older: fixed names
        optim = {r: Path(f"{stem}.rank{r}.optim.pt") for r in range(world_size)}
        outer = Path(f"{stem}.outer.npz")
        return BundlePaths(
            model=Path(f"{stem}.model.pt"),
            optim={r: p for r, p in optim.items() if p.exists()},
            outer=outer if outer.exists() else None,
        )
    return BundlePaths(
        model=folder / files.model.name,
        optim={rank: folder / f.name for rank, f in files.optim},
        outer=None if files.outer is None else folder / files.outer.name,
    )


def verify(path: Path, expected: BundleFile, *, what: str) -> None:
    """Refuse a bundle file that is missing, unreadable or not the one its meta names.

    Raises:
        ConfigError: ``resume_from``, naming the file and what is wrong.
    """
    if not path.exists():
        raise ConfigError("resume_from", f"the bundle's {what} {path} is missing")
    try:
        size, digest = _digest(path)
    except OSError as exc:  # a folder in its place, no permission, a failing disk
        raise ConfigError(
            "resume_from", f"cannot read the bundle's {what} {path}: {exc.strerror or exc}"
        ) from None
    if size != expected.size or digest != expected.sha256:
        raise ConfigError(
            "resume_from",
            f"the bundle's {what} {path} is not the file its meta names ({size} bytes, "
            f"sha256 {digest[:12]}…; the meta says {expected.size} bytes, sha256 "
            f"{expected.sha256[:12]}…): it was changed or overwritten since the save",
        )
