"""The control plane's envelope: sealing and opening one frame, without sockets.

Every message between the coordinator and a rank travels inside an envelope
that carries a protocol version, a sequence number and an HMAC-SHA256 tag
keyed by a per-run secret (design §4). This module builds and checks that
envelope over plain buffers; ``elche.runtime.transport`` moves the parts over
ZeroMQ and keeps the per-connection state (who joined, the last sequence
number). Nothing here touches a socket, and nothing imports torch.

Theory of operation
-------------------

One frame is one ZeroMQ multipart message::

    part 0  header   48 bytes, big-endian  (HEADER_PREFIX + tag)
              magic     4s   b"ELCH"
              version   u16  messages.PROTOCOL_VERSION
              sender    u16  rank, or COORDINATOR_SENDER (0xFFFF)
              seq       u64  strictly increasing per sender per connection
              tag       32s  HMAC-SHA256, see below
    part 1  body     messages.encode(message)
    part 2… payload  zero or more raw byte frames (parameter snapshots)

    tag = HMAC-SHA256(secret, len(identity) ‖ identity ‖ header[:16]
                              ‖ len(body) ‖ body ‖ len(p₁) ‖ p₁ ‖ …)

Lengths are u64 big-endian. ``identity`` is the rank's DEALER identity (a rank
prefix and a random nonce), which both ends know; binding it into the tag ties a
frame to its connection, so a frame captured on one connection fails on any
other, and the length prefixes stop anyone from moving bytes between parts
under a valid tag. Frames of another run fail because its secret differs.

``unseal`` checks, in order: part count, total size, header size, magic,
version (the refusal names both versions), tag (``hmac.compare_digest``). What
needs the connection's state (the sender field against the connection's rank,
the sequence number against the last one accepted, the body) is checked by
the endpoint, only for a frame that passed all of these.
"""

from __future__ import annotations

import hmac
import secrets
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elche.core import messages
from elche.core.errors import ConfigError, RemoteProtocolError

__all__ = [
    "COORDINATOR_SENDER",
    "HEADER_BYTES",
    "HEADER_PREFIX",
    "MAGIC",
    "MAX_FRAME_BYTES",
    "SECRET_ENV",
    "Buffer",
    "Opened",
    "check_limits",
    "check_secret",
    "check_size",
    "frame_tag",
    "new_secret",
    "seal",
    "secret_from_env",
    "unseal",
]

SECRET_ENV = "ELCHE_SECRET"
MAGIC = b"ELCH"
COORDINATOR_SENDER = 0xFFFF  # the header's sender field for the coordinator
HEADER_PREFIX = struct.Struct(">4sHHQ")  # magic, version, sender, seq: 16 bytes
TAG_BYTES = 32  # full HMAC-SHA256, never truncated
HEADER_BYTES = HEADER_PREFIX.size + TAG_BYTES
# 64 MiB: control messages are under 1 KiB, but the CPU averaging modes move a
# whole parameter snapshot in one frame, and 64 MiB holds 16 M fp32 parameters
# (ResNet-18's 11.7 M fit; bigger models raise the limit on both ends). The
# bound exists so that no peer can make an endpoint buffer unbounded memory.
MAX_FRAME_BYTES = 64 * 2**20
# Reference: a per-run secret of 16+ random bytes. We generate 32, SHA-256's
# output size (RFC 2104 §3 advises keys no shorter than that), and accept the
# reference's minimum of 16 from a user who brings their own.
MIN_SECRET_BYTES = 16
SECRET_BYTES = 32
_LENGTH = struct.Struct(">Q")

Buffer = bytes | bytearray | memoryview


def new_secret() -> bytes:
    """Return a fresh per-run secret of 32 random bytes."""
    return secrets.token_bytes(SECRET_BYTES)


def secret_from_env(env: Mapping[str, str]) -> bytes | None:
    """Read the run's secret from ``env[SECRET_ENV]`` (hex).

    Args:
        env: the environment, usually ``os.environ``.

    Returns:
        The secret, or None when the variable is unset or blank.

    Raises:
        ConfigError: the value is not hex, or encodes fewer than 16 bytes.
    """
    text = env.get(SECRET_ENV, "").strip()
    if not text:
        return None
    try:
        secret = bytes.fromhex(text)
    except ValueError as exc:
        raise ConfigError("secret", f"{SECRET_ENV} is not hex: {exc}") from exc
    check_secret(secret)
    return secret


def check_secret(secret: bytes) -> None:
    """Refuse a secret shorter than ``MIN_SECRET_BYTES``.

    Raises:
        ConfigError: ``secret`` is too short.
    """
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError("secret", f"needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")


def check_limits(world_size: int, max_frame_bytes: int) -> None:
    """Both endpoints' checks of the world size and the frame limit.

    Raises:
        ConfigError: ``world_size`` does not fit the header's sender field
            beside ``COORDINATOR_SENDER``, or ``max_frame_bytes`` cannot hold
            a header.
    """
    if not 1 <= world_size < COORDINATOR_SENDER:
        raise ConfigError("world_size", f"must be in [1, {COORDINATOR_SENDER}), got {world_size}")
    if max_frame_bytes < HEADER_BYTES:
        raise ConfigError("max_frame_bytes", f"must be at least {HEADER_BYTES}")


def check_size(body: bytes, payload: Sequence[Buffer], max_frame_bytes: int) -> None:
    """Refuse, before sending, a frame that would exceed ``max_frame_bytes``.

    Raises:
        ValueError: the header, ``body`` and ``payload`` add up to more.
        TypeError: a payload item is not a buffer.
    """
    size_bytes = HEADER_BYTES + len(body) + sum(memoryview(p).nbytes for p in payload)
    if size_bytes > max_frame_bytes:
        raise ValueError(f"frame of {size_bytes} bytes exceeds max_frame_bytes={max_frame_bytes}")


def frame_tag(secret: bytes, identity: bytes, prefix: bytes, parts: Sequence[Buffer]) -> bytes:
    """Compute the HMAC-SHA256 tag of one frame (see the module docstring).

    Args:
        secret: the run's secret.
        identity: the rank's DEALER identity (the connection).
        prefix: the header without its tag (``HEADER_PREFIX.pack(...)``).
        parts: the body, then every payload frame.

    Returns:
        The 32-byte tag.
    """
    mac = hmac.new(secret, digestmod="sha256")
    mac.update(_LENGTH.pack(len(identity)) + identity + prefix)
    for part in parts:
        view = memoryview(part)
        mac.update(_LENGTH.pack(view.nbytes))
        mac.update(view)
    return mac.digest()


def seal(
    secret: bytes,
    *,
    identity: bytes,
    sender: int,
    seq: int,
    body: bytes,
    payload: Sequence[Buffer] = (),
) -> list[Buffer]:
    """Build the parts of one frame: ``[header, body, *payload]``.

    Raises:
        TypeError: a payload buffer is not C-contiguous.
        struct.error: ``sender`` or ``seq`` is out of its field's range.
    """
    parts: list[Buffer] = [body, *(memoryview(p).cast("B") for p in payload)]
    prefix = HEADER_PREFIX.pack(MAGIC, messages.PROTOCOL_VERSION, sender, seq)
    return [prefix + frame_tag(secret, identity, prefix, parts), *parts]


@dataclass(frozen=True, slots=True)
class Opened:
    """An authentic frame's header fields, body and payload (not yet decoded)."""

    sender: int
    seq: int
    body: bytes
    payload: list[bytes | memoryview]


def unseal(
    parts: Sequence[memoryview], *, secret: bytes, identity: bytes, max_frame_bytes: int
) -> Opened:
    """Check everything a frame carries without knowing the connection's state.

    Args:
        parts: the received parts, header first; the payload views in the
            result are these views (no copy), so they keep what they view alive.
        secret: the run's secret.
        identity: the DEALER identity of the connection the frame came on.
        max_frame_bytes: the most all parts together may hold.

    Returns:
        The frame's sender, sequence number, body and payload.

    Raises:
        RemoteProtocolError: the first check that failed, in the order of the
            module docstring (no ``rank``: nothing is proven about the sender).
    """
    if len(parts) < 2:
        raise RemoteProtocolError(f"expected at least 2 parts (header, body), got {len(parts)}")
    size_bytes = sum(p.nbytes for p in parts)
    if size_bytes > max_frame_bytes:
        raise RemoteProtocolError(f"frame of {size_bytes} bytes exceeds {max_frame_bytes}")
    header = bytes(parts[0])
    if len(header) != HEADER_BYTES:
        raise RemoteProtocolError(f"header of {len(header)} bytes, expected {HEADER_BYTES}")
    magic, version, sender, seq = HEADER_PREFIX.unpack_from(header)
    if magic != MAGIC:
        raise RemoteProtocolError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != messages.PROTOCOL_VERSION:
        raise RemoteProtocolError(
            f"protocol version {version} is not supported (this endpoint speaks version "
            f"{messages.PROTOCOL_VERSION}); run the same elche release on every host"
        )
    expected = frame_tag(secret, identity, header[: HEADER_PREFIX.size], parts[1:])
    if not hmac.compare_digest(header[HEADER_PREFIX.size :], expected):
        raise RemoteProtocolError("bad HMAC tag (tampered frame, or another run's secret)")
    payload: list[bytes | memoryview] = [*parts[2:]]
    return Opened(sender, seq, bytes(parts[1]), payload)
