"""The supervisors' shared view of a run, kept in the coordination store.

Key layout (all under ``gemini/runs/<run_id>/``)::

    root                    host id of the root supervisor (bound to its lease: an election)
    alive/<host>            "1", bound to the host's lease: gone within the TTL of its death
    hosts/<host>            JSON record: pid, lease, ranks, round, restart count, when it
                            last changed, state ("waiting" until the host's first round: a
                            spare; "running"; "exited"), and where its replication server
                            listens and its rendezvous node (``describe``); written when
                            it changes, never on a timer (liveness is ``alive/``)
    replication/plan        JSON: the replication round's globally restorable step s*, its
                            next target, k and the lag (``launcher.replication.progress``)
    replication/done/<node> JSON: the newest target node ``node`` has replicated
    ranks/<rank>            JSON: the host holding the rank and its newest step per tier
    replicas/<rank>/<host>  JSON: the newest step of ``rank`` that ``host`` keeps a replica of
    failed/<host>           JSON: the rendezvous round in which ``host``'s workers failed
                            and it restarts them (bound to its lease): every member of
                            that round restarts at once (``report_failure``)
    goodput/<host>          JSON: the run's goodput ledger as ``host`` keeps it
                            (``launcher.goodput``), written every REPORT_EVERY seconds
    pace/<host>             JSON: ``host``'s own work per step (``launcher.stragglers``),
                            written every REPORT_EVERY seconds
    stragglers              JSON: the root's verdict on the hosts' paces: scores, the
                            stragglers, those to replace
    suspects/<host>/<by>    "1", bound to ``by``'s lease: ``by`` gets no heartbeat answer
                            from ``host`` (``launcher.heartbeat``; a majority makes it lost)
    events/<ns>-<host>      JSON failure and recovery events (host_lost, worker_exit, ...);
                            the root keeps the newest STORE_EVENT_LIMIT
    exit/<host>             JSON: the steps each of ``host``'s ranks holds in memory as the
                            job ends on a signal (bound to its lease): every host persists
                            the newest step all ranks hold (``agree_on_exit``)
    stopped                 JSON: why a host stopped the job for good (the no-progress
                            guard, ``report_stopped``): a host whose rendezvous then
                            closes ends with the same exit code (cleared at the next start)
    secret                  the replication secret, unless every host has a --secret-file
                            (a private key: ``launcher.store.PRIVATE_SEGMENT``); the last
                            host to leave deletes it

Each supervisor runs :class:`CoordinationService`: it registers under a lease kept alive
in the background, publishes its ranks' newest committed steps, campaigns for root, and,
while root, records a ``host_lost`` event when another host's lease expires (after a
store outage, only if the host has not registered again within a ttl: no lease could be
refreshed meanwhile). A supervisor that sees another's die (its workers failed, and
nothing listens any longer where that supervisor's replication server was: the process
is gone, its machine is up) revokes the dead host's lease (:meth:`declare_dead`): every
host learns of the loss through its watch at once, without waiting out the TTL. A host
that stops answering heartbeats (frozen, powered off, cut off: no connection is ever
refused) is lost once a majority of the hosts that watch it suspect it (:meth:`suspect`,
fed by ``launcher.heartbeat``; each running host is watched by the :data:`FANOUT` hosts
before it in the ring of running hosts, :func:`watchers`), and its lease is revoked the
same way. What every host knows of the others (who is alive, their records) comes through
watches of the store, so that no host reads a prefix that grows with the job on a timer.
Store outages never stop training: writes are queued and retried by
the heartbeat thread, and a lease that expired meanwhile is replaced and every key bound
to it published again.
:func:`read_status` turns one prefix read into the snapshot ``gemini status`` shows, and
:class:`RunReader` finds the store and the run it is about.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from launcher.errors import StoreError, UsageError
from launcher.spare import Spare
from launcher.store import PRIVATE_SEGMENT, KeepAlive, Lease, Store, Watch

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import WorkerGroup

    from launcher.slots import SlotOwner

logger = logging.getLogger(__name__)

ROOT = "gemini/runs/"
#: Agent events mirrored into the store (the full log stays in the run directory).
STORE_EVENTS = frozenset({"launch", "worker_exit", "hang", "restart", "exit", "host_lost",
                          "host_dead", "host_unresponsive", "root_elected", "restore_plan", "no_restart",
                          "round_retry", "member_failed", "avoid_step", "no_progress",
                          "replicas_diverged", "holdings_refused"})
#: Seconds a probe of a peer's replication port may take: refused is proof that the
#: peer's supervisor is gone; no answer proves nothing (its lease decides).
PROBE_TIMEOUT = 0.5


#: How many hosts watch each running host (ping it, and vote when it falls silent): its
#: predecessors in the ring of running hosts ordered by id. Three watchers tolerate one
#: with a bad link (a majority is two); the messages and threads per host stay the same
#: however many hosts the job has.
FANOUT = 3


def watched_by(host: str, hosts: Iterable[str], fanout: int = FANOUT) -> list[str]:
    """The hosts that ``host`` watches: the ``fanout`` after it in the ring of ``hosts``
    (and ``host``) ordered by id; fewer when there are fewer others."""
    ring = sorted({*hosts, host})
    at = ring.index(host)
    return [ring[(at + k) % len(ring)] for k in range(1, min(fanout, len(ring) - 1) + 1)]


def watchers(host: str, hosts: Iterable[str], fanout: int = FANOUT) -> list[str]:
    """The hosts that watch ``host``: the ``fanout`` before it in the ring of ``hosts``
    (and ``host``) ordered by id, those whose :func:`watched_by` names it."""
    ring = sorted({*hosts, host})
    at = ring.index(host)
    return [ring[(at - k) % len(ring)] for k in range(1, min(fanout, len(ring) - 1) + 1)]


#: Seconds between two writes of a host's reports (goodput, pace; and one as it leaves),
#: and between two verdicts of the root on the hosts' paces.
REPORT_EVERY = 2.0

#: Events kept in the store per run (the root deletes older ones); ``gemini status``
#: shows the latest, and every host's events.jsonl keeps them all.
STORE_EVENT_LIMIT = 500
_PRUNE_EVERY = 50  # events written between two prunes


def run_prefix(run_id: str) -> str:
    return f"{ROOT}{run_id}/"


def secret_key(run_id: str) -> str:
    return run_prefix(run_id) + PRIVATE_SEGMENT


class CoordinationService:
    """Supervisor service (see ``elastic_agent.SupervisorService``) for the coordination store."""

    def __init__(self, store: Store, *, run_id: str, host_id: str, owner: SlotOwner,
                 ttl: float) -> None:
        self.store = store
        self.host_id = host_id
        self.run_id = run_id
        self.prefix = run_prefix(run_id)
        self.owner = owner
        self.ttl = ttl
        self.is_root = False
        self._record: dict[str, Any] = {
            "host": host_id, "pid": os.getpid(), "started": time.time(), "state": "waiting",
            "ranks": [], "round": 0, "restart_count": 0, "updated": time.time(),
        }
        self._put_content: dict[str, Any] | None = None  # the record as last put
        self._view: dict[str, dict[str, Any]] = {}  # host -> record, as watched
        self._view_alive: set[str] = set()  # hosts whose alive key is there, as watched
        self._viewed: set[str] | None = set()  # keys watched before the first read (then None)
        self._published: dict[str, Any] = {}
        self._lost: set[str] = set()
        self._lost_nodes: dict[str, str] = {}  # lost host -> its rendezvous node
        self._unpruned = _PRUNE_EVERY  # events written since the last prune: prune at once
        self.persist_status: Callable[[], Mapping[int, int]] | None = None
        self.rehold_secret: Callable[[Lease, int], None] | None = None
        """Where this host holds the run's stored secret with its lease
        (``launcher.replication.service.load_secret``): moves the hold to a new lease
        (the new lease, the id of the one it replaces)."""
        self.reports: dict[str, Callable[[], dict[str, Any] | None]] = {}
        """What this host publishes every :data:`REPORT_EVERY` seconds as
        ``<name>/<host>`` (``goodput``: ``GoodputService.record``, ``pace``:
        ``StragglerService.pace``); a report of None is not written."""
        self._reported_at = 0.0  # monotonic time of the last publication
        self.judge: Callable[[dict[str, dict[str, Any]], int], dict[str, Any]] | None = None
        """While root: the verdict on every host's ``pace`` report, given how many spares
        are ready (``StragglerService.evaluate``), stored as ``stragglers``."""
        self.on_verdict: Callable[[dict[str, Any]], None] | None = None
        """Called with the ``stragglers`` verdict whenever it changes."""
        self.on_lost: Callable[[], None] | None = None
        """Called (from a background thread) whenever a host is found lost."""
        self.on_failed: Callable[[str, int, bool], None] | None = None
        """Called (from a background thread) with a host and the rendezvous round in which
        its workers failed, when it says so (:meth:`report_failure`)."""
        self._outbox: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._probing = threading.Lock()
        self._putting = threading.Lock()  # see _put_record
        self._campaigning = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # publish the record now, not at the next beat
        self.spare = Spare(store, self.prefix, owner, running_slot_bytes=self._slot_sizes,
                           peers=lambda: self.running_peers(fresh=True), changed=self._wake.set)
        """What this host does while it waits as a spare (``launcher.spare``)."""
        self._lease: Lease = store.grant_lease(ttl)
        self._keeper: KeepAlive = store.keep_alive(self._lease)
        store.delete(self.prefix + "stopped")  # an earlier job's, of the same run id
        self._register()
        self._watch: Watch = store.watch_prefix(self.prefix + "alive/", self._on_alive)
        self._records: Watch = store.watch_prefix(self.prefix + "hosts/", self._on_record)
        self._failures: Watch = store.watch_prefix(self.prefix + "failed/", self._on_failed)
        self._verdicts: Watch = store.watch_prefix(self.prefix + "stragglers",
                                                   self._on_verdict)
        self._read_view()
        self._thread = threading.Thread(target=self._heartbeat, name="gemini-coordination",
                                        daemon=True)
        self._thread.start()

    # -- the agent's hooks ----------------------------------------------------------------
    def before_start(self, group: WorkerGroup, store: object) -> None:
        with self._lock:
            self._record.update(ranks=[w.global_rank for w in group.workers], state="running",
                                group_rank=group.group_rank, round=self._record["round"] + 1)
            self._record.pop("ready", None)
        self.spare.joined()
        self._wake.set()  # peers ping a host once its record says it runs

    def after_start(self, group: WorkerGroup) -> None:
        pass

    def after_stop(self, group: WorkerGroup) -> None:
        pass

    def check(self) -> None:
        pass

    def describe(self, **fields: Any) -> None:
        """Add ``fields`` to this host's record: ``replication`` ([host, port] of its
        replication server) and ``node`` (its rendezvous node) let others declare it
        dead."""
        with self._lock:
            self._record.update(fields)
        self._put_record()

    @property
    def lease(self) -> Lease:
        """This host's lease in the store: what it binds to it ends with it."""
        return self._lease

    @property
    def running(self) -> bool:
        """Whether this host is in a round (not waiting as a spare, not exited)."""
        with self._lock:
            return bool(self._record["state"] == "running")

    def _put_record(self, force: bool = False) -> None:
        """Put this host's record if it changed since it was last put (or ``force``); one
        writer at a time, so that an older record never lands after a newer one."""
        with self._putting:
            with self._lock:
                content = {k: v for k, v in self._record.items() if k != "updated"}
                if content == self._put_content and not force:
                    return
                self._record["updated"] = time.time()
                record = _dump(self._record)
            self.store.put(self.prefix + f"hosts/{self.host_id}", record)
            self._put_content = content

    # -- what this host knows of the others, through its watches ------------------------
    def _read_view(self) -> None:
        """Fill the view once, after the watches started: a key that a watch delivered
        meanwhile is newer than what this read found."""
        alive = self.store.get_prefix(self.prefix + "alive/")
        found = self.store.get_prefix(self.prefix + "hosts/")
        with self._lock:
            viewed, self._viewed = self._viewed or set(), None
            for key in alive:
                if key not in viewed:
                    self._view_alive.add(key.rsplit("/", 1)[-1])
            for key, value in found.items():
                if key not in viewed:
                    self._view[key.rsplit("/", 1)[-1]] = _parse_record(value)

    def _mark_viewed(self, key: str) -> None:
        """A watch delivered ``key`` (under the lock): newer than the first read."""
        if self._viewed is not None:
            self._viewed.add(key)

    def _on_record(self, key: str, value: bytes | None) -> None:
        host = key.rsplit("/", 1)[-1]
        with self._lock:
            self._mark_viewed(key)
            if value is None:
                self._view.pop(host, None)
            else:
                self._view[host] = _parse_record(value)

    def declare_dead(self, hosts: Iterable[str]) -> dict[str, str]:
        """Of ``hosts``, those whose supervisor is certainly gone (nothing listens where
        its replication server did: connection refused), with the evidence; each is now
        lost, and its lease revoked so that every other host learns at once. A host that
        is slow or unreachable is left to its lease."""
        with self._probing:  # one prober at a time: each host is declared once
            return self._declare_dead(set(hosts))

    def _declare_dead(self, hosts: set[str]) -> dict[str, str]:
        wanted = hosts - {self.host_id} - self.lost_hosts()
        if not wanted or self.store.unreachable_within(0):  # no waiting out an outage here
            return {}
        try:
            found = self.store.get_prefix(self.prefix + "hosts/")
        except StoreError as exc:
            logger.warning("cannot read the host records: %s", exc)
            return {}
        records = {host: record for key, value in found.items()
                   if (host := key.rsplit("/", 1)[-1]) in wanted
                   and (record := _parse_record(value)).get("state") == "running"
                   and isinstance(record.get("replication"), list)
                   and isinstance(record.get("lease"), int)}
        if not records:
            return {}
        with ThreadPoolExecutor(min(len(records), 64)) as pool:  # each within PROBE_TIMEOUT
            verdicts = dict(zip(records, pool.map(
                _refused, [r["replication"] for r in records.values()]), strict=True))
        dead: dict[str, str] = {}
        for host in sorted(h for h, refused in verdicts.items() if refused):
            self._declare_lost(host, records[host])
            address = ":".join(map(str, records[host]["replication"]))
            dead[host] = f"its supervisor no longer listens at {address}"
        return dead

    def _running(self, *, fresh: bool = False) -> dict[str, dict[str, Any]]:
        """The records of the live hosts in a round (this one included), not lost: as
        the watches delivered them, or read from the store now (``fresh``)."""
        lost = self.lost_hosts()
        if fresh:
            alive = {k.rsplit("/", 1)[-1] for k in self.store.get_prefix(self.prefix + "alive/")}
            records = {key.rsplit("/", 1)[-1]: _parse_record(value) for key, value
                       in self.store.get_prefix(self.prefix + "hosts/").items()}
        else:
            with self._lock:
                alive, records = set(self._view_alive), dict(self._view)
        return {host: record for host, record in records.items()
                if host in alive and host not in lost and record.get("state") == "running"}

    def running_peers(self, *, fresh: bool = False) -> dict[str, tuple[str, int]]:
        """The other live hosts in a round, not lost, with their replication address (as
        the watches delivered them, or read from the store now: ``fresh``)."""
        return {host: (str(address[0]), int(address[1]))
                for host, record in self._running(fresh=fresh).items()
                if host != self.host_id and isinstance(address := record.get("replication"), list)
                and len(address) == 2}

    def suspect(self, host: str, suspected: bool = True) -> int | None:
        """Vote that ``host``'s supervisor stopped answering heartbeats, or withdraw the
        vote. A suspect is lost once a majority of the hosts that watch it
        (:func:`watchers`) vote so (one slow or cut-off observer never removes a healthy
        host): the vote that completes the majority revokes its lease, so that every
        host learns at once, and returns the number of votes; otherwise None."""
        votes_prefix = self.prefix + f"suspects/{host}/"
        if not suspected:
            self.store.delete(votes_prefix + self.host_id)
            return None
        self.store.put(votes_prefix + self.host_id, b"1", lease=self._lease)
        running = self._running(fresh=True)  # a vote is rare: the store's view, not ours
        record = running.get(host)
        if record is None or not isinstance(record.get("lease"), int):
            return None  # exited, or already lost
        voters = set(watchers(host, running))
        votes = {key.rsplit("/", 1)[-1] for key in self.store.get_prefix(votes_prefix)} & voters
        if len(votes) < len(voters) // 2 + 1:
            return None
        # Voters that complete the majority at once: one of them declares (per lease of
        # the suspect, so that a later loss of the same host is declared again).
        declared = self.prefix + f"suspects/{host}/declared-{record['lease']}"
        if not self.store.compare_and_set(declared, None, self.host_id.encode(),
                                          lease=self._lease):
            return None
        self._declare_lost(host, record)
        for voter in votes:
            self.store.delete(votes_prefix + voter)
        return len(votes)

    def _declare_lost(self, host: str, record: Mapping[str, Any]) -> None:
        """``host`` is lost: revoke its lease (every host's watch sees it go) and count it
        lost here at once."""
        try:
            self.store.revoke_lease(record["lease"])
        except StoreError as exc:
            logger.warning("cannot revoke the lease of lost host %s: %s", host, exc)
        with self._lock:
            self._lost.add(host)
            if isinstance(record.get("node"), str):
                self._lost_nodes[host] = record["node"]
        self._found_lost(host, record)

    def _found_lost(self, host: str, record: Mapping[str, Any]) -> None:
        if self.on_lost is not None:
            self.on_lost()
        with self._lock:
            waiting = self._record["state"] == "waiting"
        if waiting:
            self.spare.host_lost(host, record)

    def lost_nodes(self) -> frozenset[str]:
        """The rendezvous nodes of the lost hosts whose node is known."""
        with self._lock:
            return frozenset(node for host, node in self._lost_nodes.items()
                             if host in self._lost)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self.ttl)
        for watch in (self._watch, self._records, self._failures, self._verdicts):
            watch.cancel()
        self._keeper.stop()
        with self._lock:
            self._record.update(state="exited")
        if self.store.unreachable_within(0):  # each write would wait out its deadline
            logger.warning("the coordination store is unreachable: this host's record stays "
                           "as it was, and its lease expires")
            self.store.close()
            return
        try:
            self._publish_steps()
            self._publish_reports(force=True)
            self._flush()
            self._put_record()
            self._lease.revoke()
            self._forget_secret()
        except StoreError as exc:
            logger.warning("could not deregister from the coordination store: %s", exc)
        self.store.close()

    def agree_on_exit(self, held: Mapping[int, Collection[int]], world_size: int,
                      deadline: float) -> int | None:
        """The step to persist as the job ends (SIGTERM: a preemption): the newest step
        every rank of the world holds in some host's memory. Each host publishes what its
        ranks hold (``exit/<host>``, bound to its lease) and reads the others' until the
        world is covered or the monotonic ``deadline`` passes; then the answer is the
        newest step common to the ranks reported, so that every host persists its copy
        of the same step."""
        merged: dict[int, set[int]] = {}
        try:
            self.store.put(self.prefix + f"exit/{self.host_id}",
                           _dump({str(rank): sorted(steps) for rank, steps in held.items()}),
                           lease=self._lease)
            while True:
                merged = {}
                for value in self.store.get_prefix(self.prefix + "exit/").values():
                    for rank, steps in _parse_record(value).items():
                        if rank.isdigit() and isinstance(steps, list):
                            merged.setdefault(int(rank), set()).update(
                                s for s in steps if isinstance(s, int))
                if len(merged) >= world_size or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        except StoreError as exc:
            logger.warning("cannot agree on the step to persist with the other hosts: %s", exc)
        if not merged:
            merged = {rank: set(steps) for rank, steps in held.items()}
        common = set.intersection(*merged.values()) if merged else set()
        return max(common) if common else None

    def report_stopped(self, reason: str) -> None:
        """Record that this host stops the job for good, and why (not bound to a lease:
        the other hosts read it once their rendezvous closed, after this one left)."""
        try:
            self.store.put(self.prefix + "stopped", _dump({"host": self.host_id,
                                                           "reason": reason}))
        except StoreError as exc:
            logger.warning("cannot tell the other hosts why this host stops: %s", exc)

    def stopped(self) -> str | None:
        """Why a host stopped the job for good (:meth:`report_stopped`), if one did."""
        try:
            record = _parse_record(self.store.get(self.prefix + "stopped"))
        except StoreError:
            return None
        reason = record.get("reason")
        return f"host {record.get('host')}: {reason}" if isinstance(reason, str) else None

    def _forget_secret(self) -> None:
        """The run's secret lives as long as the run: the last host to leave deletes it
        (hosts leaving together may both do; a later ``gemini run`` makes a new one)."""
        alive = {key.rsplit("/", 1)[-1] for key in self.store.get_prefix(self.prefix + "alive/")}
        if not alive - self.lost_hosts() - {self.host_id}:
            self.store.delete(self.prefix + PRIVATE_SEGMENT)

    # -- events -----------------------------------------------------------------------------
    def record_event(self, event: str, fields: dict[str, Any]) -> None:
        """An ``EventLog`` sink: queue selected events for the store (never blocks)."""
        if event not in STORE_EVENTS:
            return
        if event == "restart":
            with self._lock:
                self._record["restart_count"] = fields.get("restart_count", 0)
        key = self.prefix + f"events/{time.time_ns():020d}-{self.host_id}"
        self._outbox.put((key, _dump({"event": event, "host": self.host_id,
                                      "ts": time.time(), **fields})))

    # -- background ---------------------------------------------------------------------------
    def _register(self) -> None:
        with self._lock:
            self._record["lease"] = self._lease.id
        self.store.put(self.prefix + f"alive/{self.host_id}", b"1", lease=self._lease)
        self._put_record(force=True)
        self._campaign()

    def _campaign(self) -> None:
        with self._campaigning:  # the heartbeat and the watch thread both campaign
            if not self.is_root and self.store.campaign(self.prefix + "root", self.host_id,
                                                        self._lease):
                self.is_root = True
                self.record_event("root_elected", {"root": self.host_id})
                logger.info("this supervisor (%s) is now the root", self.host_id)

    def _on_alive(self, key: str, value: bytes | None) -> None:
        host = key.rsplit("/", 1)[-1]
        with self._lock:
            self._mark_viewed(key)
            if value is None:
                self._view_alive.discard(host)
            else:
                self._view_alive.add(host)
        if host == self.host_id:
            return
        if value is not None:
            with self._lock:
                self._lost.discard(host)
            return
        try:
            self._campaign()  # the lost host may have been the root
        except StoreError as exc:
            logger.warning("could not campaign for root: %s", exc)
        if self.store.unreachable_within(self.ttl):
            # No lease could be refreshed while the store was away: a host counts as lost
            # only if it has not registered again a ttl later.
            timer = threading.Timer(self.ttl, self._confirm_lost, args=(host,))
            timer.daemon = True
            timer.start()
            return
        self._confirm_lost(host)

    def _confirm_lost(self, host: str) -> None:
        """``host``'s lease is gone: lost, unless it exited or registered again."""
        if self._stop.is_set():
            return
        try:
            if self.store.get(self.prefix + f"alive/{host}") is not None:
                return
            record = self.store.get(self.prefix + f"hosts/{host}")
        except StoreError as exc:
            logger.warning("could not check whether host %s is lost: %s", host, exc)
            return
        fields = _parse_record(record)
        if fields.get("state") == "exited":
            return
        node = fields.get("node")
        with self._lock:
            self._lost.add(host)
            if isinstance(node, str):
                self._lost_nodes[host] = node
        self._found_lost(host, fields)
        if self.is_root:
            self.record_event("host_lost", {"lost": host})

    def report_failure(self, round_number: int, transient: bool = False) -> None:
        """Tell every host, through its watch, that this host's workers failed in
        rendezvous round ``round_number`` and that it restarts them: the members of that
        round restart theirs at once, rather than when their collectives with the failed
        workers time out; ``transient``: a worker was killed from outside, and the other
        hosts' failures in that round count as little as this one toward giving up. In
        the background (never blocks the agent; during a store outage the others learn
        from torch's rendezvous, or their workers' errors)."""
        def put() -> None:
            try:
                self.store.put(self.prefix + f"failed/{self.host_id}",
                               _dump({"round": round_number, "transient": transient}),
                               lease=self._lease)
            except StoreError as exc:
                logger.warning("cannot tell the other hosts that this host's workers "
                               "failed: %s", exc)

        threading.Thread(target=put, name="gemini-report-failure", daemon=True).start()

    def _on_failed(self, key: str, value: bytes | None) -> None:
        host = key.rsplit("/", 1)[-1]
        record = _parse_record(value)
        number = record.get("round")
        if host != self.host_id and isinstance(number, int) and self.on_failed is not None:
            self.on_failed(host, number, record.get("transient") is True)

    def lost_hosts(self) -> frozenset[str]:
        """Hosts whose lease expired without an exit, and that have not registered again."""
        with self._lock:
            return frozenset(self._lost)

    def _heartbeat(self) -> None:
        interval = max(0.2, self.ttl / 3)
        while True:
            self._wake.wait(interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if self._keeper.lost:  # e.g. unreachable for longer than the TTL
                    expired, self._lease = self._lease, self.store.grant_lease(self.ttl)
                    self._keeper.stop()
                    self._keeper = self.store.keep_alive(self._lease)
                    self.is_root = False
                    self._register()
                    if self.rehold_secret is not None:
                        self.rehold_secret(self._lease, expired.id)
                slot_bytes = self.owner.own_slot_bytes()
                with self._lock:
                    if slot_bytes:
                        self._record["slot_bytes"] = slot_bytes
                    waiting = self._record["state"] == "waiting"
                self._put_record()
                if waiting:
                    self._record_readiness(self.spare.wait())
                self._publish_steps()
                self._publish_reports()
                self._flush()
                self._campaign()
            except StoreError as exc:
                logger.warning("coordination store unavailable, retrying: %s", exc)

    def _record_readiness(self, ready: bool) -> None:
        """A waiting host is ``ready`` (hot) once :class:`Spare` says so; ``gemini status``
        shows it, and a spare that is not ready yet takes over more slowly."""
        with self._lock:
            changed = self._record.get("ready") != ready
            self._record["ready"] = ready
        if changed:
            self._wake.set()

    def _slot_sizes(self) -> list[int]:
        """The largest slot each running host published (what a spare reserves)."""
        sizes = []
        for record in self._running().values():
            try:
                sizes.append(int(record.get("slot_bytes") or 0))
            except (TypeError, ValueError):
                continue
        return sizes

    def _publish_steps(self) -> None:
        persisted = self.persist_status() if self.persist_status is not None else {}
        own = self.owner.newest_steps()
        for rank, step in own.items():
            record = {"memory": step, "persist": persisted.get(rank)}
            if self._published.get(f"ranks/{rank}") != record:
                self.store.put(self.prefix + f"ranks/{rank}", _dump(
                    {"host": self.host_id, **record, "updated": time.time()}))
                self._published[f"ranks/{rank}"] = record
        for rank, step in self.owner.newest_steps(replica=True).items():
            if rank in own:
                continue  # the copy a host keeps of its own ranks is not a replica
            key = f"replicas/{rank}/{self.host_id}"
            if self._published.get(key) != step:
                self.store.put(self.prefix + key, _dump({"step": step, "updated": time.time()}))
                self._published[key] = step

    def _publish_reports(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._reported_at < REPORT_EVERY:
            return
        self._reported_at = now
        for name, report in self.reports.items():
            record = report()
            if record is not None:
                self.store.put(self.prefix + f"{name}/{self.host_id}", _dump(record))
        if self.is_root and self.judge is not None and not force:
            paces = {key.rsplit("/", 1)[-1]: record for key, value in
                     self.store.get_prefix(self.prefix + "pace/").items()
                     if (record := _parse_record(value))}
            with self._lock:
                ready = sum(1 for host, record in self._view.items()
                            if host in self._view_alive and record.get("state") == "waiting"
                            and record.get("ready"))
                running = {host for host, record in self._view.items()
                           if host in self._view_alive and record.get("state") == "running"}
            verdict = self.judge({h: r for h, r in paces.items() if h in running}, ready)
            self.store.put(self.prefix + "stragglers", _dump(verdict))

    def _on_verdict(self, key: str, value: bytes | None) -> None:
        if self.on_verdict is not None and value is not None:
            self.on_verdict(_parse_record(value))

    def goodput_records(self) -> dict[str, dict[str, Any]]:
        """Every host's goodput ledger of the run as stored, by host (read once, as a
        supervisor starts: it goes on from the newest; {} when the store cannot say)."""
        key = self.prefix + "goodput/"
        try:
            values = self.store.get_prefix(key)
        except StoreError:
            return {}
        return {name[len(key):]: record for name, value in values.items()
                if (record := _parse_record(value))}

    def _flush(self) -> None:
        pending: list[tuple[str, bytes]] = []
        try:
            while True:
                pending.append(self._outbox.get_nowait())
        except queue.Empty:
            pass
        for i, (key, value) in enumerate(pending):
            try:
                self.store.put(key, value)
            except StoreError:
                for item in pending[i:]:  # keep the order; retried on the next beat
                    self._outbox.put(item)
                raise
            self._unpruned += 1
        if self.is_root and self._unpruned >= _PRUNE_EVERY:
            self._unpruned = 0
            prune_events(self.store, self.prefix)


def _parse_record(value: bytes | None) -> dict[str, Any]:
    """A host record's fields ({} for a missing or malformed record)."""
    try:
        record = json.loads(value) if value is not None else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _refused(address: list[Any]) -> bool:
    """Whether a TCP connection to ``address`` ([host, port]) is refused."""
    try:
        with socket.create_connection((str(address[0]), int(address[1])), PROBE_TIMEOUT):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError, IndexError):
        return False


def prune_events(store: Store, prefix: str, keep: int = STORE_EVENT_LIMIT) -> int:
    """Delete all but the newest ``keep`` events under ``prefix`` (a run's prefix; event
    keys sort by time); returns how many were deleted."""
    keys = sorted(store.get_prefix(prefix + "events/"))
    for key in keys[:-keep] if len(keys) > keep else []:
        store.delete(key)
    return max(0, len(keys) - keep)


def _dump(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


# -- reading --------------------------------------------------------------------------------

@dataclass
class RunStatus:
    """What ``gemini status`` shows for one run."""

    run_id: str
    root: str | None
    hosts: list[dict[str, Any]] = field(default_factory=list)
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    replication: dict[str, Any] | None = None
    """The replication plan: ``sstar``, ``target``, ``every``, ``lag_steps``,
    ``lag_seconds`` (None without replication)."""
    goodput: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each host's goodput ledger (``launcher.goodput``), by host."""
    paces: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each host's own work per step (``launcher.stragglers``), by host."""
    stragglers: dict[str, Any] | None = None
    """The root's verdict on the paces: ``scores``, ``stragglers``, ``replace``."""
    stopped: dict[str, Any] | None = None
    """Why a host stopped the job for good (``host``, ``reason``: the no-progress guard),
    None unless one did since the run last started."""

    @property
    def spares(self) -> list[str]:
        """Live hosts that wait for a place in the group (spares, or hosts before their
        first round)."""
        return [h["host"] for h in self.hosts if h["status"] == "waiting"]

    @property
    def ready_spares(self) -> list[str]:
        """The :attr:`spares` that are hot: slots reserved, standby workers ready."""
        return [h["host"] for h in self.hosts if h["status"] == "waiting" and h.get("ready")]

    def as_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "root": self.root, "hosts": self.hosts,
                "ranks": {str(k): v for k, v in sorted(self.ranks.items())},
                "spares": self.spares, "ready_spares": self.ready_spares,
                "replication": self.replication, "stopped": self.stopped,
                "goodput": self.goodput_report(), "stragglers": self.stragglers,
                "paces": self.paces, "events": self.events}

    def goodput_report(self) -> dict[str, Any] | None:
        """The run's goodput: the root's ledger (else the newest), with every host's ETTR
        beside it; None before any host wrote one."""
        reports = {host: record["report"] for host, record in self.goodput.items()
                   if isinstance(record.get("report"), dict)}
        if not reports:
            return None
        chosen = self.root if self.root in reports else max(
            reports, key=lambda h: _number(self.goodput[h].get("as_of")))
        return {**reports[chosen], "host": chosen, "as_of": self.goodput[chosen].get("as_of"),
                "hosts": {host: report.get("ettr") for host, report in sorted(reports.items())}}


class RunReader:
    """What ``gemini status`` reads: the runs recorded in one coordination store.

    ``url`` defaults to ``$GEMINI_STORE``, else the embedded store next to the run root
    (``$GEMINI_RUN_ROOT``, else the default); an etcd store's credentials come from the
    same environment variables as ``gemini run``'s.
    """

    def __init__(self, url: str | None = None, environ: Mapping[str, str] | None = None
                 ) -> None:
        from launcher.config import DEFAULT_RUN_ROOT, default_store_url, env_values
        from launcher.store import EtcdCredentials, open_store

        env = os.environ if environ is None else environ
        self.url = url or env.get("GEMINI_STORE") or default_store_url(
            env.get("GEMINI_RUN_ROOT", DEFAULT_RUN_ROOT))
        self._store = open_store(self.url, credentials=EtcdCredentials.from_values(
            env_values(env), prefix="store_"))

    def status(self, run_id: str | None = None) -> RunStatus:
        """The status of ``run_id``, by default of the run started last; UsageError when
        the store knows no such run."""
        runs = [run_id] if run_id else list_runs(self._store)[:1]
        if not runs:
            raise UsageError(f"no run found in {self.url}")
        status = read_status(self._store, runs[0])
        if not status.hosts:
            raise UsageError(f"run {runs[0]!r} not found in {self.url}")
        return status

    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> RunReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def list_runs(store: Store) -> list[str]:
    """Run ids with a record in the store, most recently started first."""
    started: dict[str, float] = {}
    for key, value in store.get_prefix(ROOT).items():
        parts = key[len(ROOT):].split("/")
        if len(parts) == 3 and parts[1] == "hosts":
            try:
                started[parts[0]] = max(started.get(parts[0], 0.0),
                                        float(json.loads(value).get("started", 0.0)))
            except (ValueError, AttributeError):
                continue
    return sorted(started, key=lambda run: -started[run])


# Complexity above 10: one pass over the run's keys, one branch per kind.
def read_status(store: Store, run_id: str, *, max_events: int = 20) -> RunStatus:  # noqa: C901
    """One prefix read of ``run_id`` turned into a :class:`RunStatus`."""
    prefix = run_prefix(run_id)
    items = store.get_prefix(prefix)
    status = RunStatus(run_id=run_id, root=None)
    alive = set()
    hosts: dict[str, dict[str, Any]] = {}
    for key, value in items.items():
        kind, _, name = key[len(prefix):].partition("/")
        try:
            if kind == "root":
                status.root = value.decode()
            elif kind == "alive":
                alive.add(name)
            elif kind == "hosts":
                hosts[name] = _record(value)
            elif kind == "ranks":
                status.ranks.setdefault(int(name), {}).update(_record(value))
            elif kind == "replicas":
                rank, _, host = name.partition("/")
                record = status.ranks.setdefault(int(rank), {})
                record.setdefault("replicas", {})[host] = _record(value).get("step")
            elif kind == "events":
                status.events.append(_record(value))
            elif kind == "replication" and name == "plan":
                status.replication = _record(value)
            elif kind == "stopped":
                status.stopped = _record(value)
            elif kind == "goodput":
                status.goodput[name] = _record(value)
            elif kind == "pace":
                status.paces[name] = _record(value)
            elif kind == "stragglers":
                status.stragglers = _record(value)
        except (ValueError, UnicodeDecodeError):
            logger.warning("unreadable store value at %s", key)
    for name, record in sorted(hosts.items()):
        state = record.get("state", "running")
        record["alive"] = name in alive
        record["status"] = ("waiting" if state == "waiting" else "alive") if name in alive else (
            "exited" if state == "exited" else "lost")
        status.hosts.append(record)
        if record["status"] == "alive":  # its ranks, before their first step is published
            for rank in record.get("ranks") or []:
                if isinstance(rank, int) and not isinstance(rank, bool):
                    status.ranks.setdefault(rank, {"host": name, "memory": None})
    if status.replication is not None:
        for record in status.ranks.values():
            if isinstance(record.get("host"), str) and record["host"] in alive:
                record["sstar"] = status.replication.get("sstar")
    status.events = sorted(status.events, key=_when)[-max_events:]
    return status


def _record(value: bytes) -> dict[str, Any]:
    """A JSON object read from the store; ValueError for anything else (any host of the
    run, or anyone who may write its keys, wrote it)."""
    record = json.loads(value)
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    return record


def _number(value: object) -> float:
    """``value`` if it is a number (not a bool), else 0."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else 0.0


def _when(event: dict[str, Any]) -> float:
    return _number(event.get("ts", 0))
