"""The progress display: a rich bar over epochs on stderr, fed by timeline records."""

from __future__ import annotations

from typing import Any

from elche.core import timeline as tl

__all__ = ["Progress"]


class Progress:
    """A progress bar over epochs, on stderr; does nothing when not ``enabled``.

    Args:
        epochs: the planned number of epochs (the bar's total).
        enabled: draw it (False for ``--no-progress``, JSON output, non-zero ranks).
    """

    def __init__(self, epochs: int, *, enabled: bool) -> None:
        self.bar: Any = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("[bold]elche[/bold] {task.description}"),
            BarColumn(),
            TextColumn("epoch {task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self.task = self.bar.add_task("training", total=epochs)
        self.bar.start()

    def show(self, event: tl.TimelineEvent) -> None:
        """Reflect one timeline record: an epoch's end and loss, a rank lost."""
        if self.bar is None:
            return
        match event:
            case tl.EpochEnd(epoch=epoch, loss=loss):
                text = f"loss {loss:.4f}" if loss is not None else "training"
                self.bar.update(self.task, completed=epoch + 1, description=text)
            case tl.RankLost(rank=rank):
                self.bar.update(self.task, description=f"rank {rank} lost")
            case _:
                pass

    def describe(self, text: str) -> None:
        """Say ``text`` beside the bar (until the next epoch's end says its own)."""
        if self.bar is not None:
            self.bar.update(self.task, description=text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
