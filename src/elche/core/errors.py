"""The exceptions elche raises for bad input.

The hierarchy follows the sans-IO convention: a single root, configuration
errors that are also ``ValueError``, and protocol errors split by who broke
the rules.

- ``ConfigError`` — bad configuration at construction. The message names the
  field and the accepted values.
- ``LocalProtocolError`` — the shell (or the user) fed the core something that
  is illegal in its current state. This is a bug in the caller: let it crash.
- ``RemoteProtocolError`` — a rank sent something stale, unknown or malformed.
  The coordinator latches that rank to ``ERRORED`` and evicts it; the run goes
  on with the others.
- ``TransportError`` — a shell-side failure, always raised ``from`` its cause.

A rank dying is an *event* (``RankLost``), never an exception.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "Error",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "TransportError",
]


class Error(Exception):
    """Root of every exception elche raises on purpose."""


class ConfigError(Error, ValueError):
    """A configuration value is out of range or of the wrong kind.

    Args:
        field: the configuration field at fault, e.g. ``"anchor"``.
        message: what is wrong and which values are accepted.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ProtocolError(Error):
    """Abstract: somebody broke the coordinator protocol."""

    def __init__(self, message: str) -> None:
        if type(self) is ProtocolError:
            raise TypeError("ProtocolError is abstract; raise a subclass")
        super().__init__(message)


class LocalProtocolError(ProtocolError):
    """The caller fed the core an event that is illegal in its state (a bug)."""


class RemoteProtocolError(ProtocolError):
    """A rank sent a frame that is malformed, unknown or stale.

    Args:
        message: what was wrong with the frame.
        rank: the sender, when known.
    """

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message if rank is None else f"rank {rank}: {message}")
        self.rank = rank


class TransportError(Error):
    """The IO shell failed to move a frame; raised ``from`` the cause."""
