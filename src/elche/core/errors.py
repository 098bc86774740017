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
- ``TrainingError`` — the user's own code failed on a rank (``elche.train``
  raises it); it carries that exception as text, traceback included.
- ``RankExcluded`` — the run went on without this process's rank (declared
  lost while it was cut off, or a join refused); ``elche.train`` raises it in
  that process only.

A rank dying is an *event* (``RankLost``), never an exception.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "Error",
    "LocalProtocolError",
    "ProtocolError",
    "RankExcluded",
    "RemoteProtocolError",
    "TrainingError",
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
        self.message = message


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


class TrainingError(Error, RuntimeError):
    """The user's code raised on a rank, so the run ended (``elche.train`` raises it).

    The original exception cannot cross processes reliably, so it comes as
    text: its type name, message and formatted traceback (the useful part:
    it points into the user's code). Raised as soon as the error is known to
    be the user's: a rank failed before its first training step, or every
    rank failed with the same exception type. When ranks that had not failed
    were left, they saved what was trained first, and ``bundle`` names it:
    fix the code, then resume with ``resume_from=bundle``. A non-finite loss
    under ``nonfinite="stop"`` raises it too, with ``bundle`` naming the
    saved last finite consensus.

    Args:
        rank: the rank whose exception this is.
        epoch: the epoch it was in (0 before training began).
        error_type: the exception's type name, e.g. ``"RuntimeError"``.
        message: the exception's message.
        traceback: the formatted traceback, as the failing rank printed it.
        bundle: a resumable bundle stem, when one was saved.
    """

    def __init__(
        self,
        *,
        rank: int,
        epoch: int,
        error_type: str,
        message: str,
        traceback: str = "",
        bundle: str | None = None,
    ) -> None:
        text = f"rank {rank} failed in epoch {epoch}: {error_type}: {message}"
        if bundle is not None:
            text += f"\nWhat was trained is saved as the bundle {bundle}: resume_from={bundle!r}"
        if traceback:
            text += f"\n\nThe error on rank {rank}:\n{traceback.rstrip()}"
        super().__init__(text)
        self.rank = rank
        self.epoch = epoch
        self.error_type = error_type
        self.message = message
        self.traceback = traceback
        self.bundle = bundle

    @classmethod
    def from_summary(cls, error: dict[str, object], bundle: str | None = None) -> TrainingError:
        """Rebuild it from a run summary's ``user_error`` (``elche.core.messages.UserError``)."""
        return cls(
            rank=int(str(error["rank"])),
            epoch=int(str(error["epoch"])),
            error_type=str(error["error_type"]),
            message=str(error["message"]),
            traceback=str(error.get("traceback", "")),
            bundle=bundle,
        )


class RankExcluded(Error, RuntimeError):
    """The run went on without this process's rank; ``elche.train`` raises it there.

    The coordinator declared the rank lost (its heartbeat went stale: a host
    cut off, a process stopped too long) and re-issued its unfinished work to
    the others; when the rank spoke again, it was refused, so nothing it
    trained since its last average is in the run. Or its join was refused. Or
    it lost its coordinator and rank 0 shared no result either (a host cut
    off for good): the run, if it goes on, goes on elsewhere.
    This process's model is not the run's result: the run's summary and
    model are rank 0's.

    Args:
        rank: this process's rank.
        reason: why, as the coordinator said.
    """

    def __init__(self, *, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank} is no longer part of the run: {reason}")
        self.rank = rank
        self.reason = reason
