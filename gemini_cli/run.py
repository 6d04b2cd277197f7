"""``gemini run``: torchrun's command line, plus gemini's flags."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import click

from launcher.config import DEFAULT_RUN_ROOT

_GEMINI_OPTIONS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("--run-root", "--run_root"), "run_root",
     "Directory holding one directory per run (events, state).  "
     f"[default: {DEFAULT_RUN_ROOT}]"),
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
    (("--preload",), "preload",
     "Modules (comma-separated) the standbys import before they wait, besides torch and the "
     "installed packages the run's workers imported, e.g. your own package.  [default: none]"),
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
     "Persist every N steps, or every T seconds (with an s: 600s).  [default: 600s]"),
    (("--persist-keep", "--persist_keep"), "persist_keep",
     "Complete persisted steps to keep.  [default: 2]"),
    (("--persist-on-exit/--no-persist-on-exit",), "persist_on_exit",
     "On a stop by signal (a preemption), persist the newest step of every rank to "
     "--persist-dir before exiting.  [default: persist-on-exit]"),
    (("--exit-grace", "--exit_grace"), "exit_grace",
     "Seconds a stop by signal may spend persisting; keep it below the scheduler's grace "
     "period.  [default: 20]"),
    (("--on-divergence", "--on_divergence"), "on_divergence",
     "When the data-parallel replicas' state disagrees (silent data corruption): rollback "
     "every rank to the newest step they agreed on, stop (exit 5), or warn.  "
     "[default: rollback]"),
    (("--exclude-divergent/--no-exclude-divergent",), "exclude_divergent",
     "When a majority of three or more replicas outvotes this host's state, this host "
     "leaves the job (exit 6) and a spare or the others go on.  [default: no]"),
    (("--max-same-failures", "--max_same_failures"), "max_same_failures",
     "Restarts failing the same way with no new step in between before the job stops for "
     "good with exit code 7 (do not requeue); 0: never.  [default: 3]"),
)

# What each valued flag of gemini's takes, as `gemini run --help` names it.
_METAVARS = {
    "run_root": "DIR", "store": "URL", "store_cacert": "FILE", "store_cert": "FILE",
    "store_key": "FILE", "store_user": "USER", "store_password_file": "FILE",
    "host_ttl": "SECONDS", "heartbeat_timeout": "SECONDS", "store_timeout": "SECONDS",
    "hang_timeout": "SECONDS", "preload": "MODULE[,MODULE...]", "replicas": "M",
    "replication_addr": "HOST[:PORT]",
    "secret_file": "FILE", "replicate_every": "N", "replication_rate": "MB_PER_S",
    "persist_dir": "DIR", "persist_every": "N|Ts", "persist_keep": "N",
    "exit_grace": "SECONDS", "on_divergence": "{rollback,stop,warn}",
    "max_same_failures": "N",
}


class _Parser(argparse.ArgumentParser):
    """torchrun's own argument parser, with gemini's flags added: it accepts exactly what
    torchrun accepts, unique prefixes of long flags included (``--nproc_per 2``)."""

    def __init__(self, torchrun: argparse.ArgumentParser) -> None:
        super().__init__(
            prog="gemini run", parents=[torchrun], add_help=False,
            usage="gemini run [TORCHRUN AND GEMINI FLAGS] SCRIPT|MODULE [ARGS]...",
            description="Launch SCRIPT on every worker, exactly as torchrun would, under "
            "gemini's supervisor. Every torchrun flag works with the same meaning and "
            "default. Values come from, in order of precedence: the command line, "
            "GEMINI_<KEY> (or torchrun's PET_<KEY>) environment variables, the --config "
            "file, the defaults.")
        self._torchrun = frozenset(a.dest for a in torchrun._actions)

    def _get_option_tuples(self, option_string: str) -> list[Any]:
        """The flags a prefix could mean: torchrun's only, one per flag (both spellings of
        one flag are one match), so that what torchrun accepts means here what it means
        there. gemini's own flags are never abbreviated: ``--store-password pw`` is an
        unknown flag, not ``--store-password-file`` reading (and naming in its error) a
        file called like the password."""
        first: dict[Any, Any] = {}
        for match in super()._get_option_tuples(option_string):
            if match[0].dest in self._torchrun:
                first.setdefault(match[0], match)
        return list(first.values())

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):  # name the flags, not their values (a password?)
            message = prefix + " ".join(arg.split("=", 1)[0] + ("=..." if "=" in arg else "")
                                        for arg in message[len(prefix):].split())
        raise click.UsageError(message, ctx=click.get_current_context(silent=True))


def _parser() -> _Parser:
    from torch.distributed.run import get_args_parser

    torchrun = get_args_parser()
    for action in torchrun._actions:
        if action.option_strings and action.dest != "help":
            if action.help and action.default not in (None, False, "", []):
                action.help = f"{action.help}  [default: {action.default}]"
            action.default = argparse.SUPPRESS  # only what the command line gave
            action.type = None  # converted once, with the environment's and the file's
        elif action.dest == "training_script":
            action.metavar = "SCRIPT|MODULE"
        elif action.dest == "training_script_args":
            action.metavar = "[ARGS]..."
    parser = _Parser(torchrun)
    group = parser.add_argument_group("gemini")
    group.add_argument("--config", dest="config_file", default=argparse.SUPPRESS,
                       metavar="FILE", help="gemini.yaml with defaults for any flag (see "
                       "`gemini template config`).")
    for names, key, help_text in _GEMINI_OPTIONS:
        if "/" in names[0]:
            group.add_argument(names[0].split("/")[0], dest=key, help=help_text,
                               action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS)
        else:
            group.add_argument(*names, dest=key, help=help_text, metavar=_METAVARS[key],
                               default=argparse.SUPPRESS)
    return parser


@click.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    add_help_option=False,
    short_help="Launch training like torchrun, with in-memory checkpoints.",
)
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def run_command(argv: tuple[str, ...]) -> int:
    """Launch SCRIPT on every worker, exactly as torchrun would (see gemini run --help)."""
    from launcher import config as cfg
    from launcher.agent import Command, launch

    # The supervisor's c10d stores log a C++ warning with a backtrace for every call to
    # a store that closed (a peer that finished first), where torchrun logs nothing; the
    # level is read as torch loads, so set it for this process only, not its workers.
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ and "torch" not in sys.modules
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        parser = _parser()
    finally:
        if quiet:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
    try:
        given = vars(parser.parse_args(argv))
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    script, script_args = given.pop("training_script"), given.pop("training_script_args")
    config_file = given.pop("config_file", None)
    flags = {a.dest: _flag(a.option_strings) for a in parser._actions if a.option_strings}
    cli_values = {
        key: value if isinstance(value, bool) else cfg.convert_value(key, value, flags[key])
        for key, value in given.items()
    }
    file_path = config_file or os.environ.get("GEMINI_CONFIG")
    file_values = cfg.read_config_file(file_path) if file_path else {}
    run_config = cfg.resolve(cli=cli_values, environ=os.environ, file_values=file_values)
    launch(run_config, Command(script=script, args=tuple(script_args)))
    return 0


def _flag(names: Sequence[str]) -> str:
    """The flag as an error names it: its first long spelling."""
    return next((n for n in names if n.startswith("--")), names[0])
