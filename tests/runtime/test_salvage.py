"""The launcher commits what the ranks kept when their coordinator is gone for good
(``elche.runtime.salvage``): files under a new save's names, the meta last, the summary."""

from __future__ import annotations

import json
from pathlib import Path

from elche.core.checkpoint import CheckpointMeta, SaveReason
from elche.runtime import bundle
from elche.runtime.host import RESUME_META
from elche.runtime.journal_file import JOURNAL_FILE, JournalWriter
from elche.runtime.salvage import keep_local_state, local_state_file, salvage_run, start_round
from tests.core.harness import Harness, config
from tests.core.test_checkpoint import BASE
from tests.core.test_journal import records


def test_the_ranks_state_becomes_the_next_save_and_the_summary_says_saved(
    tmp_path: Path,
) -> None:
    cfg = config(world_size=2, epochs=2, num_samples=1280, save_path=str(tmp_path / "b" / "run"),
                 join_slots=8)  # fmt: skip
    h = Harness(cfg)
    h.form()
    h.run_to_end(until=lambda: h.core.rounds_done >= 3)
    JournalWriter(tmp_path / JOURNAL_FILE).append(records(h)[-1], compact=True)
    stem = str(cfg.save_path)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "run.s4.rank1.optim.pt").write_bytes(b"a save the coordinator began")
    for rank in (0, 1):
        kept = keep_local_state(
            tmp_path, stem, rank, consensus_round=h.last_round[rank], held=h.held(rank),
            write_model=lambda f, r=rank: f.write(b"model of rank %d" % r),
            write_optim=lambda f, r=rank: f.write(b"optim of rank %d" % r),
        )  # fmt: skip
        assert kept == f"{stem}.rank{rank}.local.model.pt"
        assert json.loads(local_state_file(tmp_path, rank).read_text())["consensus_round"] == 3

    assert salvage_run(cfg, tmp_path) == stem
    meta = CheckpointMeta.from_json(bundle.meta_path(stem).read_text(encoding="utf-8"))
    assert meta.reason is SaveReason.COORDINATOR_LOST and meta.save_seq == 5  # past s4
    paths = bundle.locate(stem, meta, 2)
    assert paths.model.read_bytes() == b"model of rank 0"  # the lowest rank's consensus
    assert {r: p.read_bytes() for r, p in paths.optim.items()} == {
        0: b"optim of rank 0",
        1: b"optim of rank 1",
    }
    assert meta.files is not None
    bundle.verify(paths.model, meta.files.model, what="model")
    assert sorted(p.name for p in (tmp_path / "b").glob("*.local.*")) == []
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["outcome"], summary["reason"]) == ("saved_and_shutdown", "coordinator_lost")
    assert summary["syncs"] == 3
    # The journal counts every join slot; the summary, as a coordinator's, the ranks used.
    assert len(h.core.work.samples_committed) == 10
    assert summary["samples_per_rank"] == h.core.work.samples_committed[:2]


def test_without_a_journal_nothing_is_committed_and_the_summary_says_why(tmp_path: Path) -> None:
    cfg = config(world_size=2, save_path=str(tmp_path / "run"))
    assert salvage_run(cfg, tmp_path) is None
    assert not bundle.meta_path(str(cfg.save_path)).exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["outcome"] == "failed"
    assert summary["reason"].startswith("coordinator_lost: it was lost before the run began")
    assert ".local" not in summary["reason"]  # no rank kept a state: none is named
    Path(f"{cfg.save_path}.rank1.local.model.pt").write_bytes(b"kept")
    assert salvage_run(cfg, tmp_path) is None
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert f"{cfg.save_path}.rank<R>.local" in summary["reason"]  # where what they kept is


def test_a_salvage_starts_at_the_resumed_bundles_round_from_the_runs_own_copy(
    tmp_path: Path,
) -> None:
    # A run resumed from a bundle keeps a copy of its meta in the run dir; a salvage
    # (the coordinator lost for good) reads the round it started at from there. It
    # read the bundle's own meta, which may have gone since (moved, pruned, a later
    # run's save): the launcher died in a FileNotFoundError, nothing committed.
    assert start_round(tmp_path) == 0  # not a resumed run
    (tmp_path / RESUME_META).write_text(BASE.to_json(), encoding="utf-8")
    assert start_round(tmp_path) == BASE.rounds_done  # and no bundle anywhere
