"""Where the collective groups of a run form: a TCP store in the coordinator process.

Theory of operation. A collective group (gloo) forms through a key-value
store that every member reaches. The store lives in the coordinator
process, which is no rank and so does not die with one, and it is reached
over the network at the coordinator's host, so ranks on other hosts reach
it as well as local ones: nothing of a run's rendezvous lies in files.

The coordinator binds the store's socket as it binds its control socket
(``listen``, same interface, any free port) and says the port on its
address line; only then does it import torch and serve the store on that
socket (``serve``, in a thread), so the launcher does not wait for torch
(a local run's coordinator forks with torch loaded and serves at once).
A rank that connects before the store serves waits in the socket's
backlog. Generation ``g`` of the group (the first one, and the one formed
after each ``Regroup``) rendezvous under the prefix ``group-g`` of the
store (``generation_store``), so the keys of an abandoned generation never
meet those of the next.

A generation after the first forms in two steps. Each member first marks
itself arrived and waits until every member has (``gather``), watching for
a newer order meanwhile; only then does it enter torch's rendezvous, which
cannot be left before its timeout. Two ranks lost within one heartbeat
check make the coordinator order two generations a moment apart: a
survivor that read the first order gathers for it, sees the second one
come, and leaves at once for the generation its peers are gathering in,
where a survivor blocked in the first generation's rendezvous would have
kept them waiting until every one of them timed out.

Whether a gathering ends in the rendezvous is decided once, for all its
members, by the store's compare-and-set on its ``outcome`` key: the first
member to see every member arrived claims it ``formed``, the first to see
the generation ordered away (or to give up waiting) claims it
``abandoned``, and every member follows what was claimed. Arrival marks
alone cannot decide it: a member that left a superseded gathering keeps
its mark, and a late member that counted it would enter the rendezvous
alone and wait there for the whole timeout (a coordinator restarted at
the final save orders a new generation and the save a moment apart; the
ranks told to hold left, and the writer, which had read only the first
order, blocked). A member whose gathering was claimed ``formed`` forms
the group even if a newer order came meanwhile; that order is next.

Every call a gathering member makes to the store is one the store answers
without waiting (a look, a mark, a claim), and ends within ``SILENT_S``
(``ask``, ``elche.runtime.store_calls``): torch's client does not keep its
timeout when the store's host drops off the network silently, and a member
gathering while the coordinator's host was cut off waited in its call
until TCP gave the connection up, a quarter of an hour later (then, bounded
by the store's own timeout and a grace, 65 s). Such a call raises
``StoreUnanswered``, and its client is used no more.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from elche.runtime.store_calls import GRACE_S, SILENT_S, bounded

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = [
    "GROUPS_FIELD",
    "GROUPS_PORT_ENV",
    "GroupStoreServer",
    "RunEndedUnformed",
    "StoreUnanswered",
    "ask",
    "connect",
    "first_group",
    "gather",
    "generation_store",
    "hung",
    "listen",
    "parse_address_line",
    "reach",
    "run_ended",
    "store_host",
]

GROUPS_FIELD = "groups="  # on the coordinator's address line: the store's port
# The port a restarted coordinator serves the store on: its predecessor's,
# which every rank was told.
GROUPS_PORT_ENV = "ELCHE_GROUPS_PORT"

# How long the store server waits on a client's request before dropping it.
SERVER_TIMEOUT_S = 300.0

# The first group's reform (``ReformFirstGroup``): "GENERATION:RANK,RANK,…", newest only.
FIRST_GROUP = "first-group"
# The run ended (failed) before its first group formed: why. Ranks still gathering
# for it read this and stop, rather than wait out the store's end (``gather``).
RUN_ENDED = "run-ended"
ARRIVED = "arrived/"  # + a member's rank: it has come to gather for its generation
# + a rank: why the run declared it lost for its silence, for the launcher that started
# it (``elche join``'s), which kills it: a hung process must not come back.
HUNG = "hung/"
OUTCOME = "outcome"  # FORMED or ABANDONED, claimed once (compare-and-set) for every member
FORMED = "formed"
ABANDONED = "abandoned"
# Not a claim: the store stopped answering (its server, the coordinator, died). A
# gathering member then waits for the news that comes of it, as for a newer order.
GONE = "gone"
GATHER_POLL_S = 0.05  # how often a gathering member looks at the store


def store_host(address: str) -> str:
    """The host part of a coordinator address ``tcp://HOST:PORT``."""
    rest = address.partition("://")[2]
    return rest.rpartition(":")[0].strip("[]")


def parse_address_line(words: list[str]) -> tuple[str, int | None]:
    """``[ADDRESS, "groups=PORT"?]`` of the coordinator's address line: address, store port."""
    port = None
    for word in words[1:]:
        if word.startswith(GROUPS_FIELD):
            port = int(word.removeprefix(GROUPS_FIELD))
    return words[0], port


def listen(bind: str, port: int = 0) -> socket.socket:
    """A listening socket on the interface of ``bind`` (``tcp://HOST:PORT``), on ``port``
    (0: any free port)."""
    host = store_host(bind)
    if host in ("*", ""):
        host = "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=128)


class GroupStoreServer:
    """Serves the run's store on a socket from ``listen`` (torch imported in a thread).

    ``info``: keys the store holds from the start (what a joining rank reads,
    ``elche.runtime.joining``); ``counters``: counters it starts at these values.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        info: dict[str, str] | None = None,
        counters: dict[str, int] | None = None,
    ) -> None:
        self.sock = sock
        self._info = dict(info or {})
        self._counters = dict(counters or {})
        self.port: int = sock.getsockname()[1]
        self.error: BaseException | None = None
        self._store: Any = None  # the TCPStore, kept alive while the run lasts
        self._lock = threading.Lock()  # _store and _info, between the host and _serve
        self._thread = threading.Thread(target=self._serve, name="elche-group-store", daemon=True)

    def start(self) -> GroupStoreServer:
        self._thread.start()
        return self

    def settle(self, timeout_s: float) -> bool:
        """Wait until the store serves or failed to start (``error``); whether it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _serve(self) -> None:
        try:
            from torch._C._distributed_c10d import TCPStore

            store = TCPStore(
                "0.0.0.0", self.port, None, True, timedelta(seconds=SERVER_TIMEOUT_S),
                wait_for_workers=False, master_listen_fd=self.sock.fileno(),
            )  # fmt: skip
            with self._lock:
                for key, value in self._info.items():
                    store.set(key, value)
                for key, start in self._counters.items():
                    store.add(key, start)
                self._store = store
        except Exception as exc:  # the ranks' group formation then times out, saying so
            self.error = exc
            print(f"elche coordinator: the group store did not start: {exc}", file=sys.stderr)
            # A listening socket nobody serves would hold each client's handshake
            # for good (torch's timeout does not bound it): refuse them instead.
            # (Shut down, not closed: the store may own the descriptor by now.)
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def reform_first(self, generation: int, members: Sequence[int]) -> None:
        """Tell ranks gathering for the first group to form ``generation`` of ``members``."""
        self._say(FIRST_GROUP, f"{generation}:{','.join(map(str, members))}")

    def end_run(self, why: str) -> None:
        """Tell ranks still gathering for the first group that the run ended (``why``)."""
        self._say(RUN_ENDED, why)

    def say_hung(self, rank: int, why: str) -> None:
        """Say that the run declared ``rank`` lost for its silence (``why``), for its
        launcher (``hung``)."""
        self._say(f"{HUNG}{rank}", why)

    def _say(self, key: str, value: str) -> None:
        with self._lock:
            if self._store is None:  # not serving yet: it holds the key from the start
                self._info[key] = value
            else:
                self._store.set(key, value)


class RunEndedUnformed(RuntimeError):
    """The run ended (failed) while this rank gathered for its first group."""

    def __init__(self, why: str) -> None:
        super().__init__(f"the run ended before its first group formed: {why}")
        self.why = why


class StoreUnanswered(TimeoutError):
    """A call to the group store got no answer in its time (``ask``): the store's host
    is off the network, or its coordinator hung."""

    def __init__(self, where: str, waited_s: float) -> None:
        super().__init__(
            f"the group store at {where} did not answer in {waited_s:.0f} s: its host is off "
            "the network, or the coordinator there hung"
        )


T = TypeVar("T")


def ask(store: Store, call: Callable[[], T], waited_s: float | None = None) -> T:
    """``call()``, a call to ``store``, ended within ``waited_s``; by default (None)
    one the store's side answers without waiting, ended within ``SILENT_S``
    (``elche.runtime.store_calls``).

    Raises:
        StoreUnanswered: the call did not end; it is left to its thread, and the
            store's client, stuck in it, must take no other call.
        RuntimeError: torch's own errors (a ``DistError``), as they come.
    """
    if waited_s is None:
        waited_s = SILENT_S
    ended, answer = bounded(call, waited_s)
    if not ended:
        while (under := getattr(store, "underlying_store", None)) is not None:
            store = under  # a generation's PrefixStore: the client under it says where
        raise StoreUnanswered(f"{getattr(store, 'host', '?')}:{getattr(store, 'port', '?')}",
                              waited_s)  # fmt: skip
    return cast("T", answer)


def run_ended(store: Store) -> str | None:
    """Why the run ended before its first group formed (``end_run``), if it did."""
    if not store.check([RUN_ENDED]):
        return None
    return bytes(store.get(RUN_ENDED)).decode()


def hung(store: Store, rank: int) -> str | None:
    """Why the run declared ``rank`` lost for its silence (``say_hung``), if it did."""
    key = f"{HUNG}{rank}"
    return bytes(store.get(key)).decode() if store.check([key]) else None


def first_group(store: Store) -> tuple[int, list[int]] | None:
    """The first group's newest reform (``GroupStoreServer.reform_first``), if any."""
    if not store.check([FIRST_GROUP]):
        return None
    generation, _, members = bytes(store.get(FIRST_GROUP)).decode().partition(":")
    return int(generation), [int(r) for r in members.split(",") if r]


def connect(address: str, port: int, timeout_s: float) -> Store:
    """A client of the store served at the host of coordinator ``address``, on ``port``."""
    from torch._C._distributed_c10d import TCPStore

    return TCPStore(
        store_host(address), port, None, False, timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )  # fmt: skip


def reach(
    address: str, port: int, timeout_s: float, *, superseded: Callable[[float], bool]
) -> Store | None:
    """``connect`` on a thread while ``superseded`` (``gather``'s look at the news) reads news.

    A store that takes connections but does not serve yet (a restarted
    coordinator imports torch first) holds a client's handshake with no
    bound, and its coordinator may meanwhile end the run, or order something
    else, without this rank: the connection is then left to its thread. So
    does a store whose host dropped off the network during the handshake:
    a handshake unfinished after ``SILENT_S`` is told from a store not
    serving yet by a new connection to it, which the host's kernel takes
    at once while the host is on the network (``_host_silent``).

    Returns:
        The client, or None when superseded first.

    Raises:
        StoreUnanswered: the store's host is off the network, or the store
            did not answer in ``2 * timeout_s``.
        RuntimeError: torch's own errors (a ``DistError``), as they come.
    """
    client: Future[Store] = Future()

    def attempt() -> None:
        try:
            client.set_result(connect(address, port, timeout_s))
        except Exception as exc:  # raised by ``result``, in the caller's thread
            client.set_exception(exc)

    threading.Thread(target=attempt, name="elche-group-store-client", daemon=True).start()
    host, began = store_host(address), time.monotonic()
    probe_at = began + SILENT_S
    while not client.done():
        if superseded(GATHER_POLL_S):
            return None
        now = time.monotonic()
        if now - began > 2 * timeout_s:
            raise StoreUnanswered(f"{host}:{port}", 2 * timeout_s)
        if now > probe_at:
            if _host_silent(host, port):
                raise StoreUnanswered(f"{host}:{port}", time.monotonic() - began)
            probe_at = time.monotonic() + SILENT_S
    return client.result()


def _host_silent(host: str, port: int) -> bool:
    """Whether a new TCP connection to ``host:port`` goes unanswered for ``GRACE_S``:
    the host is off the network (a refused or reset one is torch's to report)."""
    try:
        socket.create_connection((host, port), timeout=GRACE_S).close()
    except TimeoutError:
        return True
    except OSError:
        pass
    return False


def generation_store(client: Store, generation: int) -> Store:
    """The part of the store that generation ``generation`` of the group forms in."""
    from torch._C._distributed_c10d import PrefixStore

    return PrefixStore(f"group-{generation}", client)


def gather(
    store: Store,
    rank: int,
    members: Sequence[int],
    *,
    timeout_s: float,
    superseded: Callable[[float], bool],
) -> bool:
    """Mark ``rank`` arrived in a generation's ``store`` and wait until it is claimed formed.

    ``superseded(wait_s)`` waits up to ``wait_s`` for news and says whether
    this generation was ordered away meanwhile (a newer one, or the save of a
    run that cannot go on); the member then claims the gathering abandoned
    and leaves, unless a peer that saw every member arrived claimed it
    formed first. A member may come late by up to ``timeout_s``, the time a
    peer can spend blocked in the rendezvous of a generation superseded
    after everyone gathered for it; the wait is therefore twice that (the
    coordinator orders a newer generation, which ends it sooner, when a
    member is lost).

    A store that stops answering (the coordinator that serves it died) is
    waited out the same way: its successor's ``Rejoin``, or the news that the
    coordinator is lost, supersedes the generation. A store that does not
    answer at all (its host cut off) ends the gathering: each call to it,
    answered without waiting on the store's side, ends within ``SILENT_S``
    (``ask``).

    Returns:
        True when the gathering was claimed formed: enter the rendezvous.
        False when this member's generation was superseded and not formed.

    Raises:
        RuntimeError: the gathering was not claimed formed in ``2 * timeout_s``
            (members that did not arrive are named).
        StoreUnanswered: a call to the store got no answer (``ask``).
    """
    keys = [f"{ARRIVED}{member}" for member in members]
    deadline = time.monotonic() + 2 * timeout_s

    def answer(call: Callable[[], object]) -> str | None:
        return _answer(store, call)

    def claim(outcome: str) -> str:
        return ask(store, lambda: _claim(store, outcome))

    outcome = answer(lambda: store.set(f"{ARRIVED}{rank}", "1"))
    while outcome == GONE or (outcome := answer(lambda: _outcome(store, keys))) != FORMED:
        if superseded(GATHER_POLL_S):
            return outcome is None and claim(ABANDONED) == FORMED
        if time.monotonic() > deadline:
            waited = f"{2 * timeout_s:.0f} s"
            if outcome == GONE:
                raise RuntimeError(f"the group store stopped answering; no news came in {waited}")
            if outcome is None and claim(ABANDONED) == FORMED:
                return True  # the last member came just now
            arrived = ask(store, lambda: [store.check([key]) for key in keys])
            missing = [m for m, came in zip(members, arrived, strict=True) if not came]
            if missing:
                raise RuntimeError(f"rank(s) {missing} did not come to form the group in {waited}")
            raise RuntimeError(f"a member gave the group up and no newer order came in {waited}")
    return True


def _answer(store: Store, call: Callable[[], object]) -> str | None:
    """``call()``'s outcome (None for no claim yet), or ``GONE`` if the store broke.

    Raises:
        StoreUnanswered: no answer came (``ask``).
    """
    try:
        answer = ask(store, call)
    except RuntimeError:  # torch's DistNetworkError: the connection to its server broke
        return GONE
    return answer if isinstance(answer, str) else None


def _outcome(store: Store, keys: list[str]) -> str | None:
    """What the gathering was claimed; claimed formed now if every member has arrived."""
    if store.check([OUTCOME]):
        return bytes(store.get(OUTCOME)).decode()
    if store.check(keys):
        return _claim(store, FORMED)
    return None


def _claim(store: Store, outcome: str) -> str:
    """Claim the gathering's ``outcome`` unless a member claimed one first; what it is now."""
    return bytes(store.compare_set(OUTCOME, "", outcome)).decode()
