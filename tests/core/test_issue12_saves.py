"""Issue 12, "saves that commit": the core's half (``elche.core.saves``).

Each test is named after the item it pins down and failed before its fix.
"""

from __future__ import annotations

from elche.core import messages as m
from elche.core.checkpoint import SaveReason
from elche.core.commands import Command, Finish, WriteMeta
from elche.core.coordinator import RunState
from elche.core.events import RankLost, TimerFired
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


ENOSPC = "OSError: [Errno 28] No space left on device"


def unwritten_final(stem: str | None = "/bundles/run") -> tuple[Harness, list[Command]]:
    """Two ranks trained to the end; neither could write the final model."""
    h = Harness(world_size=2, save_path=stem, epochs=2)
    h.form()
    h.run_to_end(final=False)
    final = h.core.saves.rounds[SaveKind.FINAL]
    h.send(0, state_saved(final, 0, error=ENOSPC))
    return h, h.send(1, state_saved(final, 1, error=ENOSPC))


def test_a_final_model_nobody_could_write_is_kept_as_a_bundle_with_nothing_left_to_train() -> None:
    # It used to fail the run, and the trained model went with the ranks' processes.
    h, out = unwritten_final()
    assert not of(out, Finish)
    assert h.core.state is RunState.SAVING
    (order,) = messages(out, m.ShutdownWithSave)
    assert order.reason == SaveReason.FINAL_MODEL_UNWRITTEN.value
    assert order.writer == 0
    out = h.answer_saves()
    (write,) = of(out, WriteMeta)
    meta = write.meta  # type: ignore[attr-defined]
    assert meta.epoch == meta.epochs == 2  # nothing left: resuming writes the final model
    assert not meta.coverage
    assert meta.reason is SaveReason.FINAL_MODEL_UNWRITTEN
    (finish,) = of(out, Finish)
    assert finish.outcome == "saved_and_shutdown"  # type: ignore[attr-defined]
    assert "final model could not be written" in finish.reason  # type: ignore[attr-defined]
    assert "No space left" in finish.reason  # type: ignore[attr-defined]
    assert messages(out, m.Shutdown) == [m.Shutdown(writer=-1, saved="final_model_unwritten")]


def test_a_final_model_whose_bundle_cannot_be_written_either_fails_naming_both() -> None:
    h, out = unwritten_final()
    save = h.core.saves.rounds[SaveKind.SHUTDOWN]
    h.send(0, state_saved(save, 0, error=ENOSPC))
    out = h.send(1, state_saved(save, 1, error="PermissionError: [Errno 13] Permission denied"))
    (finish,) = of(out, Finish)
    assert finish.outcome == "failed"  # type: ignore[attr-defined]
    reason = finish.reason  # type: ignore[attr-defined]
    assert "final model could not be written (rank 0: OSError" in reason
    assert "the bundle could not be written (rank 0: OSError" in reason
    assert "Permission denied" in reason
    # The held ranks are told the run failed, not that it is saved.
    assert messages(out, m.Shutdown) == [m.Shutdown(writer=-1, failure=reason)]


def test_a_final_model_whose_writers_never_answered_fails_without_a_second_wait() -> None:
    h = Harness(world_size=2, save_path="/bundles/run")
    h.form()
    h.run_to_end(final=False)
    out: list[Command] = []
    for _ in range(2):  # rank 0 is silent past its deadline, then rank 1, asked instead
        if SaveKind.FINAL not in h.core.saves:
            break
        deadline = h.core.saves.rounds[SaveKind.FINAL].deadline_s
        while h.now < deadline + 1:  # both ranks beat meanwhile: alive, but not writing
            h.now += 1.0
            out += h.send(0, m.Heartbeat()) + h.send(1, m.Heartbeat())
            out += h.feed(TimerFired())
    assert SaveKind.SHUTDOWN not in h.core.saves  # a second wait would be as silent
    (finish,) = of(out, Finish)
    assert finish.outcome == "failed"  # type: ignore[attr-defined]
    assert "the writer never answered" in finish.reason  # type: ignore[attr-defined]


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
