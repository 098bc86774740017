"""A rank on a fourth host joins a three-host torchrun run (issue 14 item 4, across hosts).

Three namespace hosts run ``join_script.py`` under torchrun (static
rendezvous, one rank each, a secret set as off loopback it must be); a
fourth host starts the same script with the command rank 0 printed. The run
completes with the joiner in ``joined_ranks``, having trained a share.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from elche.testing.hosts import Rig

from .test_lost_host import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = Path(__file__).parents[1] / "integration" / "join_script.py"
EPOCHS = 12
JOIN_LINE = re.compile(
    r"elche: join with ELCHE_SECRET=\$ELCHE_SECRET elche join (?P<address>tcp://\S+) "
    r"--store-port (?P<port>\d+) "
)


def _result(text: str) -> dict[str, object]:
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert lines, text
    return json.loads(lines[0].removeprefix("RESULT "))  # type: ignore[no-any-return]  # JSON


def test_a_rank_on_another_host_joins_a_torchrun_run() -> None:
    secret = {"ELCHE_SECRET": secrets.token_hex(32)}
    with Rig(4) as rig:
        port = rig.free_port(0)
        logs = [rig.tmp(i) / "run.log" for i in range(4)]
        for i in range(3):
            with logs[i].open("w") as log:
                rig.spawn(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "3",
                              "--node-rank", str(i), "--nproc-per-node", "1",
                              "--master-addr", "h0", "--master-port", str(port),
                              str(SCRIPT), str(EPOCHS)],
                          env=secret, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        match = wait_for("rank 0's join line", lambda: JOIN_LINE.search(logs[0].read_text()))
        with logs[3].open("w") as log:
            joiner = rig.spawn(3, [sys.executable, "-m", "elche.cli", "join", match["address"],
                                   "--store-port", match["port"], "--speed", "0.1",
                                   str(SCRIPT), str(EPOCHS)],
                               env=secret, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        wait_for("the joiner to end", lambda: joiner.poll() is not None or None, 300.0)
        wait_for("rank 0's result", lambda: "RESULT " in logs[0].read_text() or None, 120.0)
        run_text, joined_text = logs[0].read_text(), logs[3].read_text()
    assert joiner.returncode == 0, joined_text
    summary = _result(run_text)
    assert summary["outcome"] == "completed", summary
    assert summary["lost_samples"] == 0 and summary["epochs_completed"] == EPOCHS
    assert summary["joined_ranks"] == [3]
    samples = {row["rank"]: row["samples"] for row in summary["per_rank"]}  # type: ignore[attr-defined]
    assert 0 < samples[3] < max(samples[r] for r in (0, 1, 2))
    assert _result(joined_text)["joined_as"] == 3
