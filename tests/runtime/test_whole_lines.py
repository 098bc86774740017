"""A launched rank's output goes out a whole line per write (``launched.whole_lines``)."""

from __future__ import annotations

import io
import sys

import pytest

from elche.runtime.launched import whole_lines


class Writes(io.RawIOBase):
    """A file that records each write it is given (a pipe, or a terminal)."""

    def __init__(self, *, tty: bool) -> None:
        self.tty, self.writes = tty, list[bytes]()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.tty

    def write(self, data: bytes) -> int:  # type: ignore[override]  # bytes is all print gives
        self.writes.append(bytes(data))
        return len(data)


def _unbuffered(raw: Writes) -> io.TextIOWrapper:
    """A stream as ``PYTHONUNBUFFERED`` makes it: every write goes straight to the file."""
    return io.TextIOWrapper(raw, write_through=True, encoding="utf-8")  # type: ignore[arg-type]


def test_a_pipe_gets_each_line_in_one_write_and_a_terminal_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipe, tty = Writes(tty=False), Writes(tty=True)
    monkeypatch.setattr(sys, "stdout", _unbuffered(pipe))
    monkeypatch.setattr(sys, "stderr", _unbuffered(tty))
    print("RANK", 2, 15)  # six writes, before: another rank's line can land between them
    assert pipe.writes == [b"RANK", b" ", b"2", b" ", b"15", b"\n"]
    whole_lines()
    print("RANK", 2, 15)
    print("SUMMARY", "x" * 3000)
    assert pipe.writes[6:] == [b"RANK 2 15\n", b"SUMMARY " + b"x" * 3000 + b"\n"]
    print("elche", "rank", file=sys.stderr)
    assert tty.writes == [b"elche", b" ", b"rank", b"\n"]  # a terminal: as it was
