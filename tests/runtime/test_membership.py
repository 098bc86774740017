"""Forming a new generation of the group: the members gather first (``groups.gather``).

Two ranks lost within one heartbeat check make the coordinator order two
generations a moment apart. A survivor that read the first order must not
block in its rendezvous while its peers form the second: it gathers, sees the
newer order, and joins them. The two-process test plays that interleaving
exactly with real processes, a real group store and real gloo groups; before
the gathering, the first survivor blocked in generation 2's rendezvous for
the whole timeout and the other timed out in generation 3 alongside it.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

from elche.runtime import groups, membership
from elche.runtime.membership import Membership

ADDRESS = "tcp://127.0.0.1:0"  # the host part is what the store's clients use
TIMEOUT_S = 30.0  # each process's rendezvous timeout: far above what forming takes
LONG_TIMEOUT_S = 240.0  # a collective timeout the test must never reach


@pytest.fixture(scope="module")
def store_port() -> Iterator[int]:
    """One store for the module, each test in generations of its own.

    The store's server owns its listening socket's descriptor (as in the
    coordinator, it lives as long as the process): closing the socket here
    as well would close, later, whatever socket then holds that number.
    """
    server = groups.GroupStoreServer(groups.listen(ADDRESS)).start()
    yield server.port


def never(wait_s: float) -> bool:
    time.sleep(wait_s)  # stands in for the bridge's wait for news
    return False


def test_gathering_ends_when_every_member_has_arrived(store_port: int) -> None:
    client = groups.connect(ADDRESS, store_port, 5.0)
    store = groups.generation_store(client, 4)
    store.set(groups.ARRIVED + "1", "1")
    assert groups.gather(store, 0, [0, 1], timeout_s=5.0, superseded=never)
    assert store.check([groups.ARRIVED + "0"])  # what the other member waits for


def test_gathering_ends_at_once_when_superseded(store_port: int) -> None:
    client = groups.connect(ADDRESS, store_port, 5.0)
    store = groups.generation_store(client, 5)
    asked: list[float] = []

    def newer_order(wait_s: float) -> bool:
        asked.append(wait_s)
        return True

    assert not groups.gather(store, 0, [0, 1, 2], timeout_s=5.0, superseded=newer_order)
    assert asked == [groups.GATHER_POLL_S]


def test_a_member_that_never_comes_is_named_after_twice_the_timeout(store_port: int) -> None:
    client = groups.connect(ADDRESS, store_port, 5.0)
    store = groups.generation_store(client, 6)
    store.set(groups.ARRIVED + "3", "1")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[2\] did not come"):
        groups.gather(store, 0, [0, 2, 3], timeout_s=0.1, superseded=never)
    assert time.monotonic() - started >= 0.2


def test_a_late_member_does_not_count_members_that_left_a_superseded_gathering(
    store_port: int,
) -> None:
    """A restarted coordinator orders a generation and the final save a moment apart:
    the ranks told to hold leave, their marks stay, the writer comes late."""
    client = groups.connect(ADDRESS, store_port, 5.0)
    store = groups.generation_store(client, 7)
    for rank in (1, 2):
        assert not groups.gather(store, rank, [0, 1, 2], timeout_s=5.0, superseded=lambda _: True)
    with pytest.raises(RuntimeError, match="a member gave the group up"):
        groups.gather(store, 0, [0, 1, 2], timeout_s=0.1, superseded=never)
    news = iter([False, False, True])  # the writer reads the save order a moment later
    assert not groups.gather(store, 0, [0, 1, 2], timeout_s=5.0, superseded=lambda _: next(news))
    assert next(news, None) is None


def test_a_member_superseded_once_every_member_has_arrived_forms_with_them(
    store_port: int,
) -> None:
    client = groups.connect(ADDRESS, store_port, 5.0)
    store = groups.generation_store(client, 8)

    def newer_order_as_the_last_member_comes(wait_s: float) -> bool:
        assert groups.gather(store, 1, [0, 1], timeout_s=5.0, superseded=never)
        return True

    assert groups.gather(
        store, 0, [0, 1], timeout_s=5.0, superseded=newer_order_as_the_last_member_comes
    )


def _serve_store(ports: Any) -> None:
    """A group store in a process of its own, as the coordinator serves one, until killed."""
    server = groups.GroupStoreServer(groups.listen(ADDRESS)).start()
    ports.put(server.port)
    while True:
        time.sleep(1)


def test_a_member_gathering_when_the_store_dies_waits_for_the_news_of_it() -> None:
    """The coordinator serves the store: it dying under a gathering member broke the
    member's connection, and the error ended the rank before the successor's Rejoin
    came (a chaos run lost both survivors so). Now the member waits for the news."""
    ctx = mp.get_context("fork")
    ports = ctx.Queue()
    server = ctx.Process(target=_serve_store, args=(ports,), daemon=True)
    server.start()
    try:
        store = groups.generation_store(groups.connect(ADDRESS, ports.get(timeout=30), 5.0), 1)
        polls: list[bool] = []

        def news(wait_s: float) -> bool:  # the Rejoin comes a few polls after the death
            time.sleep(wait_s)
            if len(polls) == 2:
                server.kill()
                server.join(timeout=10)
            polls.append(not server.is_alive())
            return polls.count(True) > 3

        assert not groups.gather(store, 0, [0, 1], timeout_s=5.0, superseded=news)
        assert polls.count(True) == 4  # it waited through the broken store for the news
    finally:
        server.kill()
        server.join(timeout=10)


def test_a_store_that_takes_connections_but_does_not_serve_yet_does_not_hold_a_member() -> None:
    """A restarted coordinator takes connections before it serves its store (it imports
    torch first) and may end the run meanwhile: the member reads the news as it waits."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # a backlog, never served
        membership = Membership(1, ADDRESS, silent.getsockname()[1], 5.0)
        membership.forget_store()  # the Rejoin
        news = iter([False, False, True])  # then the save order: hold

        assert not membership.form(1, [0, 1], superseded=lambda _: next(news))
        assert next(news, None) is None
        assert membership.store_lost is False  # it set out for the new store


def test_a_store_not_serving_yet_is_waited_for_past_silent_s_while_its_host_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The handshake waits in the store's backlog; a new connection to its host is
    # taken at once by the host's kernel: the host is up, the store not serving yet.
    monkeypatch.setattr(groups, "SILENT_S", 0.1)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # a backlog, never served
        polls: list[None] = []

        def news(wait_s: float) -> bool:
            time.sleep(wait_s)
            polls.append(None)
            return len(polls) > 40  # ~2 s: many looks at the host meanwhile

        port = silent.getsockname()[1]
        assert groups.reach(ADDRESS, port, 5.0, superseded=news) is None


def test_a_store_whose_host_went_off_the_network_in_the_handshake_is_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A rank reached the store as its host dropped off the network: its handshake
    # waited out twice the collective timeout (120 s), then ended in a traceback.
    # A new connection to a silent host goes unanswered: the rank gives the store up.
    probed: list[tuple[str, int]] = []

    def unanswered(address: tuple[str, int], timeout: float) -> socket.socket:
        probed.append(address)
        raise TimeoutError("timed out")

    monkeypatch.setattr(groups, "SILENT_S", 0.1)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # a backlog, never served
        port = silent.getsockname()[1]
        monkeypatch.setattr(socket, "create_connection", unanswered)
        with pytest.raises(groups.StoreUnanswered, match=rf"^the group store at 127.0.0.1:{port} "):
            groups.reach(ADDRESS, port, LONG_TIMEOUT_S, superseded=never)
        assert probed == [("127.0.0.1", port)]  # once: it did not wait out the timeout


def test_a_store_that_fails_to_start_refuses_its_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its listening socket must not hold their handshakes for good (the rendezvous'
    timeout does not bound them): a refused client times out, saying so."""
    from torch._C import _distributed_c10d

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no store here")

    monkeypatch.setattr(_distributed_c10d, "TCPStore", broken)
    server = groups.GroupStoreServer(groups.listen(ADDRESS)).start()
    assert server.settle(TIMEOUT_S)
    assert isinstance(server.error, RuntimeError)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S).close()


def _survivor(rank: int, port: int, results: Any) -> None:
    """Rank 0 read generation 2 first; rank 1 (which joined meanwhile) only generation 3."""
    membership = Membership(rank, ADDRESS, port, TIMEOUT_S)
    client = groups.connect(ADDRESS, port, TIMEOUT_S)
    third = groups.generation_store(client, 3)
    outcomes = []
    if rank == 0:

        def newer_order(wait_s: float) -> bool:  # generation 3 was ordered: its member is there
            time.sleep(wait_s)
            return bool(third.check([groups.ARRIVED + "1"]))

        outcomes.append(membership.form(2, [0, 1, 2], superseded=newer_order))
    outcomes.append(membership.form(3, [0, 1], superseded=never))
    total = torch.ones(1)
    torch.distributed.all_reduce(total, group=membership.group)
    membership.close()
    results.put((rank, outcomes, float(total)))


def _pair(target: Any, port: int, answers: int, wait_s: float) -> tuple[list[Any], list[int]]:
    """Run ``target(rank, port, results)`` for ranks 0 and 1 in spawned processes:
    the ``answers`` results they put (each within ``wait_s``) and their exit codes."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, port, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        got = [results.get(timeout=wait_s) for _ in range(answers)]
    finally:
        for proc in procs:
            proc.join(timeout=TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
    return got, [proc.exitcode for proc in procs]


def test_a_survivor_of_a_superseded_generation_joins_the_newer_one_at_once(
    store_port: int,
) -> None:
    got, codes = _pair(_survivor, store_port, 2, TIMEOUT_S)
    outcomes = {rank: (outcome, total) for rank, outcome, total in got}
    assert outcomes == {0: ([False, True], 2.0), 1: ([True], 2.0)}
    assert codes == [0, 0]


def _left_or_waiting(rank: int, port: int, results: Any) -> None:
    """Rank 1 waits in a collective rank 0 never joins; rank 0 leaves the group."""
    membership = Membership(rank, ADDRESS, port, LONG_TIMEOUT_S)
    membership.form(11, [0, 1])
    client = groups.connect(ADDRESS, port, TIMEOUT_S)
    if rank == 1:
        work = torch.distributed.all_reduce(torch.ones(4), group=membership.group, async_op=True)
        client.set("waiting-11", "1")
        try:
            work.wait()
            results.put("completed")
        except RuntimeError as exc:
            results.put(str(exc))
        membership.leave()  # as a survivor does at the Regroup
        client.set("done-11", "1")
    else:
        client.wait(["waiting-11"])
        membership.leave()
        client.wait(["done-11"])  # alive meanwhile: an exit would close the connections too


def test_a_rank_that_leaves_its_group_frees_it_so_a_peer_waiting_in_it_fails_at_once(
    store_port: int,
) -> None:
    # A survivor whose collective broke on a lost peer leaves the old group at
    # the Regroup; another may still wait in that collective for this rank.
    # Only a freed group closes its connections: one left referenced kept its
    # peer waiting out the collective timeout, and the new group could not
    # form without it (a stray reference under torchrun did just that).
    # (waited for far less than its collective timeout)
    (error,), codes = _pair(_left_or_waiting, store_port, 1, LONG_TIMEOUT_S / 2)
    assert error != "completed"
    assert "Timed out" not in error  # the connection closed, or was reset
    assert codes == [0, 0]


def _cut_off_or_surviving(rank: int, port: int, results: Any, how: str) -> None:
    """Rank 2 is in the group and never joins its round (cut off: alive, its
    connections open, until the test lets it go); ranks 0 and 1 make a round
    ``how`` (launched, or waited for on the fp32 or bf16 wire), give it up,
    form the next group without rank 2, average there and end."""
    from elche.runtime.averaging import Collectives, RoundDropped, launch_average
    from elche.runtime.wire import Wire, average_over

    generation = 21 + 2 * ["launched", "fp32", "bf16"].index(how)
    membership = Membership(rank, ADDRESS, port, LONG_TIMEOUT_S)
    membership.form(generation, [0, 1, 2])
    if rank == 2:
        client = groups.connect(ADDRESS, port, TIMEOUT_S)
        client.wait([f"{CUT_OFF_GOES}-{how}"], timedelta(seconds=LONG_TIMEOUT_S))
        return
    model = torch.nn.Linear(3, 2)
    before = [t.clone() for t in model.state_dict().values()]
    if how == "launched":
        pending = launch_average(model, 1, gamma=1.0, group=membership.group).collectives
    else:
        seen: list[Collectives] = []

        def regroup_comes(collectives: Collectives) -> None:  # as the worker's wait does
            seen.append(collectives)
            raise RoundDropped(collectives, "its group re-forms without a lost member")

        with pytest.raises(RoundDropped) as dropped:
            average_over(Wire(how), model, 1, gamma=1.0, group=membership.group, wait=regroup_comes)
        pending = dropped.value.pending
        assert seen == [pending]
    unfinished = not pending.wait_for(0.05)  # it waits for rank 2 (and goes on)
    after = model.state_dict().values()
    untouched = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    membership.drop(pending)
    membership.leave()
    membership.form(generation + 1, [0, 1])
    total = torch.ones(1)
    torch.distributed.all_reduce(total, group=membership.group)
    membership.close()  # the dropped collective still waits: its group is never freed
    results.put((rank, unfinished, untouched, float(total)))


CUT_OFF_GOES = "cut-off-goes"  # the test's word to rank 2, once the survivors ended


@pytest.mark.parametrize("how", ["launched", "fp32", "bf16"])
def test_survivors_drop_a_round_a_cut_off_member_holds_and_go_on_in_a_new_group(
    store_port: int, how: str
) -> None:
    # A member cut off the network (alive, silent) holds a round's collectives
    # until the group's timeout. The survivors drop them at the Regroup, the
    # model as it was: the old group stays alive (freeing it would wait for
    # them), the new one forms and averages at once, and each survivor's process
    # ends while the cut-off member still holds the old round, without waiting
    # out its timeout.
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_cut_off_or_surviving, args=(rank, store_port, results, how))
        for rank in range(3)
    ]
    for proc in procs:
        proc.start()
    try:
        got = sorted(results.get(timeout=LONG_TIMEOUT_S / 4) for _ in range(2))
        for proc in procs[:2]:  # (waited for far less than the collective's timeout)
            proc.join(timeout=LONG_TIMEOUT_S / 4)
        codes = [proc.exitcode for proc in procs[:2]]
    finally:
        groups.connect(ADDRESS, store_port, TIMEOUT_S).set(f"{CUT_OFF_GOES}-{how}", "1")
        for proc in procs:
            proc.join(timeout=TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
    assert got == [(0, True, True, 2.0), (1, True, True, 2.0)]
    assert codes == [0, 0]
    assert procs[2].exitcode == 0


def test_a_first_group_reformed_before_the_store_serves_is_read_once_it_does() -> None:
    # The coordinator may hear of a rank lost at start-up while its store still imports
    # torch: the reform must be there for the ranks that come to gather after.
    server = groups.GroupStoreServer(groups.listen(ADDRESS))
    server.reform_first(1, [0, 2])
    server.start()
    assert server.settle(60.0) and server.error is None
    client = groups.connect(ADDRESS, server.port, 5.0)
    assert groups.first_group(client) == (1, [0, 2])
    server.reform_first(2, [2])  # a second loss: the newest reform only
    assert groups.first_group(client) == (2, [2])


def test_the_store_says_which_ranks_the_run_declared_lost_for_their_silence() -> None:
    # elche join reads it for its rank, and kills the rank's hung process.
    server = groups.GroupStoreServer(groups.listen(ADDRESS))
    server.say_hung(3, "heartbeat stale: silent for 5.2 s")  # before it serves: kept
    server.start()
    assert server.settle(60.0) and server.error is None
    client = groups.connect(ADDRESS, server.port, 5.0)
    assert groups.hung(client, 3) == "heartbeat stale: silent for 5.2 s"
    assert groups.hung(client, 4) is None
    server.say_hung(4, "did not rejoin the restarted coordinator within 20 s")
    # (torch's set reads no answer: the server may take this client's look first)
    deadline = time.monotonic() + 30.0
    while (said := groups.hung(client, 4)) is None and time.monotonic() < deadline:
        time.sleep(0.01)  # polling for a condition, with a deadline
    assert said == "did not rejoin the restarted coordinator within 20 s"


def test_a_store_call_left_unanswered_ends_naming_the_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch's client waits for good on a store whose host went silent: a call the
    # store answers without waiting is given up after SILENT_S, naming the store (its
    # host, its port).
    import threading

    monkeypatch.setattr(groups, "SILENT_S", 0.05)
    silent = threading.Event()

    class Client:  # a PrefixStore over the client, as a generation's store is
        host, port = "10.0.0.1", 29511

    class Prefixed:
        underlying_store = Client()

    with pytest.raises(groups.StoreUnanswered) as info:
        groups.ask(Prefixed(), silent.wait)  # type: ignore[arg-type]
    silent.set()
    assert str(info.value) == (
        "the group store at 10.0.0.1:29511 did not answer in 0 s: its host is off the "
        "network, or the coordinator there hung"
    )
    assert groups.ask(Client(), lambda: "formed") == "formed"  # type: ignore[arg-type]


def test_a_rank_gathering_for_the_first_group_stops_when_the_store_closes_under_it() -> None:
    # The coordinator died before the first group formed (no journal yet: no
    # successor). Its store closed, so no news could come, and the rank waited out
    # twice its timeout, then ended in a traceback ("the group store stopped
    # answering; no news came in …"); it now stops at once, saying why.
    ctx = mp.get_context("fork")
    ports = ctx.Queue()
    server = ctx.Process(target=_serve_store, args=(ports,), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=30)
        watcher = groups.connect(ADDRESS, port, 5.0)

        def kill_once_arrived() -> None:  # rank 0 gathers; rank 1 never comes
            while not watcher.check([f"group-0/{groups.ARRIVED}0"]):
                time.sleep(0.05)  # polling the store, bounded by the member's wait
            server.kill()

        killer = threading.Thread(target=kill_once_arrived, daemon=True)
        killer.start()
        member = Membership(0, ADDRESS, port, timeout_s=5.0)
        with pytest.raises(groups.RunEndedUnformed) as ended:
            member.join_first(2)
        assert ended.value.why == membership.STORE_CLOSED
        killer.join(timeout=10)
    finally:
        server.kill()
        server.join(timeout=10)
