"""The supervisor's replication service: serve peers' replicas, push our own to the holders.

Every supervisor runs a transport :class:`~launcher.replication.transport.Server` that
keeps the replicas peers push into this host's replica slots and answers pulls. A sender
thread replicates this host's ranks to the nodes that
:mod:`~launcher.replication.placement` names as their holders, one target step at a time,
in lock step with every other host (:mod:`~launcher.replication.progress`: the round's
leader publishes the target and the globally restorable step s* in the coordination
store; each host reports there when its ranks' copies of the target have reached every
holder). It pushes each target straight from the worker's slot that holds it, in shared
memory: the worker's saves never overwrite the slot holding the step being pushed nor
the one holding s* (``SlotOwner.pin_own``), which the survivors of a host loss resume
from; a save finding both slots pinned is skipped.

Pacing (the paper's traffic interleaving, adapted): the paper fits checkpoint traffic
into the gaps of training's own network traffic. Here the contended resources are the
CPU and memory bandwidth that the copies, the kernel's TCP work and the checksums take,
so with pacing each step's replication (the local copy, then the pushes) goes out in
chunks, each only while this host's workers leave the CPU idle
(:class:`~launcher.priority.IdleGate`: waiting for a GPU, for data, for peers). If they
never do within an iteration of the commit (training that keeps every core busy), the
rest is spread over most of an iteration instead, at ``bytes / (0.8 * iteration time)``
(measured from the commits themselves). Both the sending and the receiving threads run
at a low CPU priority (nice 10: a tenth of a training thread's share under contention;
nice 19 starved them on a busy host), so replication falls behind (coalescing to the
newest step) before it slows training down much.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Protocol

from launcher import memory
from launcher.coordination import secret_key
from launcher.errors import CheckpointError, ConfigError, ReplicationError, StoreError
from launcher.events import EventLog
from launcher.files import read_user_file
from launcher.priority import IdleGate, lower_priority
from launcher.replication import placement, progress, transport, wire
from launcher.store import Lease, Store

logger = logging.getLogger(__name__)


class SlotKeeper(transport.SlotSource, Protocol):
    """What replication reads and writes of a host's slots (``launcher.slots.SlotOwner``),
    besides what the transport's server needs."""

    copies: int
    """Copies of each rank's state the host keeps (its own and its peers' replicas)."""
    local_world_size: int
    """The host's local ranks."""
    host_id: str
    """This host's id."""

    def segments(self, *, replica: bool = False) -> dict[int, list[memory.Segment]]:
        """The host's own slots by rank (or, with ``replica``, its peers' it keeps)."""
        ...

    def pin_own(self, rank: int, sstar: int, target: int) -> None:
        """Keep the own slots holding ``sstar`` and ``target`` of ``rank``."""
        ...

    def seen(self, rank: int) -> int:
        """The step of the newest save() of ``rank``, kept or skipped (-1: none)."""
        ...

    def forget_seen(self) -> None:
        """Forget the steps :meth:`seen` reports (a new round)."""
        ...

PACED_NICE = 10  # with pacing, training threads get ~10x the CPU share of replication's
PACE_SHARE = 0.8  # fraction of an iteration over which one snapshot is spread
# Chunks wait for idle workers during this many iterations after a commit, at most
# MAX_GATE seconds (a receiver gives up on a push that stalls for 30 s).
GATE_SHARE, MAX_GATE = 1.0, 5.0
MIN_RATE = 64 << 20  # bytes/s: pacing never drops below this
# Seconds between two looks at the slot headers when there is nothing to send: a twentieth
# of the shortest iteration, within these bounds (each look wakes a thread and reads every
# header: looking much more often costs as much CPU as the paced traffic itself).
MIN_POLL, MAX_POLL, POLL_SHARE = 0.002, 0.05, 0.05
STORE_POLL = 0.05  # seconds between two reads of the replication plan or reports
REPORT_EVERY = 30.0  # seconds between two ``replication_progress`` events
# Steps hosts' commits may be apart (a push's step against the receiver's newest commit),
# beyond the plan's margin and spacing: see transport.Admission.ahead.
STEPS_APART = 256


MAX_SECRET = 4096  # bytes of a --secret-file
MIN_SECRET_BITS = 128  # of random material a --secret-file must hold, at the least
MIN_SECRET_SYMBOLS = 6  # different bytes in it: a random one has 9 or more
SECRET_TTL = 30.0  # seconds a crashed supervisor's hold on the run's secret outlives it
_HEX = frozenset(b"0123456789abcdefABCDEF")
_BASE64 = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/-_")


def secret_bits(secret: bytes) -> int:
    """The bits of random material ``secret`` (a --secret-file's stripped contents) holds
    at most, from its alphabet: 4 a hex digit, 6 a base64 or other printable character,
    8 a byte otherwise; of a secret that repeats itself, its part at least twice
    (``password1password1``, ``0123456789abcdef0123456789abcdef``), only that part
    counts (a random secret that merely ends as it began is not a repetition).
    The transport's handshake makes the client prove first, so a rogue server (a peer's
    address taken over) can test guesses of the secret offline: only enough material,
    not the handshake, stops that."""
    symbols = secret.rstrip(b"=")
    if 2 * (period := _period(symbols)) <= len(symbols):
        symbols = symbols[:period]
    if symbols and all(c in _HEX for c in symbols):
        return 4 * len(symbols)
    if all(c in _BASE64 or 0x20 <= c < 0x7F for c in symbols):
        return 6 * len(symbols)
    return 8 * len(symbols)


def _period(symbols: bytes) -> int:
    """The smallest p such that every symbol equals the one p before it (the length of
    ``symbols`` for one that never repeats itself): its length less its longest border,
    from the Knuth-Morris-Pratt prefix function."""
    border = [0] * len(symbols)
    for i in range(1, len(symbols)):
        k = border[i - 1]
        while k and symbols[i] != symbols[k]:
            k = border[k - 1]
        border[i] = k + (symbols[i] == symbols[k])
    return len(symbols) - (border[-1] if symbols else 0)


def read_secret_file(secret_file: str) -> bytes:
    """The secret a --secret-file holds (stripped of surrounding white space); refused
    unless it holds at least :data:`MIN_SECRET_BITS` bits of material (32 hex digits, 22
    base64 characters, 16 random bytes: ``head -c 32 /dev/urandom | base64`` makes one)."""
    secret = read_user_file(secret_file, "secret file", MAX_SECRET)
    if len(secret) > MAX_SECRET:
        raise ConfigError(f"secret file {secret_file}: longer than {MAX_SECRET} bytes")
    secret = secret.strip()
    bits = secret_bits(secret)
    if bits < MIN_SECRET_BITS or len(set(secret)) < MIN_SECRET_SYMBOLS:
        raise ConfigError(f"secret file {secret_file}: too weak ({len(secret)} bytes, at most "
                          f"{bits} bits of random material, {len(set(secret))} different "
                          f"bytes); it needs {MIN_SECRET_BITS} bits, e.g. 32 hex digits or 22 "
                          f"base64 characters: make one with "
                          f"`head -c 32 /dev/urandom | base64`")
    return secret


def load_secret(secret_file: str, store: Store, run_id: str, *,
                lease: Lease | None = None) -> bytes:
    """The run's replication secret: from ``secret_file``, or created once at random and
    shared through the coordination store (the first supervisor to ask creates it).

    A stored secret is reused only while a supervisor that holds it lives: the record
    names the leases of its holders, each of which keeps a key of its own bound to its
    lease (``secret-holders/<lease>``). A secret none of whose holders lives is a crashed
    run's (the last supervisor of a run that ends deletes it): it is replaced, so that a
    later run of the same id never reuses it. Every change of the record is a
    compare-and-set, so supervisors starting together agree on one secret. ``lease`` is
    the supervisor's own (its hold ends with it); without one, a lease of
    :data:`SECRET_TTL` seconds is kept alive until the store is closed."""
    if secret_file:
        return read_secret_file(secret_file)
    try:
        if lease is None:
            lease = store.grant_lease(SECRET_TTL)
            store.keep_alive(lease)  # stopped by store.close(); expires with this process
        return _hold_secret(store, run_id, lease)
    except StoreError as exc:
        raise StoreError(f"cannot share the replication secret: {exc}") from None


def hold_secret(store: Store, run_id: str, lease: Lease, *, replaces: int) -> None:
    """Hold the run's stored secret with ``lease`` instead of the lease ``replaces`` (a
    supervisor whose lease expired in a store outage and was replaced), so that a host
    joining later still finds it held. Nothing changes when ``replaces`` held no secret."""
    key = secret_key(run_id)
    store.put(_holder_key(run_id, lease.id), b"1", lease=lease)
    for _ in range(_CAS_TRIES):
        value = store.get(key)
        record = _secret_record(value)
        if record is None or replaces not in record[1]:
            return
        leases = [lid for lid in record[1] if lid != replaces] + [lease.id]
        if store.compare_and_set(key, value, _dump_secret(record[0], leases)):
            return


_CAS_TRIES = 64  # compare-and-set rounds: each lost one means another supervisor moved


def _holder_key(run_id: str, lease_id: int) -> str:
    return f"{secret_key(run_id)}-holders/{lease_id:x}"


def _secret_record(value: bytes | None) -> tuple[bytes, list[int]] | None:
    """The secret and its holders' leases that a stored record names, or None (missing,
    or written by another version: replaced)."""
    if value is None:
        return None
    try:
        record = json.loads(value)
        secret, leases = record["secret"].encode(), record["leases"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if len(secret) < wire.MIN_SECRET or not isinstance(leases, list) or not all(
            type(lid) is int for lid in leases):
        return None
    return secret, leases


def _dump_secret(secret: bytes, leases: list[int]) -> bytes:
    return json.dumps({"secret": secret.decode(), "leases": leases}).encode()


def _hold_secret(store: Store, run_id: str, lease: Lease) -> bytes:
    key = secret_key(run_id)
    store.put(_holder_key(run_id, lease.id), b"1", lease=lease)  # first: see load_secret
    for _ in range(_CAS_TRIES):
        value = store.get(key)
        record = _secret_record(value)
        live = {int(k.rsplit("/", 1)[-1], 16)
                for k in store.get_prefix(f"{key}-holders/")}
        holders = [lid for lid in record[1] if lid in live] if record is not None else []
        if record is not None and holders:
            if lease.id in holders:
                return record[0]
            if store.compare_and_set(key, value, _dump_secret(record[0], [*holders, lease.id])):
                return record[0]
            continue
        if record is not None:
            logger.info("replication: the stored secret of run %s is held by no live "
                        "supervisor (a crashed run's): making a new one", run_id)
        secret = secrets.token_hex(32).encode()
        if store.compare_and_set(key, value, _dump_secret(secret, [lease.id])):
            return secret
    raise StoreError("the replication secret keeps changing in the store")


def _addresses_of(host: str) -> set[str]:
    """The IP addresses ``host`` (an address or a name) stands for: where a peer's
    connections come from. Empty when it cannot be resolved."""
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host.strip("[]"), None,
                                                               type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return set()


def address_towards(host: str) -> str | None:
    """The address of this machine's interface that routes to ``host`` (the rendezvous
    endpoint: the network the hosts share), or None if it cannot be told. No packet is
    sent: a UDP socket is only connected."""
    if not host:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), 9,
                                                             type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def advertised_host(bind_host: str, local_addr: str | None) -> str:
    """The address peers use to reach a transport bound to ``bind_host``."""
    if bind_host not in ("", "0.0.0.0", "::"):
        return bind_host
    return local_addr or socket.getfqdn()


class ReplicationService:
    """Owns the transport server and the sender thread of one supervisor."""

    def __init__(self, owner: SlotKeeper, events: EventLog, store: Store, *, run_id: str,
                 replicas: int, secret: bytes, bind: tuple[str, int], advertise: str,
                 pace: bool = True, every: int = 0, rate_limit: float = 0.0) -> None:
        self.owner = owner
        self.events = events
        self.store = store
        self.run_id = run_id
        self.replicas = replicas
        self.pace = pace
        self.every = every  # 0: chosen from the measurements
        self.rate_limit = rate_limit  # bytes/s per push, 0: none
        self._secret = secret
        self._keys = f"gemini/runs/{run_id}/replication/"
        self._node, self._nodes, self._round_id = 0, 1, ""
        self._plan: progress.Plan | None = None
        self._plan_read = 0.0  # monotonic time of the last read of the plan
        self._began: float | None = None  # when this host began to copy the current target
        self._answered: tuple[str, int] | None = None  # (round, target) reported done
        self._reported = 0.0  # monotonic time of the last replication_progress event
        self._store_down = False
        # no push is taken before the first round says which (transport.Admission); a
        # hard rate limit of the peers' (the same flag on every host) lowers the rate a
        # push must keep
        min_rate = transport.MIN_PUSH_RATE if rate_limit <= 0 else min(
            transport.MIN_PUSH_RATE, rate_limit / 4)
        self._admission = transport.Admission()
        self.server = transport.Server(owner, secret=secret, run_id=run_id, host=bind[0],
                                       port=bind[1], on_reject=self._on_reject,
                                       nice=PACED_NICE if pace else 0,
                                       admission=self._admission, min_rate=min_rate)
        self.address: tuple[str, int] = (advertise, self.server.address[1])
        self._lock = threading.Lock()
        self._holders: list[tuple[str, int]] = []
        self._clients: dict[tuple[str, int], transport.Client] = {}
        self._pulls: set[transport.Client] = set()  # in flight: see abort_pulls
        self._pushed: dict[tuple[tuple[str, int], int], int] = {}  # (holder, rank) -> step
        self._commits: dict[int, tuple[int, float]] = {}  # rank -> (newest step, seen at)
        self._interval: dict[int, float] = {}  # rank -> iteration time (EWMA, seconds)
        self._failures: dict[tuple[str, int], float] = {}  # holder -> time of last failure
        # rank -> (the header of the step being replicated, its own slot: pinned, the
        # pushes go out from it)
        self._sources: dict[int, tuple[memory.SlotHeader, memory.Segment]] = {}
        self._restored = -1  # the step this round started from: kept until s* passes it
        self._diverged: tuple[str, Any] | None = None  # the disagreement last reported
        self.on_diverged: Callable[[dict[str, Any]], None] | None = None
        """Called (in the sender's thread) with each new disagreement of the replicas."""
        self._gate = IdleGate() if pace and IdleGate.available() else None
        self.pushes = 0  # completed pushes (a step of a rank to one holder)
        self.sent = 0  # data bytes pushed
        self.skipped = 0  # data bytes not pushed: the holders had them (see reuse)
        self._running = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send_loop, name="gemini-replication",
                                        daemon=True)
        self._thread.start()

    # -- rounds -----------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop pushing (before a round's membership and placement change)."""
        self._running.clear()

    def set_round(self, node: int, nodes: int, addresses: Mapping[int, tuple[str, int] | None],
                  *, round_id: str, restored: int,
                  ranks: Mapping[int, Collection[int]] | None = None) -> None:
        """Adopt the placement of a new round (``round_id``, the same on every host) and
        resume replicating; the round's leader publishes its first plan. ``ranks`` are the
        global ranks of each node (default: ``local_world_size`` consecutive ranks per
        node, torch's assignment when every host runs as many): this host's server takes
        pushes only of the ranks of the nodes whose replicas it keeps."""
        layout = placement.plan(nodes, self.replicas)
        self.owner.copies = layout.replicas
        holders = [a for n in layout.holders(node) if (a := addresses.get(n)) is not None]
        width = self.owner.local_world_size
        of = {n: frozenset(ranks[n]) if ranks is not None and n in ranks
              else frozenset(range(n * width, (n + 1) * width)) for n in range(nodes)}
        kept = frozenset(r for n in layout.kept_by(node) for r in of[n]) if nodes > 1 \
            else frozenset()
        world = sum(len(r) for r in of.values()) if ranks is not None else 0
        peers = frozenset(ip for n, a in addresses.items() if n != node and a is not None
                          for ip in _addresses_of(str(a[0])))
        with self._lock:
            self._holders = [(str(h), int(p)) for h, p in holders]
            for address in list(self._clients):
                if address not in self._holders:
                    self._clients.pop(address).close()
            self._pushed.clear()  # the job may have gone back to an older step
            self._sources.clear()
            self._restored = restored
            self.owner.forget_seen()
            self._node, self._nodes, self._round_id = node, nodes, round_id
            for rank in self.owner.segments():  # kept until this round's first s*
                self.owner.pin_own(rank, restored if nodes > 1 else -1, -1)
            self._plan, self._plan_read, self._answered = None, 0.0, None
            self.server.round = round_id
            self.server.peers = peers
            self._admit(transport.Admission(
                round=round_id, ranks=kept, world_size=world, low=restored, target=-1,
                ahead=2 * (progress.MAX_MARGIN + max(self.every, 1)) + STEPS_APART))
        if node == 0 and nodes > 1:
            interval = min(self._interval.values(), default=None)
            plan = progress.first_plan(round_id, newest=restored, interval=interval,
                                       fixed_every=self.every)
            self._write_plan(plan, first=True)
        self.events.write("replication_round", node=node, nodes=nodes, placement=layout.kind,
                          holders=[f"{h}:{p}" for h, p in self._holders])
        self._running.set()

    def watch_workers(self, pids: Iterable[int]) -> None:
        """The processes of this round's local workers, whose idle times pacing uses."""
        if self._gate is not None:
            self._gate.watch(pids)

    def client(self, address: tuple[str, int], *, timeout: float = 30.0) -> transport.Client:
        """A transport client (not yet connected) to the peer at ``address``."""
        return transport.Client(address, secret=self._secret, run_id=self.run_id,
                                timeout=timeout)

    def pull(self, address: tuple[str, int], rank: int, step: int, *,
             into: int | None = None, replica: bool = False) -> memory.SlotHeader:
        """Fetch ``rank``'s committed ``step`` from the peer at ``address`` into one of
        this host's own slots of that rank, or of rank ``into``, or with ``replica`` into
        a replica slot of ``rank`` (verified and committed there)."""
        own = rank if into is None else into
        client = self.client(address)
        with self._lock:
            self._pulls.add(client)
        try:
            return client.pull(rank, step, lambda nbytes: self.owner.write_target(
                own, nbytes, replica=replica))
        finally:
            with self._lock:
                self._pulls.discard(client)
            client.close()

    def abort_pulls(self) -> None:
        """Make every pull in flight fail at once (its target slot stays WRITING)."""
        with self._lock:
            pulls = list(self._pulls)
        for client in pulls:
            client.close()

    # -- the sender ---------------------------------------------------------------------------
    def _send_loop(self) -> None:
        lower_priority(PACED_NICE if self.pace else 0)
        while not self._stop.is_set():
            if not self._running.wait(0.1):
                continue
            try:
                sent = self._send_once()
            except Exception:  # a bug: say so, and keep replicating what can be
                logger.exception("replication: unexpected error (retrying in a second)")
                self._stop.wait(1.0)
                continue
            if not sent:
                self._stop.wait(self._poll_interval())

    # Complexity above 10: one lock step, kept whole (see progress).
    def _send_once(self) -> bool:  # noqa: C901
        """One pass of the lock step (see :mod:`~launcher.replication.progress`): lead,
        read the plan, and replicate each rank's copy of its target to every holder that
        lacks it; report once all have it. True if any bytes moved."""
        with self._lock:
            holders = list(self._holders)
            round_id = self._round_id
        own = self.owner.segments()
        newest = self._newest(own)
        if not holders or not own or self._nodes < 2:
            return False
        if self._node == 0:
            self._lead(round_id, newest)
        plan = self._read_plan(round_id)
        if plan is not None and plan.diverged is not None:
            self._report_divergence(plan)
        if plan is None or self._answered == (round_id, plan.target):
            return False
        for rank in own:
            self.owner.pin(rank, plan.sstar)
            self.owner.pin_own(rank, max(plan.sstar, self._restored), plan.target)
        sent = False
        caught: dict[int, int] = {}
        for rank, segments in own.items():
            source = self._sources.get(rank)
            pacer = self._pacer(rank, max(seg.size for seg in segments) * len(own) * len(holders))
            if source is None or source[0].step < plan.target:
                due = self._due(segments, plan.target)
                if due is None:
                    continue
                if self._began is None:
                    self._began = time.monotonic()
                source = self._sources[rank] = (due[1], due[0])
            header, segment = source
            if not memory.unchanged(segment.view, header):
                del self._sources[rank]  # rewritten before its pin was seen: a miss, below
                continue
            caught[rank] = header.step
            for holder in holders:
                if self._pushed.get((holder, rank)) == header.step or not self._running.is_set():
                    continue
                if time.monotonic() - self._failures.get(holder, -1e9) < 1.0:
                    continue  # back off from a failing peer
                sent |= self._push(holder, rank, segment, header, pacer, plan.sstar)
        self._answer(plan, own, holders, caught, newest)
        return sent

    # -- the lock step ------------------------------------------------------------------------
    def _newest(self, own: Mapping[int, list[memory.Segment]]) -> int:
        """The newest step every local rank has reached (-1: none): the newest it committed
        or, while its saves are skipped (both slots pinned during a push), the newest it
        saved; tracking the iteration time on the way."""
        steps = []
        for rank, segments in own.items():
            headers = [h for seg in segments if memory.committed(h := memory.read_header(seg.view))]
            step = max((h.step for h in headers), default=-1)
            seen = self.owner.seen(rank)
            if step <= seen <= step + progress.MAX_EVERY:  # the worker's word, within reason
                step = seen
            self._observe(rank, step)
            steps.append(step)
        return min(steps, default=-1)

    def _answer(self, plan: progress.Plan, own: Mapping[int, list[memory.Segment]],
                holders: list[tuple[str, int]], caught: dict[int, int], newest: int) -> None:
        """Report the target done once every local rank's copy reached every holder, or
        missed once a rank can no longer catch it."""
        missed = any(self._lost_target(segments, plan.target) for rank, segments in own.items()
                     if rank not in caught)
        steps = set(caught.values())
        complete = len(caught) == len(own) and all(
            self._pushed.get((holder, rank)) == step
            for rank, step in caught.items() for holder in holders)
        if len(steps) > 1:
            missed = True  # the local ranks caught different steps
        if not (missed or complete):
            return
        began = self._began if self._began is not None else time.monotonic()
        agree = {} if missed else {str(rank): record for rank in caught
                                   if (record := self._agreement(rank)) is not None}
        done = progress.Done(round=plan.round, target=plan.target,
                             step=-1 if missed else steps.pop(), newest=newest,
                             seconds=round(time.monotonic() - began, 4),
                             host=self.owner.host_id, agree=agree)
        if self._store_call(self.store.put, self._keys + f"done/{self._node}", done.dumps()):
            self._answered = (plan.round, plan.target)

    def _agreement(self, rank: int) -> list[str] | None:
        """The ``[key, digest]`` of the replicated state in the slot ``rank`` pushed for
        the target (its metadata's ``agree``; the worker computed it from the checksums
        of its copy), or None: none, or the slot was rewritten meanwhile."""
        source = self._sources.get(rank)
        if source is None:
            return None
        header, segment = source
        try:
            agree = memory.read_meta(segment.view, header).get("agree")
        except (CheckpointError, ValueError):
            return None
        if not isinstance(agree, dict) or not memory.unchanged(segment.view, header):
            return None
        return [agree["key"], agree["digest"]]

    def _report_divergence(self, plan: progress.Plan) -> None:
        """Say once, per round and step, that the replicas of a step disagree (silent
        data corruption on some rank: its parameters or optimizer state differ from the
        other replicas'); s* stays on the newest step they agreed on."""
        diverged = plan.diverged or {}
        seen = (plan.round, diverged.get("step"))
        if seen == self._diverged:
            return
        self._diverged = seen
        odd = diverged.get("odd") or []
        logger.warning(
            "gemini: the replicas of step %s disagree: rank(s) %s on host(s) %s hold "
            "different parameters or optimizer state%s; the newest step they agreed on, "
            "%s, stays restorable", diverged.get("step"),
            ", ".join(map(str, diverged.get("ranks", []))), ", ".join(diverged.get("hosts", [])),
            f" (the majority outvotes rank(s) {', '.join(map(str, odd))})" if odd else "",
            diverged.get("agreed"))
        self.events.write("replicas_diverged", **diverged)
        if self.on_diverged is not None:
            self.on_diverged(dict(diverged))

    @staticmethod
    def _lost_target(segments: list[memory.Segment], target: int) -> bool:
        """Whether the worker has committed past ``target`` without it in its slots."""
        headers = [h for seg in segments if memory.committed(h := memory.read_header(seg.view))]
        return len(headers) == len(segments) == 2 and all(h.step > target for h in headers) \
            and not any(h.step == target for h in headers)

    def _lead(self, round_id: str, newest: int) -> None:
        """As the round's leader: once every node answered the target, publish the next
        plan (a new s*, or after a miss a target further ahead)."""
        plan = self._plan
        if plan is None or plan.round != round_id:
            return
        if time.monotonic() - self._plan_read < STORE_POLL:
            return
        items = self._store_call(self.store.get_prefix, self._keys + "done/")
        if items is None:
            return
        dones = {}
        for key, value in items.items():
            node = key.rsplit("/", 1)[-1]
            if node.isdigit() and (done := progress.Done.loads(value)) is not None:
                dones[int(node)] = done
        interval = min(self._interval.values(), default=None)
        nxt = progress.advance(plan, dones, nodes=self._nodes, newest=newest,
                               interval=interval, fixed_every=self.every)
        if nxt is not None:
            self._write_plan(nxt)
            if nxt.sstar != plan.sstar and (plan.sstar < 0 or nxt.every != plan.every
                                            or time.monotonic() - self._reported > REPORT_EVERY):
                self._reported = time.monotonic()
                self.events.write("replication_progress", sstar=nxt.sstar, every=nxt.every,
                                  margin=nxt.margin, lag_steps=nxt.lag_steps, lag_seconds=nxt.lag_seconds,
                                  seconds=nxt.seconds, checked=nxt.checked)

    def _write_plan(self, plan: progress.Plan, *, first: bool = False) -> None:
        """Publish the round's plan: the first one over whatever is there, the next ones
        only over the plan this leader wrote last. A leader of an older round (a host
        frozen past --host-ttl and woken, whose round moved on) so never overwrites the
        current round's plan: it stops leading instead."""
        data = plan.dumps()
        if first:
            written = self._store_call(self.store.put, self._keys + "plan", data)
        else:
            previous = self._plan.dumps() if self._plan is not None else None
            written = self._store_call(self.store.compare_and_set, self._keys + "plan",
                                       previous, data)
            if written is False:
                logger.warning("replication: another round's leader has published its plan; "
                               "this host's round %s is over", self._round_id)
                with self._lock:
                    self._holders = []
                return
        if written:
            if self._plan is None or plan.target != self._plan.target:
                self._began = None
                self._admit_target(plan)
            self._plan, self._plan_read = plan, time.monotonic()

    def _read_plan(self, round_id: str) -> progress.Plan | None:
        """The current plan of this round (the leader's own, or read at most every
        :data:`STORE_POLL` seconds)."""
        if self._node != 0 and time.monotonic() - self._plan_read >= STORE_POLL:
            data = self._store_call(self.store.get, self._keys + "plan")
            plan = progress.Plan.loads(data) if data is not None else None
            self._plan_read = time.monotonic()
            if plan is not None and plan.round == round_id and plan != self._plan:
                if self._plan is None or plan.target != self._plan.target:
                    self._began = None
                    self._admit_target(plan)
                self._plan = plan
        plan = self._plan
        return plan if plan is not None and plan.round == round_id else None

    def _admit(self, admission: transport.Admission) -> None:
        self._admission = self.server.admission = admission

    def _admit_target(self, plan: progress.Plan) -> None:
        """Pushes of steps up to near ``plan``'s target are taken from now on."""
        if plan.round == self._admission.round and plan.target > self._admission.target:
            self._admit(dataclasses.replace(self._admission, target=plan.target))

    def _store_call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the coordination store; None (once logged) while it is away:
        replication then waits, training does not."""
        if self._stop.is_set():  # stopping: each call may wait out an outage's deadline
            return None
        try:
            result = fn(*args)
        except StoreError as exc:
            if not self._store_down and self._running.is_set():
                self._store_down = True
                logger.warning("replication: the coordination store is unavailable (%s); "
                               "s* stays where it is until it is back", exc)
            return None
        if self._store_down:
            self._store_down = False
            logger.info("replication: the coordination store is back")
        return True if result is None else result

    @staticmethod
    def _due(segments: list[memory.Segment], target: int
             ) -> tuple[memory.Segment, memory.SlotHeader] | None:
        """The committed slot holding the first step >= ``target``, if any."""
        best: tuple[memory.Segment, memory.SlotHeader] | None = None
        for segment in segments:
            header = memory.read_header(segment.view)
            if not memory.committed(header):
                continue
            if header.step >= target and (best is None or header.step < best[1].step):
                best = (segment, header)
        return best

    def _observe(self, rank: int, step: int) -> None:
        """Track the iteration time from the commits of ``rank``."""
        if step < 0:
            return
        now = time.monotonic()
        last = self._commits.get(rank)
        if last is None or step < last[0]:
            self._commits[rank] = (step, now)
        elif step > last[0]:
            per_step = (now - last[1]) / (step - last[0])
            old = self._interval.get(rank)
            self._interval[rank] = per_step if old is None else 0.8 * old + 0.2 * per_step
            self._commits[rank] = (step, now)

    def _poll_interval(self) -> float:
        shortest = min(self._interval.values(), default=0.2)
        return min(MAX_POLL, max(MIN_POLL, POLL_SHARE * shortest))

    def _pacer(self, rank: int, per_iteration: int) -> _Pacer | None:
        """How the replication of ``rank``'s newest commit is paced when ``per_iteration``
        bytes go out every iteration; None: unpaced (no pacing, or no iteration time yet)."""
        interval = self._interval.get(rank)
        if self.rate_limit > 0:  # a hard limit: no bursts into idle time either
            rate = self.rate_limit
            if self.pace and interval:
                rate = min(rate, max(MIN_RATE, per_iteration / (PACE_SHARE * interval)))
            return _Pacer(None, rate, 0.0, self._stop)
        if not self.pace or interval is None or interval <= 0:
            return None
        rate = max(MIN_RATE, per_iteration / (PACE_SHARE * interval))
        committed = self._commits[rank][1]
        return _Pacer(self._gate, rate, committed + min(GATE_SHARE * interval, MAX_GATE),
                      self._stop)

    def _push(self, holder: tuple[str, int], rank: int, segment: memory.Segment,
              header: memory.SlotHeader, pacer: _Pacer | None, keep: int) -> bool:
        try:
            client = self._clients.get(holder)
            if client is None:
                client = self._clients[holder] = self.client(holder)
            sent, skipped = client.sent, client.skipped
            step = client.push(segment, pace=pacer, keep=keep, round_id=self._round_id,
                               expect=header)
            self.sent += client.sent - sent
            self.skipped += client.skipped - skipped
        except ReplicationError as exc:
            first = holder not in self._failures
            self._failures[holder] = time.monotonic()
            dropped = self._clients.pop(holder, None)
            if dropped is not None:
                dropped.close()
            if first:  # once per outage; the store shows the replicas' lag meanwhile
                logger.warning("replicating rank %d to %s:%d failed (retrying every second): %s",
                               rank, *holder, exc)
                self.events.write("replication_failed", rank=rank, peer=f"{holder[0]}:{holder[1]}",
                                  reason=str(exc))
            return False
        if self._failures.pop(holder, None) is not None:
            logger.info("replicating to %s:%d works again", *holder)
        if step is not None:
            self._pushed[(holder, rank)] = step
            self.pushes += 1
        return True

    def _on_reject(self, peer: str, reason: str) -> None:
        self.events.write("replication_rejected", peer=peer, reason=reason)

    def stop_sending(self, *, wait: bool = True) -> None:
        """Stop the sender thread (idempotent): before the coordination store closes. Not
        ``wait``: only tell it; a call it has in flight to an unreachable store ends when
        the store is closed, and :meth:`close` waits for it."""
        self._stop.set()
        self._running.set()
        if wait:
            self._thread.join(timeout=10)

    def close(self) -> None:
        self.stop_sending()
        self.events.write("replication_done", pushes=self.pushes, sent=self.sent,
                          skipped=self.skipped,
                          checked=self._plan.checked if self._plan is not None else 0)
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
        self.server.close()


class _Pacer:
    """When the chunks of one step's replication may go: each while the workers are idle,
    until ``until`` (monotonic time); after that, or without a gate, at ``rate`` bytes/s."""

    def __init__(self, gate: IdleGate | None, rate: float, until: float,
                 stop: threading.Event) -> None:
        self._gate = gate
        self._rate = rate
        self._until = until
        self._stop = stop
        self._paced: tuple[float, int] | None = None  # (time, bytes sent) when rating began
        self._pushed = 0  # bytes of the earlier pushes (to other holders) of this step
        self._last = 0  # ``sent`` at the last call

    def wait_idle(self) -> bool:
        """Wait for idle workers; False once past ``until`` (then at once), or without a
        gate."""
        if self._gate is not None and not self._gate.wait(self._until, self._stop):
            self._gate = None
        return self._gate is not None

    def __call__(self, sent: int) -> None:
        """Before each chunk of a push, ``sent`` bytes into it: wait as pacing says."""
        if sent < self._last:  # the push to the next holder
            self._pushed += self._last
        self._last = sent
        total = self._pushed + sent
        if self.wait_idle():
            return
        if self._paced is None:
            self._paced = (time.monotonic(), total)
        began, base = self._paced
        ahead = (total - base) / self._rate - (time.monotonic() - began)
        if ahead > 0.002:
            time.sleep(ahead)
