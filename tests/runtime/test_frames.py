"""The envelope without sockets: sealing, opening, the run's secret.

``seal`` and ``unseal`` are inverses for the right secret and connection, and
``unseal`` refuses a frame at the first check that fails, with a
``RemoteProtocolError`` that blames no rank. Everything over real sockets is
in ``test_transport.py``.
"""

from __future__ import annotations

import pytest

from elche.core import messages as m
from elche.core.errors import ConfigError, RemoteProtocolError
from elche.runtime.frames import (
    HEADER_BYTES,
    MAX_FRAME_BYTES,
    SECRET_ENV,
    Opened,
    new_secret,
    seal,
    secret_from_env,
    unseal,
)

IDENTITY = b"rank0-0123456789abcdef"


def sealed(secret: bytes, *, payload: list[bytes] | None = None) -> list[memoryview]:
    body = m.encode(m.Exiting(reason="done"))
    parts = seal(secret, identity=IDENTITY, sender=0, seq=7, body=body, payload=payload or [])
    return [memoryview(p) for p in parts]


def test_unseal_opens_what_seal_built() -> None:
    secret = new_secret()
    opened = unseal(
        sealed(secret, payload=[b"abc", b""]),
        secret=secret,
        identity=IDENTITY,
        max_frame_bytes=MAX_FRAME_BYTES,
    )
    assert opened == Opened(0, 7, m.encode(m.Exiting(reason="done")), [b"abc", b""])


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("one part", "expected at least 2 parts"),
        ("too big", "exceeds"),
        ("short header", "header of"),
        ("other secret", "bad HMAC tag"),
        ("other connection", "bad HMAC tag"),
    ],
)
def test_unseal_refuses_at_the_first_failed_check(case: str, match: str) -> None:
    secret = new_secret()
    parts = sealed(secret)
    identity, limit = IDENTITY, MAX_FRAME_BYTES
    if case == "one part":
        parts = parts[:1]
    elif case == "too big":
        limit = HEADER_BYTES
    elif case == "short header":
        parts = [parts[0][:-1], *parts[1:]]
    elif case == "other secret":
        secret = new_secret()
    else:
        identity = b"rank0-another-nonce"
    with pytest.raises(RemoteProtocolError, match=match) as info:
        unseal(parts, secret=secret, identity=identity, max_frame_bytes=limit)
    assert info.value.rank is None


def test_secret_from_env() -> None:
    secret = new_secret()
    assert len(secret) == 32
    assert secret_from_env({SECRET_ENV: secret.hex()}) == secret
    assert secret_from_env({SECRET_ENV: f" {secret.hex().upper()}\n"}) == secret
    assert secret_from_env({}) is None
    assert secret_from_env({SECRET_ENV: ""}) is None
    with pytest.raises(ConfigError, match="not hex"):
        secret_from_env({SECRET_ENV: "zz" * 32})
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        secret_from_env({SECRET_ENV: "ab" * 15})
