"""``gemini run``: torchrun's command line, plus gemini's flags."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource

# (flag names, config key, help). Every torchrun flag, in both of torchrun's spellings.
_TORCHRUN_OPTIONS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("--nnodes",), "nnodes", "Number of nodes, N or MIN:MAX.  [default: 1:1]"),
    (("--nproc-per-node", "--nproc_per_node"), "nproc_per_node",
     "Workers per node: an integer, auto, cpu, gpu or xpu.  [default: 1]"),
    (("--node-rank", "--node_rank"), "node_rank", "Rank of this node (static backend)."),
    (("--rdzv-backend", "--rdzv_backend"), "rdzv_backend",
     "Rendezvous backend: static, c10d, etcd, etcd-v2, or etcd-v3 (gemini's: torch's "
     "dynamic rendezvous kept in etcd v3, survives any host).  [default: static]"),
    (("--rdzv-endpoint", "--rdzv_endpoint"), "rdzv_endpoint", "Rendezvous HOST[:PORT]."),
    (("--rdzv-id", "--rdzv_id"), "rdzv_id", "Job id shared by all nodes."),
    (("--rdzv-conf", "--rdzv_conf"), "rdzv_conf", "Rendezvous settings, k1=v1,k2=v2."),
    (("--standalone",), "standalone", "Single-node job with a private localhost rendezvous."),
    (("--max-restarts", "--max_restarts"), "max_restarts",
     "Restarts of the worker group before failing.  [default: 0]"),
    (("--monitor-interval", "--monitor_interval"), "monitor_interval",
     "Seconds between worker state checks.  [default: 0.1]"),
    (("--start-method", "--start_method"), "start_method", "spawn, fork or forkserver."),
    (("--event-log-handler", "--event_log_handler"), "event_log_handler",
     "torch elastic event log handler."),
    (("--role",), "role", "Worker role.  [default: default]"),
    (("-m", "--module"), "module", "Run SCRIPT as a module, like python -m."),
    (("--no-python", "--no_python"), "no_python", "Run SCRIPT directly, not through python."),
    (("--run-path", "--run_path"), "run_path", "Run SCRIPT with runpy.run_path in the launcher."),
    (("--log-dir", "--log_dir"), "log_dir", "Directory for worker log files."),
    (("-r", "--redirects"), "redirects", "Redirect worker streams to log files: 0-3 or rank:N,..."),
    (("-t", "--tee"), "tee", "Tee worker streams to log files and console: 0-3 or rank:N,..."),
    (("--local-ranks-filter", "--local_ranks_filter"), "local_ranks_filter",
     "Comma-separated local ranks shown on the console."),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), "duplicate_stdout_filters",
     "Copy stdout lines containing these comma-separated strings to a log."),
    (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), "duplicate_stderr_filters",
     "Copy stderr lines containing these comma-separated strings to a log."),
    (("--master-addr", "--master_addr"), "master_addr", "Node 0 address (static backend)."),
    (("--master-port", "--master_port"), "master_port", "Node 0 port (static backend)."),
    (("--local-addr", "--local_addr"), "local_addr", "This node's address for other nodes."),
    (("--logs-specs", "--logs_specs"), "logs_specs", "torchrun.logs_specs entry point name."),
    (("--numa-binding", "--numa_binding"), "numa_binding",
     "NUMA binding: node, socket, exclusive, core-complex."),
    (("--signals-to-handle", "--signals_to_handle"), "signals_to_handle",
     "Signals that stop the job gracefully."),
    (("--shutdown-timeout", "--shutdown_timeout"), "shutdown_timeout",
     "Seconds from SIGTERM to SIGKILL when stopping workers."),
    (("--virtual-local-rank", "--virtual_local_rank"), "virtual_local_rank",
     "LOCAL_RANK=0 for every worker, one visible device each."),
)
_FLAGS = frozenset({"standalone", "module", "no_python", "run_path", "virtual_local_rank"})

_GEMINI_OPTIONS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("--run-root", "--run_root"), "run_root",
     "Directory holding one directory per run (events, state).  "
     "[default: ~/.local/state/gemini/runs]"),
    (("--store",), "store",
     "Coordination store: etcd://HOST:PORT[,HOST:PORT...] or embedded:///PATH.  "
     "[default: embedded, next to the run root]"),
    (("--store-cacert", "--store_cacert"), "store_cacert",
     "CA certificate of an etcd store (and etcd-v3 rendezvous) served over TLS."),
    (("--store-cert", "--store_cert"), "store_cert",
     "Client certificate for an etcd with --client-cert-auth (with --store-key)."),
    (("--store-key", "--store_key"), "store_key", "Private key of --store-cert."),
    (("--store-user", "--store_user"), "store_user",
     "etcd user to authenticate as (with --store-password-file)."),
    (("--store-password-file", "--store_password_file"), "store_password_file",
     "File holding --store-user's password."),
    (("--host-ttl", "--host_ttl"), "host_ttl",
     "Seconds without a refresh of its lease in the store before a host counts as lost.  "
     "[default: 10]"),
    (("--heartbeat-timeout", "--heartbeat_timeout"), "heartbeat_timeout",
     "Seconds a peer's supervisor may leave heartbeats unanswered before it is suspected; "
     "a majority of suspecting hosts makes it lost.  0: leases alone decide.  [default: 1]"),
    (("--store-timeout", "--store_timeout"), "store_timeout",
     "Seconds an etcd store may stay unreachable while training goes on; past them the "
     "workers stop, their checkpoints stay in memory, exit 3.  0: exit at once.  "
     "[default: 60]"),
    (("--hang-timeout", "--hang_timeout"), "hang_timeout",
     "Seconds without an optimizer step or save in a worker's Checkpointer before the "
     "host's workers count as hung and are restarted; 0 turns hang detection off.  "
     "[default: 0]"),
    (("--standby/--no-standby",), "standby",
     "Keep a standby interpreter per worker with torch imported, for fast restarts.  "
     "[default: standby]"),
    (("--replicas",), "replicas",
     "Copies of each host's checkpoint in CPU memory, its own included; 1 turns "
     "replication to peer hosts off.  [default: 2]"),
    (("--replication-addr", "--replication_addr"), "replication_addr",
     "HOST[:PORT] the replication transport listens on.  [default: --local-addr, else the "
     "address that reaches the rendezvous endpoint; any port]"),
    (("--secret-file", "--secret_file"), "secret_file",
     "File with the run's replication secret.  [default: random, shared via the store]"),
    (("--replicate-every", "--replicate_every"), "replicate_every",
     "Replicate every N-th step (the same steps on every host); 0 picks N from the "
     "time one replication takes.  [default: 0]"),
    (("--replication-rate", "--replication_rate"), "replication_rate",
     "Cap replication traffic at this many MB/s per push; 0: no cap.  [default: 0]"),
    (("--pace/--no-pace",), "pace",
     "Spread replication traffic over each iteration instead of bursts.  [default: pace]"),
    (("--persist-dir", "--persist_dir"), "persist_dir",
     "Directory (shared by all hosts) for the persistent tier.  [default: none]"),
    (("--persist-every", "--persist_every"), "persist_every",
     "Persist every N steps, or every Ts seconds.  [default: 600s]"),
    (("--persist-keep", "--persist_keep"), "persist_keep",
     "Complete persisted steps to keep.  [default: 2]"),
)


def _options(command: Callable[..., Any]) -> Callable[..., Any]:
    table = _TORCHRUN_OPTIONS + _GEMINI_OPTIONS
    for names, key, help_text in reversed(table):
        if key in _FLAGS:
            command = click.option(*names, key, is_flag=True, default=False,
                                   help=help_text)(command)
        elif "/" in names[0]:
            command = click.option(*names, key, default=None, help=help_text)(command)
        else:
            command = click.option(*names, key, default=None, metavar="VALUE",
                                   help=help_text)(command)
    return command


@click.command(
    "run",
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
    short_help="Launch training like torchrun, with in-memory checkpoints.",
)
@click.option("--config", "config_file", default=None, metavar="FILE",
              help="gemini.yaml with defaults for any flag (see `gemini template config`).")
@_options
@click.argument("script", metavar="SCRIPT|MODULE")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[ARGS]...")
@click.pass_context
def run_command(ctx: click.Context, /, config_file: str | None, script: str,
                script_args: tuple[str, ...], **options: Any) -> int:
    """Launch SCRIPT on every worker, exactly as torchrun would, under gemini's supervisor.

    Every torchrun flag works with the same meaning and default. Values come from, in
    order of precedence: the command line, GEMINI_<KEY> (or torchrun's PET_<KEY>)
    environment variables, the --config file, the defaults.
    """
    from launcher import config as cfg
    from launcher.agent import Command, launch

    given = {
        key: value for key, value in options.items()
        if ctx.get_parameter_source(key) is ParameterSource.COMMANDLINE
    }
    cli_values = {
        key: value if isinstance(value, bool) else cfg.convert_value(key, value, _flag(key))
        for key, value in given.items()
    }
    file_path = config_file or os.environ.get("GEMINI_CONFIG")
    file_values = cfg.read_config_file(file_path) if file_path else {}
    run_config = cfg.resolve(cli=cli_values, environ=os.environ, file_values=file_values)
    launch(run_config, Command(script=script, args=script_args))
    return 0


def _flag(key: str) -> str:
    for names, name, _ in _TORCHRUN_OPTIONS + _GEMINI_OPTIONS:
        if name == key:
            return names[-1] if len(names[0]) == 2 else names[0].split("/")[0]
    return key
