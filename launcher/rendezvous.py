"""``--rdzv-backend etcd-v3``: torch's dynamic rendezvous kept in etcd v3, which no host owns.

torch's own etcd backends speak the legacy v2 API, and its c10d backend keeps the
rendezvous in a TCP store on one of the hosts, so the job dies with that host. This
module plugs gemini's :class:`~launcher.store.Store` into torch's
``DynamicRendezvousHandler``: :class:`StoreRendezvousBackend` holds the rendezvous state
(compare-and-set on one key) and :class:`TorchStore` is the ``torch.distributed.Store``
the agents exchange their round's data through. ``register()`` makes the backend
available to torch's rendezvous registry in this process.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch._C._distributed_c10d import Store as _TorchStoreBase
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousHandler,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)

from launcher.errors import StoreError, StoreUncertainError
from launcher.rendezvous_state import sync_patiently
from launcher.store import EtcdCredentials, Store, open_store

logger = logging.getLogger(__name__)

BACKEND = "etcd-v3"
_POLL = 0.02


#: Set when the rendezvous state changed: wakes a node polling for the next round.
_CHANGED = threading.Event()


class StoreRendezvousBackend(RendezvousBackend):
    """The rendezvous state of one run in one key; the token is the state's bytes.

    A watch on the key notes when it last changed (``changed_at``), so that a node
    waiting for a round reads the new state at once instead of at its next poll."""

    def __init__(self, store: Store, run_id: str) -> None:
        self.store = store
        self._key = f"gemini/rdzv/{run_id}/state"
        self.changed_at = 0.0
        try:
            store.watch_prefix(self._key, self._on_change)
        except StoreError as exc:  # polling alone still works
            logger.warning("cannot watch the rendezvous state: %s", exc)

    def _on_change(self, key: str, value: bytes | None) -> None:
        if key == self._key:
            self.changed_at = time.monotonic()
            _CHANGED.set()

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Token] | None:
        value = self._call(self.store.get, self._key)
        return None if value is None else (value, value)

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        expected = token if isinstance(token, bytes) else None
        if token is not None and expected is None:  # a token from elsewhere: refuse to set
            current = self.get_state()
            return None if current is None else (*current, False)
        try:
            if self._call(self.store.compare_and_set, self._key, expected, state):
                return state, state, True
        except RendezvousConnectionError as exc:
            if not isinstance(exc.__cause__, StoreUncertainError):
                raise
        current = self.get_state()  # after a timed-out write: whether it was applied
        if current is None:
            return None
        return (*current, current[0] == state)

    @staticmethod
    def _call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except StoreError as exc:
            raise RendezvousConnectionError(str(exc)) from exc


class TorchStore(_TorchStoreBase):
    """A ``torch.distributed.Store`` over a gemini store (keys under ``prefix``).

    ``get`` and ``wait`` poll until the keys exist or the store's timeout passes. The
    agents use this store right after a round forms, when every member posts its part at
    once; a minute without one means that member is gone (see ``GeminiAgent``).
    """

    def __init__(self, store: Store, prefix: str,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> None:
        super().__init__()
        self._store = store
        self._prefix = prefix
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._call(self._store.put, self._key(key), data)

    def get(self, key: str) -> bytes:
        value = self._call(self._store.get, self._key(key))
        if value is None:
            self.wait([key])
            value = self._call(self._store.get, self._key(key))
        if value is None:
            raise LookupError(f"key {key!r} disappeared")
        return bytes(value)

    def add(self, key: str, num: int) -> int:
        full = self._key(key)
        while True:
            current = self._call(self._store.get, full)
            value = (int(current) if current is not None else 0) + num
            if self._call(self._store.compare_and_set, full, current, str(value).encode()):
                return value

    def check(self, keys: list[str]) -> bool:
        return len(self._many(keys)) == len(set(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        found = self._many(keys)
        if len(found) < len(set(keys)):
            raise LookupError(f"keys {sorted(set(keys) - found.keys())} disappeared")
        return [found[k] for k in keys]

    def _many(self, keys: list[str]) -> dict[str, bytes]:
        """Those of ``keys`` that exist, read in one request (a range read under their
        common prefix) where there are several."""
        if len(set(keys)) == 1:
            value = self._call(self._store.get, self._key(keys[0]))
            return {} if value is None else {keys[0]: bytes(value)}
        found = self._call(self._store.get_prefix, self._key(os.path.commonprefix(keys)))
        return {k: bytes(found[self._key(k)]) for k in keys if self._key(k) in found}

    def wait(self, keys: list[str], override_timeout: datetime.timedelta | None = None) -> None:
        # ``self.timeout`` is the C++ base class's, which mypy cannot see.
        timeout: datetime.timedelta = override_timeout or self.timeout  # type: ignore[attr-defined]
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout} waiting for keys {keys}")
            time.sleep(_POLL)

    def delete_key(self, key: str) -> bool:
        return bool(self._call(self._store.delete, self._key(key)))

    def num_keys(self) -> int:
        return len(self._call(self._store.get_prefix, self._prefix))

    @staticmethod
    def _call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except StoreError as exc:
            raise RuntimeError(str(exc)) from exc


#: torch's default drops a dead host from the rendezvous after 3 missed keep-alives 5 s
#: apart; a lost host then holds up every survivor for up to 15 s. etcd handles one
#: keep-alive per host and second easily.
KEEP_ALIVE = {"keep_alive_interval": "1", "keep_alive_max_attempt": "3"}
#: The ``--rdzv-conf`` key carrying ``--store-timeout`` to the etcd-v3 backend.
STORE_TIMEOUT_KEY = "store_timeout"


def set_credentials(configs: dict[str, Any], credentials: EtcdCredentials) -> None:
    """Put ``credentials`` into a rendezvous configuration where ``--rdzv-conf`` did not.
    Their ``--rdzv-conf`` keys are the field names of :class:`EtcdCredentials`
    (``cacert``, ``cert`` and ``key`` are also those of torch's etcd backend)."""
    for name, value in dataclasses.asdict(credentials).items():
        if value:
            configs.setdefault(name, value)


def create_etcd_v3_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's dynamic rendezvous with its state and store in etcd v3 at ``params.endpoint``."""
    if not params.endpoint:
        raise ValueError("--rdzv-backend etcd-v3 needs --rdzv-endpoint HOST:PORT[,HOST:PORT...]")
    for key, value in KEEP_ALIVE.items():  # --rdzv-conf overrides these
        params.config.setdefault(key, value)
    outage = float(params.config.pop(STORE_TIMEOUT_KEY, 0) or 0)
    credentials = EtcdCredentials.from_values(params.config)
    for name in dataclasses.asdict(credentials):
        params.config.pop(name, None)
    store = open_store(f"etcd://{params.endpoint}", outage=outage, credentials=credentials)
    backend = StoreRendezvousBackend(store, params.run_id)
    # c10d's --rdzv-conf key for its store's timeout, here too
    timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    torch_store = TorchStore(store, f"gemini/rdzv/{params.run_id}/kv/", timeout)
    handler = create_handler(torch_store, backend, params)
    next_rendezvous = handler.next_rendezvous

    def next_rendezvous_pruned() -> Any:
        info = next_rendezvous()
        if info.rank == 0:
            try:
                prune_rounds(store, params.run_id, handler._state_holder.state.round)
            except StoreError as exc:
                logger.warning("could not prune the keys of earlier rendezvous rounds: %s", exc)
        return info

    setattr(handler, "next_rendezvous", next_rendezvous_pruned)  # noqa: B010
    return handler


def prune_rounds(store: Store, run_id: str, current: int) -> int:
    """Delete the keys torch's rendezvous left for rounds before ``current - 1`` (each
    round scopes its keys under ``torch.rendezvous.<run_id>.<round>/``; no member reads
    them once a later round formed): the store stays the same size however often the job
    restarts. Returns the number of keys deleted."""
    prefix = f"gemini/rdzv/{run_id}/kv/torch.rendezvous.{run_id}."
    deleted = 0
    for key in store.get_prefix(prefix):
        number = key[len(prefix):].partition("/")[0]
        if number.isdigit() and int(number) < current - 1:
            deleted += store.delete(key)
    return deleted


def register() -> None:
    """Make ``--rdzv-backend etcd-v3`` available in this process (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    try:
        registry.register(BACKEND, create_etcd_v3_handler)
    except ValueError:  # already registered
        pass


def bind_rendezvous_store() -> None:
    """Make the c10d rendezvous backend's TCP store listen only on the endpoint's address
    when that is an IP address or ``localhost`` (idempotent).

    torch's ``TCPStore`` server listens on every interface, so a store meant for
    ``127.0.0.1`` is open to the whole network; here the host that serves it binds the
    listening socket to the endpoint's own address (a host name keeps torch's behaviour:
    it may resolve to another address on this host than on the peers)."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d

    if getattr(c10d, "_gemini_bound", False):
        return
    c10d.TCPStore = _bound_store_factory(c10d.TCPStore)  # type: ignore[attr-defined]
    c10d._gemini_bound = True  # type: ignore[attr-defined]


def listen_address(host: str) -> str | None:
    """The address a store served for ``host`` should listen on: ``host`` itself for an
    IP address, 127.0.0.1 for ``localhost``; for a name, the one address it resolves to
    when that is an address of this machine other than a loopback one (a name that
    resolves to several addresses, or to a loopback one, as Debian's /etc/hosts maps the
    host's own name, is what peers elsewhere may resolve differently: None, every
    interface)."""
    import ipaddress
    import socket

    if host == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    try:
        found = {str(info[4][0])
                 for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return None
    if len(found) != 1:
        return None
    address = found.pop()
    if ipaddress.ip_address(address.split("%")[0]).is_loopback or not _local(address):
        return None
    return address


def _local(address: str) -> bool:
    """Whether ``address`` is one of this machine's (a socket can bind it)."""
    import socket

    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def _bound_store_factory(tcp_store: Any) -> Any:
    def bound_tcp_store(host: str, port: int, *args: Any, is_master: bool = False,
                        **kwargs: Any) -> Any:
        address = listen_address(host) if is_master else None
        if address is None or kwargs.get("master_listen_fd") is not None:
            return tcp_store(host, port, *args, is_master=is_master, **kwargs)
        import socket

        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
            sock.listen(1024)
        except OSError as exc:  # taken: torch then connects to it as a client
            sock.close()
            raise RuntimeError(f"cannot listen on {address}:{port}: {exc.strerror}") from None
        bound = sock.getsockname()[1]
        return tcp_store(host, bound, *args, is_master=True, master_listen_fd=sock.detach(),
                         **kwargs)  # the store owns the socket from here on

    return bound_tcp_store


def _caller_name(depth: int = 2) -> str:
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a shallower stack, as torch's version answers it
        return "no_method_name"


def speed_up_rendezvous(*, single_node: bool) -> None:
    """Two costs of torch's dynamic rendezvous that a restart pays for nothing, and one
    cause of false deaths.

    It names each event it records after the calling method, found with
    ``inspect.stack()``, which reads the source file of every frame on the stack: about
    0.1 s per round, after every failure. The same name from ``sys._getframe`` costs
    microseconds. And before a handler's first re-rendezvous it sleeps a random 0-0.3 s
    to spread the nodes' first attempts over time; a single-node job has no one to
    spread against, so there it does not sleep.

    And its keep-alive timer ticks once per ``keep_alive_interval`` but writes only when
    the last heartbeat is at least that old, so a tick that comes a moment early skips
    a beat: heartbeats go out up to two intervals apart, and with a few seconds of delay
    on a loaded host (or store) a live node's heartbeat is older than
    ``keep_alive_interval * keep_alive_max_attempt``. Another node then drops it from the
    round as dead: a spare waiting for that round is let in, and the whole group
    restarts for nothing. Here the timer ticks twice per interval.

    And when a round ends, every waiting node races to join the next one: spares, which
    wait the whole time, often win it over the survivors of the last round, which first
    stop their workers; the survivors are then left out, and their progress with them.
    Here the members of the last round join first (:func:`members_first`)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.get_method_name = _caller_name
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    if not getattr(handler, "_gemini_steady_keep_alive", False):
        setattr(handler, "_start_heartbeats", _steady_heartbeats)  # noqa: B010
        setattr(handler, "_gemini_steady_keep_alive", True)  # noqa: B010
    holder = dynamic_rendezvous._BackendRendezvousStateHolder
    if not getattr(holder, "_gemini_outage_aware", False):
        setattr(holder, "_sanitize", _outage_aware(holder._sanitize))  # noqa: B010
        setattr(holder, "_gemini_outage_aware", True)  # noqa: B010
    join = dynamic_rendezvous._RendezvousJoinOp
    if not getattr(join, "_gemini_members_first", False):
        setattr(join, "__call__", _members_first(join.__call__))  # noqa: B010
        setattr(join, "_gemini_members_first", True)  # noqa: B010
    if not getattr(holder, "_gemini_fresh", False):
        setattr(holder, "sync", _fresh_after_change(holder.sync))  # noqa: B010
        setattr(holder, "_gemini_fresh", True)  # noqa: B010
        delay = getattr(dynamic_rendezvous, "_delay")  # noqa: B009
        setattr(dynamic_rendezvous, "_delay", _wake_on_change(delay))  # noqa: B010
    _SINGLE_NODE[:] = [single_node]


def _steady_heartbeats(self: Any) -> None:
    """torch's ``_start_heartbeats`` with the timer at half the keep-alive interval."""
    import weakref

    from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer

    interval = self._settings.keep_alive_interval / 2
    self._keep_alive_timer = _PeriodicTimer(interval, self._keep_alive_weak, weakref.ref(self))
    self._keep_alive_timer.set_name(f"RendezvousKeepAliveTimer_{self._this_node.local_id}")
    self._keep_alive_timer.start()


_GONE: list[Callable[[], frozenset[str]]] = []


def drop_gone_nodes(gone: Callable[[], frozenset[str]]) -> None:
    """Have torch's rendezvous in this process drop the nodes that ``gone()`` names (as
    ``repr`` of torch's node descriptors: ``ADDR_PID_ID``) at once, as it drops a node
    whose keep-alive expired: a host known to be lost cannot hold up the next round
    until its heartbeat goes stale."""
    _GONE[:] = [gone]


def _drop_gone(holder: Any) -> None:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _remove_participant_epilogue,
    )

    gone = _GONE[0]() if _GONE else frozenset()
    state = holder._state
    nodes = {*state.last_heartbeats, *state.participants, *state.wait_list,
             *state.redundancy_list}
    for key in _GONE_BEATS.keys() - gone:  # registered again: a later loss starts afresh
        del _GONE_BEATS[key]
    removed = False
    for node in [n for n in nodes if _still_gone(n, gone, state.last_heartbeats)]:
        state.last_heartbeats.pop(node, None)
        removed |= state.participants.pop(node, None) is not None
        state.wait_list.discard(node)
        state.redundancy_list.discard(node)
    if removed:
        _remove_participant_epilogue(state, holder._settings)


_GONE_BEATS: dict[str, Any] = {}
"""The last heartbeat of each node known lost, as it stood when first seen lost."""


def _still_gone(node: Any, gone: frozenset[str], heartbeats: Mapping[Any, Any]) -> bool:
    """Whether ``node`` is one of the ``gone`` and has not heartbeated since: a host that
    was frozen, declared lost and then thawed heartbeats again when it rejoins (torch's
    join records a heartbeat), and must not be dropped from the round it joined."""
    key = repr(node)
    if key not in gone:
        return False
    beat = heartbeats.get(node)
    first = _GONE_BEATS.setdefault(key, beat)
    return beat is None or beat == first


def _outage_aware(sanitize: Any) -> Any:
    """torch's removal of dead nodes from the rendezvous state, skipped while the store is
    away or slow: while it is unreachable and for one keep-alive grace after it is back,
    and whenever no node at all has heartbeated within the keep-alive window (a store
    too slow to take writes, a quorum being re-formed). Then every heartbeat is stale,
    and a node that synced first would drop all the others, healthy as they are, and
    itself from the running round."""

    def sanitize_unless_after_outage(self: Any) -> None:
        _drop_gone(self)  # known dead, whatever the heartbeats say
        store = getattr(self._backend, "store", None)
        settings = self._settings
        window = settings.keep_alive_interval * settings.keep_alive_max_attempt
        grace = window.total_seconds() + settings.keep_alive_interval.total_seconds()
        beats = self._state.last_heartbeats.values()
        if (store is not None and store.unreachable_within(grace)) or (
                beats and max(beats) < datetime.datetime.now(datetime.timezone.utc) - window):
            self._dead_nodes = []
            return
        sanitize(self)

    return sanitize_unless_after_outage


SETTLE = 0.5
"""Seconds a spare waits after a round opens: the last member to leave the old round
joins the new one within milliseconds, but is briefly in neither."""


def members_first(node: Any, members: frozenset[Any], participants: Iterable[Any],
                  heartbeats: Iterable[Any], open_for: float, grace: float, *,
                  gone: frozenset[str] = frozenset(), max_nodes: int = 0) -> bool:
    """Whether ``node`` may join a round that has been open for ``open_for`` seconds,
    the last complete round having had ``members``: yes for a member; a spare (any other
    node) at once while the round has room for it beside every member that is not known
    lost (``gone``: their ``repr``) and has yet to rejoin, else once every member still
    alive (heartbeating) has joined, at least :data:`SETTLE` seconds after the round
    opened, or in any case after ``grace`` seconds (a member that never comes back
    cannot keep the round from forming)."""
    if node in members or open_for >= grace:
        return True
    joined, alive = set(participants), set(heartbeats)
    returning = [m for m in members if m not in joined and repr(m) not in gone]
    if max_nodes and len(joined) + len(returning) < max_nodes:
        return True
    return open_for >= SETTLE and not any(m in alive and m not in joined for m in members)


def all_rejoined(members: frozenset[Any], participants: Iterable[Any],
                 heartbeats: Iterable[Any]) -> bool:
    """Whether every node still alive (it heartbeats: a lost host's node is dropped at
    once), the last complete round's ``members`` and any spare, has joined the next
    round: then it need not wait out torch's last call for hosts that may never come (a
    job that shrinks goes on at once; a host that comes later is admitted at the next
    round)."""
    joined = set(participants)
    return bool(members) and all(node in joined for node in heartbeats)


@dataclasses.dataclass
class _LastRound:
    round: int = -1
    members: frozenset[Any] = frozenset()
    opened: float | None = None  # monotonic time this node first saw the next round open


_LAST_ROUNDS: dict[str, _LastRound] = {}


def _members_first(join: Any) -> Any:
    """torch's join operation, holding spares back while the last round's members rejoin."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _Action,
        _should_keep_alive,
    )

    def join_members_first(self: Any, ctx: Any, deadline: float) -> Any:
        action = join(self, ctx, deadline)
        state, settings = ctx.state, ctx.settings
        last = _LAST_ROUNDS.setdefault(settings.run_id, _LastRound())
        if state.complete:
            if state.round != last.round:
                _LAST_ROUNDS[settings.run_id] = _LastRound(state.round,
                                                           frozenset(state.participants))
            return action
        if state.round != last.round + 1:
            return action
        if (action in (_Action.KEEP_ALIVE, _Action.SYNC) and ctx.node in state.participants
                and settings.min_nodes <= len(state.participants) <= settings.max_nodes
                and all_rejoined(last.members, state.participants, state.last_heartbeats)):
            return _Action.MARK_RENDEZVOUS_COMPLETE
        if action is not _Action.ADD_TO_PARTICIPANTS:
            return action
        if last.opened is None:
            last.opened = time.monotonic()
        grace = (settings.keep_alive_interval * settings.keep_alive_max_attempt
                 ).total_seconds() + 2 * SETTLE
        gone = _GONE[0]() if _GONE else frozenset()
        if members_first(ctx.node, last.members, state.participants, state.last_heartbeats,
                         time.monotonic() - last.opened, grace, gone=gone,
                         max_nodes=settings.max_nodes):
            return action
        return _Action.KEEP_ALIVE if _should_keep_alive(ctx) else _Action.SYNC

    return join_members_first


_SINGLE_NODE = [False]


def _wake_on_change(delay: Any) -> Any:
    """torch's ``_delay``: a fixed delay is the poll interval of a node waiting for the
    rendezvous state to change, and ends early when it does (etcd-v3); a random one
    (0-0.3 s) spreads the nodes' first attempts to join, which a single-node job does
    without. torch sleeps it whenever the last round this node saw is round 0, so also at
    the first restart after the job's first round: not here, where every member rejoins
    at once and the round cannot form before the last one did."""

    def wait_for_change(seconds: float | tuple[float, float]) -> None:
        if isinstance(seconds, tuple):
            if not _SINGLE_NODE[0] and not any(r.round >= 0 for r in _LAST_ROUNDS.values()):
                delay(seconds)
            return
        _CHANGED.wait(seconds)
        _CHANGED.clear()

    return wait_for_change


def _fresh_after_change(sync: Any) -> Any:
    """torch's state sync, which serves a cached state for a second: not once the
    backend saw the state change since. And patient with a value a newcomer cannot
    verify (``rendezvous_state.sync_patiently``)."""

    def sync_fresh(self: Any) -> Any:
        changed = getattr(self._backend, "changed_at", None)
        if changed is not None and changed > self._last_sync_time:
            self._last_sync_time = -1
        return sync_patiently(sync, self, self._settings.keep_alive_interval,
                              leftovers=self._backend.name != "c10d")

    return sync_fresh


def assign_slots(members: dict[int, tuple[str, int | None]], world_size: int) -> dict[int, int]:
    """Stable node slots: survivors keep theirs, newcomers take the free ones.

    ``members`` maps each member's rank in this round (as torch's rendezvous numbered it)
    to ``(host id, the slot it held before or None)``. A member keeps its previous slot
    when that slot still exists and no one else claims it; the others take the free slots
    in order of host id, so a replacement takes the slot (and so the ranks) of the host it
    replaces. Returns the slot of every member. A pure function: every supervisor computes
    the same answer from the same round.
    """
    slots: dict[int, int] = {}
    claimed: dict[int, int] = {}
    for member, (_, previous) in sorted(members.items(), key=lambda m: m[1][0]):
        if previous is not None and 0 <= previous < world_size and previous not in claimed:
            claimed[previous] = member
            slots[member] = previous
    free = iter(sorted(set(range(world_size)) - set(claimed)))
    for member, _ in sorted(members.items(), key=lambda m: m[1][0]):
        if member not in slots:
            slots[member] = next(free)
    return slots


def worker_ranks(nodes: Sequence[tuple[str, int]], slot: int) -> tuple[int, int, int, int]:
    """The ranks of the workers of node slot ``slot``, as torch elastic's agents assign
    them (``SimpleElasticAgent._assign_worker_ranks``) from every node's (role, number of
    workers) in slot order: ``(base global rank, global world size, base role rank, role
    world size)``; its workers take the ranks from each base up. A pure function: every
    supervisor computes the same answer from the same round."""
    role = nodes[slot][0]
    return (sum(n for _, n in nodes[:slot]), sum(n for _, n in nodes),
            sum(n for r, n in nodes[:slot] if r == role), sum(n for r, n in nodes if r == role))
