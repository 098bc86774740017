"""A fourth host joins a three-host run under torchrun, then a host is lost (issue 14
items 3 and 4, across hosts, static rendezvous).

Three namespace hosts run the same script under torchrun (static rendezvous,
one rank each, private /tmp each); a fourth host starts it with ``elche
join`` and the run's join line (address, store port, the secret from the
file on rank 0's host). The run's ranks hold at epoch 2's start until the
joiner is in (``HOLD_AT``); the joiner then trains a share of the last
epochs over the network, through the coordinator's group store on rank 0's
host. Once epoch 2 is over, host 1 is cut off the network and every process
of host 2 is SIGKILLed at once: two ranks are lost within one heartbeat
check, so the coordinator orders two new generations of the group a moment
apart, and a survivor may read the first before the second comes
(``elche.runtime.groups.gather``; the exact interleaving is pinned in
``tests/runtime/test_membership.py``). The run goes on with rank 0 and the
joiner and completes with every sample trained once. (The c10d lost-host
run, with one result on every surviving host, is in ``test_lost_host.py``.)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from elche.testing.hosts import Rig
from tests.hosts.test_lost_host import SCRIPT, records, start_torchrun, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EPOCHS = 5  # held at 2 for the join; host 2 lost once 2 is over
HOLD_FILE = "/tmp/joined"  # on each host's own /tmp
JOIN_LINE = re.compile(
    r"elche: join with ELCHE_SECRET=\$\(cat (?P<secret>\S+)\) elche join (?P<address>tcp://\S+) "
    r"--store-port (?P<port>\d+) "
)


def test_a_fourth_host_joins_a_torchrun_run_across_hosts_and_two_lost_hosts_are_survived() -> None:
    with Rig(4) as rig:
        logs = start_torchrun(rig, "static", EPOCHS, env={"HOLD_AT": f"2:{HOLD_FILE}"})
        logs.append(rig.tmp(3) / "join.log")
        line = wait_for("the join line", lambda: JOIN_LINE.search(logs[0].read_text()))
        assert not line["address"].startswith("tcp://127."), line[0]  # reachable from h3
        run_dir = rig.tmp(0) / Path(line["secret"]).parent.relative_to("/tmp")  # on h0
        secret = (run_dir / Path(line["secret"]).name).read_text()
        with logs[3].open("w") as log:
            joiner = rig.spawn(3, [sys.executable, "-m", "elche.cli", "join", line["address"],
                                   "--store-port", line["port"], "--speed", "0.2", str(SCRIPT),
                                   str(EPOCHS)],
                               env={"ELCHE_SECRET": secret}, stdout=log,
                               stderr=subprocess.STDOUT)  # fmt: skip
        path = run_dir / "timeline.jsonl"
        mark = '"kind":"RankJoined","rank":3,'
        wait_for("rank 3 joined", lambda: (path.exists() and mark in path.read_text()) or None)
        for i in range(3):
            (rig.tmp(i) / Path(HOLD_FILE).name).touch()  # the run's ranks go on
        wait_for("epoch 2's end", lambda: '"kind":"EpochEnd","epoch":2' in path.read_text() or None)
        rig.partition(1)  # static rendezvous: node rank r is rank r
        assert rig.kill_host(2)
        assert joiner.wait(timeout=180) == 0, logs[3].read_text()[-3000:]

        def returned() -> str | None:
            text = logs[0].read_text()
            return text if "RETURNED" in text else None

        text = wait_for("rank 0 to return", returned)
        joined_text = logs[3].read_text()
        events = records(path)
    lines = [x for x in text.splitlines() if x.startswith("SUMMARY ")]
    assert len(lines) == 1, text[-3000:]
    summary = json.loads(lines[0].removeprefix("SUMMARY "))
    assert summary["outcome"] == "completed", summary
    assert summary["joined_ranks"] == [3]
    assert summary["dead_ranks"] == [1, 2]
    assert summary["lost_samples"] == 0
    assert summary["epochs_completed"] == EPOCHS
    rows = {row["rank"]: row for row in summary["per_rank"]}
    assert sorted(rows) == [0, 1, 2, 3]
    # The joiner trained part of the epochs after it joined; every sample once.
    assert 0 < rows[3]["samples"] <= (EPOCHS - 2) * 1437
    assert sum(row["samples"] for row in rows.values()) == EPOCHS * 1437
    joined = next(e for e in events if e.get("kind") == "RankJoined" and e.get("rank") == 3)
    assert joined["host"] == "h3"  # from its own host, by name
    assert "RETURNED joined" in joined_text, joined_text[-3000:]
