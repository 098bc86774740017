"""What ``metrics_fn`` and ``eval_result_fn`` get, numbered alike: from a timeline, in-process."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

import elche
from elche.core import timeline as tl
from elche.monitor.progress import Progress
from elche.runtime.epochs import EpochLog, with_bundles
from elche.runtime.launch import on_record
from elche.runtime.plan import Hooks
from tests.runtime import byo_fns as fx


def _window(rank: int, epoch: int, samples: int, span_s: float) -> tl.RankWindow:
    return tl.RankWindow(
        rank=rank, epoch=epoch, span_s=span_s, batches=samples // 10, samples=samples, loss=1.0,
        samples_per_s=samples / span_s, share=0.0, compute_ms_per_batch=1.0, idle_pct=0.0,
    )  # fmt: skip


def test_each_epoch_entry_has_lr_progress_and_every_ranks_rate_and_share() -> None:
    seen: list[object] = []
    hooks = Hooks(
        eval_result_fn=lambda e, m: seen.append(("eval", e, m)),
        metrics_fn=lambda entry: seen.append(("metrics", entry["epoch"], entry)),
    )
    log = EpochLog(epochs=2, num_samples=100, reference_batch=10)
    quiet = Progress(2, enabled=False)
    records = [
        _window(0, 0, 60, 1.0), _window(1, 0, 40, 2.0), _window(0, 1, 50, 1.0),
        tl.EpochEnd(epoch=0, loss=0.5, rounds_done=3, lr=0.01),
        tl.BundleWritten(stem="/b/run", seq=1, reason="checkpoint"),
        tl.Eval(epoch=1, metric=0.9, rank=0),  # after 1 epoch: epoch 0
    ]  # fmt: skip
    for record in records:
        on_record(record, log, hooks, quiet)
    entry = log[0]
    assert entry == {
        "epoch": 0, "loss": 0.5, "syncs": 3, "lr": 0.01, "eval": 0.9,
        "progress": {"samples": 100, "step": 10, "fraction": 0.5},
        "per_rank": [
            {"rank": 0, "samples": 60, "loss": 1.0, "samples_per_s": 60.0, "share": 0.6},
            {"rank": 1, "samples": 40, "loss": 1.0, "samples_per_s": 20.0, "share": 0.4},
        ],
    }  # fmt: skip
    assert [(kind, epoch) for kind, epoch, _ in seen] == [("metrics", 0), ("eval", 0)]  # type: ignore[misc]
    summary: dict[str, object] = {"bundle": None}
    with_bundles(summary, log)
    assert summary == {
        "bundle": "/b/run",
        "bundles": [{"stem": "/b/run", "seq": 1, "reason": "checkpoint"}],
    }


def test_one_rank_numbers_epochs_alike_and_reports_the_same_keys() -> None:
    x = torch.randn(64, 4)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    metrics: list[dict[str, object]] = []
    evals: list[int] = []
    result = elche.train(
        fx.linear_model, fx.linear_optimizer, fx.mse_step, data, batch_size=16, epochs=2,
        ranks=1, progress=False, eval_fn=fx.linear_eval, eval_dataset=data,
        metrics_fn=metrics.append, eval_result_fn=lambda e, m: evals.append(e),
    )  # fmt: skip
    assert [m["epoch"] for m in metrics] == evals == [0, 1]
    assert {"lr", "progress", "per_rank", "eval"} <= set(metrics[-1])
    assert metrics[-1]["progress"] == {"samples": 128, "step": 8, "fraction": 1.0}
    assert result.summary["eval"] == result.summary["eval_accuracy"] == metrics[-1]["eval"]
    assert result.summary["bundles"] == []
