"""The layering contract, enforced by a test rather than by convention.

``elche.core`` is sans-IO: it must not reach sockets, threads, clocks, the
OS, logging or torch, nor the layers built on top of it. ``elche.sim`` may use
the core but no real IO. The public surface is ``elche.__all__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import elche

SRC = Path(elche.__file__).parent

CORE_FORBIDDEN = {
    "torch", "zmq", "socket", "threading", "asyncio", "time", "os", "logging",
    "multiprocessing", "subprocess", "selectors", "signal",
    "elche.runtime", "elche.sim", "elche.monitor", "elche.cli",
}  # fmt: skip
SIM_FORBIDDEN = {
    "torch", "zmq", "socket", "threading", "asyncio", "time", "multiprocessing",
    "subprocess", "elche.runtime",
}  # fmt: skip


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def violations(package: str, forbidden: set[str]) -> list[str]:
    bad = []
    for path in sorted((SRC / package).rglob("*.py")):
        for module in imported_modules(path):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(SRC)} imports {module}")
    return bad


@pytest.mark.parametrize(
    ("package", "forbidden"), [("core", CORE_FORBIDDEN), ("sim", SIM_FORBIDDEN)]
)
def test_layer_imports_stay_inside_their_contract(package: str, forbidden: set[str]) -> None:
    assert violations(package, forbidden) == []


def test_the_checker_catches_a_violation(tmp_path: Path) -> None:
    module = tmp_path / "leaky.py"
    module.write_text("import time\nfrom socket import socket\n")
    assert imported_modules(module) >= {"time", "socket"}


def test_public_surface_is_importable_and_complete() -> None:
    for name in elche.__all__:
        assert hasattr(elche, name), name
    assert sorted(elche.__all__) == list(elche.__all__)
