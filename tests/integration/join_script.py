"""The script of the join test: digits on three paced ranks; ``elche join`` adds a fourth.

``python join_script.py EPOCHS``: ``elche.train(ranks=3)`` in ``cadence``
mode, every rank paced to a tenth of its speed so that the run lasts long
enough for a rank to join it. Under ``elche join`` the same file, unchanged,
is the joining rank (its ``ranks=`` and ``speeds=`` are ignored). Each
process prints its result in one line.
"""

from __future__ import annotations

import json
import sys

import elche
from elche.workloads import digits

if __name__ == "__main__":
    train_set, test_set = digits.load_digits_split(seed=0)
    result = elche.train(
        digits.make_model, digits.make_optimizer, digits.step_fn, train_set,
        batch_size=32, epochs=int(sys.argv[1]), mode="cadence", heartbeat_timeout_s=5.0,
        ranks=3, speeds=[0.1, 0.1, 0.1], speed_base_s=0.004,
        eval_fn=digits.eval_fn, eval_dataset=test_set, progress=False,
    )  # fmt: skip
    print("RESULT " + json.dumps(result.summary), flush=True)
