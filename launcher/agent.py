"""The per-host supervisor's entry point: ``launch`` wires gemini's services around the agent.

``launch`` turns a :class:`RunConfig` into exactly what torchrun would build (torchrun's
own argument parser and ``config_from_args``), opens this host's services (coordination
store, memory tiers with replication and persistence, health, heartbeats, standby
interpreters) and runs ``launcher.elastic_agent.GeminiAgent`` instead of torch's stock
agent, mapping how its run ends to gemini's errors. This module also holds
:class:`Command` (the training command); the interface the services present to the
agent is ``launcher.elastic_agent.SupervisorService``. It imports torch only inside
functions, so that importing it stays cheap.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher import torch_boundary
from launcher.config import TORCHRUN_FIELDS, RunConfig
from launcher.contract import ENV_HOST_ID, ENV_RUN_DIR, ENV_SUPERVISOR_PID
from launcher.errors import (
    ConfigError,
    HostUnhealthyError,
    Interrupted,
    NoProgressError,
    StorageError,
    StoreError,
    StoreUnavailableError,
    UsageError,
    WorkerFailedError,
)
from launcher.events import EventLog, run_directory

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import RunResult
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    from launcher.coordination import CoordinationService
    from launcher.elastic_agent import GeminiAgent, SupervisorService
    from launcher.health import HealthService
    from launcher.heartbeat import HeartbeatService
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
    torch_boundary.check()  # before anything patches, subclasses or calls torch's internals
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
    from torch.distributed.launcher.api import _get_entrypoint_name

    launch_config, entrypoint, entry_args = _torchrun_config(config, command)
    spec = _prepare_rendezvous(config, launch_config, entrypoint, entry_args)
    host = _open_host(config, launch_config, spec.rdzv_handler, entry_args, extra_services)
    os.environ[ENV_RUN_DIR] = str(host.run_dir)
    os.environ[ENV_HOST_ID] = host.owner.host_id
    os.environ[ENV_SUPERVISOR_PID] = str(os.getpid())  # see launcher.hook
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = launch_config.signals_to_handle
    _run_agent(config, launch_config, spec, host,
               entrypoint_name=_get_entrypoint_name(entrypoint, list(entry_args)))


def _torchrun_config(config: RunConfig, command: Command) -> tuple[Any, Any, list[str]]:
    """torchrun's launch config, entrypoint and its arguments, as ``torch.distributed.run``
    builds them from the equivalent command line; its signals are handled from now on."""
    import torch.distributed.run as torchrun

    args = torchrun.parse_args(torchrun_argv(config, command))  # type: ignore[no-untyped-call]
    _check_backend(args.rdzv_backend)
    _apply_torchrun_defaults(args, torchrun.parse_min_max_nnodes)
    try:
        launch_config, entrypoint, entry_args = torchrun.config_from_args(args)
    except ValueError as exc:  # torch's verdict on a flag (--logs-specs, say)
        raise ConfigError(" ".join(str(exc).split())) from None
    _handle_signals(launch_config.signals_to_handle)
    if not launch_config.run_id:
        launch_config.run_id = str(uuid.uuid4().int)
    return launch_config, entrypoint, entry_args


def _prepare_rendezvous(config: RunConfig, launch_config: Any, entrypoint: Any,
                        entry_args: list[str]) -> Any:
    """This host's WorkerSpec, with gemini's rendezvous settings (and its etcd backend)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous import RendezvousError

    from launcher.rendezvous import STORE_TIMEOUT_KEY, set_credentials

    torch_boundary.apply(single_node=launch_config.max_nodes == 1,
                         etcd_v3=launch_config.rdzv_backend == "etcd-v3")
    if launch_config.rdzv_backend == "etcd-v3":
        launch_config.rdzv_configs.setdefault(STORE_TIMEOUT_KEY, config.store_timeout)
        set_credentials(launch_config.rdzv_configs, config.store_credentials)
    try:
        return _worker_spec(launch_config, entrypoint, tuple(entry_args))
    except (RendezvousError, DistError) as exc:
        raise StoreError(f"rendezvous failed: {type(exc).__name__}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"invalid rendezvous settings: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class _Host:
    """What :func:`_open_host` opened for this host's run; :meth:`close` closes it all."""

    run_dir: Path
    """The run's directory: events and error files."""
    owner: SlotOwner
    """The owner of this host's checkpoint slots in shared memory."""
    events: EventLog
    """This host's JSON-lines events."""
    coordination: CoordinationService
    """Leases, lost hosts and holdings in the coordination store."""
    memory: MemoryService
    """The checkpoint tiers: memory, replication to peer hosts, persistence."""
    services: tuple[SupervisorService, ...]
    """Every service the agent runs, in the order they close: the heartbeats (if any;
    first, so that no leaving host is pinged), coordination, the memory tiers, health,
    the standby interpreters (if any), then the caller's."""
    unwatch: Callable[[], None]
    """Stops writing the store's outages as events."""

    def close(self, *, wait: bool) -> None:
        """Close everything; replication stops sending first (it uses the store, which
        coordination closes), waiting for the sends under way when ``wait``."""
        if self.memory.replication is not None:
            self.memory.replication.stop_sending(wait=wait)
        for service in self.services:
            service.close()
        self.unwatch()
        self.events.close()


def _open_host(config: RunConfig, launch_config: Any, rdzv_handler: Any,
               entry_args: list[str], extra_services: Sequence[SupervisorService]) -> _Host:
    """Open this host's services for the run: the owner of its slots and its event log,
    the coordination store, the memory tiers, health, heartbeats between hosts and standby
    interpreters; what was opened is closed again when a later one fails."""
    from launcher.config import default_store_url
    from launcher.coordination import CoordinationService
    from launcher.health import HealthService
    from launcher.rendezvous import drop_gone_nodes
    from launcher.slots import SlotOwner
    from launcher.standby import ENV_PRELOAD, StandbyService
    from launcher.store import open_store, watch_outages

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
        secret = _run_secret(config, launch_config, store, coordination)
        memory = _memory_service(config, launch_config, owner, events, store, secret)
        services.append(memory)
        health = HealthService(owner.prefix, launch_config.nproc_per_node,
                               hang_timeout=config.hang_timeout, events=events)
        services.append(health)
        services += _progress_services(config, launch_config, health, events, coordination)
        if memory.persist is not None:
            coordination.persist_status = memory.persist.status
        if memory.replication is not None:
            coordination.spare.take_over = memory.take_over
        if launch_config.max_nodes > 1:
            print(f"gemini: coordination store {store!r}", file=sys.stderr, flush=True)
            _describe_host(coordination, memory, rdzv_handler)
            drop_gone_nodes(coordination.lost_nodes)
            heartbeat = _heartbeat_service(config, coordination, memory, events)
            if heartbeat is not None:
                services.insert(0, heartbeat)  # closes first: no pings of leaving hosts
        events.add_sink(coordination.record_event)
        if config.standby:
            if config.preload:  # read by the standbys (launcher.standby.warm_recorded)
                os.environ[ENV_PRELOAD] = config.preload
            standbys = StandbyService(launch_config.nproc_per_node, entry_args,
                                      progressed=health.progressed)
            services.append(standbys)
            coordination.spare.standby_ready = standbys.ready
    except BaseException:
        for service in services:
            service.close()
        owner.close()
        unwatch()
        events.close()
        raise
    return _Host(run_dir=run_dir, owner=owner, events=events, coordination=coordination,
                 memory=memory, services=(*services, *extra_services), unwatch=unwatch)


def _progress_services(config: RunConfig, launch_config: Any, health: HealthService,
                       events: EventLog, coordination: CoordinationService
                       ) -> list[SupervisorService]:
    """What the workers' progress words feed: the run's goodput, and with several hosts
    the search for stragglers; each publishes through the coordination store."""
    from launcher.goodput import GoodputService
    from launcher.stragglers import StragglerService

    goodput = GoodputService(health.progress, events, coordination.goodput_records,
                             coordination.host_id)
    coordination.reports["goodput"] = goodput.record
    if config.straggler_threshold <= 0 or launch_config.max_nodes <= 1:
        return [goodput]
    stragglers = StragglerService(health.progress, events, coordination.host_id,
                                  threshold=config.straggler_threshold,
                                  window=config.straggler_window,
                                  replace=config.replace_stragglers)
    coordination.reports["pace"] = stragglers.pace
    coordination.judge = stragglers.evaluate
    coordination.on_verdict = stragglers.verdict
    return [goodput, stragglers]


def _heartbeat_service(config: RunConfig, coordination: CoordinationService,
                       memory: MemoryService, events: EventLog) -> HeartbeatService | None:
    """Heartbeats to the peer hosts' replication servers; None without replication or
    with ``--heartbeat-timeout 0``."""
    replication = memory.replication
    if replication is None or config.heartbeat_timeout <= 0:
        return None
    from launcher.heartbeat import HeartbeatService

    return HeartbeatService(coordination, events, connect=replication.client,
                            timeout=config.heartbeat_timeout)


def _run_agent(config: RunConfig, launch_config: Any, spec: Any, host: _Host, *,
               entrypoint_name: str) -> None:
    """Run the agent until the job ends on this host and map how it ended to gemini's
    errors; then shut the rendezvous down (not after a signal or a store outage: that
    would close it for the hosts that go on, or for this run resumed later) and close
    the host's services."""
    from torch.distributed import DistError
    from torch.distributed.elastic import events as torch_events
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler
    from torch.distributed.elastic.rendezvous import RendezvousError

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
            events=host.events,
            host_id=host.owner.host_id,
            services=host.services,
            lost_hosts=host.coordination.lost_hosts,
            declare_dead=host.coordination.declare_dead,
            report_failure=host.coordination.report_failure,
            forget=lambda: host.owner.discard_newer_than(-1),
            restores=host.memory, max_same_failures=config.max_same_failures,
        )
        host.coordination.on_lost = agent.wake
        host.coordination.on_failed = agent.member_failed
        host.events.write("launch", run_id=launch_config.run_id, nnodes=config.nnodes,
                          nproc_per_node=launch_config.nproc_per_node,
                          rdzv_backend=launch_config.rdzv_backend,
                          max_restarts=launch_config.max_restarts, entrypoint=entrypoint_name)
        result = agent.run_job()
        _stop_without_progress(agent, result, host, entrypoint_name, error_handler)
        if result is None:  # torch's graceful exit, or ours: the job ended without this host
            print("gemini: the rendezvous is closed: the job finished without needing this "
                  "host", file=sys.stderr, flush=True)
            host.events.write("not_needed", fenced=agent.fenced)
        torch_events.record(agent.get_event_succeeded(), launch_config.event_log_handler)
        if result is not None and result.is_failed():
            raise _worker_failure(result, entrypoint_name, error_handler)
        outcome = "succeeded"
    except SignalException as exc:
        shutdown_rdzv = False
        outcome = "interrupted"
        torch_events.record(agent.get_event_failed(), launch_config.event_log_handler)
        _persist_on_exit(config, host, agent)
        raise Interrupted(int(exc.sigval)) from None
    except Exception as exc:
        outage = _store_outage(exc)
        if outage is not None:  # torch stopped the workers; their memory stays for the next run
            shutdown_rdzv = False
            outcome = "store_unavailable"
            host.owner.keep_segments()
            raise StoreUnavailableError(
                f"{outage}; the workers were stopped and their checkpoints stay in shared "
                "memory for the next `gemini run` of this run on this host") from None
        if isinstance(exc, (RendezvousError, DistError)):
            raise StoreError(f"rendezvous failed: {type(exc).__name__}: {exc}") from exc
        if isinstance(exc, HostUnhealthyError):  # this host leaves; the job goes on
            shutdown_rdzv = False
        if isinstance(exc, StorageError):  # nothing is wrong with what the slots committed
            shutdown_rdzv = False  # this host's next run of the job joins it again
            outcome = "storage_error"
            host.owner.keep_segments()
            raise StorageError(f"{exc}; the committed checkpoints stay in shared memory for "
                               "the next `gemini run` of this run on this host") from None
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        host.events.write("exit", outcome=outcome)
        host.close(wait=outcome != "store_unavailable")


#: Seconds of a stop by signal that go to agreeing with the other hosts on the step to
#: persist (the rest of --exit-grace writes it).
EXIT_AGREE = 5.0


def _persist_on_exit(config: RunConfig, host: _Host, agent: GeminiAgent) -> None:
    """A signal ends the job (a preemption: SLURM, spot instances and Kubernetes send
    SIGTERM, then SIGKILL after a grace period) and its workers have stopped: write the
    newest step that every rank holds, agreed with the other hosts, to the persistent
    tier before the memory is freed, within ``--exit-grace`` seconds, and say so."""
    persist = host.memory.persist
    group = agent._worker_group
    if persist is None or not config.persist_on_exit or not group.workers:
        return
    began = time.monotonic()
    deadline = began + config.exit_grace
    world_size = group.workers[0].world_size

    def choose(held: dict[int, list[int]]) -> int | None:
        return host.coordination.agree_on_exit(
            held, world_size, min(deadline, began + EXIT_AGREE))

    step, ranks = persist.final(choose, deadline)
    seconds = round(time.monotonic() - began, 3)
    host.events.write("persist_on_exit", step=step, ranks=ranks, seconds=seconds)
    if step is None:
        print("gemini: stopping: no step held by every rank to persist", file=sys.stderr,
              flush=True)
    else:
        print(f"gemini: stopping: persisted step {step} of rank(s) "
              f"{', '.join(map(str, ranks)) or 'none'} to {persist.directory} in {seconds} s",
              file=sys.stderr, flush=True)


def _stop_without_progress(agent: GeminiAgent, result: RunResult | None, host: _Host,
                           entrypoint_name: str, error_handler: ErrorHandler) -> None:
    """Raise :class:`NoProgressError` when the no-progress guard stopped this host, or
    stopped another one and so ended this host's run (its rendezvous closed); print
    torchrun's failure summary first, as for any worker failure."""
    reason = agent.gave_up
    if reason is not None:
        host.coordination.report_stopped(reason)
    elif result is None or result.is_failed():
        elsewhere = host.coordination.stopped()
        reason = None if elsewhere is None else f"stopped by {elsewhere}"
    if reason is None:
        return
    if result is not None and result.is_failed():
        print(_worker_failure(result, entrypoint_name, error_handler).summary,
              file=sys.stderr, flush=True)
    raise NoProgressError(f"{reason}; not restarting again (exit code 7: do not requeue)")


def _worker_failure(result: RunResult, entrypoint_name: str,
                    error_handler: ErrorHandler) -> WorkerFailedError:
    """torchrun's summary of a failed run; the first failure's error file is dumped where
    torchrun dumps it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    failed = ChildFailedError(name=entrypoint_name, failures=result.failures)
    _, first = failed.get_first_failure()
    if first.error_file != "<N/A>":
        error_handler.dump_error_file(first.error_file, first.exitcode)
    return WorkerFailedError(failed.format_msg())  # type: ignore[no-untyped-call]


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


def _run_secret(config: RunConfig, launch_config: Any, store: GeminiStore,
                coordination: CoordinationService) -> bytes | None:
    """The run's secret, which signs the rendezvous state and authenticates replication:
    from ``--secret-file``, or shared through the store when every host opens the same
    one (etcd; an embedded store, which only a single-host job is sure to share). None
    for a multi-host job on embedded stores without a secret file: its rendezvous state
    is then JSON that runs no code but is not signed, and replication cannot connect."""
    from launcher import rendezvous_state
    from launcher.replication.service import hold_secret, load_secret

    shared = config.store.startswith("etcd://") or launch_config.max_nodes == 1
    if not config.secret_file and not shared:
        logger.warning("a job of several hosts needs one secret for the whole run: pass "
                       "--secret-file (the same file on every host) or an etcd --store; "
                       "without it, the rendezvous state is not signed and replication "
                       "between hosts cannot authenticate")
        secret = None
    else:  # a stored secret is held with this host's lease: a crashed run's is not reused
        secret = load_secret(config.secret_file, store, launch_config.run_id,
                             lease=coordination.lease)
        if not config.secret_file:
            run_id = launch_config.run_id

            def rehold(lease: Any, replaces: int) -> None:
                hold_secret(store, run_id, lease, replaces=replaces)

            coordination.rehold_secret = rehold
    rendezvous_state.use_secret(secret, launch_config.run_id)
    return secret


def _memory_service(config: RunConfig, launch_config: Any, owner: SlotOwner, events: EventLog,
                    store: GeminiStore, secret: bytes | None) -> MemoryService:
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
        replication = ReplicationService(
            owner, events, store, run_id=launch_config.run_id, replicas=config.replicas,
            secret=secret or load_secret("", store, launch_config.run_id), bind=bind,
            advertise=advertised_host(bind[0], launch_config.local_addr), pace=config.pace,
            every=config.replicate_every, rate_limit=config.replication_rate * 1e6)
    if config.persist_dir:
        from launcher.persist import PersistWriter

        every_steps, every_seconds = config.persist_interval
        persist = PersistWriter(Path(config.persist_dir).expanduser(), run_id=launch_config.run_id,
                                sources=owner.segments, every_steps=every_steps,
                                every_seconds=every_seconds, keep=config.persist_keep)
        persist.start()
    service = MemoryService(owner, events, replication=replication, persist=persist)
    service.on_divergence, service.max_rollbacks = config.on_divergence, config.max_same_failures
    service.exclude_divergent = config.exclude_divergent
    if replication is not None:
        replication.on_diverged = service.diverged
    return service


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
    """What ``torch.distributed.run.run`` does to its arguments before ``config_from_args``,
    except that a single-host job keeps a ``--rdzv-id`` it was given (torchrun replaces it
    with a random one): its next run on the host finds the checkpoints kept in memory or
    persisted under that id."""
    given = args.rdzv_id if args.rdzv_id not in ("", "none") else None
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = given or str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = given or str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
