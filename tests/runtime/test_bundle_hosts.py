"""Across hosts the coordinator names the host each file of a resumable bundle lies on."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

from elche.core.config import CoordinatorConfig, Mode
from elche.core.coordinator import RunState
from elche.runtime.frames import new_secret
from elche.runtime.host import Host
from elche.runtime.transport import CoordinatorEndpoint
from elche.testing import FakeRank

WAIT_S = 30.0


def test_a_stop_saved_across_hosts_says_which_file_lies_on_which_host(tmp_path: Path) -> None:
    stem = tmp_path / "bundle"
    config = CoordinatorConfig(
        mode=Mode.CPU_CADENCE, world_size=2, num_samples=64, batch_size=8, epochs=50,
        save_path=str(stem),
    )  # fmt: skip
    secret = new_secret()
    log_path = tmp_path / "host.log"
    with CoordinatorEndpoint(world_size=2, secret=secret) as endpoint, log_path.open("w") as log:
        host = Host(config, endpoint, tmp_path, log=log)
        pace = threading.Semaphore(0)  # the fake ranks (hosts fake-0, fake-1) hold: no epoch ends
        fakes = [FakeRank(endpoint.address, r, 2, secret, mode=config.mode, batch_size=8,
                          pace=pace) for r in range(2)]  # fmt: skip
        deadline_s = time.monotonic() + WAIT_S
        threads = [threading.Thread(target=host.run, daemon=True)]
        threads += [threading.Thread(target=functools.partial(f.run, deadline_s), daemon=True)
                    for f in fakes]  # fmt: skip
        for thread in threads:
            thread.start()
        while host.core.state is RunState.FORMING and time.monotonic() < deadline_s:
            time.sleep(0.01)  # polls a condition: a stop before the run forms saves nothing
        host.request_stop("test")
        pace.release(10_000)
        for thread in threads:
            thread.join(WAIT_S)
        assert not any(t.is_alive() for t in threads)
    text = log_path.read_text()
    (line,) = [x for x in text.splitlines() if "lie on several hosts" in x]
    assert "bundle.meta.json on fake-0 (the coordinator's)" in line
    assert ".rank0.optim on fake-0 (rank 0)" in line
    assert ".rank1.optim on fake-1 (rank 1)" in line
    assert "resume_from=FOLDER/bundle" in line
