"""Configuration of ``gemini run``: one frozen dataclass, built from flags, environment and file.

Precedence, highest first: command line > ``GEMINI_<KEY>`` environment variable >
torchrun's own ``PET_<KEY>`` variable > ``--config`` YAML file > default. Constructing a
:class:`RunConfig` validates it and does no I/O; :func:`read_config_file` is the only
function here that touches the file system.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from launcher.contract import ENV_HOST_ID
from launcher.errors import ConfigError
from launcher.events import check_run_id
from launcher.files import read_user_file
from launcher.store import EtcdCredentials

StartMethod = Literal["spawn", "fork", "forkserver"]
NumaBinding = Literal["node", "socket", "exclusive", "core-complex"]
OnDivergence = Literal["rollback", "stop", "warn"]

_NNODES = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")
_NPROC_NAMES = ("auto", "cpu", "gpu", "xpu")
_MODULE = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"  # a module name, as import takes it
_STD_SPEC = re.compile(r"^([0-3])$|^(\d+:[0-3])(,\d+:[0-3])*$")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})

DAY = 86400.0  # the longest timeout a flag may ask for; also rules out inf and nan


#: Where each run gets a directory for its events and state, unless told otherwise.
DEFAULT_RUN_ROOT = "~/.local/state/gemini/runs"

def _gemini(default: Any, metavar: str = "", *, shown: str = "") -> Any:
    """A field of gemini's own: a flag of ``gemini run`` (:func:`gemini_flags`) whose value
    is named ``metavar`` in its help (none for an on/off flag) and whose default is shown
    as ``shown`` where the default value alone does not say it (it is computed)."""
    return dataclasses.field(default=default,
                             metadata={"gemini": True, "metavar": metavar, "shown": shown})


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything ``gemini run`` needs besides the training command itself.

    The first group of fields are torchrun's flags, with torchrun's names, meanings and
    defaults; the second group are gemini's own.
    """

    # --- torchrun's flags -------------------------------------------------------------
    nnodes: str = "1:1"
    """Number of nodes, ``N`` or ``MIN:MAX`` for an elastic job."""
    nproc_per_node: str = "1"
    """Workers per node: an integer, or ``auto``, ``cpu``, ``gpu``, ``xpu``."""
    node_rank: int = 0
    """This node's rank for the ``static`` rendezvous backend."""
    rdzv_backend: str = "static"
    """Rendezvous backend: ``static``, ``c10d``, ``etcd``, ``etcd-v2`` or a registered one."""
    rdzv_endpoint: str = ""
    """Rendezvous endpoint, ``HOST[:PORT]``."""
    rdzv_id: str = "none"
    """Job id shared by every node of the job."""
    rdzv_conf: str = ""
    """Extra rendezvous settings, ``key1=value1,key2=value2``."""
    standalone: bool = False
    """Single-node job with a private rendezvous on localhost (ignores the rdzv flags)."""
    max_restarts: int = 0
    """How many times the worker group may be restarted before the job fails."""
    monitor_interval: float = 0.1
    """Seconds between two checks of the workers' state."""
    start_method: StartMethod = "spawn"
    """How workers are created when the entry point is a function."""
    event_log_handler: str = "null"
    """torch elastic's event log handler."""
    role: str = "default"
    """Role of the workers."""
    module: bool = False
    """Run the script as a module (``python -m``)."""
    no_python: bool = False
    """Run the script directly instead of through ``python``."""
    run_path: bool = False
    """Run the script in the launcher's interpreter with ``runpy.run_path``."""
    log_dir: str | None = None
    """Directory for the workers' log files (a fresh temporary one when unset)."""
    redirects: str = "0"
    """Redirect worker streams into log files: 0 none, 1 stdout, 2 stderr, 3 both; or ``rank:N,...``."""
    tee: str = "0"
    """Like ``redirects`` but also keep writing to the console."""
    local_ranks_filter: str = ""
    """Comma-separated local ranks whose output reaches the console."""
    duplicate_stdout_filters: str = ""
    """Comma-separated strings; stdout lines containing one are copied to a filtered log."""
    duplicate_stderr_filters: str = ""
    """Comma-separated strings; stderr lines containing one are copied to a filtered log."""
    master_addr: str = "127.0.0.1"
    """Address of node rank 0 for the ``static`` backend."""
    master_port: int | None = None
    """Port of node rank 0 for the ``static`` backend (29500 when unset)."""
    local_addr: str | None = None
    """This node's address as other nodes reach it."""
    logs_specs: str | None = None
    """Name of a ``torchrun.logs_specs`` entry point that lays out the log files."""
    numa_binding: NumaBinding | None = None
    """NUMA binding of the workers."""
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    """Signals that stop the launcher gracefully, forwarded to the workers."""
    shutdown_timeout: int | None = None
    """Seconds between SIGTERM and SIGKILL when stopping workers (30 when unset)."""
    virtual_local_rank: bool = False
    """Give every worker LOCAL_RANK=0 and restrict its visible devices to one."""

    # --- gemini's own (each a flag of ``gemini run``: its help is the docstring) --------
    run_root: str = _gemini(DEFAULT_RUN_ROOT, "DIR")
    """Directory holding one directory per run (its events and state)."""
    store: str = _gemini("", "URL", shown="embedded: store.db next to the run root")
    """Coordination store: ``etcd://HOST:PORT[,HOST:PORT...]``, or ``embedded:///PATH``
    (SQLite, one host only)."""
    store_cacert: str = _gemini("", "FILE")
    """CA certificate of an etcd store (and ``etcd-v3`` rendezvous) served over TLS."""
    store_cert: str = _gemini("", "FILE")
    """Client certificate for an etcd started with ``--client-cert-auth`` (with
    ``store_key``)."""
    store_key: str = _gemini("", "FILE")
    """Private key of ``store_cert``."""
    store_user: str = _gemini("", "USER")
    """etcd user to authenticate as (etcd with ``auth enable``), with
    ``store_password_file``."""
    store_password_file: str = _gemini("", "FILE")
    """File holding ``store_user``'s password (never the password itself on a command
    line: command lines are public)."""
    host_ttl: float = _gemini(10.0, "SECONDS")
    """Seconds without a refresh of its lease in the store before a host counts as lost."""
    heartbeat_timeout: float = _gemini(1.0, "SECONDS")
    """Seconds a peer's supervisor may leave heartbeats unanswered before it is suspected;
    a majority of its watchers suspecting it makes it lost (0: leases alone decide)."""
    store_timeout: float = _gemini(60.0, "SECONDS")
    """Seconds an etcd store may stay unreachable (restarting, hung, without quorum) while
    training goes on; past them the workers stop, their checkpoints stay in shared memory
    for the next ``gemini run``, exit 3 (0: exit at once)."""
    hang_timeout: float = _gemini(0.0, "SECONDS", shown="0 (off)")
    """Seconds without an optimizer step or save in a worker's Checkpointer before the
    host's workers count as hung and are restarted (0: no hang detection)."""
    standby: bool = _gemini(True)
    """Keep a standby interpreter per local rank with torch and the installed modules the
    run's workers imported, so that a restarted worker skips start-up."""
    preload: str = _gemini("", "MODULE[,MODULE...]")
    """Modules (comma-separated) the standbys import too before they wait: your own
    packages, which they do not learn from the workers."""
    replicas: int = _gemini(2, "M")
    """Copies of each host's checkpoint in CPU memory, its own included (1: no replication
    to peer hosts)."""
    replication_addr: str = _gemini("", "HOST[:PORT]", shown="--local-addr, else the address of "
                                    "the interface that reaches the rendezvous endpoint; any port")
    """Where the replication transport listens; peers are told the same address."""
    secret_file: str = _gemini("", "FILE", shown="a random secret shared through the store")
    """File with the run's secret (at least 128 bits of random material): signs the
    rendezvous state and authenticates replication."""
    replicate_every: int = _gemini(0, "N", shown="0 (measured)")
    """Replicate every N-th step, the same steps on every host; 0 picks the spacing from
    the time one replication takes (k iterations: a host loss then costs at most about 2k
    to 3k steps; a fixed N about 3N)."""
    replication_rate: float = _gemini(0.0, "MB_PER_S", shown="0 (no cap)")
    """Cap on the replication traffic of one push, in MB/s."""
    pace: bool = _gemini(True)
    """Send replication traffic while the workers leave the CPU idle, spread over each
    iteration, instead of in a burst."""
    persist_dir: str = _gemini("", "DIR")
    """Directory for the persistent tier, one that every host sees (local disk for one
    host)."""
    persist_every: str = _gemini("600s", "N|Ts")
    """Persist every ``N`` steps (multiples of N, the same on every host) or every ``T``
    seconds (``600s``)."""
    persist_keep: int = _gemini(2, "N")
    """Complete persisted steps to keep; older ones are deleted."""
    persist_on_exit: bool = _gemini(True)
    """On a stop by signal (a preemption), persist the newest step every rank holds to
    ``persist_dir`` before the memory is freed (no effect without ``persist_dir``)."""
    exit_grace: float = _gemini(20.0, "SECONDS")
    """Seconds a stop by signal may spend persisting; keep it below the scheduler's grace
    period."""
    on_divergence: OnDivergence = _gemini("rollback", "{rollback,stop,warn}")
    """When the data-parallel replicas' state disagrees (silent data corruption): roll
    every rank back to the newest step they agreed on (at most ``max_same_failures`` times
    to one step, then exit 5), stop (exit 5), or only warn."""
    exclude_divergent: bool = _gemini(False)
    """When a strict majority of three or more replicas outvotes this host's state, this
    host leaves the job (exit 6) and a spare or the others go on from the agreed step,
    instead of every host rolling back."""
    straggler_threshold: float = _gemini(1.25, "RATIO")
    """A host whose workers' own work per step (the time before they wait for the others)
    is at least RATIO times the median host's for a whole ``straggler_window`` is a
    straggler: reported in ``gemini status`` and as an event (0: off)."""
    straggler_window: float = _gemini(20.0, "SECONDS")
    """Seconds over which a host's own work is averaged, and for which it must stay
    above (or, to stop being one, below) the threshold."""
    replace_stragglers: bool = _gemini(False)
    """With a ready spare, a straggler leaves the job (exit 6) and the spare takes its
    node slot as after a host loss; without one, stragglers are only reported."""
    max_same_failures: int = _gemini(3, "N")
    """Restarts failing the same way with no new step in between before the job stops for
    good with exit code 7 (do not requeue); 0: never."""

    # Complexity above 10: one check per field, in one place.
    def __post_init__(self) -> None:  # noqa: C901
        _parse_nnodes(self.nnodes)
        if not (self.nproc_per_node.isdigit() and int(self.nproc_per_node) > 0) and (
            self.nproc_per_node not in _NPROC_NAMES
        ):
            raise ConfigError(
                f"nproc_per_node={self.nproc_per_node!r}: expected a positive integer or one "
                f"of {', '.join(_NPROC_NAMES)}", field="nproc_per_node"
            )
        if self.store and not self.store.startswith(("etcd://", "embedded://")):
            raise ConfigError(f"store={self.store!r}: expected etcd://HOST:PORT[,HOST:PORT...] "
                              "or embedded:///PATH", field="store")
        _parse_interval(self.persist_every)
        if self.replication_addr:
            _parse_host_port(self.replication_addr, "replication_addr")
        for name, ok, rule in (
            ("host_ttl", 1 <= self.host_ttl <= DAY, "between 1 and 86400 seconds"),
            ("heartbeat_timeout", self.heartbeat_timeout == 0
             or 0.2 <= self.heartbeat_timeout <= DAY, "0, or between 0.2 and 86400 seconds"),
            ("store_timeout", 0 <= self.store_timeout <= DAY, "between 0 and 86400 seconds"),
            ("hang_timeout", 0 <= self.hang_timeout <= DAY, "between 0 and 86400 seconds"),
            ("replicas", self.replicas >= 1, ">= 1"),
            ("replicate_every", self.replicate_every >= 0, ">= 0"),
            ("replication_rate", 0 <= self.replication_rate < math.inf, ">= 0 MB/s, finite"),
            ("persist_keep", self.persist_keep >= 1, ">= 1"),
            ("exit_grace", 0 <= self.exit_grace <= DAY, "between 0 and 86400 seconds"),
            ("max_same_failures", self.max_same_failures >= 0, ">= 0"),
            ("straggler_threshold", self.straggler_threshold == 0
             or 1 < self.straggler_threshold < math.inf, "0 (off) or more than 1, finite"),
            ("straggler_window", 1 <= self.straggler_window <= DAY,
             "between 1 and 86400 seconds"),
            ("node_rank", self.node_rank >= 0, ">= 0"),
            ("max_restarts", self.max_restarts >= 0, ">= 0"),
            ("monitor_interval", 0 < self.monitor_interval <= DAY, "> 0 and at most 86400"),
            ("master_port", self.master_port is None or 0 <= self.master_port < 65536,
             "in 0..65535"),
            ("shutdown_timeout", self.shutdown_timeout is None or self.shutdown_timeout >= 0,
             ">= 0"),
        ):
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)}: must be {rule}", field=name)
        for name in ("redirects", "tee"):
            value = getattr(self, name)
            if not _STD_SPEC.match(value):
                raise ConfigError(f"{name}={value!r}: expected 0-3 or 'rank:N,...' like '0:1,1:2'",
                                  field=name)
        if self.preload and not re.fullmatch(rf"{_MODULE}(,{_MODULE})*", self.preload):
            raise ConfigError(f"preload={self.preload!r}: expected module names "
                              "separated by commas, like 'mypkg.model,mypkg.data'",
                              field="preload")
        if self.local_ranks_filter and not re.fullmatch(r"\d+(,\d+)*", self.local_ranks_filter):
            raise ConfigError(
                f"local_ranks_filter={self.local_ranks_filter!r}: expected comma-separated integers",
                field="local_ranks_filter",
            )
        for item in filter(None, self.rdzv_conf.split(",")):
            if "=" not in item or not item.split("=", 1)[0].strip():
                raise ConfigError(f"rdzv_conf item {item!r}: expected key=value", field="rdzv_conf")
        check_run_id(self.rdzv_id)
        _ = self.store_credentials  # raises if its fields do not go together
        if self.module and self.no_python:
            raise ConfigError("--module and --no-python cannot be used together")
        for name in ("start_method", "numa_binding", "on_divergence"):
            _check_literal(name, getattr(self, name))

    @property
    def store_credentials(self) -> EtcdCredentials:
        """How to authenticate to an etcd store (and to an ``etcd-v3`` rendezvous)."""
        return EtcdCredentials.from_values(dataclasses.asdict(self), prefix="store_")

    @property
    def min_max_nodes(self) -> tuple[int, int]:
        """``nnodes`` as a ``(min, max)`` pair."""
        return _parse_nnodes(self.nnodes)

    @property
    def persist_interval(self) -> tuple[int | None, float | None]:
        """``persist_every`` as ``(steps, None)`` or ``(None, seconds)``."""
        return _parse_interval(self.persist_every)

    @property
    def replication_bind(self) -> tuple[str, int]:
        """``replication_addr`` as ``(host, port)``; port 0 means any free port."""
        if not self.replication_addr:
            return "0.0.0.0", 0
        return _parse_host_port(self.replication_addr, "replication_addr")


@dataclass(frozen=True)
class Flag:
    """One of gemini's own flags of ``gemini run``, made from its :class:`RunConfig` field."""

    names: tuple[str, ...]  # the dashed spelling first, then torchrun's underscored one
    key: str
    help: str
    metavar: str  # "" for an on/off flag (--X/--no-X)


def gemini_flags() -> list[Flag]:
    """gemini's flags, in :class:`RunConfig`'s order: each field's docstring is its help,
    followed by its default (``[default: ...]``), so that the help, the YAML keys and
    docs/configuration.md (checked by a test) say one thing."""
    docs = field_docs()
    flags = []
    for field in dataclasses.fields(RunConfig):
        if not field.metadata.get("gemini"):
            continue
        dashed = "--" + field.name.replace("_", "-")
        names = (dashed,) if "_" not in field.name else (dashed, "--" + field.name)
        metavar = field.metadata["metavar"]
        text = _plain(docs.get(field.name, ""))
        flags.append(Flag(names if metavar else (dashed,), field.name,
                          f"{text}  [default: {shown_default(field.name)}]", metavar))
    return flags


def shown_default(key: str) -> str:
    """The default of gemini's field ``key`` as its help and the docs show it."""
    field = RunConfig.__dataclass_fields__[key]
    if field.metadata.get("shown"):
        return str(field.metadata["shown"])
    value = field.default
    if isinstance(value, bool):
        flag = key.replace("_", "-")
        return flag if value else f"no-{flag}"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if value != "" else "none"


def field_docs() -> dict[str, str]:
    """The docstring under each field of :class:`RunConfig`, read from this module's source
    (Python keeps no attribute docstrings); empty where the source is not installed."""
    import ast
    import inspect

    try:
        tree = ast.parse(inspect.getsource(RunConfig))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = after.value.value
    return docs


def _plain(doc: str) -> str:
    """A docstring as one line of help: ``a_field`` becomes its flag, ``code`` plain."""
    def literal(match: re.Match[str]) -> str:
        text = match.group(1)
        return "--" + text.replace("_", "-") if text in RunConfig.__dataclass_fields__ else text

    return re.sub(r"``([^`]+)``", literal, " ".join(doc.split()))


def default_store_url(run_root: str) -> str:
    """The embedded store used when no ``--store`` is given: next to the run root."""
    path = Path(os.path.expanduser(run_root)).absolute().parent / "store.db"
    return f"embedded://{path}"


def _parse_nnodes(value: str) -> tuple[int, int]:
    match = _NNODES.match(value)
    if not match:
        raise ConfigError(f"nnodes={value!r}: expected N or MIN:MAX, e.g. 2 or 1:4", field="nnodes")
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) is not None else low
    if not 0 < low <= high:
        raise ConfigError(f"nnodes={value!r}: need 0 < MIN <= MAX", field="nnodes")
    return low, high


_INTERVAL = re.compile(r"^\s*(?:(\d+)|(\d+(?:\.\d+)?)\s*s)\s*$")


def _parse_interval(value: str) -> tuple[int | None, float | None]:
    match = _INTERVAL.match(value)
    if not match or (match.group(1) and int(match.group(1)) < 1) or (
        match.group(2) and float(match.group(2)) <= 0
    ):
        raise ConfigError(f"persist_every={value!r}: expected N steps (e.g. 100) or seconds "
                          "(e.g. 600s)", field="persist_every")
    if match.group(1):
        return int(match.group(1)), None
    return None, float(match.group(2))


def _parse_host_port(value: str, name: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = value, "0"
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{name}={value!r}: expected HOST or HOST:PORT", field=name)
    return host, int(port)


def _field_type(name: str) -> Any:
    return typing.get_type_hints(RunConfig)[name]


def _check_literal(name: str, value: object) -> None:
    choices = [
        arg
        for part in _union_members(_field_type(name))
        if typing.get_origin(part) is Literal
        for arg in typing.get_args(part)
    ]
    if value is not None and choices and value not in choices:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(map(str, choices))}",
                          field=name)


def _union_members(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunConfig))
#: The fields that are torchrun's flags (the others are gemini's own).
TORCHRUN_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(RunConfig) if not f.metadata.get("gemini"))


def closest_key(name: str) -> str:
    """A " (did you mean X?)" hint for an unknown key, or an empty string."""
    matches = difflib.get_close_matches(name, FIELD_NAMES, n=1, cutoff=0.5)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


# Complexity above 10: one branch per field type.
def convert_value(name: str, raw: Any, source: str) -> Any:  # noqa: C901
    """Convert a value from an environment variable (a string) or YAML to the field's type."""
    members = _union_members(_field_type(name))
    if raw is None:
        if type(None) in members:
            return None
        raise ConfigError(f"{source}: {name} must not be empty")
    base = next(m for m in members if m is not type(None))
    try:
        if base is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError(raw)
        if base is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(raw)
            return int(raw)
        if base is float:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return float(raw)
        if isinstance(raw, (dict, list)):
            raise ValueError(raw)
        return str(raw)
    except (ValueError, TypeError, OverflowError):
        kind = getattr(base, "__name__", "one of the allowed values")
        shown = repr(raw) if len(repr(raw)) <= 60 else repr(raw)[:60] + "..."
        raise ConfigError(f"{source}: {name}={shown} is not a valid {kind}") from None


_CONFIG_MAX_BYTES = 1 << 20
_CONFIG_MAX_DEPTH = 16


class _ConfigLoader(yaml.SafeLoader):
    """YAML for a config file: no aliases (a few hundred bytes of them expand to
    gigabytes) and no deep nesting (the composer recurses)."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed",
                                              self.peek_event().start_mark)  # type: ignore[no-untyped-call]
        if self._depth >= _CONFIG_MAX_DEPTH:
            raise yaml.composer.ComposerError(None, None, "nested too deeply",
                                              self.peek_event().start_mark)  # type: ignore[no-untyped-call]
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a ``gemini.yaml``; keys may be spelled with dashes or underscores."""
    raw = read_user_file(path, "config file", _CONFIG_MAX_BYTES)
    if len(raw) > _CONFIG_MAX_BYTES:
        raise ConfigError(f"config file {path}: larger than {_CONFIG_MAX_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {exc.start})") from None
    try:
        data = yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"config file {path}{where}: {problem}") from None
    except ValueError as exc:  # a scalar the resolver cannot convert (a 5000-digit int)
        raise ConfigError(f"config file {path}: {str(exc).split(';')[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of keys to values")
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELD_NAMES:
            raise ConfigError(f"config file {path}: unknown key {key!r}{closest_key(name)}")
        values[name] = convert_value(name, value, f"config file {path}")
    return values


def env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """Config values set through ``GEMINI_<KEY>`` (or torchrun's ``PET_<KEY>``) variables."""
    values: dict[str, Any] = {}
    for name in FIELD_NAMES:
        for prefix in ("GEMINI_", "PET_"):
            var = prefix + name.upper()
            if var in environ:
                values[name] = convert_value(name, environ[var], f"environment variable {var}")
                break
    return values


def check_host_id(host_id: str) -> str:
    """``host_id`` if it is a safe host id, by the rules of run ids (it names store keys,
    shared-memory segments, and ``gemini status`` shows it); else ConfigError naming
    ``GEMINI_HOST_ID``."""
    try:
        return check_run_id(host_id)
    except ConfigError:
        shown = host_id if len(host_id) <= 40 else host_id[:40] + "..."
        raise ConfigError(f"environment variable {ENV_HOST_ID}={shown!r}: use 1-128 letters, "
                          "digits, '.', '_', ':' or '-', not starting with '.', ':' or '-'",
                          field="host_id") from None


def resolve(
    *,
    cli: Mapping[str, Any],
    environ: Mapping[str, str],
    file_values: Mapping[str, Any],
) -> RunConfig:
    """Merge the sources by precedence (command line > environment > file > default);
    ``GEMINI_HOST_ID`` in ``environ`` is checked too (empty: the host name is used)."""
    if environ.get(ENV_HOST_ID):
        check_host_id(environ[ENV_HOST_ID])
    merged: dict[str, Any] = dict(file_values)
    sources = dict.fromkeys(file_values, "the config file")
    for name, value in env_values(environ).items():
        merged[name] = value
        sources[name] = "the environment"
    for name, value in cli.items():
        if name not in FIELD_NAMES:
            raise ConfigError(f"unknown option {name!r}{closest_key(name)}")
        merged[name] = value
        sources[name] = "the command line"
    try:
        return RunConfig(**merged)
    except ConfigError as exc:
        if exc.field in sources:
            raise ConfigError(f"{exc} (set in {sources[exc.field]})", field=exc.field) from None
        raise
