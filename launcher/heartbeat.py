"""Heartbeats between supervisors: a host that stops answering is found in about a second.

A lease in the coordination store finds a dead host only after ``--host-ttl``; a refused
connection (:meth:`~launcher.coordination.CoordinationService.declare_dead`) finds one
whose machine is up but whose supervisor is gone. Neither finds quickly a machine that
froze, lost power or dropped off the network: nothing ever refuses a connection, and the
survivors' workers wait on it in their collectives. So every running host's supervisor
pings the supervisors of the :data:`~launcher.coordination.FANOUT` running hosts after it
in the ring of running hosts ordered by id (``coordination.watched_by``), over the
authenticated replication transport (a ``ping`` answered at full priority, every
``timeout / 4`` seconds, each within what is left of ``timeout``): each host is watched by
the hosts before it, and a host sends and answers the same few pings a second however many
hosts the job has. A peer that has not answered for ``timeout`` seconds is suspected
(:meth:`~launcher.coordination.CoordinationService.suspect`): it is lost once a majority
of its watchers suspect it, and its lease is revoked so that every host learns at once.
A peer that answers again withdraws the vote. Spares ping no one: they are in no ring.
Who runs comes from the coordination service's watches, not from reads of the store. A ping that fails at once
(the connection was closed or refused: the peer's process is gone, its machine is not)
needs no vote: the pinger probes the peer's port right away
(:meth:`~launcher.coordination.CoordinationService.declare_dead`), so a killed
supervisor is found within a ping interval.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from launcher.coordination import watched_by
from launcher.errors import GeminiError
from launcher.events import EventLog, report_dead

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import WorkerGroup

    from launcher.coordination import CoordinationService
    from launcher.replication.transport import Client

logger = logging.getLogger(__name__)

PEERS_EVERY = 1.0  # seconds between two looks at who the running peers are
MIN_WAIT = 0.05  # the shortest wait for an answer
PROBE_EVERY = 1.0  # seconds between two probes of a peer whose pings fail at once


class HeartbeatService:
    """Supervisor service (see ``elastic_agent.SupervisorService``): one pinger thread per
    watched peer, started and stopped as peers come and go."""

    def __init__(self, coordination: CoordinationService, events: EventLog, *,
                 connect: Callable[..., Client], timeout: float) -> None:
        """``connect(address, timeout=...)`` makes a transport client to a peer."""
        self.coordination = coordination
        self.events = events
        self.timeout = timeout
        self.connect = connect
        self._stop = threading.Event()
        self._pingers: dict[str, _Pinger] = {}
        self._thread = threading.Thread(target=self._watch_peers, name="gemini-heartbeat",
                                        daemon=True)
        self._thread.start()

    def before_start(self, group: WorkerGroup, store: object) -> None:
        pass

    def after_start(self, group: WorkerGroup) -> None:
        pass

    def after_stop(self, group: WorkerGroup) -> None:
        pass

    def check(self) -> None:
        pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=PEERS_EVERY + self.timeout)
        for pinger in self._pingers.values():
            pinger.stop()

    def _watch_peers(self) -> None:
        while not self._stop.is_set():
            peers = self.coordination.running_peers()
            watched = (watched_by(self.coordination.host_id, peers)
                       if self.coordination.running else [])
            peers = {host: peers[host] for host in watched}
            for host in [h for h, p in self._pingers.items() if peers.get(h) != p.address]:
                self._pingers.pop(host).stop()
            for host, address in peers.items():
                if host not in self._pingers:
                    self._pingers[host] = _Pinger(self, host, address)
            self._stop.wait(PEERS_EVERY)

    def on_silent(self, host: str, silent: float) -> None:
        """``host`` has not answered for ``silent`` seconds (a pinger's thread)."""
        logger.warning("heartbeat: host %s has not answered for %.1f s", host, silent)
        try:
            votes = self.coordination.suspect(host)
        except GeminiError as exc:
            logger.warning("heartbeat: cannot vote on host %s: %s", host, exc)
            return
        if votes is not None:
            print(f"gemini: host {host} stopped answering heartbeats for {silent:.1f} s "
                  f"({votes} host(s) agree): every host restarts without it",
                  file=sys.stderr, flush=True)
            self.events.write("host_unresponsive", lost=host, silent=round(silent, 3),
                              votes=votes)

    def on_refused(self, host: str) -> bool:
        """A ping to ``host`` failed at once: if nothing listens where its supervisor did,
        it is gone (every host learns through its revoked lease). True if so."""
        try:
            dead = self.coordination.declare_dead([host])
        except GeminiError as exc:
            logger.warning("heartbeat: cannot declare host %s dead: %s", host, exc)
            return False
        report_dead(self.events, dead)
        return bool(dead)

    def on_answer(self, host: str) -> None:
        """``host`` answers again after it was suspected, or is no longer pinged."""
        logger.info("heartbeat: withdrawing the vote on host %s", host)
        try:
            self.coordination.suspect(host, False)
        except GeminiError as exc:
            logger.warning("heartbeat: cannot withdraw the vote on host %s: %s", host, exc)


class _Pinger:
    """Pings one peer until stopped; tells the service when it falls silent, and when it
    answers again."""

    def __init__(self, service: HeartbeatService, host: str, address: tuple[str, int]) -> None:
        self.service = service
        self.host = host
        self.address = address
        self._stop = threading.Event()
        self.suspected = False
        self._client = service.connect(address, timeout=service.timeout)
        self._thread = threading.Thread(target=self._run, name=f"gemini-heartbeat-{host}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop pinging (the peer left, or this host does); a vote it cast is withdrawn."""
        self._stop.set()
        self._client.close()
        if self.suspected:
            self.service.on_answer(self.host)

    def _run(self) -> None:
        timeout = self.service.timeout
        interval = timeout / 4
        answered = time.monotonic()  # a new peer gets a whole timeout to answer first
        probed = -PROBE_EVERY
        while not self._stop.is_set():
            began = time.monotonic()
            wait = max(MIN_WAIT, answered + timeout - began)
            try:
                self._client.ping(wait)
                ok = True
            except (GeminiError, OSError) as exc:
                logger.debug("heartbeat: no answer from %s: %s", self.host, exc)
                ok = False
            now = time.monotonic()
            if self._stop.is_set():
                return
            if not ok and now - began < wait / 2 and now - probed >= PROBE_EVERY:
                probed = now  # failed at once, not by waiting: is the peer's process gone?
                if self.service.on_refused(self.host):
                    return
            if ok:
                answered = now
                if self.suspected:
                    self.suspected = False
                    self.service.on_answer(self.host)
            elif not self.suspected and now - answered >= timeout:
                self.suspected = True
                self.service.on_silent(self.host, now - answered)
            self._stop.wait(max(0.0, began + interval - time.monotonic()))
