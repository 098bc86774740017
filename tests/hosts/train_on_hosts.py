"""The script every host runs under torchrun in the several-hosts tests (unchanged per host).

``python train_on_hosts.py EPOCHS``: digits in ``cadence`` mode, every rank
paced to a fifth of its speed so that the run lasts long enough to lose a
host in the middle; rank 0 prints the summary, and a rank the run went on
without says so (``EXCLUDED``) and exits with status 3. With ``HOLD_AT``
(``EPOCH:FILE``), the run's ranks wait at that epoch's start, at most two
minutes, until ``FILE`` is on their host: the join test's condition, so the
joiner is in the run however long it takes to start (the joiner, started by
``elche join``, has no ``RANK`` and does not wait). With ``STALL_RANK``, that
rank's process, once started, writes ``/tmp/stalled`` on its host and waits
two minutes in ``model_fn``: a host lost before its rank gathered for the
first group (``FORMATION_TIMEOUT_S``: the run's ``formation_timeout_s``).
``WIRE`` is the run's ``wire`` (``fp32`` when unset).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import elche
from elche.workloads import digits

HOLD_AT = os.environ.get("HOLD_AT", "")


def hold(epoch: int, model: Any, optimizer: Any) -> None:
    at, _, path = HOLD_AT.partition(":")
    if not at or epoch != int(at) or "RANK" not in os.environ:
        return
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline and not Path(path).exists():
        time.sleep(0.05)  # polling for the test's file, bounded by the deadline


def make_model(device: Any) -> Any:
    if os.environ.get("STALL_RANK", "-") == os.environ.get("ELCHE_RANK"):  # its rank process
        Path("/tmp/stalled").touch()
        time.sleep(120.0)  # the test kills this host meanwhile (never synchronisation)
    return digits.make_model(device)


if __name__ == "__main__":
    train_set, test_set = digits.load_digits_split(seed=0)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # a joiner's speeds= is ignored
    try:
        result = elche.train(
            make_model, digits.make_optimizer, digits.step_fn, train_set,
            batch_size=32, epochs=int(sys.argv[1]), mode="cadence", heartbeat_timeout_s=3.0,
            formation_timeout_s=float(os.environ.get("FORMATION_TIMEOUT_S", "60")),
            speeds=[0.2] * world, speed_base_s=0.004, epoch_fn=hold,
            wire=os.environ.get("WIRE", "fp32"),
            eval_fn=digits.eval_fn, eval_dataset=test_set, progress=False,
        )  # fmt: skip
    except elche.RankExcluded as out:  # cut off, declared lost, refused when back
        print(f"EXCLUDED {out.rank} {out.reason}", flush=True)
        sys.exit(3)
    print(f"RETURNED {os.environ.get('RANK', 'joined')} {result.run_dir}", flush=True)
    if result.summary:
        print("SUMMARY " + json.dumps(result.summary), flush=True)
