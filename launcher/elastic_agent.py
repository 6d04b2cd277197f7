"""The per-host agent: torch elastic's ``LocalElasticAgent`` with gemini's services.

:class:`GeminiAgent` keeps torch elastic's monitor/restart loop and adds:

* a fresh worker TCP store every rendezvous round, so restarted gloo workers never read
  the previous round's addresses (torchrun reuses one store: pytorch/pytorch#135712);
* stable node slots with a dynamic rendezvous (``launcher.rendezvous.assign_slots``);
* spares that wait while the group is full, restarts without members confirmed lost, a
  restart of every host as soon as one host's workers fail (it says so through the
  store), and fencing of a host the job went on without (the decisions are in
  ``launcher.rounds``);
* JSON-lines events (rendezvous, start, worker exit, restart, stop, exit);
* extension points (:class:`SupervisorService`) where the memory, replication,
  health and persistence services plug in.

Importing this module imports torch; ``launcher.agent.make_agent`` imports it only when
a run starts, so that commands other than ``gemini run`` stay fast.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, cast

import psutil
from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.distributed import DistStoreError
from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.agent.server.api import (
    _TERMINAL_STATE_SYNC_ID as _EXIT_BARRIER,
)
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.utils import store as store_util
from torch.distributed.elastic.utils.store import _NUM_MEMBERS

from launcher.contract import RAISED_DIR
from launcher.errors import ConfigError
from launcher.events import EventLog, report_dead
from launcher.rounds import (
    AfterFailure,
    FailureHistory,
    Guard,
    Signature,
    after_failure,
    answer_waiting,
    failure_signature,
    guard_failure,
    round_moved_on,
    stranded,
)

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store


logger = logging.getLogger(__name__)

_EXIT_MEMBERS = _EXIT_BARRIER + _NUM_MEMBERS  # the hosts counted into torch's exit barrier
_RESTARTING = _EXIT_BARRIER + "/gemini_restarting"  # the hosts of a round that restarted
_ROUND_ATTEMPTS = 5  # rendezvous rounds whose set-up may time out before the run fails


def _status(pid: int | None) -> str | None:
    try:
        return psutil.Process(pid).status() if pid is not None else None
    except psutil.Error:
        return None


def _exited(pid: int | None) -> bool:
    """Whether a worker process has exited (a zombie until torch reaps it)."""
    return pid is not None and _status(pid) in (None, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def _running(pid: int | None) -> bool:
    """Whether a worker process runs: not exited, not stopped (a hung worker SIGSTOPped
    writes nothing more)."""
    return _status(pid) not in (None, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD,
                                psutil.STATUS_STOPPED)


class _NotNeeded(Exception):  # noqa: N818 (a control-flow signal, not an error)
    """This host never joined a round (a spare), or was fenced out of the job, and the
    rendezvous closed: the job finished without needing it."""


class _RoundClosed(Exception):  # noqa: N818 (a control-flow signal, not an error)
    """This host's workers failed and the rendezvous closed while it restarted them: the
    other hosts finished. ``failure`` is the failed run's RunResult."""

    def __init__(self, failure: RunResult) -> None:
        super().__init__("the rendezvous closed")
        self.failure = failure


def _group_world(worker_group: WorkerGroup) -> int:
    """The number of hosts in the group's round."""
    world = cast("int | None", worker_group.group_world_size)  # torch declares it None
    assert world is not None  # set by _rendezvous
    return world


def _min_nodes(worker_group: WorkerGroup) -> int:
    settings = getattr(worker_group.spec.rdzv_handler, "_settings", None)
    return int(getattr(settings, "min_nodes", _group_world(worker_group)))


def _max_nodes(worker_group: WorkerGroup) -> int:
    settings = getattr(worker_group.spec.rdzv_handler, "_settings", None)
    return int(getattr(settings, "max_nodes", 1 << 30))


def _rendezvous_round(handler: Any) -> int | None:
    """The round number in torch's dynamic rendezvous state as last synced (None for
    other backends)."""
    holder = getattr(handler, "_state_holder", None)
    return None if holder is None else int(holder.state.round)


def _formed_without(handler: Any, joined: int) -> bool:
    """Whether a round after ``joined`` is running without this host."""
    if not _round_running(handler):
        return False
    state = handler._state_holder.state
    return bool(state.round > joined and handler._this_node not in state.participants)


def _members_left(handler: Any, joined: int | None, world: int) -> bool:
    """Whether a member already left round ``joined`` of ``world`` hosts, as torch's
    dynamic rendezvous state last synced says (False for other backends)."""
    holder = getattr(handler, "_state_holder", None)
    if holder is None or joined is None:
        return False
    state = holder.state
    return bool(state.round == joined and len(state.participants) < world)


def _round_running(handler: Any) -> bool:
    """Whether torch's dynamic rendezvous has a complete round with hosts in it."""
    holder = getattr(handler, "_state_holder", None)
    if holder is None:
        return False
    with handler._heartbeat_lock:
        holder.sync()
        return bool(holder.state.complete and holder.state.participants)


@functools.cache
def _fqdn() -> str:
    """This host's name as torch's rendezvous names a node without ``--local-addr``."""
    return socket.getfqdn()


def _member_record(value: bytes) -> dict[str, Any]:
    """A member's post of :meth:`GeminiAgent._exchange`, checked."""
    try:
        record = json.loads(value)
        valid = (isinstance(record, dict) and isinstance(record.get("host"), str)
                 and (record.get("slot") is None or type(record["slot"]) is int)
                 and isinstance(record.get("role"), str)
                 and type(record.get("workers")) is int and record["workers"] > 0)
        store = record.get("store") if valid else None
        if store is not None and not (isinstance(store, list) and len(store) == 2
                                      and isinstance(store[0], str) and type(store[1]) is int):
            valid = False
    except ValueError:
        valid = False
    if not valid:
        raise RuntimeError(f"a member of the rendezvous round posted a set-up record that is "
                           f"not gemini's: {bytes(value)[:200]!r}")
    return cast(dict[str, Any], record)


def _failure_record(rank: int, failure: Any) -> dict[str, Any]:
    """A JSON-friendly summary of torch elastic's ``ProcessFailure``."""
    return {
        "rank": rank,
        "local_rank": failure.local_rank,
        "pid": failure.pid,
        "exitcode": failure.exitcode,
        "signal": failure.signal_name() if failure.exitcode < 0 else None,
        "error_file": failure.error_file,
        "message": failure.message if isinstance(failure.message, str) else None,
    }


class SupervisorService(Protocol):
    """A per-host service run by the supervisor around each round of workers.

    Calls happen on the agent's thread: ``before_start`` once a round's ranks are known
    and before its workers start (``store`` is a key-value store shared by every host's
    supervisor and private to this round), ``after_start`` once they run, ``after_stop``
    when the round's workers have exited or been stopped, ``check`` on every monitor tick
    (raise a ``GeminiError`` to end the job), ``close`` once when the supervisor ends.
    Services may set ``GEMINI_*`` variables in ``os.environ`` in ``before_start``: the
    workers inherit them.
    """

    def before_start(self, group: WorkerGroup, store: Store) -> None: ...

    def after_start(self, group: WorkerGroup) -> None: ...

    def after_stop(self, group: WorkerGroup) -> None: ...

    def check(self) -> None: ...

    def close(self) -> None: ...


class Restores(Protocol):
    """What the no-progress guard reads and sets of the host's checkpoints
    (``launcher.tiers.MemoryService``)."""

    restored: int
    avoid: frozenset[int]
    rollback_to: int | None
    """A rollback to carry out: the step the replicas last agreed on (see
    ``MemoryService.diverged``)."""

    def committed(self) -> int: ...

    def copying(self, ranks: Iterable[int]) -> set[tuple[int, str]]: ...


#: How long a host whose workers failed waits for the other members' reports of the same
#: round before it counts the failure toward giving up: when another member's workers
#: were killed from outside, this host's workers died of that (their collectives broke),
#: and the failure is as transient as the kill.
GUARD_GRACE = 1.0

#: How long the workers of a round that ends may go on writing the saves they are in
#: before they are stopped: a survivor of a peer's crash is often in the copy of the step
#: the crashed rank committed last (or, with a copy slower than a step, of the one
#: before), and a step is restorable only once every rank has it. A copy takes a fraction
#: of a step, so the wait is shorter than the work it keeps.
COPY_GRACE = 5.0


class _MonitorClock:
    """The ``time`` module as torch's agent module sees it, except that ``sleep`` (the
    monitor loop's wait between two looks at the workers) ends early when woken: a host
    confirmed lost restarts the round at once, not at the next look."""

    def __init__(self) -> None:
        self.woken = threading.Event()

    def sleep(self, seconds: float) -> None:
        if self.woken.wait(seconds):
            self.woken.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


_CLOCK = _MonitorClock()


class GeminiAgent(LocalElasticAgent):
    """LocalElasticAgent plus a per-round worker store, events and services."""

    _store: Store  # type: ignore[assignment]  # torch's, which it declares None: set by _rendezvous

    def __init__(self, *args: Any, events: EventLog, host_id: str,
                 services: Sequence[SupervisorService],
                 lost_hosts: Callable[[], frozenset[str]] = frozenset,
                 declare_dead: Callable[[Iterable[str]], dict[str, str]] = lambda _: {},
                 report_failure: Callable[[int, bool], None] = lambda *_: None,
                 forget: Callable[[], None] = lambda: None,
                 restores: Restores | None = None, max_same_failures: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lost_hosts = lost_hosts
        self._declare_dead = declare_dead
        self._report_failure = report_failure
        self._failed: dict[str, int] = {}  # host -> the rendezvous round its workers failed in
        self._transient_rounds: set[int] = set()  # rounds in which a member's worker was killed
        self._restores = restores
        self._max_same_failures = max_same_failures
        self._history = FailureHistory()
        self.gave_up: str | None = None
        """Why this host stopped restarting (the no-progress guard), or None."""
        self._forget = forget
        self._members: frozenset[str] = frozenset()  # the hosts of this host's round
        self._joined_round: int | None = None  # torch's round number of that round
        self._fenced = False  # the job went on without this host: it is a spare now
        self._acted_on: frozenset[str] = frozenset()  # lost members restarted for
        self._events = events
        self._host_id = host_id
        self._slot: int | None = None  # this host's node slot in the last round
        self._services = list(services)
        self._round = 0
        self._worker_store: TCPStore | None = None
        self._round_store: Store | None = None
        self._reported_failure = False
        self._copies_waited = False  # this round's saves in flight were waited for
        self._last_failure: RunResult | None = None
        self._spare_noted = False
        self._stopping: Future[None] | None = None  # see _stop_while_rejoining
        setattr(agent_api, "time", _CLOCK)  # noqa: B010  (see _MonitorClock)
        handler = self._worker_group.spec.rdzv_handler
        self._waiting = handler.num_nodes_waiting
        handler.num_nodes_waiting = self._num_nodes_waiting  # type: ignore[method-assign]

    def wake(self) -> None:
        """Look at the workers and the round's members now (a host was found lost)."""
        _CLOCK.woken.set()

    def member_failed(self, host: str, round_number: int, transient: bool = False) -> None:
        """``host`` says its workers failed in rendezvous round ``round_number`` and it
        restarts them (any thread): if it is a member of this host's round, this host
        restarts too, at its next look (now). ``transient``: a worker was killed from
        outside (see ``launcher.rounds.EXTERNAL_SIGNALS``)."""
        if transient:
            self._transient_rounds.add(round_number)
        self._failed[host] = round_number
        self.wake()

    def run_job(self) -> RunResult | None:
        """torch's ``run``; None when the job ended without needing this host (torch's
        graceful exit, or the rendezvous closed on a spare or a host fenced out), and the
        failed run's result when this host's workers failed and the other hosts finished
        and closed the rendezvous while it restarted them."""
        try:
            result: RunResult | None = self.run()  # torch's returns None on a graceful exit
            return result
        except _RoundClosed as ended:
            return ended.failure
        except _NotNeeded:
            return None

    # -- spares: hosts that wait while the group is full -----------------------------
    def _num_nodes_waiting(self) -> int:
        """torch's count of the hosts waiting for the next round, as the monitor loop
        sees it (``launcher.rounds.answer_waiting``): 0 while the group already has
        ``max_nodes`` hosts, so that a spare waits until a host is lost (the survivors'
        restart admits it) or the group can grow; 1 (restart: a new round) when a member
        of this host's round was confirmed lost (its lease expired), when another
        member's workers failed (it said so through the store, :meth:`member_failed`, or
        it left the round to re-join), and when the job went on without this host (it
        froze for longer than the rendezvous allows); it then stops its stale workers,
        forgets its memory, and waits as a spare."""
        if self._restores is not None and self._restores.rollback_to is not None:
            step, self._restores.rollback_to = self._restores.rollback_to, None
            print(f"gemini: rolling back to step {step}, the newest step the replicas agreed "
                  "on: every host restarts its workers from it", file=sys.stderr, flush=True)
            self._events.write("rollback", round=self._round, step=step)
            return 1
        waiting = int(self._waiting())
        current = _rendezvous_round(self._worker_group.spec.rdzv_handler)
        world = self._worker_group.group_world_size or 0
        joined = self._joined_round
        answer = answer_waiting(
            waiting=waiting, moved_on=round_moved_on(joined, current),
            lost=self._lost_hosts(), members=self._members, host=self._host_id,
            acted_on=self._acted_on, world=world, max_nodes=_max_nodes(self._worker_group),
            spares_noted=self._spare_noted,
            failed=frozenset(h for h, r in list(self._failed.items()) if r == joined),
            left=_members_left(self._worker_group.spec.rdzv_handler, joined, world))
        self._acted_on = answer.acted_on
        if answer.fence:
            self._fence("a new rendezvous round formed without it")
        elif answer.lost:
            print(f"gemini: host(s) {', '.join(sorted(answer.lost))} of this round lost "
                  "(lease gone): restarting the round without them", file=sys.stderr,
                  flush=True)
            self._events.write("member_lost", round=self._round, lost=sorted(answer.lost))
        elif answer.failed:
            print(f"gemini: the workers of host(s) {', '.join(sorted(answer.failed))} failed: "
                  "every host restarts its workers", file=sys.stderr, flush=True)
            self._events.write("member_failed", round=self._round,
                               failed=sorted(answer.failed))
        elif answer.note_spares:
            self._spare_noted = True
            logger.info("%d host(s) wait for the rendezvous; the group is full "
                        "(%d hosts): they stay spares", waiting, world)
            self._events.write("spares_waiting", round=self._round, waiting=waiting)
        return answer.count

    def _next_rendezvous(self, worker_group: WorkerGroup) -> Any:
        """torch's ``next_rendezvous``; a host that has never been in a round (a spare)
        and times out while a round is running waits again instead of failing, and
        one that finds the rendezvous closed ends: the job finished without it."""
        handler = worker_group.spec.rdzv_handler
        if self._joined_round is not None and not self._fenced:
            if _formed_without(handler, self._joined_round):
                self._fence("a new rendezvous round formed without it")
        while True:
            spare = self._round == 0 or self._fenced
            try:
                return handler.next_rendezvous()
            except RendezvousClosedError:
                if not spare:
                    raise
                raise _NotNeeded() from None
            except RendezvousTimeoutError:
                if not spare or not _round_running(handler):
                    raise
                print("gemini: this host is a spare: the running group is full; waiting "
                      "for a place again", file=sys.stderr, flush=True)
                self._events.write("spare_rejoin")

    @property
    def fenced(self) -> bool:
        """Whether the job went on without this host, which now waits as a spare."""
        return self._fenced

    def _fence(self, why: str) -> None:
        """The job went on without this host: it must not act on its old round."""
        if self._fenced:
            return
        self._fenced = True
        print(f"gemini: this host was left out of the job ({why}; it stopped for longer "
              "than the others wait): stopping its workers; it waits as a spare, and "
              "forgets its memory if it is let in again", file=sys.stderr, flush=True)
        self._events.write("fenced", round=self._round, why=why)

    # -- rendezvous: a fresh store for the workers of every round ------------------
    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        """torch's rendezvous and start, again from the rendezvous when the round's
        set-up times out on the store: a member that died right after the round
        formed never publishes its part (the master address, its node slot, its
        holdings), and the others would wait for it until the rendezvous timed out,
        while the hosts replacing it waited for them."""
        for attempt in range(1, _ROUND_ATTEMPTS + 1):
            try:
                super()._initialize_workers(worker_group)
                return
            except (TimeoutError, DistStoreError) as exc:
                if attempt == _ROUND_ATTEMPTS:
                    raise
                print(f"gemini: the set-up of rendezvous round {self._round} timed out "
                      f"({exc}); a member is gone: rendezvous again", file=sys.stderr,
                      flush=True)
                self._events.write("round_retry", round=self._round, error=str(exc))

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """torch elastic's rendezvous, with stable node slots as group ranks."""
        spec = worker_group.spec
        handler = spec.rdzv_handler
        static = handler.get_backend() == "static"
        shared = handler.use_agent_store
        own_addr = spec.local_addr or _fqdn()
        if shared and hasattr(handler, "_bootstrap_store_info"):
            # torch's dynamic handler has every member wait in each round for its rank 0
            # to post the address of a store that gemini's workers do not use (they use
            # the store of :meth:`_exchange`); with this in place, none waits for it.
            setattr(handler, "_bootstrap_store_info",  # noqa: B010
                    RendezvousStoreInfo(master_addr=own_addr, master_port=0))
        with self.record_duration("RENDEZVOUS"):
            rdzv_info = self._next_rendezvous(worker_group)
        store, world_size = rdzv_info.store, rdzv_info.world_size
        self._round += 1
        if self._fenced:  # admitted again: a member like any other, with empty memory
            self._forget()
            self._fenced = False
        self._joined_round = _rendezvous_round(handler)
        # Dynamic backends hand out a store scoped to the round; the static backend's
        # store lives for the whole run, where only restarts start a new round (and
        # node ranks are fixed by --node-rank).
        scope = f"gemini/{self._restart_count(worker_group)}/" if static else "gemini/"
        self._round_store = PrefixStore(scope, store)
        bootstrap = rdzv_info.bootstrap_store_info
        assert bootstrap is not None  # every torch backend sets it
        self._store = store
        master: tuple[str, int] = (spec.master_addr or bootstrap.master_addr,
                                   spec.master_port or bootstrap.master_port)
        with self.record_duration("ASSIGN_WORKER_RANKS"):
            if static:
                group_rank = rdzv_info.rank
                workers = self._assign_worker_ranks(store, group_rank, world_size, spec)
                if shared:  # group rank 0 is the master node, known by --master-addr
                    master = self._publish_worker_store(group_rank, self._round_store,
                                                        bootstrap.master_addr)
            else:
                group_rank, workers, hosted = self._exchange(
                    self._round_store, rdzv_info.rank, world_size, spec,
                    own_addr if shared and rdzv_info.rank == 0 else None)
                master = hosted or master
        # WorkerGroup types these attributes as None; torch's _rendezvous sets them too.
        worker_group.workers = workers
        worker_group.store = store
        worker_group.group_rank = group_rank
        worker_group.group_world_size = world_size
        worker_group.master_addr, worker_group.master_port = master  # type: ignore[assignment]
        self._events.write(
            "rendezvous",
            round=self._round,
            group_rank=group_rank,
            group_world_size=world_size,
            restart_count=self._restart_count(worker_group),
            master_addr=worker_group.master_addr,
            master_port=worker_group.master_port,
            ranks=[w.global_rank for w in workers],
        )

    def _exchange(self, store: Store, member: int, world_size: int, spec: WorkerSpec,
                  host_store: str | None) -> tuple[int, list[Worker], tuple[str, int] | None]:
        """A round's whole set-up in one write and one wait per member: each posts its
        host id, previous node slot, role and number of workers (and the member that
        hosts the workers' store, torch's rank 0 when ``host_store`` is its address, that
        store's address), then reads everyone's. From them every member computes the same
        node slots (``launcher.rendezvous.assign_slots``), worker ranks (as torch's
        ``_assign_worker_ranks`` would, in slot order) and store. torch's own set-up waits
        three times in a row for one member's keys.

        Returns this host's node slot, its workers, and the workers' store address (None
        where the workers do not use the agents' store)."""
        from launcher.rendezvous import assign_slots, worker_ranks

        self._worker_store = None  # the previous round's server shuts down
        record: dict[str, Any] = {"host": self._host_id, "slot": self._slot,
                                  "role": spec.role, "workers": spec.local_world_size}
        if host_store is not None:
            self._worker_store = TCPStore(host_name=host_store, port=0, is_master=True,
                                          wait_for_workers=False)
            record["store"] = [host_store, self._worker_store.port]
        store.set(f"member/{member}", json.dumps(record))
        keys = [f"member/{other}" for other in range(world_size)]
        records = [_member_record(value) for value in store.multi_get(keys)]
        slots = assign_slots({m: (r["host"], r["slot"]) for m, r in enumerate(records)},
                             world_size)
        self._slot = slots[member]
        self._members = frozenset(r["host"] for r in records)
        # A member still counted lost here joined this round, so it is alive: a host
        # that froze, was declared lost and thawed, before its new lease is seen.
        self._acted_on = self._lost_hosts() & self._members
        by_slot = [records[m] for m in sorted(slots, key=slots.__getitem__)]
        base, size, role_base, role_size = worker_ranks(
            [(r["role"], r["workers"]) for r in by_slot], self._slot)
        workers = [Worker(local_rank=local, global_rank=base + local,
                          role_rank=role_base + local, world_size=size,
                          role_world_size=role_size)
                   for local in range(spec.local_world_size)]
        hosted = next((r["store"] for r in records if r.get("store")), None)
        return self._slot, workers, (hosted[0], hosted[1]) if hosted else None

    def _publish_worker_store(self, group_rank: int, store: Store,
                              own_addr: str) -> tuple[str, int]:
        """With the static backend, group rank 0 hosts a new TCPStore for this round's
        workers and posts its address; returns it. Keys of earlier rounds cannot leak
        into it."""
        self._worker_store = None  # the previous round's server shuts down
        if group_rank == 0:
            self._worker_store = TCPStore(host_name=own_addr, port=0, is_master=True,
                                          wait_for_workers=False)
            address: list[Any] = [own_addr, self._worker_store.port]
            store.set("worker_store", json.dumps(address))
        else:
            address = json.loads(store.get("worker_store"))
        return str(address[0]), int(address[1])

    def _restart_count(self, worker_group: WorkerGroup) -> int:
        return int(worker_group.spec.max_restarts - self._remaining_restarts)

    # -- workers -------------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        assert self._round_store is not None  # set by _rendezvous
        self._stopped()
        for service in self._services:
            service.before_start(worker_group, self._round_store)
        self._reported_failure = self._copies_waited = False
        try:
            pids = super()._start_workers(worker_group)
        except OSError as exc:
            if exc.errno != errno.E2BIG:
                raise
            raise ConfigError("cannot start the workers: their command line and environment "
                              "(torch adds its variables to gemini's) exceed the system's "
                              "limit on exec arguments; shorten the script's arguments or "
                              "the environment") from None
        for worker in worker_group.workers:  # as torch does right after this returns
            worker.id = pids.get(worker.local_rank)
        for service in self._services:
            service.after_start(worker_group)
        self._events.write(
            "start",
            round=self._round,
            restart_count=self._restart_count(worker_group),
            workers=[
                {"local_rank": w.local_rank, "rank": w.global_rank,
                 "pid": pids.get(w.local_rank)}
                for w in worker_group.workers
            ],
        )
        return dict(pids)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._let_copies_commit(worker_group)
        super()._stop_workers(worker_group)
        self._events.write("stop", round=self._round)
        for service in self._services:
            service.after_stop(worker_group)

    def _let_copies_commit(self, worker_group: WorkerGroup) -> None:
        """Wait (at most :data:`COPY_GRACE`) until the saves that this host's running
        workers are writing are committed: stopped in the middle, a save's step is lost
        on that rank. Once per round: torch stops the workers as soon as one has failed,
        and before that the agent waits here."""
        if self._restores is None or self._copies_waited:
            return
        self._copies_waited = True
        began = time.monotonic()
        pids = {w.global_rank: w.id for w in worker_group.workers}
        pending = self._restores.copying(rank for rank, pid in pids.items() if _running(pid))
        while pending and time.monotonic() < began + COPY_GRACE:
            time.sleep(0.005)
            pending &= self._restores.copying(rank for rank, _ in pending
                                              if _running(pids[rank]))
        if pending or time.monotonic() - began > 0.01:
            self._events.write("copies_waited", round=self._round,
                               seconds=round(time.monotonic() - began, 3),
                               unfinished=sorted({rank for rank, _ in pending}))

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        for service in self._services:
            service.check()
        if not self._copies_waited and any(_exited(w.id) for w in worker_group.workers):
            self._let_copies_commit(worker_group)  # before torch stops the others
        result: RunResult = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and (
            not self._reported_failure
        ):
            self._reported_failure = True
            self._last_failure = result
            self._events.write(
                "worker_exit",
                round=self._round,
                state=result.state.name,
                failures=[_failure_record(rank, f) for rank, f in result.failures.items()],
            )
            # A peer's death is the usual cause of a healthy worker's communication
            # error: if its supervisor is gone, every host learns it now.
            report_dead(self._events, self._declare_dead(self._members - {self._host_id}),
                        round=self._round)
            signature = failure_signature(self._exit_codes(result))
            self._guard(signature)
            self._after_failure(worker_group, transient=signature is None)
        return result

    # -- the no-progress guard (``launcher.rounds.guard_failure``) -----------------------
    def _exit_codes(self, result: RunResult) -> dict[int, tuple[int, Any]]:
        """Each failed rank's exit code and message; a rank that died of its own error
        (``contract.RAISED_DIR``) but was ended by a signal first (torch's SIGTERM once a
        peer it broke died first, an abort in its teardown) as if it had exited with 1."""
        folder = self._events.path.parent / RAISED_DIR
        codes: dict[int, tuple[int, Any]] = {}
        for rank, failure in result.failures.items():
            marker = folder / str(failure.pid)
            raised = marker.exists()
            marker.unlink(missing_ok=True)
            codes[rank] = (1, "") if raised and failure.exitcode < 0 else (
                failure.exitcode, failure.message)
        return codes

    def _guard(self, signature: Signature | None) -> None:
        """Count this failure toward ``--max-same-failures``; give up (no restarts left,
        :attr:`gave_up` says why) or restore the next older step in the next round."""
        if self._restores is None:
            return
        restores = self._restores
        committed, restored = restores.committed(), restores.restored
        verdict, history = guard_failure(self._history, signature=signature,
                                         committed=committed, restored=restored,
                                         limit=self._max_same_failures)
        if verdict is not Guard.RESTART and self._caused_elsewhere():
            verdict, history = guard_failure(self._history, signature=None,
                                             committed=committed, restored=restored,
                                             limit=self._max_same_failures)
        self._history = history
        if verdict is Guard.RESTART_OLDER:
            restores.avoid = history.avoid
            print(f"gemini: the workers failed right after restoring step {restored}: the "
                  "next round restores an older step", file=sys.stderr, flush=True)
            self._events.write("avoid_step", round=self._round, step=restored)
        elif verdict is Guard.GIVE_UP:
            last = sorted(history.signature or ())[0]
            times = "once" if history.same == 1 else f"{history.same} times in a row"
            self.gave_up = (f"the workers failed {times} the same way "
                            f"(rank {last[0]}, exit code {last[1]}"
                            f"{': ' + last[2] if last[2] else ''}) "
                            f"without completing a step after step {history.high_water}")
            self._remaining_restarts = 0
            self._events.write("no_progress", round=self._round, failures=history.same,
                               step=history.high_water, rank=last[0], exitcode=last[1],
                               error=last[2])

    def _caused_elsewhere(self) -> bool:
        """Whether this host's failure came from another member's transient one: a
        member of the round was lost, or reports a worker killed from outside (waiting
        :data:`GUARD_GRACE` for the reports)."""
        others = self._members - {self._host_id}
        if not others:
            return False
        deadline = time.monotonic() + GUARD_GRACE
        while True:
            if self._joined_round in self._transient_rounds or others & self._lost_hosts():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    # -- the end of a run: torch elastic's exit barrier ----------------------------
    # A host whose workers succeeded waits in that barrier for every host of the round
    # and joins no later round. torch counts a host in only when its workers succeed,
    # so a host whose worker failed after its peers finished (at exit, say) either left
    # the finished ones waiting for the barrier's timeout (300 s) or, with restarts
    # left, waited itself for a round that could not fill (600 s). gemini counts a
    # host whose run ends in failure into the barrier; a host that restarts announces
    # it there (_RESTARTING), and a finished host closes the rendezvous when the hosts
    # it still waits for all restarted and cannot form a round without it.

    def _after_failure(self, worker_group: WorkerGroup, *, transient: bool) -> None:
        """Skip the restart when hosts of this round have already finished their
        workers and the rest are too few for a new round; count this host into the
        exit barrier when its run ends here, or announce its restart there."""
        world = _group_world(worker_group)
        try:
            finished = int(self._store.add(_EXIT_MEMBERS, 0))
            min_nodes = _min_nodes(worker_group)
            choice = after_failure(remaining_restarts=self._remaining_restarts,
                                   finished=finished, world=world, min_nodes=min_nodes)
            if choice is AfterFailure.RESTART:
                if self._joined_round is not None:  # the others restart with it at once
                    self._report_failure(self._joined_round, transient)
                self._store.add(_RESTARTING, 1)
                return
            if choice is AfterFailure.PEERS_FINISHED:
                print(f"gemini: not restarting: {finished} of {world} hosts already "
                      f"finished their workers, and a new round needs {min_nodes}",
                      file=sys.stderr, flush=True)
                self._events.write("no_restart", round=self._round, reason="peers_finished",
                                   finished_hosts=finished, min_nodes=min_nodes)
                self._remaining_restarts = 0
            store_util._barrier_nonblocking(self._store, world, _EXIT_BARRIER)
        except Exception as exc:  # the store of a host that went away
            logger.warning("cannot reach the exit barrier: %s", exc)

    def _exit_barrier(self) -> None:
        """torch's exit barrier (every host of the round, for at most the exit barrier
        timeout), which closes the rendezvous once the hosts still missing all
        restarted after a failure and are fewer than a round needs."""
        world = _group_world(self._worker_group)
        deadline = time.monotonic() + self._exit_barrier_timeout
        closed = arrived = False
        self._in_exit_barrier = True
        try:
            last = store_util._barrier_nonblocking(self._store, world, _EXIT_BARRIER)
            arrived = True
            while not self._store.check([last]):
                if time.monotonic() > deadline:
                    logger.error("timed out after %ss waiting for the other hosts to "
                                 "finish their workers", self._exit_barrier_timeout)
                    return
                if not closed and self._stranded(world):
                    closed = True
                    print("gemini: the hosts still running restarted after a failure and "
                          "cannot form a round without this one: closing the rendezvous",
                          file=sys.stderr, flush=True)
                    self._events.write("close_rendezvous", round=self._round,
                                       reason="restarting_hosts_too_few")
                    self._worker_group.spec.rdzv_handler.set_closed()  # type: ignore[no-untyped-call]
                time.sleep(0.1)
        except SignalException:
            raise
        except Exception as exc:
            if arrived:  # the store's host (group rank 0) saw the barrier complete and left
                logger.info("the exit barrier's store closed after this host arrived: %s",
                            exc)
            else:
                logger.warning("cannot reach the exit barrier: %s", " ".join(
                    str(exc).split()))
        finally:
            self._in_exit_barrier = False

    def _stranded(self, world: int) -> bool:
        """Whether every host of the round that has not finished restarted, too few
        for a round of their own (a static rendezvous cannot be closed: no)."""
        static = self._worker_group.spec.rdzv_handler.get_backend() == "static"
        finished = int(self._store.add(_EXIT_MEMBERS, 0))
        restarting = int(self._store.add(_RESTARTING, 0))
        return stranded(finished=finished, restarting=restarting, world=world,
                        min_nodes=_min_nodes(self._worker_group), static=static)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        failed = worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
        self._events.write(
            "restart",
            round=self._round,
            reason="failure" if failed else "membership",
            restart_count=self._restart_count(worker_group),
            remaining_restarts=self._remaining_restarts,
        )
        round_store, world = self._store, _group_world(worker_group)
        try:
            self._stop_while_rejoining(worker_group)
            worker_group.state = WorkerState.STOPPED
            self._initialize_workers(worker_group)
        except RendezvousClosedError:
            if self._fenced:
                raise _NotNeeded() from None
            if not failed:
                raise
            print("gemini: not restarting: the other hosts finished their workers and "
                  "closed the rendezvous", file=sys.stderr, flush=True)
            self._events.write("no_restart", round=self._round, reason="rendezvous_closed")
            try:
                store_util._barrier_nonblocking(round_store, world, _EXIT_BARRIER)
            except Exception as exc:
                logger.warning("cannot reach the exit barrier: %s", exc)
            assert self._last_failure is not None  # set with the failure
            raise _RoundClosed(self._last_failure) from None
        finally:
            self._stopped()

    def _stop_while_rejoining(self, worker_group: WorkerGroup) -> None:
        """Stop this round's workers in the background: their exit (SIGTERM, then their
        teardown) overlaps the next rendezvous, which does not depend on it. The new
        round's services and workers start only once it is done (:meth:`_stopped`)."""
        stopping: Future[None] = Future()

        def stop() -> None:
            try:
                self._stop_workers(worker_group)
            except BaseException as exc:  # re-raised where the restart waits for it
                stopping.set_exception(exc)
            else:
                stopping.set_result(None)

        self._stopping = stopping
        threading.Thread(target=stop, name="gemini-stop-workers", daemon=True).start()

    def _stopped(self) -> None:
        """Wait for the workers stopped by :meth:`_stop_while_rejoining`; re-raise its error."""
        stopping, self._stopping = self._stopping, None
        if stopping is not None:
            stopping.result()
