"""The journal on disk: appended records read back; a torn tail is ignored; compaction."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from elche.core.coordinator import Coordinator
from elche.core.errors import ConfigError
from elche.core.journal import JournalRecord, record_of
from elche.runtime.journal_file import JournalWriter, _frame, read_journal
from tests.core.harness import Harness


def a_record() -> JournalRecord:
    h = Harness(world_size=2, epochs=2, num_samples=640)
    h.form()
    h.run_to_end(until=lambda: h.core.rounds_done >= 1)
    return record_of(h.core)


def test_records_read_back_whole_and_a_torn_tail_leaves_the_one_before(tmp_path: Path) -> None:
    path = tmp_path / "journal.bin"
    first = a_record()
    second = dataclasses.replace(first, rounds_done=first.rounds_done + 1)
    writer = JournalWriter(path)
    writer.append(first, compact=True)
    writer.append(second)
    writer.close()
    assert read_journal(path) == second
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])  # the coordinator died while appending
    assert read_journal(path) == first
    restored = Coordinator.restore(
        Harness(world_size=2, epochs=2, num_samples=640).cfg, first, last_save=0
    )
    assert restored.rounds_done == first.rounds_done and restored.coordinator_restarts == 1


def test_compaction_past_the_size_leaves_only_the_new_record(tmp_path: Path) -> None:
    path = tmp_path / "journal.bin"
    record = a_record()
    one = len(_frame(record))
    writer = JournalWriter(path, compact_bytes=3 * one)
    for _ in range(3):
        writer.append(record)
    assert path.stat().st_size == 3 * one
    writer.append(record, compact=True)
    assert path.stat().st_size == one and read_journal(path) == record
    writer.close()


def test_a_compacting_record_below_the_size_is_appended(tmp_path: Path) -> None:
    path = tmp_path / "journal.bin"
    record = a_record()
    newer = dataclasses.replace(record, rounds_done=record.rounds_done + 1)
    one = len(_frame(record))
    writer = JournalWriter(path, compact_bytes=3 * one)
    writer.append(record)
    writer.append(newer, compact=True)  # a new epoch opened, the file still small
    assert path.stat().st_size == one + len(_frame(newer)) and read_journal(path) == newer
    writer.close()
    again = JournalWriter(path)  # a successor's writer starts its own file
    again.append(record)
    assert path.stat().st_size == one and read_journal(path) == record
    again.close()


def test_an_unreadable_journal_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="journal"):
        read_journal(tmp_path / "journal.bin")
    (tmp_path / "journal.bin").write_bytes(b"\x00\x00\x00\x05garbage")
    with pytest.raises(ConfigError, match="no whole record"):
        read_journal(tmp_path / "journal.bin")


def test_an_appended_record_is_in_the_file_before_it_is_synced(tmp_path: Path) -> None:
    # What a successor started after a SIGKILL reads: the OS's copy, no fsync needed.
    path = tmp_path / "journal.bin"
    first = a_record()
    second = dataclasses.replace(first, rounds_done=first.rounds_done + 1)
    writer = JournalWriter(path)
    writer.append(first)  # the first append compacts: a file of its own
    assert read_journal(path) == first
    writer.append(second)
    assert read_journal(path) == second
    writer.sync()
    writer.sync()  # nothing new: nothing to do
    writer.close()
    assert read_journal(path) == second
    assert [p.name for p in tmp_path.iterdir()] == ["journal.bin"]  # no temporary file left


def test_a_compaction_that_fails_leaves_the_old_journal_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elche.runtime import journal_file

    path = tmp_path / "journal.bin"
    record = a_record()
    writer = JournalWriter(path, compact_bytes=1)  # every compacting record rewrites
    writer.append(record)

    def refuse(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal_file.os, "replace", refuse)
    newer = dataclasses.replace(record, rounds_done=record.rounds_done + 5)
    with pytest.raises(OSError, match="No space"):
        writer.append(newer, compact=True)
    assert read_journal(path) == record
    assert [p.name for p in tmp_path.iterdir()] == ["journal.bin"]
