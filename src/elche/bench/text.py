"""How the report's sections write numbers and rigs (``report``, ``hosts_report``,
``peers_report``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["num", "rig_label"]


def num(value: object, digits: int) -> str:
    """``value`` with ``digits`` decimals; "—" for None, a bool, a non-number, a non-finite one."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return "—"
    return f"{value:.{digits}f}"


def rig_label(speeds: Sequence[float]) -> str:
    """A rig's speeds as the report names it: ``1, 0.5, 0.25``."""
    return ", ".join(f"{s:g}" for s in speeds)
