"""A one-rank run's bundles: its checkpoints, and the bundle a stop leaves.

A run of one rank has no coordinator to commit its saves, so it writes them
itself, as a coordinator and its ranks together would (``elche.runtime.bundle``):
the model and rank 0's optimizer state under the save's numbered names, then
the meta that names both with their sizes and hashes, last; once the meta is
on disk the files of the save it replaced go. Before a save, the files of
saves that never committed go (``bundle.prune``). A bundle of one rank resumes a
run of one rank or of several, and one of several ranks resumes one rank.

Where: ``save_path``, or ``RUN_DIR/checkpoint`` when the run names none (as a
run of several ranks does). When: every ``checkpoint_every`` epochs
(``SaveReason.CHECKPOINT``), and when SIGINT, SIGTERM or SIGHUP stops the run
(``SaveReason.GRACEFUL_SHUTDOWN``), between two steps: the model then holds
every step trained, and the meta lists the rest of the epoch as still to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from elche.core.checkpoint import BundleFile, BundleFiles, CheckpointMeta, EpochCoverage, SaveReason
from elche.core.config import CoordinatorConfig
from elche.core.dispatch import Span, coalesce
from elche.runtime import bundle

__all__ = ["SoloSaves"]


class SoloSaves:
    """Writes the bundles of a one-rank run at ``stem``.

    Args:
        stem: the bundle's stem.
        config: the run's configuration.
        resumed: the meta the run resumed from, if any (its steps, rounds and
            save numbers go on from there).
    """

    def __init__(
        self, stem: str, config: CoordinatorConfig, resumed: CheckpointMeta | None
    ) -> None:
        self.stem = stem
        self.config = config
        self._committed = bundle.read_meta(stem)  # its files go once a newer meta is written
        self._last_seq = max(
            self._committed.save_seq if self._committed is not None else 0,
            resumed.save_seq if resumed is not None else 0,
        )
        self._base_step = resumed.global_step if resumed is not None else 0
        self._rounds = resumed.rounds_done if resumed is not None else 0

    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        reason: SaveReason,
        epoch: int,
        holes: Mapping[int, Sequence[Span]],
        steps: int,
    ) -> int:
        """Write one bundle; the model holds every sample before ``epoch`` but ``holes``.

        Args:
            epoch: the first epoch not finished.
            holes: per epoch from ``epoch`` on, the samples still to train where
                not the whole epoch.
            steps: optimizer steps this run took so far.

        Returns:
            The save's number.

        Raises:
            OSError, RuntimeError: a file could not be written (``OSError``,
                naming it: ``bundle.write_file``), or ``torch.save`` failed on
                its own; the bundle committed before stays, and this save's
                files are removed.
        """
        seq = self._last_seq = bundle.next_seq(self.stem, self._last_seq)
        folder = Path(self.stem).parent
        written: list[Path] = []
        try:
            folder.mkdir(parents=True, exist_ok=True)
            # Files of saves that never committed go first (a writer killed mid-write).
            committed = self._committed.save_seq if self._committed is not None else 0
            bundle.prune(self.stem, {seq, committed})
            model_file = self._write(folder / bundle.model_name(self.stem, seq), model, written)
            optim_file = self._write(
                folder / bundle.optim_name(self.stem, seq, 0), optimizer, written
            )
            files = BundleFiles(model=model_file, optim=((0, optim_file),))
            meta = CheckpointMeta(
                epoch=epoch, global_step=self._base_step + steps, rounds_done=self._rounds,
                world_size=1, reason=reason, seed=self.config.seed,
                batch_size=self.config.batch_size, epochs=self.config.epochs,
                coverage=_coverage(holes, epoch, self.config), mode=self.config.mode.value,
                save_seq=seq, files=files,
                order=self.config.order,
            )  # fmt: skip
            bundle.write_meta(self.stem, meta)
        except BaseException:
            for path in written:
                with contextlib.suppress(OSError):
                    path.unlink()
            raise
        old, self._committed = self._committed, meta
        if old is not None and old.files is not None:
            for name in old.files.names() - files.names():
                with contextlib.suppress(OSError):
                    (folder / name).unlink()
        return seq

    @staticmethod
    def _write(
        path: Path, owner: nn.Module | torch.optim.Optimizer, written: list[Path]
    ) -> BundleFile:
        written.append(path)
        saved = bundle.write_file(path, lambda f: torch.save(owner.state_dict(), f), kind="file")
        return BundleFile.from_saved(saved)


def _coverage(
    holes: Mapping[int, Sequence[Span]], epoch: int, config: CoordinatorConfig
) -> tuple[EpochCoverage, ...]:
    return tuple(
        EpochCoverage(epoch=e, total_samples=config.num_samples, uncovered=tuple(coalesce(spans)))
        for e, spans in sorted(holes.items())
        if epoch <= e < config.epochs
    )
