"""Evaluating elche's and solo's runs after their clock, as the bench does for every peer.

The peers (torch DDP, torchft) copy rank 0's weights at each epoch end and
evaluate the copies once their clock has stopped; the capacity the bench
divides by trains without evaluating at all. So that elche's clock holds
the same work, its ``eval_fn`` in the bench is ``KeepWeights``: on the eval
role's rank it writes a copy of the model it is given (the epoch's
consensus, the model elche would evaluate) to a directory and returns the
copy's number (0, 1, 2, ... in the order kept) as the metric, so the run's
record says which copy each epoch's eval is; after the run the bench
evaluates the copies (``evaluate_kept``) and puts each one's eval where its
number stands. What a copy costs inside the clock (a ``torch.save`` of the
weights, a few ms for tiny-gpt's 4 MB) is what the peers' in-memory copy
costs them; the evaluation itself, which a user's ``eval_fn`` would spend
in the clock, is out of every system's wall alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["KeepWeights", "evaluate_kept"]

SUFFIX = ".kept.pt"


@dataclass(frozen=True, slots=True)
class KeepWeights:
    """An ``eval_fn`` that keeps a copy of the weights under ``directory`` and evaluates nothing."""

    directory: str

    def __call__(self, model: Any, dataset: Any) -> float:
        """Keep a copy of ``model``'s weights; returns the copy's number."""
        import torch

        from elche.baselines.ddp import snapshot

        del dataset
        directory = Path(self.directory)
        number = len(list(directory.glob(f"*{SUFFIX}")))  # one eval at a time, in the run
        tmp = directory / f"{number:06d}.tmp"
        torch.save(snapshot(model), tmp)
        tmp.rename(directory / f"{number:06d}{SUFFIX}")
        return float(number)


def evaluate_kept(
    workload: str, directory: Path, eval_dataset: Any, *, final: dict[str, Any]
) -> tuple[list[float], float]:
    """The eval of every copy ``KeepWeights`` kept under ``directory``, by number, and ``final``'s.

    ``final`` is the run's final model; when it equals the last copy kept
    (the last epoch's consensus, as it usually is) it is not evaluated twice.
    """
    import torch

    from elche.baselines.ddp import eval_snapshots

    paths = sorted(directory.glob(f"*{SUFFIX}"))
    states = [torch.load(path, map_location="cpu", weights_only=True) for path in paths]
    *kept, last = eval_snapshots(workload, [*states, final], eval_dataset)
    return kept, last
