"""The journal on disk: the coordinator's records, appended, then fsynced.

Format: a sequence of frames, each a 4-byte big-endian length, a 4-byte
CRC-32 of the payload, and the payload (one ``JournalRecord``,
msgpack-encoded by msgspec). A compacting record (the coordinator's first,
and one whose open epochs changed) replaces the file once the file holds
``COMPACT_BYTES`` or more: it is written to a temporary file and renamed
over the journal, so a crash leaves the old journal or the new one. Below
that it is appended like any other record (the reader takes the last whole
record: the outcome is the same, and creating and renaming a file cost the
coordinator ~1 ms at every epoch end, between the round and the next
epoch's work). A torn last frame (the coordinator died while appending) is
ignored by the reader; the record before it stands.

Two steps, because the journal guards against the loss of the coordinator
*process*: its successor is started by the process that watched it, on the
same host, from the same file (``runtime.supervision.restart_coordinator``).
``append`` hands the record to the operating system (written and flushed:
a coordinator killed right after finds it in the file), and the coordinator
sends the new window's work after it; ``sync`` puts it on disk
(``os.fsync``, and the folder's after a compaction) once that work is out,
off the ranks' restart, and reports the errors a file system defers to it
(a full disk under some of them).
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import BinaryIO

import msgspec

from elche.core.errors import ConfigError
from elche.core.journal import JournalRecord
from elche.runtime.bundle import fsync_dir

__all__ = ["COMPACT_BYTES", "JOURNAL_FILE", "JournalWriter", "read_journal"]

JOURNAL_FILE = "journal.bin"
COMPACT_BYTES = 1 << 20  # ~2,700 records of a 3-rank run; a restart reads it in milliseconds
_HEADER = struct.Struct(">II")  # payload length, CRC-32
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(JournalRecord)


def _frame(record: JournalRecord) -> bytes:
    payload = _ENCODER.encode(record)
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


class JournalWriter:
    """Appends records to ``path``: in the file when ``append`` returns, on disk after ``sync``."""

    def __init__(self, path: Path, *, compact_bytes: int = COMPACT_BYTES) -> None:
        self.path = path
        self.compact_bytes = compact_bytes
        self._file: BinaryIO | None = None
        self._size = 0  # the file's bytes
        self._unsynced = False  # appended since the last sync
        self._renamed = False  # compacted since: the folder's entry too

    def append(self, record: JournalRecord, *, compact: bool = False) -> None:
        """Append ``record``; with ``compact``, make it the journal's only one if the
        file holds ``compact_bytes`` or more. The writer's first record starts the file.

        Raises:
            OSError: the run directory is full, read-only or gone.
        """
        frame = _frame(record)
        if self._file is None or (compact and self._size >= self.compact_bytes):
            self.close()
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:
                with tmp.open("wb") as f:
                    f.write(frame)
                os.replace(tmp, self.path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            self._file = self.path.open("ab")
            self._renamed = True
            self._size = len(frame)
        else:
            self._file.write(frame)
            self._file.flush()
            self._size += len(frame)
        self._unsynced = True

    def sync(self) -> None:
        """Put every record appended so far on disk (nothing to do: returns at once).

        Raises:
            OSError: the disk refused what ``append`` wrote (full, or gone).
        """
        if self._file is None or not self._unsynced:
            return
        self._unsynced = False
        os.fsync(self._file.fileno())
        if self._renamed:
            self._renamed = False
            fsync_dir(self.path.parent)

    def close(self) -> None:
        """Close the file; the writer forgets it even when its last bytes could not
        be flushed (a full disk: ``OSError``), so the next ``append`` starts anew."""
        file, self._file = self._file, None
        self._unsynced = self._renamed = False
        if file is not None:
            file.close()


def read_journal(path: Path) -> JournalRecord:
    """The newest whole record of the journal at ``path``.

    Raises:
        ConfigError: the journal is missing or holds no whole record (field
            ``journal``).
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError("journal", f"{path} cannot be read: {exc}") from exc
    last: JournalRecord | None = None
    at = 0
    while at + _HEADER.size <= len(data):
        size, crc = _HEADER.unpack_from(data, at)
        payload = data[at + _HEADER.size : at + _HEADER.size + size]
        if len(payload) < size or zlib.crc32(payload) != crc:
            break  # torn by a crash while appending: what came before stands
        try:
            last = _DECODER.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ConfigError):
            break
        at += _HEADER.size + size
    if last is None:
        raise ConfigError("journal", f"{path} holds no whole record")
    return last
