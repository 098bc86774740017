"""The journal on disk: the coordinator's records, appended and fsynced.

Format: a sequence of frames, each a 4-byte big-endian length, a 4-byte
CRC-32 of the payload, and the payload (one ``JournalRecord``,
msgpack-encoded by msgspec). An append is durable before the coordinator
goes on (``os.fsync``). A compacting record replaces the file: it is written
to a temporary file, fsynced and renamed over the journal, so a crash leaves
the old journal or the new one. A torn last frame (the coordinator died while
appending) is ignored by the reader; the record before it stands.
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
from elche.runtime.bundle import write_file

__all__ = ["JOURNAL_FILE", "JournalWriter", "read_journal"]

JOURNAL_FILE = "journal.bin"
_HEADER = struct.Struct(">II")  # payload length, CRC-32
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(JournalRecord)


def _frame(record: JournalRecord) -> bytes:
    payload = _ENCODER.encode(record)
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


class JournalWriter:
    """Appends records to ``path``, each durable when ``append`` returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO | None = None

    def append(self, record: JournalRecord, *, compact: bool = False) -> None:
        """Append ``record`` (or, with ``compact``, make it the journal's only one).

        Raises:
            OSError: the run directory is full, read-only or gone.
        """
        frame = _frame(record)
        if compact or self._file is None:
            self.close()
            write_file(self.path, lambda f: f.write(frame), kind="journal")
            self._file = self.path.open("ab")
            return
        self._file.write(frame)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
