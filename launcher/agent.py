"""The per-host supervisor: torch elastic's ``LocalElasticAgent`` with gemini's services.

``launch`` turns a :class:`RunConfig` into exactly what torchrun would build (torchrun's
own argument parser and ``config_from_args``), then runs :class:`GeminiAgent` instead of
the stock agent. The agent keeps torch elastic's monitor/restart loop and adds:

* a fresh worker TCP store every rendezvous round, so restarted gloo workers never read
  the previous round's addresses (torchrun reuses one store: pytorch/pytorch#135712);
* stable node slots with a dynamic rendezvous (``launcher.rendezvous.assign_slots``);
* JSON-lines events (rendezvous, start, worker exit, restart, stop, exit);
* extension points (:class:`SupervisorService`) where the memory, replication, health
  and persistence services plug in.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from launcher.config import TORCHRUN_FIELDS, RunConfig
from launcher.contract import ENV_HOST_ID, ENV_RUN_DIR, ENV_SUPERVISOR_PID
from launcher.errors import (
    ConfigError,
    Interrupted,
    StoreError,
    StoreUnavailableError,
    UsageError,
    WorkerFailedError,
)
from launcher.events import EventLog, report_dead, run_directory

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

    from launcher.slots import SlotOwner
    from launcher.store import Store as GeminiStore
    from launcher.tiers import MemoryService

logger = logging.getLogger(__name__)



@dataclass(frozen=True, kw_only=True)
class Command:
    """The training command: a script (or module, or executable) and its arguments."""

    script: str
    """Path of the training script, module name with ``--module``, or an executable."""
    args: tuple[str, ...] = ()
    """Arguments passed to the script unchanged."""


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


def _torch_agent_base() -> type:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    return LocalElasticAgent


def make_agent(*args: Any, events: EventLog, host_id: str,
               services: Sequence[SupervisorService], **kwargs: Any) -> Any:
    """Build a :class:`GeminiAgent` (defined lazily: importing it imports torch).
    Optional: ``lost_hosts()``, the hosts confirmed lost (their lease expired), and
    ``forget()``, which empties this host's memory once it was fenced out."""
    return _agent_class()(*args, events=events, host_id=host_id, services=services, **kwargs)


_AGENT_CLASS: type | None = None
_ROUND_ATTEMPTS = 5  # rendezvous rounds whose set-up may time out before the run fails


class _NotNeeded(Exception):  # noqa: N818 (a control-flow signal, not an error)
    """This host never joined a round (a spare), or was fenced out of the job, and the
    rendezvous closed: the job finished without needing it."""


class _RoundClosed(Exception):  # noqa: N818 (a control-flow signal, not an error)
    """This host's workers failed and the rendezvous closed while it restarted them: the
    other hosts finished. ``failure`` is the failed run's RunResult."""

    def __init__(self, failure: RunResult) -> None:
        super().__init__("the rendezvous closed")
        self.failure = failure


def _agent_class() -> type:
    global _AGENT_CLASS
    if _AGENT_CLASS is None:
        _AGENT_CLASS = _define_agent(_torch_agent_base())
    return _AGENT_CLASS


def _define_agent(base: type) -> type:
    from torch._C._distributed_c10d import PrefixStore, TCPStore
    from torch.distributed.elastic.agent.server.api import (
        _TERMINAL_STATE_SYNC_ID as _EXIT_BARRIER,
    )
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.utils.store import _NUM_MEMBERS

    # Constants of the agent class below, defined here where torch is imported.
    _EXIT_MEMBERS = _EXIT_BARRIER + _NUM_MEMBERS  # noqa: N806 (hosts in the exit barrier)
    _RESTARTING = _EXIT_BARRIER + "/gemini_restarting"  # noqa: N806 (hosts that restarted)

    def _min_nodes(worker_group: WorkerGroup) -> int:
        settings = getattr(worker_group.spec.rdzv_handler, "_settings", None)
        world = worker_group.group_world_size
        assert world is not None  # set by _rendezvous
        return int(getattr(settings, "min_nodes", world))

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

    def _round_running(handler: Any) -> bool:
        """Whether torch's dynamic rendezvous has a complete round with hosts in it."""
        holder = getattr(handler, "_state_holder", None)
        if holder is None:
            return False
        with handler._heartbeat_lock:
            holder.sync()
            return bool(holder.state.complete and holder.state.participants)

    class GeminiAgent(base):  # type: ignore[misc]
        """LocalElasticAgent plus a per-round worker store, events and services."""

        _remaining_restarts: int  # torch's

        def __init__(self, *args: Any, events: EventLog, host_id: str,
                     services: Sequence[SupervisorService],
                     lost_hosts: Callable[[], frozenset[str]] = frozenset,
                     declare_dead: Callable[[Iterable[str]], dict[str, str]] = lambda _: {},
                     forget: Callable[[], None] = lambda: None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._lost_hosts = lost_hosts
            self._declare_dead = declare_dead
            self._forget = forget
            self._members: frozenset[str] = frozenset()  # the hosts of this host's round
            self._joined_round: int | None = None  # torch's round number of that round
            self._fenced = False  # the job went on without this host: it is a spare now
            self._acted_on: frozenset[str] = frozenset()
            self._events = events
            self._host_id = host_id
            self._slot: int | None = None  # this host's node slot in the last round
            self._services = list(services)
            self._round = 0
            self._worker_store: TCPStore | None = None
            self._round_store: Store | None = None
            self._reported_failure = False
            self._last_failure: RunResult | None = None
            self._spare_noted = False
            handler = self._worker_group.spec.rdzv_handler
            self._waiting = handler.num_nodes_waiting
            handler.num_nodes_waiting = self._num_nodes_waiting

        # -- spares: hosts that wait while the group is full -----------------------------
        def _num_nodes_waiting(self) -> int:
            """torch's count of the hosts waiting for the next round, as the monitor loop
            sees it: 0 while the group already has ``max_nodes`` hosts.

            torch restarts a healthy group whenever a host waits, expecting the next
            round to let it in; a full group cannot, and the waiting host would push an
            original one out of the next round, which then waits and restarts the group
            again. A spare waits until a host is lost (the survivors' restart admits it)
            or the group can grow.

            Also 1 (restart: a new round) when a member of this host's round was
            confirmed lost (its lease expired: a host that froze, or vanished without a
            connection reset, leaves the survivors' workers waiting on it forever), and
            when the job went on without this host (its round is over: it froze for
            longer than the rendezvous allows); it then stops its stale workers, forgets
            its memory, and waits as a spare."""
            waiting = int(self._waiting())
            handler = self._worker_group.spec.rdzv_handler
            current = _rendezvous_round(handler)
            if (self._joined_round is not None and current is not None
                    and current != self._joined_round):
                self._fence("a new rendezvous round formed without it")
                return 1
            lost = (self._lost_hosts() & self._members) - {self._host_id}
            self._acted_on &= lost  # one that registered again may be lost again later
            if lost and lost != self._acted_on:
                self._acted_on = frozenset(lost)
                print(f"gemini: host(s) {', '.join(sorted(lost))} of this round lost (lease "
                      "gone): restarting the round without them", file=sys.stderr,
                      flush=True)
                self._events.write("member_lost", round=self._round, lost=sorted(lost))
                return 1
            world = self._worker_group.group_world_size or 0
            if waiting and world >= _max_nodes(self._worker_group):
                if not self._spare_noted:
                    self._spare_noted = True
                    logger.info("%d host(s) wait for the rendezvous; the group is full "
                                "(%d hosts): they stay spares", waiting, world)
                    self._events.write("spares_waiting", round=self._round, waiting=waiting)
                return 0
            return waiting

        def _next_rendezvous(self, worker_group: WorkerGroup) -> Any:
            """torch's ``next_rendezvous``; a host that has never been in a round (a spare)
            and times out while a round is running waits again instead of failing, and
            one that finds the rendezvous closed ends: the job finished without it."""
            from torch.distributed.elastic.rendezvous import (
                RendezvousClosedError,
                RendezvousTimeoutError,
            )

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
            from torch.distributed import DistStoreError

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
            if getattr(spec.rdzv_handler, "_bootstrap_store_info", None) is not None:
                # torch's dynamic handler publishes the bootstrap address only in its own
                # first round: a host joining a later round (a replacement) would wait for
                # it forever unless this round's rank 0 publishes it again.
                setattr(spec.rdzv_handler, "_bootstrap_store_info", None)  # noqa: B010
            with self.record_duration("RENDEZVOUS"):
                rdzv_info = self._next_rendezvous(worker_group)
            store, world_size = rdzv_info.store, rdzv_info.world_size
            self._round += 1
            if self._fenced:  # admitted again: a member like any other, with empty memory
                self._forget()
                self._fenced = False
            self._joined_round = _rendezvous_round(spec.rdzv_handler)
            # Dynamic backends hand out a store scoped to the round; the static backend's
            # store lives for the whole run, where only restarts start a new round (and
            # node ranks are fixed by --node-rank).
            static = spec.rdzv_handler.get_backend() == "static"
            scope = f"gemini/{self._restart_count(worker_group)}/" if static else "gemini/"
            self._round_store = PrefixStore(scope, store)
            group_rank = rdzv_info.rank if static else self._stable_slot(
                self._round_store, rdzv_info.rank, world_size)
            bootstrap = rdzv_info.bootstrap_store_info
            assert bootstrap is not None  # every torch backend sets it
            self._store = store
            with self.record_duration("ASSIGN_WORKER_RANKS"):
                workers = self._assign_worker_ranks(store, group_rank, world_size, spec)
            # WorkerGroup types these attributes as None; torch's _rendezvous sets them too.
            worker_group.workers = workers
            worker_group.store = store
            worker_group.group_rank = group_rank  # type: ignore[assignment]
            worker_group.group_world_size = world_size
            worker_group.master_addr = spec.master_addr or bootstrap.master_addr  # type: ignore[assignment]
            worker_group.master_port = spec.master_port or bootstrap.master_port  # type: ignore[assignment]
            if spec.rdzv_handler.use_agent_store:
                own_addr = (bootstrap.master_addr if rdzv_info.rank == 0 or static
                            else spec.local_addr or socket.getfqdn())
                self._publish_worker_store(worker_group, self._round_store, own_addr)
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

        def _stable_slot(self, store: Store, member: int, world_size: int) -> int:
            """Exchange (host, previous slot) with the round's other members; see
            ``launcher.rendezvous.assign_slots``."""
            from launcher.rendezvous import assign_slots

            store.set(f"slot/{member}", json.dumps([self._host_id, self._slot]))
            members = {}
            for other in range(world_size):
                host, previous = json.loads(store.get(f"slot/{other}"))
                members[other] = (str(host), previous)
            self._slot = assign_slots(members, world_size)[member]
            self._members = frozenset(host for host, _ in members.values())
            # A member still counted lost here joined this round, so it is alive: a host
            # that froze, was declared lost and thawed, before its new lease is seen.
            self._acted_on = self._lost_hosts() & self._members
            return self._slot

        def _publish_worker_store(self, worker_group: WorkerGroup, store: Store,
                                  own_addr: str) -> None:
            """Group rank 0 hosts a new TCPStore for this round's workers; all agents point
            MASTER_ADDR/MASTER_PORT at it. Keys of earlier rounds cannot leak into it."""
            self._worker_store = None  # the previous round's server shuts down
            if worker_group.group_rank == 0:
                host = str(own_addr)
                self._worker_store = TCPStore(host_name=host, port=0, is_master=True,
                                              wait_for_workers=False)
                address: list[Any] = [host, self._worker_store.port]
                store.set("worker_store", json.dumps(address))
            else:
                address = json.loads(store.get("worker_store"))
            # WorkerGroup declares these None; torch's own _rendezvous assigns them too.
            worker_group.master_addr = str(address[0])  # type: ignore[assignment]
            worker_group.master_port = int(address[1])  # type: ignore[assignment]

        def _restart_count(self, worker_group: WorkerGroup) -> int:
            return int(worker_group.spec.max_restarts - self._remaining_restarts)

        # -- workers -------------------------------------------------------------------
        def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
            assert self._round_store is not None  # set by _rendezvous
            for service in self._services:
                service.before_start(worker_group, self._round_store)
            self._reported_failure = False
            pids = super()._start_workers(worker_group)
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
            super()._stop_workers(worker_group)
            self._events.write("stop", round=self._round)
            for service in self._services:
                service.after_stop(worker_group)

        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
            for service in self._services:
                service.check()
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
                self._after_failure(worker_group)
            return result

        # -- the end of a run: torch elastic's exit barrier ----------------------------
        # A host whose workers succeeded waits in that barrier for every host of the round
        # and joins no later round. torch counts a host in only when its workers succeed,
        # so a host whose worker failed after its peers finished (at exit, say) either left
        # the finished ones waiting for the barrier's timeout (300 s) or, with restarts
        # left, waited itself for a round that could not fill (600 s). gemini counts a
        # host whose run ends in failure into the barrier; a host that restarts announces
        # it there (_RESTARTING), and a finished host closes the rendezvous when the hosts
        # it still waits for all restarted and cannot form a round without it.

        def _after_failure(self, worker_group: WorkerGroup) -> None:
            """Skip the restart when hosts of this round have already finished their
            workers and the rest are too few for a new round; count this host into the
            exit barrier when its run ends here, or announce its restart there."""
            from torch.distributed.elastic.utils import store as store_util

            world = worker_group.group_world_size
            assert world is not None  # set by _rendezvous
            try:
                if self._remaining_restarts > 0:
                    finished = int(self._store.add(_EXIT_MEMBERS, 0))
                    min_nodes = _min_nodes(worker_group)
                    if finished == 0 or world - finished >= min_nodes:
                        self._store.add(_RESTARTING, 1)
                        return
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
            from torch.distributed.elastic.multiprocessing.api import SignalException
            from torch.distributed.elastic.utils import store as store_util

            world = self._worker_group.group_world_size
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
                        self._worker_group.spec.rdzv_handler.set_closed()
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
            if self._worker_group.spec.rdzv_handler.get_backend() == "static":
                return False
            finished = int(self._store.add(_EXIT_MEMBERS, 0))
            restarting = int(self._store.add(_RESTARTING, 0))
            return (restarting > 0 and finished + restarting >= world
                    and world - finished < _min_nodes(self._worker_group))

        def _restart_workers(self, worker_group: WorkerGroup) -> None:
            from torch.distributed.elastic.rendezvous import RendezvousClosedError
            from torch.distributed.elastic.utils import store as store_util

            failed = worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
            self._events.write(
                "restart",
                round=self._round,
                reason="failure" if failed else "membership",
                restart_count=self._restart_count(worker_group),
                remaining_restarts=self._remaining_restarts,
            )
            round_store, world = self._store, worker_group.group_world_size
            assert world is not None  # set by _rendezvous
            try:
                super()._restart_workers(worker_group)
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

    return GeminiAgent


def _describe_host(coordination: Any, memory_service: Any, handler: Any) -> None:
    """Publish where this host's replication server listens and its rendezvous node, by
    which the others can tell that its supervisor died and drop it from the rendezvous."""
    node = getattr(handler, "_this_node", None)
    replication = memory_service.replication
    try:
        coordination.describe(
            replication=list(replication.address) if replication is not None else None,
            node=repr(node) if node is not None else None)
    except StoreError as exc:
        logger.warning("cannot publish this host's addresses: %s", exc)


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


# -- launching --------------------------------------------------------------------------

def torchrun_argv(config: RunConfig, command: Command) -> list[str]:
    """The torchrun command line equivalent to ``config`` and ``command``."""
    argv: list[str] = []
    for name in TORCHRUN_FIELDS:
        value = getattr(config, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif value is not None and value != "":
            argv.append(f"{flag}={value}")
    return [*argv, command.script, *command.args]


def check_command(config: RunConfig, command: Command) -> None:
    """Fail early, with a one-line reason, on a training command that cannot start."""
    import shutil

    if config.module:
        return  # a module is found by the workers' interpreter
    if config.no_python:
        if shutil.which(command.script) is None:
            raise UsageError(f"training command not found or not executable: {command.script}")
        return
    if not Path(command.script).is_file():
        raise UsageError(f"training script not found: {command.script}")


def launch(config: RunConfig, command: Command, *,
           extra_services: Sequence[SupervisorService] = ()) -> None:
    """Run the job on this host until it succeeds, fails or is stopped by a signal.

    Raises :class:`WorkerFailedError` with torchrun's failure summary when the worker
    group fails with no restarts left, and :class:`Interrupted` on a handled signal.
    """
    check_command(config, command)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        _launch(config, command, extra_services)
    except SignalException as exc:  # a signal before the job started (see _handle_signals)
        raise Interrupted(int(exc.sigval)) from None


def _handle_signals(names: str) -> None:
    """Turn ``names`` (torchrun's --signals-to-handle) into SignalException from now on.

    torch elastic installs this handler only when it first starts workers; a supervisor
    stopped before that (waiting for its first rendezvous, say) would die of the signal's
    default action, with no clean-up of its memory and no exit event.
    """
    import signal
    import threading

    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    if threading.current_thread() is not threading.main_thread():
        return
    for name in names.split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals):
            signal.signal(sig, _terminate_process_handler)


def _launch(config: RunConfig, command: Command,
            extra_services: Sequence[SupervisorService]) -> None:
    import torch.distributed.run as torchrun
    from torch.distributed import DistError
    from torch.distributed.elastic import events as torch_events
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        get_error_handler,
    )
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import _get_entrypoint_name

    from launcher.config import default_store_url
    from launcher.coordination import CoordinationService
    from launcher.slots import SlotOwner
    from launcher.standby import StandbyService
    from launcher.store import open_store, watch_outages

    args = torchrun.parse_args(torchrun_argv(config, command))  # type: ignore[no-untyped-call]
    _check_backend(args.rdzv_backend)
    _apply_torchrun_defaults(args, torchrun.parse_min_max_nnodes)
    launch_config, entrypoint, entry_args = torchrun.config_from_args(args)
    _handle_signals(launch_config.signals_to_handle)
    if not launch_config.run_id:
        launch_config.run_id = str(uuid.uuid4().int)

    from launcher.rendezvous import (
        STORE_TIMEOUT_KEY,
        drop_gone_nodes,
        register,
        set_credentials,
        speed_up_rendezvous,
    )

    speed_up_rendezvous(single_node=launch_config.max_nodes == 1)
    if launch_config.rdzv_backend == "etcd-v3":
        register()
        launch_config.rdzv_configs.setdefault(STORE_TIMEOUT_KEY, config.store_timeout)
        set_credentials(launch_config.rdzv_configs, config.store_credentials)
    try:
        spec = _worker_spec(launch_config, entrypoint, tuple(entry_args))
    except (RendezvousError, DistError) as exc:
        raise StoreError(f"rendezvous failed: {type(exc).__name__}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"invalid rendezvous settings: {exc}") from None

    run_dir = run_directory(config.run_root, launch_config.run_id)
    owner = SlotOwner(run_id=launch_config.run_id,
                      host_id=os.environ.get(ENV_HOST_ID) or socket.gethostname(),
                      local_world_size=launch_config.nproc_per_node,
                      fixed_host_id=ENV_HOST_ID in os.environ)
    try:
        events = EventLog(run_dir, host=owner.host_id)
    except OSError as exc:
        owner.close()
        raise ConfigError(f"cannot write the run directory {run_dir}: {exc.strerror}") from None
    unwatch = watch_outages(lambda event, fields: events.write(event, **fields))
    services: list[SupervisorService] = []  # coordination closes first, the slots last
    try:
        store = open_store(config.store or default_store_url(config.run_root),
                           outage=config.store_timeout, credentials=config.store_credentials)
        coordination = CoordinationService(store, run_id=launch_config.run_id,
                                           host_id=owner.host_id, owner=owner,
                                           ttl=config.host_ttl)
        services.append(coordination)
        memory_service = _memory_service(config, launch_config, owner, events, store)
        services.append(memory_service)
        from launcher.health import HealthService

        services.append(HealthService(owner.prefix, launch_config.nproc_per_node,
                                      hang_timeout=config.hang_timeout, events=events))
        if memory_service.persist is not None:
            coordination.persist_status = memory_service.persist.status
    except BaseException:
        for service in services:
            service.close()
        owner.close()
        unwatch()
        events.close()
        raise
    if launch_config.max_nodes > 1:
        print(f"gemini: coordination store {store!r}", file=sys.stderr, flush=True)
        _describe_host(coordination, memory_service, spec.rdzv_handler)
        drop_gone_nodes(coordination.lost_nodes)
        replication = memory_service.replication
        if replication is not None and config.heartbeat_timeout > 0:
            from launcher.heartbeat import HeartbeatService

            services.insert(0, HeartbeatService(  # closes first: no pings of leaving hosts
                coordination, events, connect=replication.client,
                timeout=config.heartbeat_timeout))
    events.add_sink(coordination.record_event)
    if config.standby:
        services.append(StandbyService(launch_config.nproc_per_node, entry_args))
    services += extra_services
    os.environ[ENV_RUN_DIR] = str(run_dir)
    os.environ[ENV_HOST_ID] = owner.host_id
    os.environ[ENV_SUPERVISOR_PID] = str(os.getpid())  # see launcher.hook
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = launch_config.signals_to_handle

    error_handler = get_error_handler()
    error_handler.initialize()
    shutdown_rdzv = True
    outcome = "failed"
    try:
        agent = make_agent(
            spec=spec,
            logs_specs=launch_config.logs_specs,
            start_method=launch_config.start_method,
            log_line_prefix_template=launch_config.log_line_prefix_template,
            shutdown_timeout=launch_config.shutdown_timeout,
            events=events,
            host_id=owner.host_id,
            services=services,
            lost_hosts=coordination.lost_hosts,
            declare_dead=coordination.declare_dead,
            forget=lambda: owner.discard_newer_than(-1),
        )
        events.write("launch", run_id=launch_config.run_id, nnodes=config.nnodes,
                     nproc_per_node=launch_config.nproc_per_node,
                     rdzv_backend=launch_config.rdzv_backend,
                     max_restarts=launch_config.max_restarts,
                     entrypoint=_get_entrypoint_name(entrypoint, list(entry_args)))
        try:
            result = agent.run()
        except _RoundClosed as ended:
            result = ended.failure
        except _NotNeeded:
            result = None
        if result is None:  # torch's graceful exit, or ours: the job ended without this host
            print("gemini: the rendezvous is closed: the job finished without needing this "
                  "host", file=sys.stderr, flush=True)
            events.write("not_needed", fenced=agent.fenced)
        torch_events.record(agent.get_event_succeeded(), launch_config.event_log_handler)
        if result is not None and result.is_failed():
            failed = ChildFailedError(
                name=_get_entrypoint_name(entrypoint, list(entry_args)),
                failures=result.failures,
            )
            _, first = failed.get_first_failure()
            if first.error_file != "<N/A>":
                error_handler.dump_error_file(first.error_file, first.exitcode)
            raise WorkerFailedError(failed.format_msg())  # type: ignore[no-untyped-call]
        outcome = "succeeded"
    except SignalException as exc:
        shutdown_rdzv = False
        outcome = "interrupted"
        torch_events.record(agent.get_event_failed(), launch_config.event_log_handler)
        raise Interrupted(int(exc.sigval)) from None
    except Exception as exc:
        outage = _store_outage(exc)
        if outage is not None:  # torch stopped the workers; their memory stays for the next run
            shutdown_rdzv = False
            outcome = "store_unavailable"
            owner.keep_segments()
            raise StoreUnavailableError(
                f"{outage}; the workers were stopped and their checkpoints stay in shared "
                "memory for the next `gemini run` of this run on this host") from None
        if isinstance(exc, (RendezvousError, DistError)):
            raise StoreError(f"rendezvous failed: {type(exc).__name__}: {exc}") from exc
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        events.write("exit", outcome=outcome)
        if memory_service.replication is not None:  # it uses the store, closed first
            memory_service.replication.stop_sending(wait=outcome != "store_unavailable")
        for service in services:
            service.close()
        unwatch()
        events.close()


def _check_backend(backend: str) -> None:
    """A ConfigError for a rendezvous backend torch does not know (before torch warns
    about flags that only matter to other backends)."""
    from torch.distributed.elastic.rendezvous import registry  # registers torch's own
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    from launcher.rendezvous import BACKEND

    assert registry is not None  # imported for its registrations
    known = {*getattr(rendezvous_handler_registry, "_registry", {}), BACKEND, "static"}
    if backend not in known:
        raise ConfigError(f"unknown rendezvous backend {backend[:40]!r}; use one of: "
                          f"{', '.join(sorted(known))}", field="rdzv_backend")


def _store_outage(exc: BaseException) -> StoreUnavailableError | None:
    """The outage past ``--store-timeout`` behind ``exc`` (torch wraps it), if any."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, StoreUnavailableError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _memory_service(config: RunConfig, launch_config: Any, owner: SlotOwner, events: EventLog,
                    store: GeminiStore) -> MemoryService:
    """The memory tier, with replication to peer hosts when the job may have several and
    the persistent tier when a directory is given."""
    from launcher.tiers import MemoryService

    replication = persist = None
    if config.replicas > 1 and launch_config.max_nodes > 1:
        from launcher.replication.service import (
            ReplicationService,
            address_towards,
            advertised_host,
            load_secret,
        )

        bind = config.replication_bind
        if not config.replication_addr:  # where peers reach this host, not every interface
            toward = (launch_config.rdzv_endpoint or launch_config.master_addr or "").split(",")[0]
            host = launch_config.local_addr or address_towards(toward.rpartition(":")[0]
                                                               if ":" in toward else toward)
            if host is not None:
                bind = (host, 0)
        if not config.secret_file and not config.store.startswith("etcd://"):
            logger.warning("replication between hosts needs one secret for the whole run: "
                           "unless every host opens this same embedded store file, pass "
                           "--secret-file (the same file on every host) or an etcd --store")
        replication = ReplicationService(
            owner, events, store, run_id=launch_config.run_id, replicas=config.replicas,
            secret=load_secret(config.secret_file, store, launch_config.run_id), bind=bind,
            advertise=advertised_host(bind[0], launch_config.local_addr), pace=config.pace,
            every=config.replicate_every, rate_limit=config.replication_rate * 1e6)
    if config.persist_dir:
        from launcher.persist import PersistWriter

        every_steps, every_seconds = config.persist_interval
        persist = PersistWriter(Path(config.persist_dir).expanduser(), run_id=launch_config.run_id,
                                sources=owner.segments, every_steps=every_steps,
                                every_seconds=every_seconds, keep=config.persist_keep)
        persist.start()
    return MemoryService(owner, events, replication=replication, persist=persist)


def _worker_spec(launch_config: Any, entrypoint: Any, entry_args: tuple[Any, ...]) -> Any:
    """torch elastic's WorkerSpec for this host, as ``torch.distributed.launcher`` builds it."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.launcher.api import _get_addr_and_port

    rdzv_parameters = RendezvousParameters(
        backend=launch_config.rdzv_backend,
        endpoint=launch_config.rdzv_endpoint,
        run_id=launch_config.run_id,
        min_nodes=launch_config.min_nodes,
        max_nodes=launch_config.max_nodes,
        local_addr=launch_config.local_addr,
        **launch_config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(rdzv_parameters)
    return WorkerSpec(
        role=launch_config.role,
        local_world_size=launch_config.nproc_per_node,
        entrypoint=entrypoint,
        args=entry_args,
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv_parameters),
        max_restarts=launch_config.max_restarts,
        monitor_interval=launch_config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=launch_config.local_addr,
        event_log_handler=launch_config.event_log_handler,
        numa_options=launch_config.numa_options,
        duplicate_stdout_filters=launch_config.duplicate_stdout_filters,
        duplicate_stderr_filters=launch_config.duplicate_stderr_filters,
        virtual_local_rank=launch_config.virtual_local_rank,
    )


def _apply_torchrun_defaults(args: Any, parse_min_max_nnodes: Any) -> None:
    """What ``torch.distributed.run.run`` does to its arguments before ``config_from_args``."""
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
