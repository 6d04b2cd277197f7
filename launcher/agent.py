"""The per-host supervisor's entry point: ``launch`` wires gemini's services around the agent.

``launch`` turns a :class:`RunConfig` into exactly what torchrun would build (torchrun's
own argument parser and ``config_from_args``), opens this host's services (coordination
store, memory tiers with replication and persistence, health, heartbeats, standby
interpreters) and runs ``launcher.elastic_agent.GeminiAgent`` instead of torch's stock
agent, mapping how its run ends to gemini's errors. This module also holds
:class:`Command` (the training command) and :class:`SupervisorService`, the interface
those services present to the agent. It imports torch only inside functions, so that
importing it stays cheap.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from collections.abc import Sequence
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
from launcher.events import EventLog, run_directory

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store
    from torch.distributed.elastic.agent.server.api import WorkerGroup

    from launcher.elastic_agent import GeminiAgent
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


def make_agent(*args: Any, events: EventLog, host_id: str,
               services: Sequence[SupervisorService], **kwargs: Any) -> GeminiAgent:
    """Build a :class:`launcher.elastic_agent.GeminiAgent` (imported here: it imports
    torch). Optional: ``lost_hosts()``, the hosts confirmed lost (their lease expired),
    ``declare_dead(hosts)``, those of ``hosts`` whose supervisor is certainly gone, and
    ``forget()``, which empties this host's memory once it was fenced out."""
    from launcher.elastic_agent import GeminiAgent

    return GeminiAgent(*args, events=events, host_id=host_id, services=services, **kwargs)


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
        result = agent.run_job()
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
