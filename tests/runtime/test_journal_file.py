"""The journal on disk: appended records read back; a torn tail is ignored; compaction."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from elche.core.coordinator import Coordinator
from elche.core.errors import ConfigError
from elche.core.journal import JournalRecord, record_of
from elche.runtime.journal_file import JournalWriter, read_journal
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
    restored = Coordinator.restore(Harness(world_size=2, epochs=2, num_samples=640).cfg, first)
    assert restored.rounds_done == first.rounds_done and restored.coordinator_restarts == 1


def test_compaction_leaves_only_the_new_record(tmp_path: Path) -> None:
    path = tmp_path / "journal.bin"
    record = a_record()
    writer = JournalWriter(path)
    for _ in range(3):
        writer.append(record)
    size = path.stat().st_size
    writer.append(record, compact=True)
    writer.close()
    assert path.stat().st_size * 3 == size and read_journal(path) == record


def test_an_unreadable_journal_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="journal"):
        read_journal(tmp_path / "journal.bin")
    (tmp_path / "journal.bin").write_bytes(b"\x00\x00\x00\x05garbage")
    with pytest.raises(ConfigError, match="no whole record"):
        read_journal(tmp_path / "journal.bin")
