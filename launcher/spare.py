"""A spare host: what a host does while it waits to take a lost host's place.

A host that comes while the job has ``--nnodes MAX`` hosts waits in the rendezvous: the
running group is never restarted for it (``launcher.rounds.answer_waiting``: hosts
waiting beside a full group are spares, unless a member of the round left or failed).
While it waits, its supervisor makes it *hot* (:class:`Spare`, driven by the
coordination service's heartbeat): it reserves and pre-faults the slots of the ranks it
may take over, as large as the running hosts' largest (``slot_bytes`` in their records),
and its standby workers import torch and the modules the workers use
(``launcher.standby``); once both are done its record says ``ready``, which ``gemini
status`` shows and the root counts for ``--replace-stragglers``.

When a host is lost (``launcher.coordination``: a lease revoked or expired), the spare
looks up which live peers hold replicas of the lost host's ranks, s* first, and pulls
them into its reserved memory (``MemoryService.take_over``) while the survivors stop and
the next round forms; that round admits it in the lost host's node slot
(``launcher.rendezvous.assign_slots``), and its restore finds the pulled copies in its
own memory (``launcher.tiers``). A spare fenced out of a round, or a host that joins a
job that shrank, is a spare again the same way (``launcher.elastic_agent``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from launcher.errors import StoreError

if TYPE_CHECKING:
    from launcher.slots import SlotOwner
    from launcher.store import Store

logger = logging.getLogger(__name__)

#: Where the copies of one rank are: per copy, (replication address, step), best first.
Copies = Mapping[int, list[tuple[tuple[str, int], int]]]


class Spare:
    """The waiting host's side: reservation, readiness, the take-over of a lost host."""

    def __init__(self, store: Store, prefix: str, owner: SlotOwner, *,
                 running_slot_bytes: Callable[[], list[int]],
                 peers: Callable[[], dict[str, tuple[str, int]]],
                 changed: Callable[[], None]) -> None:
        """``running_slot_bytes``: the slot sizes the running hosts published;
        ``peers``: the live running hosts' replication addresses, read fresh;
        ``changed``: publish this host's record now (its readiness changed)."""
        self.store, self.prefix, self.owner = store, prefix, owner
        self._running_slot_bytes, self._peers, self._changed = (
            running_slot_bytes, peers, changed)
        self.take_over: Callable[[Copies], None] | None = None
        """Called with the copies of a lost host's ranks that the peers hold
        (``MemoryService.take_over``); None: no replication, nothing to pull."""
        self.standby_ready: Callable[[], bool] | None = None
        """Whether this host's standby workers wait with torch imported (None: none kept)."""
        self._reserving: threading.Thread | None = None
        self._reserved_for = 0  # the slot size the last finished reservation was for
        self._taken_over: set[str] = set()
        self._lock = threading.Lock()

    def joined(self) -> None:
        """This host's ranks take the reserved slots: reserve again if it waits later."""
        self._reserved_for = 0

    def wait(self) -> bool:
        """Called on every heartbeat while the host waits: reserve the slots (in the
        background) for the running hosts' slot size; whether the host is ready (slots
        reserved, standby workers warm)."""
        reserving = self._reserving is not None and self._reserving.is_alive()
        if not reserving:
            nbytes = max(self._running_slot_bytes(), default=0)
            if nbytes > 0 and nbytes != self._reserved_for:
                self._reserve(nbytes)
                reserving = True
        standbys = self.standby_ready is None or self.standby_ready()
        return bool(self._reserved_for) and not reserving and standbys

    def _reserve(self, nbytes: int) -> None:
        def reserve() -> None:
            self.owner.reserve(2 * self.owner.local_world_size, nbytes)
            self._reserved_for = nbytes  # done (when short of memory: as far as it could)
            self._changed()  # publish the readiness now

        self._reserving = threading.Thread(target=reserve, name="gemini-reserve", daemon=True)
        self._reserving.start()

    def host_lost(self, host: str, record: Mapping[str, Any]) -> None:
        """A host is lost while this one waits: look up, in the background, which peers
        hold replicas of its ranks and hand them to :attr:`take_over` (once per host)."""
        with self._lock:
            if self.take_over is None or host in self._taken_over:
                return
            self._taken_over.add(host)
        ranks = {rank for rank in record.get("ranks") or [] if isinstance(rank, int)}
        if ranks:
            threading.Thread(target=self._find_replicas, args=(ranks,),
                             name="gemini-takeover", daemon=True).start()

    def _find_replicas(self, ranks: set[int]) -> None:
        """The copies of ``ranks`` on live peers: of the replication's globally
        restorable step s* first (every holder keeps it; the round restores it, or a
        newer step when one completed meanwhile), then of the newest step each peer
        published (published every few seconds: it may be gone by now)."""
        prefix = self.prefix + "replicas/"
        try:  # read now: the watch of the records may not have delivered the latest yet
            peers = self._peers()
            found = self.store.get_prefix(prefix)
            sstar = _field(self.store.get(self.prefix + "replication/plan"), "sstar")
        except StoreError as exc:
            logger.warning("cannot look up the replicas of a lost host: %s", exc)
            return
        copies: dict[int, list[tuple[tuple[str, int], int]]] = {}
        for key, value in sorted(found.items()):
            rank, _, holder = key[len(prefix):].partition("/")
            step = _field(value, "step")
            if rank.isdigit() and int(rank) in ranks and holder in peers and isinstance(step, int):
                steps = [s for s in (sstar, step) if isinstance(s, int) and s >= 0]
                copies.setdefault(int(rank), []).extend(
                    (peers[holder], s) for s in dict.fromkeys(steps))
        for held in copies.values():  # s* from every holder first
            held.sort(key=lambda copy: copy[1] != sstar)
        if copies and self.take_over is not None:
            self.take_over(copies)


def _field(value: bytes | None, name: str) -> object:
    """``name`` of the JSON object ``value`` (None if it is not one)."""
    try:
        record = json.loads(value) if value is not None else None
    except (ValueError, UnicodeDecodeError):
        return None
    return record.get(name) if isinstance(record, dict) else None
