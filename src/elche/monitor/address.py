"""Where the dashboard listens: ``[HOST:]PORT``, from the argument or ``ELCHE_DASHBOARD``.

Kept apart from ``elche.monitor.dashboard`` so that checking an address
imports no server library.
"""

from __future__ import annotations

from elche.core.errors import ConfigError

__all__ = ["DASHBOARD_ENV", "DEFAULT_HOST", "parse_address"]

DASHBOARD_ENV = "ELCHE_DASHBOARD"
# A bare port serves this machine only: opening the run to the network is a choice.
DEFAULT_HOST = "127.0.0.1"


def parse_address(text: str) -> tuple[str, int]:
    """``[HOST:]PORT`` as (host, port); port 0 picks a free one.

    Raises:
        ConfigError: not a string (``dashboard=8080``), not a port, or a port out of range.
    """
    if not isinstance(text, str):
        raise ConfigError(
            "dashboard", f'expected "[HOST:]PORT" as a string, such as "8080", got {text!r}'
        )
    host, _, port_text = text.strip().rpartition(":")
    host = host.strip("[]") or DEFAULT_HOST
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError("dashboard", f"expected [HOST:]PORT, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError("dashboard", f"port must be in [0, 65535], got {port}")
    return host, port
