"""The layering contract, enforced by a test rather than by convention.

``elche.core`` is sans-IO: it must not reach sockets, threads, clocks, the
OS, logging or torch, nor the layers built on top of it. ``elche.sim`` may use
the core but no real IO. ``elche.runtime`` sits below ``elche.api``,
``elche.cli``, ``elche.bench`` and ``elche.sim``: imports point one way, not
even inside a function or under ``TYPE_CHECKING``. The coordinator process
and ``import elche`` never import torch. The public surface is
``elche.__all__``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import elche

SRC = Path(elche.__file__).parent

CORE_FORBIDDEN = {
    "torch", "zmq", "socket", "threading", "asyncio", "time", "os", "logging",
    "multiprocessing", "subprocess", "selectors", "signal",
    "elche.runtime", "elche.sim", "elche.monitor", "elche.cli", "elche.api",
}  # fmt: skip
SIM_FORBIDDEN = {
    "torch", "zmq", "socket", "threading", "asyncio", "time", "multiprocessing",
    "subprocess", "elche.runtime",
}  # fmt: skip
RUNTIME_FORBIDDEN = {"elche.api", "elche.cli", "elche.bench", "elche.sim"}
# What the coordinator process (``python -m elche.runtime.host``) and the
# launcher import before any rank starts; none of it may pull in torch.
TORCH_FREE = ("elche", "elche.api", "elche.runtime.host", "elche.runtime.plan")


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
    ("package", "forbidden"),
    [("core", CORE_FORBIDDEN), ("sim", SIM_FORBIDDEN), ("runtime", RUNTIME_FORBIDDEN)],
)
def test_layer_imports_stay_inside_their_contract(package: str, forbidden: set[str]) -> None:
    assert violations(package, forbidden) == []


def test_the_checker_catches_a_violation(tmp_path: Path) -> None:
    module = tmp_path / "leaky.py"
    module.write_text(
        "import time\nfrom socket import socket\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from elche.api import Plan\n"
        "def late() -> None:\n    from elche.sim import engine\n"
    )
    assert imported_modules(module) >= {"time", "socket", "elche.api", "elche.sim"}


@pytest.mark.slow
def test_the_coordinator_and_import_elche_never_import_torch() -> None:
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(TORCH_FREE)!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_public_surface_is_importable_and_complete() -> None:
    for name in elche.__all__:
        assert hasattr(elche, name), name
    assert sorted(elche.__all__) == list(elche.__all__)
