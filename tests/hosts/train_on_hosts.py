"""The script every host runs under torchrun in the several-hosts tests (unchanged per host).

``python train_on_hosts.py EPOCHS``: digits in ``cadence`` mode, every rank
paced to a fifth of its speed so that the run lasts long enough to lose a
host in the middle; rank 0 prints the summary, and a rank the run went on
without says so (``EXCLUDED``) and exits with status 3.
"""

from __future__ import annotations

import json
import os
import sys

import elche
from elche.workloads import digits

if __name__ == "__main__":
    train_set, test_set = digits.load_digits_split(seed=0)
    world = int(os.environ["WORLD_SIZE"])
    try:
        result = elche.train(
            digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
            batch_size=32, epochs=int(sys.argv[1]), mode="cadence", heartbeat_timeout_s=3.0,
            speeds=[0.2] * world, speed_base_s=0.004,
            eval_fn=digits.eval_fn, eval_dataset=test_set, progress=False,
        )  # fmt: skip
    except elche.RankExcluded as out:  # cut off, declared lost, refused when back
        print(f"EXCLUDED {out.rank} {out.reason}", flush=True)
        sys.exit(3)
    print(f"RETURNED {os.environ['RANK']} {result.run_dir}", flush=True)
    if result.summary:
        print("SUMMARY " + json.dumps(result.summary), flush=True)
