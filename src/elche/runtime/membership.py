"""A collective rank's place in the run's gloo group, one generation after another.

Theory of operation. Without a launcher, generation 0 of the group forms
at the start over the coordinator's group store (``elche.runtime.groups``);
under one (``torchrun``, ``elche run``) the launcher's default group is
generation 0, once a barrier shows every rank still there. A rank lost since
the launcher's rendezvous (killed while it built its model) fails that
barrier on every other rank: they let the default group go and form
generation 0 over the store, which the coordinator re-forms without the lost
rank. After a rank is lost the coordinator orders
the survivors into a new generation: each leaves the old group (which may be
broken), gathers with the new members and forms the new group. A restarted
coordinator serves a new store, so the client is dropped (``forget_store``)
and reconnected at the next formation; so is one stuck in a call the store
did not answer (``groups.StoreUnanswered``: the coordinator's host is off
the network).

A collective a rank dropped when the group re-formed (``drop``: it waits for
a member that was lost, cut off rather than dead, so it fails only at the
group's timeout) keeps its group alive until it ends: freeing a gloo group
waits for the collectives it runs, so the old group is left without that
wait and freed once its collective timed out. One still waiting when the
rank's training ends is never freed (``close``): its thread ends with the
process, which would otherwise wait out that timeout on its way out.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from elche.runtime import groups

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

    from elche.runtime.averaging import Collectives

__all__ = ["Membership"]


# Why a rank gathering for the first group stops when the store closes under it:
# no news can come (a restarted coordinator has no journal before the run began,
# so it cannot go on with the run), and the rank no longer waits out the gathering.
STORE_CLOSED = "the coordinator's group store closed (the coordinator ended or died)"


class Membership:
    """The group of rank ``rank``, formed at the store of coordinator ``address``."""

    def __init__(self, rank: int, address: str, port: int | None, timeout_s: float) -> None:
        self.rank = rank
        self.address = address
        self.port = port
        self.timeout_s = timeout_s
        self.group: dist.ProcessGroup | None = None
        self._store: Store | None = None  # the client of the group store, once formed
        self._forgotten = False  # a restart dropped the client (until the next connection)
        # Collectives dropped unfinished, each with its group (kept alive until it ends).
        self._dropped: list[tuple[dist.ProcessGroup, Collectives]] = []

    @property
    def store_lost(self) -> bool:
        """Whether a restart dropped the store client since this rank last set out to reach it."""
        return self._forgotten

    def forget_store(self) -> None:
        """The coordinator restarted: its store went with it; reconnect at the next formation."""
        self._store = None
        self._forgotten = True

    def join_first(self, world_size: int) -> None:
        """Form generation 0 of ``world_size`` ranks, or take the launcher's default group.

        A rank lost while they gather (a crash during start-up) leaves the
        others waiting: the coordinator then has them form a newer generation
        without it (``groups.first_group``), and each moves there. Under a
        launcher its default group is taken once a barrier in it passes; a rank
        lost since its rendezvous fails the barrier on every rank that waits
        for it there, and they form generation 0 over the store instead. (One
        that dies inside the barrier itself could let some pass and fail
        others: the few microseconds of that window are not guarded.) A run
        the coordinator ended meanwhile (a whole host gone before its rank
        gathered: the formation timed out) says so in the store, and the rank
        stops at once instead of waiting out the store's end. A store that
        does not answer (its host cut off) has no news to give: the rank fails.

        Raises:
            groups.RunEndedUnformed: the run ended before the group formed.
            groups.StoreUnanswered: the store did not answer a call.
            RuntimeError: the group did not form otherwise.
        """
        if dist.is_initialized():
            try:
                dist.barrier()  # (its timeout is the launcher's)
            except RuntimeError:  # torch's DistError: a rank is gone since the rendezvous
                with contextlib.suppress(Exception):  # the group is broken
                    dist.destroy_process_group()
            else:
                self.group = dist.group.WORLD
                return
        generation, members = 0, list(range(world_size))
        while True:
            try:
                if self.form(generation, members, superseded=self._first_reformed(generation)):
                    return
            except groups.RunEndedUnformed:
                raise
            except RuntimeError:  # torch's timeout in the rendezvous, past the gathering
                if self._newer_first(generation) is None:
                    raise
            reform = self._newer_first(generation)
            if reform is None or self.rank not in reform[1]:
                raise RuntimeError(f"group {generation} of {members} did not form")
            generation, members = reform

    def _first_reformed(self, generation: int) -> Callable[[float], bool]:
        """``groups.gather``'s look at the news for the first group: a newer generation.

        Raises (from the returned function):
            groups.RunEndedUnformed: the coordinator ended the run meanwhile
                (its formation timed out, too few ranks left).
        """

        def superseded(wait_s: float) -> bool:
            time.sleep(wait_s)  # the gathering's poll interval
            why = None
            if (store := self._store) is not None:
                try:  # (unanswered, ``StoreUnanswered``, a TimeoutError: raised as it is)
                    why = groups.ask(store, lambda: groups.run_ended(store))
                except RuntimeError:  # torch's DistNetworkError: the store is gone
                    why = STORE_CLOSED
            if why is not None:
                raise groups.RunEndedUnformed(why)
            return self._newer_first(generation) is not None

        return superseded

    def _newer_first(self, generation: int) -> tuple[int, list[int]] | None:
        """The first group's reform, if newer than ``generation``."""
        if (store := self._store) is None:  # still reaching the store
            return None
        try:
            reform = groups.ask(store, lambda: groups.first_group(store))
        except RuntimeError:  # the store stopped answering: no news (``groups.gather``)
            return None
        return reform if reform is not None and reform[0] > generation else None

    def form(
        self,
        generation: int,
        members: list[int],
        *,
        superseded: Callable[[float], bool] | None = None,
    ) -> bool:
        """Join generation ``generation`` of the group made of ``members``.

        With ``superseded`` the members gather first (``groups.gather``).

        Returns:
            False when the generation was superseded, and not claimed formed,
            while its members gathered.

        Raises:
            RuntimeError: no store port, or the group did not form in time.
            groups.StoreUnanswered: the store did not answer a call as the
                members gathered; its client is dropped.
        """
        if self.port is None:
            raise RuntimeError("a collective group needs the coordinator's group store port")
        if self._store is None:
            self._forgotten = False
            if superseded is None:
                self._store = groups.connect(self.address, self.port, self.timeout_s)
            else:
                self._store = groups.reach(
                    self.address, self.port, self.timeout_s, superseded=superseded
                )
                if self._store is None:
                    return False
        store = groups.generation_store(self._store, generation)
        try:
            if superseded is not None and not groups.gather(
                store, self.rank, members, timeout_s=self.timeout_s, superseded=superseded
            ):
                return False
        except groups.StoreUnanswered:
            self._store = None  # stuck in that call: a client takes no other
            raise
        dist.init_process_group(
            "gloo",
            store=store,
            rank=members.index(self.rank),
            world_size=len(members),
            timeout=timedelta(seconds=self.timeout_s),
        )
        self.group = dist.group.WORLD
        return True

    def drop(self, collective: Collectives) -> None:
        """Give up ``collective``, started in the current group and not completed
        (the group re-forms without a lost member, or the rank stops). The
        group stays alive until the collective ends (the module docstring)."""
        if self.group is not None:
            self._dropped.append((self.group, collective))

    def leave(self) -> None:
        """Leave the current group before forming the next one.

        The group is freed here only if nothing else holds it: a reference
        kept elsewhere keeps its connections open, and a peer still waiting
        in a broken collective for this rank waits out its timeout. A group
        whose dropped collective still waits is not freed yet (``drop``).
        """
        if self.group is not None:
            with contextlib.suppress(Exception):  # the old group may be broken
                dist.destroy_process_group()
            self.group = None
        self._dropped = [(group, c) for group, c in self._dropped if not c.completed()]

    def close(self) -> None:
        """At the end of training: destroy the group; a group whose dropped
        collective still waits is never freed (the module docstring)."""
        for group, collective in self._dropped:
            if not collective.completed():
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
        self._dropped.clear()
        if self.group is not None:
            dist.destroy_process_group()
            self.group = None
