"""Evaluating elche's and solo's runs after their clock, as the bench does for every peer.

The peers (torch DDP, torchft) copy rank 0's weights in memory at each epoch
end and evaluate the copies once their clock has stopped; the capacity the
bench divides by trains without evaluating at all. So that elche's clock
holds the same work, its ``eval_fn`` in the bench is ``KeepWeights``: on the
eval role's rank it takes the same in-memory copy of the model it is given
(``baselines.ddp.snapshot``: the epoch's consensus, the model elche would
evaluate), reserves the copy's number (0, 1, 2, ... in the order kept) with
an empty file, and returns the number as the metric, so the run's record
says which copy each epoch's eval is.

The copies reach the disk after the clock: each process that kept one
writes them when its main thread ends (a rank process's exit, after the
run's final average), and ``evaluate_kept`` writes those of its own process
first (``ranks=1`` trains in the bench's process). Then the bench evaluates
them and puts each one's eval where its number stands. A copy that cannot be
written (a full or read-only disk) leaves its number renamed to say why,
``NNNNNN.unwritten-ENOSPC``: a rename needs no room, and the bench's process,
not the rank's, is the one that can tell the user (``evaluate_kept`` raises
the ``OSError`` naming the copy's file). On a read-only disk, which takes no
rename either, the number stays reserved and ``evaluate_kept`` finds the
folder unwritable and says so. Writing each copy
inside the clock instead (a ``torch.save`` on the rank the eval role holds,
usually the fastest) held that rank 3-8 ms an epoch on digits-cnn in a loaded
run, where DDP's in-memory copy costs ~0.1 ms: the same work in every clock
is the point, not a speed-up (eight runs each way did not show it in the
wall through this machine's noise). The evaluation itself, which a user's
``eval_fn`` would spend in the clock, is out of every system's wall alike.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elche._files import check_writable
from elche.core.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["KeepWeights", "evaluate_kept", "keeping"]

SUFFIX = ".kept.pt"
RESERVED = ".reserved"  # a copy's number, taken in the clock; its weights come later
UNWRITTEN = ".unwritten-"  # + the errno's name: a number whose weights could not be written


@dataclass(frozen=True, slots=True)
class KeepWeights:
    """An ``eval_fn`` that keeps a copy of the weights for ``directory`` and evaluates nothing."""

    directory: str

    def __call__(self, model: Any, dataset: Any) -> float:
        """Keep an in-memory copy of ``model``'s weights; returns the copy's number."""
        from elche.baselines.ddp import snapshot

        del dataset
        state = snapshot(model)
        reserved = _reserve(Path(self.directory))
        _HELD.add(reserved, state)
        return float(reserved.name.removesuffix(RESERVED))


def _reserve(directory: Path) -> Path:
    """The next copy's number, as an empty file made exclusively (one eval at a time)."""
    number = sum(1 for _ in directory.glob(f"*{SUFFIX}"))
    number += sum(1 for _ in directory.glob(f"*{RESERVED}"))
    number += sum(1 for _ in directory.glob(f"*{UNWRITTEN}*"))
    while True:
        path = directory / f"{number:06d}{RESERVED}"
        try:
            path.open("x").close()
        except FileExistsError:
            number += 1
            continue
        return path


class _Held:
    """This process's copies not yet written, and the thread that writes them when it exits.

    The thread is not a daemon: the interpreter, and a ``multiprocessing``
    child alike, joins it before the process exits, once the main thread is
    done; it waits for that, then writes. A forked child starts with none:
    the parent's copies are the parent's to write.
    """

    def __init__(self) -> None:
        self.forget()
        os.register_at_fork(after_in_child=self.forget)

    def forget(self) -> None:
        """Hold nothing (a fresh process's state; a forked child's lock may be held)."""
        self.copies: list[tuple[Path, dict[str, Any]]] = []  # (its reserved file, the weights)
        self.lock = threading.Lock()
        self.writer: threading.Thread | None = None

    def add(self, reserved: Path, state: dict[str, Any]) -> None:
        with self.lock:
            self.copies.append((reserved, state))
            if self.writer is None or not self.writer.is_alive():
                self.writer = threading.Thread(target=self._write_at_exit, name="elche-bench-kept")
                self.writer.start()

    def _write_at_exit(self) -> None:
        threading.main_thread().join()
        self.write()

    def take(self, directory: Path | None = None) -> list[tuple[Path, dict[str, Any]]]:
        """The copies held for ``directory`` (every one with ``None``), no longer held."""
        taken: list[tuple[Path, dict[str, Any]]] = []
        kept: list[tuple[Path, dict[str, Any]]] = []
        with self.lock:
            for copy in self.copies:
                (taken if directory is None or copy[0].parent == directory else kept).append(copy)
            self.copies = kept
        return taken

    def write(self, directory: Path | None = None) -> None:
        """Write every copy held for ``directory`` (all with ``None``) to its number.

        A copy that cannot be written is dropped, its number renamed to
        ``NNNNNN.unwritten-ERRNO`` (kept as ``.reserved`` if even that fails)
        and no partial file left; the others are still tried.
        """
        import torch

        from elche.runtime.bundle import write_whole

        for reserved, state in self.take(directory):
            try:
                write_whole(_kept(reserved), functools.partial(torch.save, state), sync=False)
            except OSError as exc:
                name = errno.errorcode.get(exc.errno or 0, "EIO")
                with contextlib.suppress(OSError):  # evaluate_kept names the number either way
                    reserved.rename(reserved.with_suffix(UNWRITTEN + name))
                continue
            reserved.unlink()


@contextlib.contextmanager
def keeping(directory: Path) -> Iterator[Path]:
    """``directory`` made for one run's kept copies.

    A run that ends without ``evaluate_kept`` (it failed, or was stopped)
    leaves the copies this process kept for it unwritten: they are dropped
    when the run ends, not written at the process's exit into a run that is
    over, nor by the next run's ``evaluate_kept``.
    """
    directory.mkdir()
    try:
        yield directory
    finally:
        _HELD.take(directory)


def _kept(reserved: Path) -> Path:
    """The file a reserved number's weights go to (``NNNNNN.kept.pt``)."""
    return reserved.with_name(reserved.name.removesuffix(RESERVED) + SUFFIX)


_HELD = _Held()


def evaluate_kept(
    workload: str, directory: Path, eval_dataset: Any, *, final: dict[str, Any]
) -> tuple[list[float], float]:
    """The eval of every copy ``KeepWeights`` kept under ``directory``, by number, and ``final``'s.

    ``final`` is the run's final model; when it equals the last copy kept
    (the last epoch's consensus, as it usually is) it is not evaluated twice.

    Raises:
        OSError: a copy could not be written (a full or read-only disk),
            naming its file and the reason, as ``open`` would.
        RuntimeError: a copy's number was taken but its weights never
            written (its process died before its exit).
    """
    import torch

    from elche.baselines.ddp import eval_snapshots

    _HELD.write(directory)  # this process's own copies (``ranks=1`` trains here)
    failed = sorted(directory.glob(f"*{UNWRITTEN}*"))
    if failed:
        reserved = failed[0].with_suffix(RESERVED)
        code = getattr(errno, failed[0].suffix.removeprefix(UNWRITTEN), errno.EIO)
        raise OSError(code, os.strerror(code), str(_kept(reserved)))
    unwritten = sorted(p.name for p in directory.glob(f"*{RESERVED}"))
    if unwritten:
        raise RuntimeError(f"kept copies never written ({_why_unmarked(directory)}): {unwritten}")
    paths = sorted(directory.glob(f"*{SUFFIX}"))
    states = [torch.load(path, map_location="cpu", weights_only=True) for path in paths]
    *kept, last = eval_snapshots(workload, [*states, final], eval_dataset)
    return kept, last


def _why_unmarked(directory: Path) -> str:
    """Why copies were left neither written nor marked: a disk that takes no rename
    either (read-only) says so; otherwise their process died before its exit."""
    try:
        check_writable(directory, "kept")
    except ConfigError as exc:
        return str(exc).removeprefix("kept: ")
    return "their process died"
