"""The rank fork server's preload: what a rank would otherwise import itself.

Every rank forks from a server that imported ``FORKSERVER_PRELOAD`` once. A
module a rank still imports on its own is paid by every rank of every run,
at the same moment, so the check runs a rank's first steps in a fresh
interpreter that imported only the preload, and lists what they imported.
"""

from __future__ import annotations

import json
import subprocess
import sys

from elche.runtime.launch import FORKSERVER_PRELOAD

# A rank's first optimizer steps, after the fork server's imports.
_FIRST_STEPS = """
import importlib, json, sys
for name in {preload!r}:
    importlib.import_module(name)
before = set(sys.modules)
import torch
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
for make in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
    optimizer = make(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_a_ranks_first_optimizer_imports_nothing_heavy_after_the_preload() -> None:
    code = _FIRST_STEPS.format(preload=list(FORKSERVER_PRELOAD))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported = json.loads(out.stdout)
    heavy = [m for m in imported if m.startswith("torch._dynamo") or m.split(".")[0] == "sympy"]
    assert heavy == [], f"imported by every rank on its own: {heavy}"
