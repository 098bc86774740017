"""Issue 12, "saves that commit": the core's half (``elche.core.saves``).

Each test is named after the item it pins down and failed before its fix.
"""

from __future__ import annotations

from elche.core import messages as m
from elche.core.commands import Finish, WriteMeta
from elche.core.coordinator import RunState
from elche.core.events import RankLost
from elche.core.rank import SaveKind
from tests.core.harness import Harness, messages, of, state_saved


def test_issue12_item07_the_run_completes_only_once_the_final_model_is_on_disk() -> None:
    h = Harness(world_size=3, num_samples=960)
    h.form()
    out = h.run_to_end(final=False)
    assert h.core.state is RunState.CLOSING
    assert messages(out, m.Shutdown) == [m.Shutdown(writer=0, seq=1)]
    assert not of(out, Finish)
    out = h.feed(RankLost(rank=0, reason="process killed"))  # the writer dies writing
    assert not of(out, Finish)
    assert messages(out, m.Shutdown) == [m.Shutdown(writer=1, seq=1)]
    out = h.send(1, state_saved(h.core.saves.rounds[SaveKind.FINAL], 1))
    assert of(out, Finish) == [Finish(outcome="completed")]
    assert messages(out, m.Shutdown) == [m.Shutdown(writer=-1)]  # the held ranks exit


def test_issue12_item07_a_final_model_nobody_could_write_fails_the_run() -> None:
    h = Harness(world_size=2)
    h.form()
    h.run_to_end(final=False)
    final = h.core.saves.rounds[SaveKind.FINAL]
    h.send(0, state_saved(final, 0, error="OSError: [Errno 28] No space left on device"))
    out = h.send(1, state_saved(final, 1, error="OSError: [Errno 28] No space left on device"))
    (finish,) = of(out, Finish)
    assert finish.outcome == "failed"  # type: ignore[attr-defined]
    assert "final model could not be written" in finish.reason  # type: ignore[attr-defined]
    assert "No space left" in finish.reason  # type: ignore[attr-defined]


def test_issue12_item08_a_dead_bundle_writer_is_replaced_and_its_answer_counts_only_as_writer() -> (
    None
):
    h = Harness(world_size=3, num_samples=960, max_failures=1, save_path="/b/run")
    h.form()
    h.feed(RankLost(rank=2, reason="exit 1"))
    save = h.core.saves.rounds[SaveKind.SHUTDOWN]
    out = h.feed(RankLost(rank=0, reason="killed while saving"))  # the writer
    assert messages(out, m.ShutdownWithSave) == [
        m.ShutdownWithSave(reason="max_failure_exceeded", writer=1, seq=1)
    ]
    # Rank 1 answered the first order, as a non-writer, before it got the new one.
    out = h.send(1, m.StateSaved(seq=1, files=state_saved(save, 1).files[:1], writer=False))
    assert not of(out, WriteMeta) and not of(out, Finish)
    out = h.send(1, state_saved(save, 1))
    (write,) = of(out, WriteMeta)
    assert write.meta.files.model.name == "run.s1.1.model"  # type: ignore[attr-defined]
    assert of(out, Finish) == [Finish(outcome="saved_and_shutdown", reason="max_failure_exceeded")]


def test_issue12_item08_a_stop_whose_bundle_nobody_wrote_is_not_announced_as_saved() -> None:
    h = Harness(world_size=2, max_failures=1, save_path="/b/run")
    h.form()
    h.feed(RankLost(rank=1, reason="exit 1"))
    out = h.feed(RankLost(rank=0, reason="killed while saving"))
    assert not of(out, WriteMeta)
    (finish,) = of(out, Finish)
    assert finish.outcome == "failed"  # type: ignore[attr-defined]


def test_issue12_item09_a_checkpoints_meta_waits_for_every_ranks_files() -> None:
    h = Harness(world_size=3, num_samples=960, checkpoint_every=1, save_path="/b/run")
    h.form()
    out = h.run_to_end(periodic=False, final=False)
    assert messages(out, m.SaveState) == [m.SaveState(seq=1, writer=0, keep=0)]
    assert h.core.state is RunState.FINISHING  # the final save waits for the checkpoint
    assert not of(out, WriteMeta)  # nothing is claimed before the files are on disk
    save = h.core.saves.rounds[SaveKind.CHECKPOINT]
    for rank in (0, 1):
        assert not of(h.send(rank, state_saved(save, rank)), WriteMeta)
    (write,) = of(h.send(2, state_saved(save, 2)), WriteMeta)
    assert [rank for rank, _ in write.meta.files.optim] == [0, 1, 2]  # type: ignore[attr-defined]
    assert write.meta.save_seq == 1  # type: ignore[attr-defined]
