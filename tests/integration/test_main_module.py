"""A local run from a main module the ranks cannot import again (``elche.runtime.sending``).

What ``python -c`` (as a notebook or the REPL) defines goes to the ranks by
value and trains; a script read from standard input is refused before any
process starts, naming what to do.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CODE = """
import torch
from torch import nn
import elche

SCALE = 0.5  # a global the step reads: it travels with the functions

class Points:  # a dataset class written where the ranks cannot import it from
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = (self.x.sum(1) > 0).long()
    def __len__(self):
        return len(self.y)
    def __getitem__(self, i):
        return self.x[i], self.y[i]

def make_model(device):
    torch.manual_seed(0)
    return nn.Linear(4, 2).to(device)

def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

def step(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x * SCALE), y)

result = elche.train(make_model, make_optimizer, step, Points(96), batch_size=8, epochs=2,
                     ranks=2, mode="cpu-cadence", progress=False)
s = result.summary
print("OUTCOME", s["outcome"], s["lost_samples"], sum(r["samples"] for r in s["per_rank"]))
"""


def test_functions_and_a_dataset_defined_in_python_c_train_on_every_rank() -> None:
    # Each rank failed to unpickle them ("Can't get attribute 'make_model' on <module
    # '__main__' (built-in)>", a traceback each), and the run failed as "rank 0 lost
    # before the run formed (process ended (exit code 1)); single_survivor".
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "OUTCOME completed 0 192" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_script_read_from_standard_input_is_refused_before_anything_starts() -> None:
    # Every process the fork server started failed to read "<stdin>" again, the
    # coordinator first: "the coordinator failed to start (said ''); see stderr".
    done = subprocess.run([sys.executable, "-"], input=CODE, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "elche.core.errors.ConfigError: ranks: the main module was read from <stdin> "
        "(python - or python < file), which the rank processes, started apart, cannot read "
        "again; save the script as a file and run that (python train.py), or train with ranks=1"
    ), done.stderr[-3000:]
    assert "coordinator" not in done.stderr, done.stderr[-3000:]
