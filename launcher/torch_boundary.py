"""The private torch internals gemini relies on, in one list, and the check that they hold.

gemini is built on ``torch.distributed.elastic`` and changes it where its public API has no
hook: it replaces functions of torch's dynamic rendezvous, overrides private methods of
its agent, reads private attributes of its objects and calls private helpers. torch may
move or change any of them in a release without notice, and then gemini would not fail
cleanly: a replaced function that torch no longer calls is silently dead (restarts slow
down, spares take survivors' places), an attribute read with a default reads the default.
:data:`INTERNALS` names each one, what gemini does with it and, where torch calls gemini's
code in place of its own or gemini calls torch's, the parameters that must match.

:func:`check` runs once at the start of ``gemini run``, before anything touches these
internals, and stops a torch older than gemini supports, or one that moved or changed any
of them, with one line naming the first; a newer torch than the tested ones is accepted
where every one holds. ``tests/unit/test_torch_boundary.py`` holds the list to the
launcher's source.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import types
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal

from launcher.errors import TorchUnsupportedError

MINIMUM = (2, 13)
"""The oldest torch release gemini supports, the oldest it is tested on: an older one is
refused, not tried (WorkerSpec fields gemini passes, NUMA binding and output filters among
them, and several of the internals below are recent)."""
TESTED = ((2, 13), (2, 14))
"""The torch releases (major, minor) the test suite has passed on."""

Use = Literal["patched", "wrapped", "overridden", "called", "subclassed", "read", "set"]
Where = Literal["supervisor", "worker"]


@dataclass(frozen=True)
class Internal:
    """One torch internal that gemini relies on."""

    module: str
    """The torch module gemini finds it in."""
    path: str
    """Its attribute path in ``module``: ``name`` or ``Class.name``."""
    use: Use
    """What gemini does with it. ``patched``: replaced by gemini's own function, which
    torch calls with its own arguments; ``wrapped``: replaced by gemini's function, which
    passes torch's arguments on to it with some of its own; ``overridden``: a method
    gemini's subclass overrides, which torch calls as its own; ``called``: called (or
    constructed) by gemini; ``subclassed``: a class gemini derives from; ``read``/``set``:
    an attribute gemini reads, or assigns for torch's code to read."""
    by: str
    """The gemini module that relies on it."""
    _: KW_ONLY
    params: tuple[str, ...] = ()
    """Parameters, in order. ``patched``/``overridden``: exactly the parameters torch's
    function has (gemini's replacement has the same); otherwise the leading parameters,
    which gemini passes by position (for a class, its constructor's). Nothing is checked
    where neither this nor :attr:`keywords` is given."""
    keywords: tuple[str, ...] = ()
    """Parameters gemini passes by name (for a dataclass such as WorkerSpec: the fields it
    sets), anywhere in the signature."""
    instance: bool = False
    """An attribute torch's objects set on themselves rather than a class attribute: it
    holds while the class's own code still names it."""
    attributes: tuple[str, ...] = ()
    """Where given, exactly the attributes of an instance constructed without arguments:
    gemini copies such an object field by field, and would drop a field it does not know."""
    where: Where = "supervisor"
    """The process that relies on it: the supervisor (``gemini run`` itself), or a worker
    (the training script's ``launcher.hook``)."""

    @property
    def name(self) -> str:
        """The full dotted name, as the error names it."""
        return f"{self.module}.{self.path}"


_C10D = "torch._C._distributed_c10d"
_DR = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_AGENT = "torch.distributed.elastic.agent.server.api"
_LOCAL = "torch.distributed.elastic.agent.server.local_elastic_agent"
_MP = "torch.distributed.elastic.multiprocessing.api"
_SUBPROCESS = "torch.distributed.elastic.multiprocessing.subprocess_handler"
_STORE_UTIL = "torch.distributed.elastic.utils.store"
_LAUNCHER = "torch.distributed.launcher.api"
_PLACEMENTS = "torch.distributed.tensor.placement_types"
_MODULE = "torch.nn.modules.module"
_WORKER_GROUP = ("self", "worker_group")

INTERNALS: tuple[Internal, ...] = (
    # launcher.rendezvous: the etcd-v3 backend, faster and steadier rounds, lost hosts dropped
    Internal(_C10D, "Store", "subclassed", "launcher.rendezvous"),
    Internal("torch.distributed.elastic.rendezvous.c10d_rendezvous_backend", "TCPStore", "wrapped",
             "launcher.rendezvous", params=("host_name", "port"),
             keywords=("is_master", "master_listen_fd")),
    Internal(_DR, "get_method_name", "patched", "launcher.rendezvous", params=("depth",)),
    Internal(_DR, "_delay", "patched", "launcher.rendezvous", params=("seconds",)),
    Internal(_DR, "DynamicRendezvousHandler._start_heartbeats", "patched", "launcher.rendezvous",
             params=("self",)),
    Internal(_DR, "DynamicRendezvousHandler._keep_alive_weak", "called", "launcher.rendezvous",
             params=("weak_self",)),
    Internal(_DR, "DynamicRendezvousHandler._keep_alive_timer", "set", "launcher.rendezvous",
             instance=True),
    Internal(_DR, "DynamicRendezvousHandler._settings", "read", "launcher.rendezvous",
             instance=True),
    Internal(_DR, "DynamicRendezvousHandler._this_node", "read", "launcher.rendezvous",
             instance=True),
    Internal("torch.distributed.elastic.rendezvous.utils", "_PeriodicTimer", "called",
             "launcher.rendezvous", params=("interval", "function")),
    Internal(_DR, "_BackendRendezvousStateHolder._sanitize", "patched", "launcher.rendezvous",
             params=("self",)),
    Internal(_DR, "_BackendRendezvousStateHolder.sync", "patched", "launcher.rendezvous",
             params=("self",)),
    Internal(_DR, "_BackendRendezvousStateHolder._state", "read", "launcher.rendezvous",
             instance=True),
    Internal(_DR, "_BackendRendezvousStateHolder._settings", "read", "launcher.rendezvous",
             instance=True),
    Internal(_DR, "_BackendRendezvousStateHolder._backend", "read", "launcher.rendezvous",
             instance=True),
    Internal(_DR, "_BackendRendezvousStateHolder._dead_nodes", "set", "launcher.rendezvous",
             instance=True),
    Internal(_DR, "_BackendRendezvousStateHolder._last_sync_time", "set", "launcher.rendezvous",
             instance=True),
    Internal(_DR, "_remove_participant_epilogue", "called", "launcher.rendezvous",
             params=("state", "settings")),
    Internal(_DR, "_RendezvousJoinOp.__call__", "patched", "launcher.rendezvous",
             params=("self", "ctx", "deadline")),
    Internal(_DR, "_RendezvousContext.node", "read", "launcher.rendezvous", instance=True),
    Internal(_DR, "_RendezvousContext.state", "read", "launcher.rendezvous", instance=True),
    Internal(_DR, "_RendezvousContext.settings", "read", "launcher.rendezvous", instance=True),
    Internal(_DR, "_Action.KEEP_ALIVE", "read", "launcher.rendezvous"),
    Internal(_DR, "_Action.SYNC", "read", "launcher.rendezvous"),
    Internal(_DR, "_Action.ADD_TO_PARTICIPANTS", "read", "launcher.rendezvous"),
    Internal(_DR, "_Action.MARK_RENDEZVOUS_COMPLETE", "read", "launcher.rendezvous"),
    Internal(_DR, "_should_keep_alive", "called", "launcher.rendezvous", params=("ctx",)),
    # launcher.rendezvous_state: the rendezvous state as signed JSON instead of pickle
    Internal(_DR, "pickle", "patched", "launcher.rendezvous_state"),
    Internal(_DR, "_RendezvousState", "called", "launcher.rendezvous_state",
             attributes=("round", "complete", "deadline", "closed", "participants", "wait_list",
                         "redundancy_list", "last_heartbeats")),
    Internal(_DR, "_NodeDesc", "called", "launcher.rendezvous_state",
             params=("addr", "pid", "local_id")),
    Internal("torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
             "C10dRendezvousBackend._decode_state", "patched", "launcher.rendezvous_state",
             params=("self", "base64_state")),
    # launcher.elastic_agent: GeminiAgent, torch's agent with gemini's rounds and services
    Internal(_LOCAL, "LocalElasticAgent", "subclassed", "launcher.elastic_agent",
             keywords=("spec", "logs_specs", "start_method", "log_line_prefix_template",
                       "shutdown_timeout")),
    Internal(_AGENT, "SimpleElasticAgent._initialize_workers", "overridden",
             "launcher.elastic_agent", params=_WORKER_GROUP),
    Internal(_AGENT, "SimpleElasticAgent._rendezvous", "overridden", "launcher.elastic_agent",
             params=_WORKER_GROUP),
    Internal(_AGENT, "SimpleElasticAgent._restart_workers", "overridden", "launcher.elastic_agent",
             params=_WORKER_GROUP),
    Internal(_AGENT, "SimpleElasticAgent._exit_barrier", "overridden", "launcher.elastic_agent",
             params=("self",)),
    Internal(_LOCAL, "LocalElasticAgent._start_workers", "overridden", "launcher.elastic_agent",
             params=_WORKER_GROUP),
    Internal(_LOCAL, "LocalElasticAgent._stop_workers", "overridden", "launcher.elastic_agent",
             params=_WORKER_GROUP),
    Internal(_LOCAL, "LocalElasticAgent._monitor_workers", "overridden", "launcher.elastic_agent",
             params=_WORKER_GROUP),
    Internal(_AGENT, "SimpleElasticAgent._assign_worker_ranks", "called", "launcher.elastic_agent",
             params=("self", "store", "group_rank", "group_world_size", "spec")),
    Internal(_AGENT, "SimpleElasticAgent._worker_group", "read", "launcher.elastic_agent",
             instance=True),
    Internal(_AGENT, "SimpleElasticAgent._store", "set", "launcher.elastic_agent", instance=True),
    Internal(_AGENT, "SimpleElasticAgent._remaining_restarts", "set", "launcher.elastic_agent",
             instance=True),
    Internal(_AGENT, "SimpleElasticAgent._exit_barrier_timeout", "read", "launcher.elastic_agent",
             instance=True),
    Internal(_AGENT, "SimpleElasticAgent._in_exit_barrier", "set", "launcher.elastic_agent",
             instance=True),
    Internal(_AGENT, "time", "patched", "launcher.elastic_agent"),
    Internal(_AGENT, "_TERMINAL_STATE_SYNC_ID", "read", "launcher.elastic_agent"),
    Internal(_STORE_UTIL, "_NUM_MEMBERS", "read", "launcher.elastic_agent"),
    Internal(_STORE_UTIL, "_barrier_nonblocking", "called", "launcher.elastic_agent",
             params=("store", "world_size", "key_prefix")),
    Internal(_C10D, "PrefixStore", "called", "launcher.elastic_agent", params=("prefix", "store")),
    Internal(_C10D, "TCPStore", "called", "launcher.elastic_agent",
             keywords=("host_name", "port", "is_master", "wait_for_workers")),
    Internal(_DR, "DynamicRendezvousHandler._state_holder", "read", "launcher.elastic_agent",
             instance=True),
    Internal(_DR, "DynamicRendezvousHandler._heartbeat_lock", "read", "launcher.elastic_agent",
             instance=True),
    Internal(_DR, "DynamicRendezvousHandler._bootstrap_store_info", "set", "launcher.elastic_agent",
             instance=True),
    Internal(_DR, "_BackendRendezvousStateHolder.state", "read", "launcher.elastic_agent"),
    # launcher.agent: torchrun's launch, with gemini's agent
    Internal(_AGENT, "WorkerSpec", "called", "launcher.agent",
             keywords=("role", "local_world_size", "entrypoint", "args", "rdzv_handler",
                       "max_restarts", "monitor_interval", "master_addr", "master_port",
                       "local_addr", "event_log_handler", "numa_options",
                       "duplicate_stdout_filters", "duplicate_stderr_filters",
                       "virtual_local_rank")),
    Internal(_LAUNCHER, "LaunchConfig", "read", "launcher.agent",
             keywords=("signals_to_handle", "logs_specs", "log_line_prefix_template",
                       "shutdown_timeout", "event_log_handler", "numa_options",
                       "duplicate_stdout_filters", "duplicate_stderr_filters",
                       "virtual_local_rank")),
    Internal(_LAUNCHER, "_get_entrypoint_name", "called", "launcher.agent",
             params=("entrypoint", "args")),
    Internal(_LAUNCHER, "_get_addr_and_port", "called", "launcher.agent",
             params=("rdzv_parameters",)),
    Internal(_MP, "_terminate_process_handler", "called", "launcher.agent",
             params=("signum", "frame")),
    Internal("torch.distributed.elastic.rendezvous.api", "rendezvous_handler_registry._registry",
             "read", "launcher.agent"),
    # launcher.standby: workers started in interpreters that imported torch already
    Internal(_MP, "get_subprocess_handler", "patched", "launcher.standby"),
    Internal(_SUBPROCESS, "SubprocessHandler._popen", "overridden", "launcher.standby",
             params=("self", "args", "env")),
    Internal(_SUBPROCESS, "SubprocessHandler._stdout", "read", "launcher.standby", instance=True),
    Internal(_SUBPROCESS, "SubprocessHandler._stderr", "read", "launcher.standby", instance=True),
    # the worker: DTensors (launcher.codec), a fast state dict (launcher.state_dicts), batched copies
    Internal(_PLACEMENTS, "_StridedShard", "called", "launcher.codec", params=("dim",),
             keywords=("split_factor",), where="worker"),
    Internal(_PLACEMENTS, "_StridedShard.split_factor", "read", "launcher.codec", instance=True,
             where="worker"),
    Internal("torch.distributed.tensor._utils", "_compute_local_shape_and_global_offset", "called",
             "launcher.codec", params=("global_shape", "mesh_shape", "my_coordinate", "placements"),
             where="worker"),
    Internal(_MODULE, "Module._save_to_state_dict", "read", "launcher.state_dicts", where="worker"),
    Internal(_MODULE, "Module._parameters", "read", "launcher.state_dicts", instance=True, where="worker"),
    Internal(_MODULE, "Module._buffers", "read", "launcher.state_dicts", instance=True, where="worker"),
    Internal(_MODULE, "Module._non_persistent_buffers_set", "read", "launcher.state_dicts", instance=True,
             where="worker"),
    Internal(_MODULE, "Module._modules", "read", "launcher.state_dicts", instance=True, where="worker"),
    Internal(_MODULE, "Module._state_dict_hooks", "read", "launcher.state_dicts", instance=True,
             where="worker"),
    Internal(_MODULE, "Module._state_dict_pre_hooks", "read", "launcher.state_dicts", instance=True,
             where="worker"),
    Internal("torch", "_foreach_copy_", "called", "launcher.copier", where="worker"),
)
"""Every private torch internal gemini relies on, and the recent public fields it passes
(WorkerSpec's, LaunchConfig's). Not listed: what gemini can do without, ``DTensor``'s
``_local_tensor`` (a save reads the local shard through the public ``to_local()`` where it
is missing) and ``torch._dynamo`` (one of the modules a standby imports ahead, if it can)."""


def version() -> tuple[int, int] | None:
    """The installed torch's (major, minor), or None where its version string has none."""
    import torch

    found = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    return None if found is None else (int(found[1]), int(found[2]))


def supported() -> str:
    """The supported range, as every error says it."""
    from launcher import __version__

    first, last = (".".join(map(str, v)) for v in (MINIMUM, TESTED[-1]))
    return (f"gemini {__version__} supports torch {first}-{last} (tested) and later releases "
            "that keep the torch internals it relies on")


def problem(internal: Internal) -> str | None:
    """What is wrong with ``internal`` in the installed torch, as the middle of the error
    line (``has no X``, ``changed X ...``); None when it holds."""
    what = f"{internal.name} ({internal.use} by {internal.by})"
    found = _find(internal)
    if found is _MISSING:
        return f"has no {what}"
    if internal.attributes:
        try:
            fields = tuple(vars(found()))
        except TypeError:  # it wants arguments now
            return f"changed the constructor of {what}"
        if sorted(fields) != sorted(internal.attributes):
            return f"changed the fields of {what} to ({', '.join(fields)})"
    if internal.params or internal.keywords:
        candidates = signatures(found)
        if not any(_fits(internal, names) for names in candidates):
            has = " or ".join(f"({', '.join(names)})" for names in candidates) or "unknown"
            return f"changed the parameters of {what} to {has}"
    return None


def _find(internal: Internal) -> Any:
    """The object ``internal`` names (the name itself for an instance attribute), or
    ``_MISSING``."""
    try:
        owner: Any = importlib.import_module(internal.module)
    except ImportError:
        return _MISSING
    *parents, leaf = internal.path.split(".")
    for part in parents:
        owner = getattr(owner, part, _MISSING)
        if owner is _MISSING:
            return _MISSING
    if internal.instance:
        return leaf if leaf in class_names(owner) else _MISSING
    # A class's own attributes and its bases', not its metaclass's: every class has a
    # ``__call__`` (type's, which constructs it).
    if isinstance(owner, type) and not any(leaf in vars(klass) for klass in owner.__mro__):
        return _MISSING
    return getattr(owner, leaf, _MISSING)


@functools.cache
def check() -> None:
    """Raise :class:`TorchUnsupportedError`, one line, when the installed torch is older
    than :data:`MINIMUM` or lacks (or changed) one of :data:`INTERNALS`.

    The worker's internals are checked only on a torch release that is not one of
    :data:`TESTED`: some live in modules that ``gemini run`` does not otherwise import
    (``torch.distributed.tensor``, about half a second on a 2-core machine), and on a
    tested release the test suite has resolved them. The answer is kept: torch does not
    change within a process."""
    import torch

    found = version()
    if found is not None and found < MINIMUM:
        raise TorchUnsupportedError(f"torch {torch.__version__} is older than gemini supports: "
                                    f"{supported()}")
    tested = found in TESTED
    for internal in INTERNALS:
        if internal.where == "worker" and tested:
            continue
        wrong = problem(internal)
        if wrong is not None:
            raise TorchUnsupportedError(f"torch {torch.__version__} {wrong}: {supported()}")


def apply(*, single_node: bool, etcd_v3: bool) -> None:
    """:func:`check` torch, then change it where gemini must, for this process: no pickle
    read from a rendezvous store (``rendezvous_state``), the c10d store bound to its
    endpoint's address, faster and steadier rendezvous rounds with the last round's members
    first, and with ``etcd_v3`` gemini's etcd-v3 rendezvous backend (``rendezvous``).
    Idempotent. Two changes belong to objects made later and are made with them: the
    standby handler torch starts workers through (``standby.install``, with the host's
    pool) and the agent's monitor clock (``elastic_agent.GeminiAgent``)."""
    check()
    from launcher import rendezvous, rendezvous_state

    rendezvous_state.install()
    rendezvous.bind_rendezvous_store()
    rendezvous.speed_up_rendezvous(single_node=single_node)
    if etcd_v3:
        rendezvous.register()


def class_names(cls: Any) -> frozenset[str]:
    """Every name that ``cls`` and its bases define or that their code uses: attribute
    names (``self.x``) and the strings their code holds (``object.__setattr__(self, "x")``).
    An attribute torch sets on its instances is one of them for as long as torch uses it."""
    names: set[str] = set()
    for klass in getattr(cls, "__mro__", ()):
        names.update(vars(klass))
        codes = [code for value in vars(klass).values() for code in _codes(value)]
        while codes:
            code = codes.pop()
            names.update(code.co_names)
            for const in code.co_consts:
                if isinstance(const, str):
                    names.add(const)
                elif isinstance(const, types.CodeType):
                    codes.append(const)
    return frozenset(names)


def signatures(obj: Any) -> list[tuple[str, ...]]:
    """The parameter names of ``obj`` (for a class, its constructor's), one tuple per
    overload of a C++ function, which states them only in its docstring; empty where
    neither says."""
    try:
        return [tuple(inspect.signature(obj).parameters)]
    except (ValueError, TypeError):
        pass
    doc = (getattr(obj, "__init__", obj) if isinstance(obj, type) else obj).__doc__ or ""
    found = []
    for args in re.findall(r"^(?:\d+\. )?\w+\((.*)\) ->", doc, re.MULTILINE):
        names = tuple(re.findall(r"(?:^|, )(\w+):", args))
        found.append(names[1:] if isinstance(obj, type) and names[:1] == ("self",) else names)
    return found


def _fits(internal: Internal, names: tuple[str, ...]) -> bool:
    if internal.use in ("patched", "overridden") and names != internal.params:
        return False
    return (names[:len(internal.params)] == internal.params
            and all(keyword in names for keyword in internal.keywords))


def _codes(value: Any) -> Iterator[types.CodeType]:
    """The code objects behind a class attribute (a function, a static or class method, a
    property's accessors)."""
    for part in (value, getattr(value, "__func__", None), getattr(value, "fget", None),
                 getattr(value, "fset", None)):
        code = getattr(part, "__code__", None)
        if isinstance(code, types.CodeType):
            yield code


_MISSING = object()
