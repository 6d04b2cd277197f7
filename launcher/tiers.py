"""The checkpoint tiers of one host, tied together for the supervisor: its slots in shared
memory (``launcher.slots``), the replicas it exchanges with peers
(``launcher.replication``) and the persistent tier (``launcher.persist``). Before each
round :class:`MemoryService` decides what every rank restores and brings it into memory.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from launcher import memory
from launcher.contract import (
    ENV_PREFIX,
    ENV_RESTORE_RESHARD,
    ENV_RESTORE_STEP,
    ENV_RESTORE_VERIFIED,
    ENV_SOCKET,
)
from launcher.errors import (
    CheckpointError,
    GeminiError,
    HostUnhealthyError,
    ReplicasDivergedError,
    ReplicationError,
)
from launcher.events import EventLog
from launcher.recovery import (
    HoldingsReport,
    ReportRefused,
    RestorePlan,
    Source,
    Tier,
    choose_plan,
    explain_incomplete,
    gather_sources,
)
from launcher.slots import SlotOwner, SlotServer

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store
    from torch.distributed.elastic.agent.server.api import WorkerGroup

    from launcher.persist import PersistWriter
    from launcher.replication.service import ReplicationService

logger = logging.getLogger(__name__)

#: Seconds a round's restore, while the workers start, waits for a pull of the restore
#: step that a spare began when it learned of a lost host (:meth:`MemoryService.take_over`)
#: before aborting it: what it has not brought in by then is pulled again as the plan says.
TAKE_OVER_WAIT = 2.0


class MemoryService:
    """The supervisor service of the checkpoint tiers (see ``elastic_agent.SupervisorService``).

    Before each round it gathers, from every host through the round's store, which steps
    each rank holds in each tier (own memory, peers' replicas, persistent files), picks
    the newest step complete for all ranks (``launcher.recovery``), brings every copy
    that is not already in this host's memory into it (pulled from a peer or loaded from
    a file, verified), and tells its workers the step through ``GEMINI_RESTORE_STEP``.
    """

    def __init__(self, owner: SlotOwner, events: EventLog, *,
                 replication: ReplicationService | None = None,
                 persist: PersistWriter | None = None) -> None:
        self.owner = owner
        self.server = SlotServer(owner)
        self.server.arrival = self._arrival
        self._arrivals: dict[int, Future[int | None]] = {}  # rank -> its restore, on its way
        self._pulling: threading.Thread | None = None
        self._taking_over: threading.Thread | None = None  # see take_over
        self._stop_taking_over = threading.Event()
        self._taking: tuple[int, int] | None = None  # the (rank, step) it pulls now
        self._take_step: int | None = None  # once the round chose it: the step it may pull
        self._taken: set[tuple[int, int]] = set()  # the (rank, step) it pulled, verified
        self.events = events
        self.replication = replication
        self.persist = persist
        self.avoid: frozenset[int] = frozenset()
        """Steps no round restores (see ``rounds.guard_failure``), in this host's reports."""
        self.restored = -1
        """The step the last round restored (-1: none, a fresh start)."""
        self.ceiling: int | None = None
        """No round restores a step newer than this (a rollback after the replicas
        disagreed), in this host's reports; cleared once a round restored."""
        self.on_divergence = "warn"
        """What the replicas' disagreement does: ``rollback``, ``stop`` or ``warn``."""
        self.max_rollbacks = 3
        """Rollbacks to the same agreed step before the job stops (0: no limit)."""
        self.exclude_divergent = False
        """A host whose ranks a majority of the replicas outvotes leaves the job."""
        self.rollback_to: int | None = None
        """A rollback the agent has yet to carry out (the step the replicas agreed on)."""
        self.fatal: GeminiError | None = None
        self._rollbacks: dict[int, int] = {}  # agreed step -> rollbacks to it
        os.environ[ENV_SOCKET] = self.server.env_address
        os.environ[ENV_PREFIX] = self.owner.prefix

    def committed(self) -> int:
        """The newest step any of this host's ranks committed (-1: none)."""
        return max((step for step in self.owner.newest_steps().values() if step is not None),
                   default=-1)

    def copying(self, ranks: Iterable[int]) -> set[tuple[int, str]]:
        """(rank, slot) of each save of ``ranks`` being written here (``SlotOwner.copying``)."""
        return self.owner.copying(ranks)

    def _arrival(self, rank: int) -> int | None:
        """Wait until ``rank``'s restore step is in this host's memory (the slot server's
        ``await``); the seq of its verified slot, or None."""
        arrival = self._arrivals.get(rank)
        return None if arrival is None else arrival.result()

    def take_over(self, copies: Mapping[int, list[tuple[tuple[str, int], int]]]) -> None:
        """A spare learned that a host was lost: pull one copy of each of its ranks (the
        first of ``copies`` that a peer serves: per rank, ``(address, step)``, best first)
        into own slots of that rank, in the background, while the next round forms. If this host then
        runs those ranks and the round restores that step, the plan finds it in memory
        and nothing is left to pull once the workers start."""
        if self.replication is None or (self._taking_over is not None
                                        and self._taking_over.is_alive()):
            return
        replication = self.replication
        self._stop_taking_over.clear()
        self._take_step = None
        self._taken = set()

        def run() -> None:
            for rank, held in sorted(copies.items()):
                for address, step in held:
                    if self._stop_taking_over.is_set():
                        return
                    if self._take_step is not None and step != self._take_step:
                        continue
                    began = time.monotonic()
                    self._taking = (rank, step)
                    try:
                        replication.pull(address, rank, step)
                    except GeminiError as exc:
                        logger.warning("taking over rank %d: step %d from %s:%d failed: %s",
                                       rank, step, *address, exc)
                        continue
                    finally:
                        self._taking = None
                    self._taken.add((rank, step))
                    self.events.write("take_over", rank=rank, step=step,
                                      seconds=round(time.monotonic() - began, 4))
                    break

        self._taking_over = threading.Thread(target=run, name="gemini-take-over", daemon=True)
        self._taking_over.start()

    def _end_take_over(self, wait: float = TAKE_OVER_WAIT) -> None:
        """Let a pull begun by :meth:`take_over` finish, for ``wait`` seconds, then abort it."""
        if self._taking_over is None:
            return
        self._taking_over.join(wait)
        self._stop_taking_over.set()
        if self._taking_over.is_alive() and self.replication is not None:
            self.replication.abort_pulls()
            self._taking_over.join()

    def before_start(self, group: WorkerGroup, store: Store) -> None:
        started = time.monotonic()
        if self._pulling is not None:  # the last round's transfers end before this one's
            self._pulling.join()
            self._pulling = None
        if self.replication is not None:
            self.replication.pause()
        ranks = [w.global_rank for w in group.workers]
        self.server.ranks = frozenset(ranks)
        self.owner.forget_seen()
        world_size = group.workers[0].world_size if group.workers else 0
        node, nodes = group.group_rank or 0, group.group_world_size or 1
        report = self._holdings(ranks, world_size)
        if node == 0 and self.replication is not None:
            store.set("replication_round", uuid.uuid4().hex)
        store.set(f"holdings/{node}", report.dumps())
        reports = read_holdings(store, nodes, self.events)
        plan = choose_plan(reports, world_size, node)
        if plan.step is None and (available := gather_sources(reports)):
            why = explain_incomplete(available, world_size)
            logger.warning("no step is complete for every rank in any tier, so the job starts "
                           "from step 0: %s", why)
            self.events.write("restore_incomplete", why=why,
                              reports={str(k): asdict(v) for k, v in reports.items()})
        scanned = time.monotonic()
        restore = -1 if plan.step is None else plan.step
        self.restored = restore
        self.ceiling = None  # the rollback, if one was asked for, is this restore
        # A take-over still pulling the restore step of one of this host's ranks goes on
        # while the workers start (see _bring_in_the_rest); any other pull ends now.
        self._take_step = restore
        taking = self._taking
        if taking is None or plan.reshard or plan.world_size is not None or (
                taking[0] not in ranks or taking[1] != restore):
            self._end_take_over(wait=0)
        self.owner.discard_newer_than(restore)
        self.owner.reset_pins(restore)  # kept until this round's first s*
        if self.persist is not None:
            self.persist.rewind(restore)  # later files belong to the abandoned attempt
        # Copies in this host's memory are brought in now; pulls from peers and loads from
        # files go on while the workers start (each worker's restore awaits its own rank).
        here = [] if plan.reshard else [
            r for r in ranks if (sources := plan.sources.get(r)) and sources[0].tier is Tier.MEMORY]
        used = self._bring_in(plan, here, reports)
        os.environ[ENV_RESTORE_STEP] = str(restore)
        os.environ[ENV_RESTORE_VERIFIED] = ",".join(
            f"{rank}:{seq}" for rank, seq in self._verified(here, restore).items())
        os.environ[ENV_RESTORE_RESHARD] = str(plan.world_size if plan.reshard else 0)
        _announce_resize(plan, world_size)

        def done() -> None:
            self.events.write("restore_plan", step=plan.step, local=report.local,
                              world_size=world_size, from_world_size=plan.world_size,
                              replicas=report.replicas, persist=report.persist,
                              sources={str(rank): used[rank] for rank in sorted(used)},
                              scan_seconds=round(scanned - started, 4),
                              transfer_seconds=round(time.monotonic() - scanned, 4))

        self._bring_in_the_rest(plan, ranks, used, reports, done)
        if self.replication is not None:
            addresses = {peer: r.address for peer, r in reports.items() if r.address}
            round_id = store.get("replication_round").decode()
            # A node whose report was refused is left to set_round's default: torch's
            # assignment of ranks to nodes.
            self.replication.set_round(
                node, nodes, addresses, round_id=round_id, restored=restore,
                ranks={peer: r.ranks for peer, r in reports.items()})

    def _holdings(self, ranks: list[int], world_size: int) -> HoldingsReport:
        """This host's report to the round: the steps it holds of each rank in each tier,
        and what it can restore at another world size."""
        resizable = self.owner.resizable(world_size)
        return HoldingsReport(
            local=self.owner.holdings(ranks, world_size),
            replicas=self.owner.holdings(None, world_size, replica=True)
            if self.replication is not None else {},
            persist={rank: steps for rank, steps in self.persist.scan().items()
                     if rank in ranks} if self.persist is not None else {},
            address=self.replication.address if self.replication is not None else None,
            ranks=ranks,
            avoid=sorted(self.avoid),
            ceiling=self.ceiling,
            resizable=resizable["replicated"],
            reshardable=resizable["sharded"],
        )

    def _bring_in_the_rest(self, plan: RestorePlan, ranks: list[int], used: dict[int, str],
                           reports: dict[int, HoldingsReport], done: Callable[[], None]
                           ) -> None:
        """Pull from peers and load from files what ``plan`` needs and ``used`` lacks, in
        the background; each rank's arrival resolves when its copy is in (resharding:
        every old rank's copy); then ``done()``."""
        restore = -1 if plan.step is None else plan.step
        arrivals: dict[int, Future[int | None]] = {
            rank: Future() for rank in ranks if rank not in used and plan.step is not None}
        self._arrivals = arrivals
        batches = [(sorted(plan.sources), list(arrivals))] if plan.reshard else [
            ([rank], [rank]) for rank in arrivals]

        def run() -> None:
            self._end_take_over()
            for wanted, waiting in batches:
                try:
                    if plan.reshard or not self._taken_over(wanted, restore, used):
                        used.update(self._bring_in(plan, wanted, reports))
                except Exception as exc:  # the worker's restore fails with it, and says why
                    for rank in waiting:
                        arrivals[rank].set_exception(CheckpointError(
                            f"rank {rank}: step {restore} could not be brought in: {exc}"))
                    continue
                for rank in waiting:
                    arrivals[rank].set_result(self._verified([rank], restore).get(rank))
            done()

        if arrivals:
            self._pulling = threading.Thread(target=run, name="gemini-restore", daemon=True)
            self._pulling.start()
        else:
            run()

    def _taken_over(self, ranks: list[int], step: int, used: dict[int, str]) -> bool:
        """Whether a take-over brought ``step`` of every one of ``ranks`` into own slots
        (pulled and verified as it landed); if so they count as restored from memory."""
        own = self.owner.segments()
        found = [self.owner.find(rank, step) for rank in ranks]
        if not all((rank, step) in self._taken and seg is not None and seg in own.get(rank, [])
                   for rank, seg in zip(ranks, found, strict=True)):
            return False
        used.update(dict.fromkeys(ranks, Tier.MEMORY.name.lower()))
        return True

    def _verified(self, ranks: list[int], step: int) -> dict[int, int]:
        """The seq of each rank's own slot holding ``step``: every such slot was verified
        in this round, by the scan or when it was pulled or loaded."""
        found = {}
        own = self.owner.segments()
        for rank in ranks if step >= 0 else []:
            segment = self.owner.find(rank, step)  # own slots first, then replicas
            header = memory.read_header(segment.view) if segment is not None else None
            if header is not None and segment in own.get(rank, []):
                found[rank] = header.seq
        return found

    def _bring_in(self, plan: RestorePlan, ranks: list[int],
                  reports: dict[int, HoldingsReport]) -> dict[int, str]:
        """Make this host's memory hold ``plan.step`` for each of ``ranks``; return the
        tier each one came from."""
        used: dict[int, str] = {}
        if plan.step is None:
            return used
        for rank in ranks:
            errors = []
            for source in plan.sources.get(rank, []):
                try:
                    self._fetch(rank, plan.step, source, reports, plan.origin.get(rank, rank),
                                reshard=plan.reshard)
                except GeminiError as exc:
                    errors.append(f"{source.tier.name.lower()}: {exc}")
                    logger.warning("rank %d step %d from %s failed: %s", rank, plan.step,
                                   source, exc)
                    continue
                used[rank] = source.tier.name.lower()
                break
            else:
                raise CheckpointError(f"rank {rank}: no copy of step {plan.step} could be "
                                      f"restored ({'; '.join(errors) or 'none found'})")
        return used

    def _fetch(self, rank: int, step: int, source: Source,
               reports: dict[int, HoldingsReport], origin: int, *, reshard: bool = False
               ) -> None:
        """Bring ``step`` of rank ``origin`` (``rank`` itself, unless the job was resized)
        from ``source`` into an own slot of ``rank``; with ``reshard``, ``rank`` is a rank
        of the old world, and its copy stays as it is (MEMORY) or goes into a replica slot
        (PEER)."""
        if source.tier is Tier.MEMORY:
            if not reshard:
                self.owner.restore_local(rank, step, source=origin)  # unless already there
            return  # the worker verifies it again
        if source.tier is Tier.PEER:
            address = reports[source.node].address
            if self.replication is None or not address:
                raise ReplicationError(f"node {source.node} has no replication address")
            if reshard:  # a copy of an old rank, kept beside this host's own slots
                self.replication.pull(address, rank, step, replica=True)
            else:
                self.replication.pull(address, origin, step, into=rank)
            return
        if self.persist is None:
            raise CheckpointError("no persistent tier configured")
        self.persist.load(rank, step, lambda n: self.owner.write_target(rank, n, replica=False))

    def after_start(self, group: WorkerGroup) -> None:
        pids = [int(w.id) for w in group.workers if w.id is not None]
        if self.replication is not None:
            self.replication.watch_workers(pids)
        if self.persist is not None:
            self.persist.watch_workers(pids)

    def after_stop(self, group: WorkerGroup) -> None:
        pass

    def check(self) -> None:
        if self.server.fatal is not None:
            raise self.server.fatal
        if self.fatal is not None:
            raise self.fatal

    def diverged(self, record: dict[str, Any]) -> None:
        """The replicas of a step disagree (``ReplicationService``, its thread): with
        ``rollback``, every host's workers go back to the newest step they agreed on (the
        agent restarts them, :attr:`rollback_to`; no restart of ``--max-restarts`` is
        spent), at most :attr:`max_rollbacks` times to the same step; with ``stop``, or
        past that, the job stops with exit code 5; with ``warn``, nothing more. With
        :attr:`exclude_divergent` and a majority (three replicas or more), the outvoted
        host leaves instead (exit 6, as an unhealthy host) and the others' next round
        restores the agreed step."""
        agreed = int(record.get("agreed", -1))
        why = (f"the replicas of step {record.get('step')} disagree (rank(s) "
               f"{', '.join(map(str, record.get('ranks', [])))})")
        odd = {int(rank) for rank in record.get("odd") or ()}
        if self.exclude_divergent and odd and self.on_divergence != "warn":
            # The majority is right: the outvoted host leaves (as a lost host), and every
            # round's plan stops at the agreed step (the outvoted ranks' newer replicas
            # are the corrupted ones).
            self.ceiling = agreed
            mine = odd & (self.server.ranks or frozenset())
            if mine:
                self.fatal = HostUnhealthyError(
                    f"{why}: the majority outvotes rank(s) {', '.join(map(str, sorted(mine)))}"
                    " of this host; it leaves the job (--exclude-divergent)")
            return
        if self.on_divergence == "stop":
            self.fatal = ReplicasDivergedError(f"{why}; stopping (--on-divergence stop)")
        elif self.on_divergence == "rollback":
            count = self._rollbacks[agreed] = self._rollbacks.get(agreed, 0) + 1
            if self.max_rollbacks and count > self.max_rollbacks:
                self.fatal = ReplicasDivergedError(
                    f"{why} again after {count - 1} rollback(s) to step {agreed}; stopping")
            else:
                self.ceiling = self.rollback_to = agreed

    def close(self) -> None:
        if self.persist is not None:
            self.persist.close()
        if self.replication is not None:
            self.replication.close()
        self.server.close()
        self.owner.close()


def read_holdings(store: Store, nodes: int, events: EventLog) -> dict[int, HoldingsReport]:
    """Every node's holdings report to the round, as each wrote it under
    ``holdings/<node>`` (the store's ``get`` waits for it).

    A report that does not parse (:class:`ReportRefused`: a damaged value, or a host of
    another version of gemini) is left out, and its node holds nothing in this round: the
    plan restores its ranks from copies elsewhere, or starts fresh; nothing is pulled from
    it, and its ranks are taken to be torch's assignment. Reading what could be read of it
    instead might name copies its host does not hold, or miss an ``avoid`` or a
    ``ceiling``. Hosts of one version refuse the same bytes alike, so their plans still
    agree. Said as a warning and a ``holdings_refused`` event.
    """
    reports: dict[int, HoldingsReport] = {}
    for node in range(nodes):
        try:
            reports[node] = HoldingsReport.loads(store.get(f"holdings/{node}"))
        except ReportRefused as exc:
            logger.warning("node %d's holdings report is refused, so it holds nothing in "
                           "this round: %s", node, exc)
            events.write("holdings_refused", node=node, why=str(exc))
    return reports


def _announce_resize(plan: RestorePlan, world_size: int) -> None:
    """Say on the console how the ranks restore when the job changed its world size."""
    if plan.reshard:
        print(f"gemini: the job now has {world_size} ranks instead of {plan.world_size}: "
              f"each rank assembles its shard of step {plan.step} from the copies of all "
              f"{plan.world_size} ranks", file=sys.stderr, flush=True)
    elif plan.world_size is not None:
        print(f"gemini: the job now has {world_size} ranks instead of {plan.world_size}: "
              f"each rank resumes step {plan.step} from a whole copy of the state (rank r "
              f"from rank r % {plan.world_size})", file=sys.stderr, flush=True)
