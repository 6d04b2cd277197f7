"""How checkpoint bytes move between supervisors: an authenticated TCP transport.

A :class:`Server` runs in every supervisor and serves two operations to its peers: PUT (a
peer pushes the committed slot of one rank; it lands in one of this host's replica slots)
and GET (a peer asks for a step of a rank this host holds). A :class:`Client` keeps one
authenticated connection to one peer's server. What they say to each other (handshake,
sealed frames, requests and replies, their limits) is :mod:`launcher.replication.wire`;
which bytes of a push the receiver fills from its own memory instead is
:mod:`launcher.replication.reuse`. This module holds the connections, with every socket
operation under a timeout, and the server's and client's behaviour.

Data moves without copies through Python: the sender ``os.sendfile``\\ s from the slot's
file in ``/dev/shm``, the receiver ``recv_into``\\ s straight into the target slot's mapping.
A sender re-checks the slot's seqlock (:func:`launcher.memory.unchanged`) after the data
and tells the receiver to discard bytes that may have been overwritten mid-send.
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from launcher import memory
from launcher.errors import CheckpointError, ReplicationError, StorageError
from launcher.priority import lower_priority
from launcher.replication import reuse
from launcher.replication.wire import (
    CLIENT_PROOF,
    FRAME,
    HELLO,
    MAC_SIZE,
    MAGIC,
    MAX_DATA,
    MAX_META,
    NONCE_SIZE,
    SERVER_PROOF,
    SESSION,
    TO_CLIENT,
    TO_SERVER,
    WELCOME,
    GetRequest,
    PingRequest,
    PutRequest,
    Refused,
    check_secret,
    derive,
    frame_lengths,
    header_run_id,
    open_frame,
    parse_hello,
    parse_reply,
    parse_request,
    parse_skip,
    parse_slot_reply,
    parse_trailer,
    parse_welcome,
    run_tag,
    seal_frame,
    slot_message,
)

logger = logging.getLogger(__name__)

SEND_CHUNK = 8 << 20
"""Bytes per ``os.sendfile`` call."""
RECV_LOWAT = 1 << 20
"""A receiver of data wakes up for this many bytes at a time (``SO_RCVLOWAT``), not for
every packet: wake-ups, not copies, dominate a loopback or virtualised transfer."""
REPLICA_SLACK = 4
"""A replica slot may be at most this many times this host's largest own slot (see
:class:`Admission`): gemini's memory model takes a peer's state to be as large as one's own."""
MIN_PUSH_RATE = 16 << 20
"""Bytes/s a push's data must average (see :class:`Server`): a quarter of the slowest a
paced sender goes (``replication.service.MIN_RATE``)."""
PUSH_GRACE = 10.0
"""Seconds a push's data may take beyond its bytes at :data:`MIN_PUSH_RATE` (pacing waits
for idle workers up to ``replication.service.MAX_GATE`` seconds first)."""


class SlotSource(Protocol):
    """Where a :class:`Server` finds and puts slots; :class:`launcher.slots.SlotOwner`."""

    def write_target(self, rank: int, nbytes: int, *, replica: bool) -> memory.Segment:
        """A slot of at least ``nbytes`` that may be overwritten, already marked WRITING."""
        ...

    def find(self, rank: int, step: int) -> memory.Segment | None:
        """A committed slot holding ``step`` of ``rank``, or None."""
        ...

    def pin(self, rank: int, step: int) -> None:
        """Keep the replica of ``step`` of ``rank`` from being overwritten."""
        ...

    def segments(self, *, replica: bool = False) -> dict[int, list[memory.Segment]]:
        """The mapped own slots (or replica slots) per rank."""
        ...

    def own_slot_bytes(self) -> int:
        """The size of this host's largest own slot (0 before any)."""
        ...


@dataclass(frozen=True, kw_only=True)
class Admission:
    """Which pushes a :class:`Server` takes: those a member of the current replication
    round sends under its placement. A push with the secret is still refused unless it
    names this round, a rank this host keeps a replica of, a step near the round's plan
    and a size near this host's own slots: an insider cannot pin steps far ahead nor
    fill this host's shared memory (see :meth:`Server._admit`)."""

    round: str = ""
    """The round pushes must name; "" (before the first round): every push is refused."""
    ranks: frozenset[int] = frozenset()
    """The ranks whose replicas this host keeps in the round's placement."""
    world_size: int = 0
    """The world size pushes must state (0: not checked)."""
    low: int = -1
    """The oldest step a push may carry: the step the round restored."""
    target: int = -1
    """The newest target this host knows of the round's plan."""
    ahead: int = 0
    """Steps a push may be past ``target`` or past this host's own newest committed step
    (the plan it knows may be one behind, and hosts commit a few steps apart)."""

    def refusal(self, request: PutRequest, newest: int) -> str | None:
        """Why ``request`` is refused, or None; ``newest`` is this host's own newest
        committed step (-1: none)."""
        header = request.header
        if not self.round:
            return "this host is in no replication round yet"
        if request.round != self.round:
            return f"push from round {request.round!r}, but this host is in round {self.round}"
        if header.rank not in self.ranks:
            return f"this host keeps no replica of rank {header.rank} in round {self.round}"
        if self.world_size and header.world_size != self.world_size:
            return f"world size {header.world_size}, but round {self.round} has {self.world_size}"
        high = max(self.target, self.low, newest) + self.ahead
        if not self.low <= header.step <= high:
            return f"step {header.step} is outside round {self.round}'s steps {self.low}..{high}"
        if request.keep > header.step:
            return f"keep step {request.keep} is after the pushed step {header.step}"
        return None


# -- errors ---------------------------------------------------------------------------

class _Broken(ReplicationError):
    """The connection was closed or reset; ``clean`` when it happened between frames."""

    def __init__(self, message: str, *, clean: bool = False) -> None:
        super().__init__(message)
        self.clean = clean


class _Idle(ReplicationError):
    """No frame started within the idle timeout."""


# -- socket I/O -----------------------------------------------------------------------

_PREALLOCATE = 64 << 10  # bytes of a frame allocated before any of it arrived
MAX_AUTHENTICATING = 32  # connections in the handshake from unknown addresses, in all
MAX_AUTHENTICATING_PER_SOURCE = 4  # ... and from one address (a known peer's included)
MAX_CONNECTIONS_PER_SOURCE = 16  # authenticated connections from one address
REPORT_INTERVAL = 10.0  # seconds
REPORTS_PER_SOURCE = 10  # rejections of one address logged and reported per interval
REPORTS_TOTAL = 20  # ... and of all addresses together
MAX_REPORT_SOURCES = 1024  # addresses whose rejections are counted one by one


# Complexity above 10: every timeout and close case of a read.
def _recv_exact(sock: socket.socket, n: int, timeout: float, *, boundary: bool = False,  # noqa: C901
                idle: float | None = None) -> bytes:
    """Exactly ``n`` bytes within ``timeout``. With ``boundary`` (a frame starts here) a
    close before the first byte is a clean :class:`_Broken`; with ``idle`` up to ``idle``
    seconds may pass before the first byte (then an :class:`_Idle`), and ``timeout``
    counts from that byte. The buffer grows as the bytes arrive (at most twice what was
    received), so an announced length costs nothing until it is sent."""
    buf = bytearray(min(n, _PREALLOCATE))
    got = 0
    deadline = None if idle is not None else time.monotonic() + timeout
    try:
        while got < n:
            if deadline is None:
                sock.settimeout(idle)
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                sock.settimeout(remaining)
            if got == len(buf):
                buf.extend(bytes(min(len(buf), n - len(buf))))
            try:
                with memoryview(buf) as view, view[got:] as free:
                    k = sock.recv_into(free, len(buf) - got)
            except TimeoutError:
                if got == 0 and idle is not None:
                    raise _Idle(f"no frame within {idle} s") from None
                raise
            if k == 0:
                if got == 0:
                    raise _Broken("peer closed the connection", clean=boundary or idle is not None)
                raise _Broken(f"truncated frame: peer closed after {got} of {n} bytes")
            got += k
            if deadline is None:
                deadline = time.monotonic() + timeout
    except TimeoutError:
        raise ReplicationError(f"timed out after {got} of {n} bytes of a frame") from None
    except OSError as exc:
        raise _Broken(f"connection lost after {got} of {n} bytes of a frame: {exc}") from None
    return bytes(buf)


def _sendall(sock: socket.socket, data: bytes, timeout: float) -> None:
    try:
        sock.settimeout(timeout)
        sock.sendall(data)
    except TimeoutError:
        raise ReplicationError(f"timed out sending {len(data)} bytes") from None
    except OSError as exc:
        raise _Broken(f"connection lost: {exc}") from None


# Complexity above 10: every timeout and close case of the data.
def _recv_data(sock: socket.socket, view: memoryview, timeout: float,  # noqa: C901
               verifier: memory.StreamVerifier,
               ranges: list[tuple[int, int]] | None = None, *,
               deadline: float | None = None) -> None:
    """Fill ``ranges`` of ``view`` (all of it by default) from ``sock``, in order, at
    most :data:`RECV_LOWAT` bytes at a time, each checked by ``verifier`` while it is in
    the cache; ``timeout`` bounds each wait for the next :data:`RECV_LOWAT` bytes (or
    the rest, when fewer are left), ``deadline`` (monotonic time) the whole."""
    n = sum(end - start for start, end in ranges) if ranges is not None else len(view)
    got = 0
    lowat = 1
    try:
        sock.settimeout(timeout)
        for start, end in ranges if ranges is not None else [(0, len(view))]:
            at = start
            while at < end:
                want = min(RECV_LOWAT, end - at)
                if want != lowat:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    lowat = want
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ReplicationError(f"data too slow: {got} of {n} bytes by the "
                                               "push's deadline")
                    sock.settimeout(min(timeout, left))
                k = sock.recv_into(view[at:end], want)
                if k == 0:
                    raise _Broken(f"truncated data: peer closed after {got} of {n} bytes")
                at += k
                got += k
                verifier.advance(at)
        if lowat != 1:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
    except TimeoutError:
        if deadline is not None and time.monotonic() >= deadline:
            raise ReplicationError(f"data too slow: {got} of {n} bytes by the push's "
                                   "deadline") from None
        raise ReplicationError(f"data stalled for {timeout} s after {got} of {n} bytes") from None
    except OSError as exc:
        raise _Broken(f"connection lost after {got} of {n} data bytes: {exc}") from None


def _offset(pace: Callable[[int], None] | None, base: int) -> Callable[[int], None] | None:
    """``pace`` for a part of a push that begins ``base`` bytes into it."""
    return None if pace is None else lambda sent: pace(base + sent)


def _send_file(sock: socket.socket, fd: int, offset: int, count: int, timeout: float, *,
               pace: Callable[[int], None] | None = None) -> None:
    """Send ``count`` bytes of file ``fd`` from ``offset`` with ``os.sendfile``, calling
    ``pace`` (which may wait) with the bytes sent so far before each chunk and at the end."""
    sent = 0
    try:
        sock.settimeout(timeout)  # the descriptor is non-blocking from here on
        out = sock.fileno()
        poller = select.poll()
        poller.register(out, select.POLLOUT)
        while sent < count:
            if pace is not None:
                pace(sent)
            try:
                k = os.sendfile(out, fd, offset + sent, min(count - sent, SEND_CHUNK))
            except BlockingIOError:
                if not poller.poll(timeout * 1000):
                    raise ReplicationError(f"peer stopped reading for {timeout} s after "
                                           f"{sent} of {count} bytes") from None
                continue
            if k == 0:
                raise ReplicationError(f"slot file ended after {sent} of {count} data bytes")
            sent += k
        if pace is not None:
            pace(sent)  # the last chunk counts too: a rate holds for the whole push
    except OSError as exc:
        raise _Broken(f"connection lost after {sent} of {count} data bytes: {exc}") from None


def _need(data_len: int, meta_len: int) -> int:
    """Bytes a slot needs to hold ``data_len`` data and ``meta_len`` metadata bytes."""
    return memory.HEADER_SIZE + (data_len + memory.ALIGN - 1) // memory.ALIGN * memory.ALIGN + meta_len


class _Channel:
    """An authenticated connection: sealed control frames, and raw data in between."""

    def __init__(self, sock: socket.socket, key: bytes, *, outgoing: bytes, incoming: bytes,
                 timeout: float) -> None:
        self.sock = sock
        self.timeout = timeout
        self._key = key
        self._out = outgoing
        self._in = incoming
        self._sent = 0
        self._received = 0

    def send(self, message: dict[str, Any], blob: bytes = b"") -> None:
        frame = seal_frame(self._key, self._out, self._sent, message, blob)
        self._sent += 1
        _sendall(self.sock, frame, self.timeout)

    def recv(self, *, idle: float | None = None) -> tuple[dict[str, Any], bytes]:
        head = _recv_exact(self.sock, FRAME.size, self.timeout, boundary=True, idle=idle)
        json_len, blob_len = frame_lengths(head)
        rest = _recv_exact(self.sock, json_len + blob_len + MAC_SIZE, self.timeout)
        message, blob = open_frame(self._key, self._in, self._received, head + rest)
        self._received += 1
        return message, blob

    def close(self) -> None:
        self.sock.close()


def _connect(address: tuple[str, int], *, secret: bytes, run_id: str, timeout: float,
             opened: Callable[[socket.socket], None] | None = None) -> _Channel:
    """Open and authenticate a connection to the server at ``address``; ``opened`` is
    given the socket before it connects (to abort the connection or its handshake from
    another thread: Linux's shutdown() ends a connect() in progress too)."""
    peer = f"{address[0]}:{address[1]}"
    sock = _open_socket(address, timeout, opened)
    try:
        client_nonce = secrets.token_bytes(NONCE_SIZE)
        _sendall(sock, HELLO.pack(MAGIC, client_nonce, run_tag(run_id)), timeout)
        server_nonce = parse_welcome(_recv_exact(sock, WELCOME.size, timeout))
        _sendall(sock, derive(secret, CLIENT_PROOF, run_id, client_nonce, server_nonce), timeout)
        proof = _recv_exact(sock, MAC_SIZE, timeout)
        expected = derive(secret, SERVER_PROOF, run_id, client_nonce, server_nonce)
        if not hmac.compare_digest(proof, expected):
            raise ReplicationError(f"{peer} failed authentication (another secret or run id)")
        key = derive(secret, SESSION, run_id, client_nonce, server_nonce)
        channel = _Channel(sock, key, outgoing=TO_SERVER, incoming=TO_CLIENT, timeout=timeout)
        parse_reply(channel.recv()[0])
        return channel
    except _Broken as exc:
        sock.close()
        raise ReplicationError(f"{peer} closed the connection during authentication "
                               f"(another secret or run id?): {exc}") from None
    except BaseException:
        sock.close()
        raise


def _open_socket(address: tuple[str, int], timeout: float,
                 opened: Callable[[socket.socket], None] | None) -> socket.socket:
    """A TCP connection to ``address`` (each of its addresses in turn, as
    ``socket.create_connection``), handed to ``opened`` before it connects."""
    peer = f"{address[0]}:{address[1]}"
    failure: OSError | None = None
    try:
        found = socket.getaddrinfo(address[0], address[1], 0, socket.SOCK_STREAM)
    except OSError as exc:
        raise ReplicationError(f"cannot connect to {peer}: {exc}") from None
    for family, kind, proto, _, sockaddr in found:
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            if opened is not None:
                opened(sock)
            sock.connect(sockaddr)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            sock.close()
            failure = exc
        except BaseException:
            sock.close()
            raise
    raise ReplicationError(f"cannot connect to {peer}: {failure}")


class _SourceFile:
    """The file behind a slot, opened read-only: its data is sent with ``os.sendfile``
    and its header page is mapped for the seqlock check, so both always see the same file
    even if the owner recreates the segment meanwhile."""

    def __init__(self, segment: memory.Segment) -> None:
        try:
            self.fd = memory.open_segment(segment.name, os.O_RDONLY)
        except StorageError as exc:
            raise ReplicationError(f"cannot open slot {segment.name}: {exc}") from None
        try:
            self.size = os.fstat(self.fd).st_size
            if self.size < memory.HEADER_SIZE:
                raise ReplicationError(f"slot {segment.name} is not a gemini slot")
            self.head = mmap.mmap(self.fd, memory.HEADER_SIZE, prot=mmap.PROT_READ)
        except OSError as exc:
            os.close(self.fd)
            raise ReplicationError(f"cannot map slot {segment.name}: {exc.strerror}") from None
        except BaseException:
            os.close(self.fd)
            raise
        self.name = segment.name

    def snapshot(self) -> tuple[memory.SlotHeader, bytes] | None:
        """The committed header and metadata, or None if the slot holds no committed step
        (or is being rewritten)."""
        header = memory.read_header(self.head)
        if not memory.committed(header):
            return None
        end = header.meta_offset + header.meta_len
        if (header.meta_offset < memory.HEADER_SIZE + header.data_len or end > self.size
                or header.meta_len > MAX_META):
            if not memory.unchanged(self.head, header):
                return None
            raise ReplicationError(f"slot {self.name} has an inconsistent header")
        try:
            meta = os.pread(self.fd, header.meta_len, header.meta_offset)
        except OSError as exc:
            raise ReplicationError(f"cannot read slot {self.name}: {exc.strerror}") from None
        if not memory.unchanged(self.head, header):
            return None
        if xxhash.xxh3_64_intdigest(meta) != header.meta_hash:
            raise ReplicationError(f"slot {self.name}: metadata checksum mismatch")
        return header, meta

    def unchanged(self, header: memory.SlotHeader) -> bool:
        return memory.unchanged(self.head, header)

    def close(self) -> None:
        self.head.close()
        os.close(self.fd)


# -- server ---------------------------------------------------------------------------

def _committed(segment: memory.Segment) -> memory.SlotHeader | None:
    """The header of the step ``segment`` holds committed, or None."""
    try:
        header = memory.read_header(segment.view)
    except (ValueError, StorageError):  # unmapped meanwhile (a regrow), or torn
        return None
    return header if memory.committed(header) else None


class Server:
    """Serves PUT and GET to authenticated peers: one accept thread, one thread per
    connection. A rejected connection (failed authentication, malformed or oversized
    frame, bad MAC, bad request, stall, data that fails verification) is logged, reported
    to ``on_reject(peer, reason)`` and closed; it never changes a committed slot. Each
    replica committed is reported to ``on_replica(rank, step)`` before the pusher is told.
    Callbacks run on connection threads and must be quick."""

    def __init__(self, slots: SlotSource, *, secret: bytes, run_id: str,
                 host: str = "127.0.0.1", port: int = 0,
                 on_reject: Callable[[str, str], None] | None = None,
                 on_replica: Callable[[int, int], None] | None = None,
                 timeout: float = 30.0, handshake_timeout: float = 2.0,
                 idle_timeout: float = 600.0, max_connections: int = 64, nice: int = 0,
                 admission: Admission | None = None, min_rate: float = MIN_PUSH_RATE,
                 push_grace: float = PUSH_GRACE) -> None:
        """Listen on ``host:port`` (0: any free port, see :attr:`address`). ``timeout``
        bounds every wait once a frame or the data has started, ``handshake_timeout`` the
        whole handshake, ``idle_timeout`` the wait for a client's next request; a connection
        thread that receives pushes runs at niceness ``nice`` (see :func:`lower_priority`),
        one that serves pulls (a host restoring) at full priority. ``admission`` says which
        pushes are taken (see :attr:`admission`); a push's data must arrive within
        ``push_grace`` seconds plus its bytes at ``min_rate`` bytes/s, so that no slow
        sender holds a rank's replica slots for long."""
        check_secret(secret)
        self.slots = slots
        self.run_id = run_id
        self.timeout = timeout
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.nice = nice
        self._secret = secret
        self._on_reject = on_reject
        self._on_replica = on_replica
        self.round = ""
        """The replication round this host is in: pushes from another one are refused."""
        self.admission = admission
        """Which pushes are taken (:class:`Admission`); None takes every push of a rank
        below its world size (tools and tests: a supervisor always sets one)."""
        self.peers: frozenset[str] = frozenset()
        """The source addresses of the round's members: connections from them have
        handshake room of their own (see :meth:`_refusal`)."""
        self.min_rate = min_rate
        self.push_grace = push_grace
        self._lock = threading.Lock()
        self._rank_locks: dict[int, threading.Lock] = {}
        self._reuse = reuse.HeldBytes(slots)
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._authenticating: dict[str, int] = {}  # source address -> connections
        self._authenticated: dict[socket.socket, str] = {}  # connection -> source address
        self._idle: dict[socket.socket, float] = {}  # authenticated, between requests: since
        self._reports: dict[str, tuple[float, int, int]] = {}  # source -> (since, told, quiet)
        self._reported: tuple[float, int, int] = (0.0, 0, 0)  # all sources: the same
        self._closed = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._sock = socket.create_server((host, port), family=family, backlog=64)
        except OSError as exc:
            raise ReplicationError(f"cannot listen on {host}:{port}: {exc}") from None
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"gemini-transport-{self.address[1]}")
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, drop every connection and join the threads (idempotent)."""
        with self._lock:
            self._closed = True
            threads = list(self._conns.values())
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=self.timeout)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                logger.warning("transport: accept failed: %s", exc)
                time.sleep(0.1)
                continue
            peer, source = f"{addr[0]}:{addr[1]}", str(addr[0])
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                refused = self._refusal(source)
                if refused is None:
                    self._authenticating[source] = self._authenticating.get(source, 0) + 1
                    thread = threading.Thread(target=self._serve, args=(conn, peer, source),
                                              daemon=True, name=f"gemini-transport-{peer}")
                    self._conns[conn] = thread
                    thread.start()  # under the lock: close() never joins an unstarted thread
            if refused is not None:
                conn.close()
                self._reject(peer, refused)

    def _refusal(self, source: str) -> str | None:
        """Why a new connection from ``source`` is refused (under the lock), or None. Peers
        that have not proven the secret yet have their own budget, per source and in all,
        so that they can never crowd out the authenticated ones; the round's members
        (:attr:`peers`) have room of their own beside the strangers' (a flood from many
        addresses fills only the strangers' budget)."""
        if source not in self.peers and sum(
                n for s, n in self._authenticating.items() if s not in self.peers
        ) >= MAX_AUTHENTICATING:
            return f"too many connections still authenticating ({MAX_AUTHENTICATING})"
        if self._authenticating.get(source, 0) >= MAX_AUTHENTICATING_PER_SOURCE:
            return (f"too many connections from {source} still authenticating "
                    f"({MAX_AUTHENTICATING_PER_SOURCE})")
        return None

    def _room(self, conn: socket.socket, source: str) -> str | None:
        """Make room for a connection from ``source`` that just authenticated (under the
        lock): at most :data:`MAX_CONNECTIONS_PER_SOURCE` from one address and
        :attr:`max_connections` in all. When full, the connection idle the longest (of
        this source, else of the source with the most) is closed: a peer that left
        connections idle, or reconnects, is never locked out by them; a client whose idle
        connection is closed opens a new one. Why none could be made, or None."""
        mine = [c for c, s in self._authenticated.items() if s == source]
        if len(mine) >= MAX_CONNECTIONS_PER_SOURCE:
            victims = mine
        elif len(self._authenticated) >= self.max_connections:
            counts: dict[str, int] = {}
            for s in self._authenticated.values():
                counts[s] = counts.get(s, 0) + 1
            most = max(counts.values())
            victims = [c for c, s in self._authenticated.items() if counts[s] == most]
        else:
            victims = []
        if victims:
            idle = [c for c in victims if c in self._idle]
            if not idle:
                return (f"too many connections from {source} ({MAX_CONNECTIONS_PER_SOURCE})"
                        if victims is mine else f"too many connections ({self.max_connections})")
            oldest = min(idle, key=self._idle.__getitem__)
            del self._authenticated[oldest], self._idle[oldest]
            try:
                oldest.shutdown(socket.SHUT_RDWR)  # its thread sees a clean close
            except OSError:
                pass
        self._authenticated[conn] = source
        return None

    def _reject(self, peer: str, reason: str) -> None:
        """Log and report a rejection: at most :data:`REPORTS_PER_SOURCE` per source
        address and :data:`REPORTS_TOTAL` in all every :data:`REPORT_INTERVAL` seconds;
        the next one reported says how many were not. The table of sources is pruned
        every interval and holds at most :data:`MAX_REPORT_SOURCES` (the others count
        against the total only)."""
        source, now = peer.rpartition(":")[0], time.monotonic()
        with self._lock:
            since, told, quiet = self._reported
            if now - since >= REPORT_INTERVAL:
                since, told = now, 0
                self._reports = {s: r for s, r in self._reports.items()
                                 if now - r[0] < REPORT_INTERVAL}
            first, told_source, _ = self._reports.get(source, (now, 0, 0))
            if now - first >= REPORT_INTERVAL:
                first, told_source = now, 0
            known = source in self._reports or len(self._reports) < MAX_REPORT_SOURCES
            if told >= REPORTS_TOTAL or told_source >= REPORTS_PER_SOURCE or not known:
                self._reported = (since, told, quiet + 1)
                return
            self._reported = (since, told + 1, 0)
            self._reports[source] = (first, told_source + 1, 0)
        if quiet:
            reason += f" (and {quiet} more rejections not reported)"
        logger.warning("transport: rejected %s: %s", peer, reason)
        if self._on_reject is not None:
            try:
                self._on_reject(peer, reason)
            except Exception:
                logger.exception("transport: on_reject callback failed")

    # Complexity above 10: one connection's states, in order.
    def _serve(self, conn: socket.socket, peer: str, source: str) -> None:  # noqa: C901
        lowered = False
        try:
            try:
                try:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError as exc:
                    raise _Broken(f"connection lost: {exc}", clean=True) from None
                channel = self._authenticate(conn)
            finally:
                with self._lock:
                    left = self._authenticating.get(source, 1) - 1
                    if left:
                        self._authenticating[source] = left
                    else:
                        self._authenticating.pop(source, None)
            with self._lock:
                full = self._room(conn, source)
            if full is not None:
                self._try_reply(channel, {"ok": False, "error": full})
                raise ReplicationError(full)
            while not self._closed:
                with self._lock:
                    if conn not in self._authenticated:  # closed to make room
                        return
                    self._idle[conn] = time.monotonic()
                try:
                    message, blob = channel.recv(idle=self.idle_timeout)
                except _Idle:
                    logger.debug("transport: closing idle connection from %s", peer)
                    return
                finally:
                    with self._lock:
                        self._idle.pop(conn, None)
                try:
                    request = parse_request(message, blob, run_id=self.run_id)
                except ReplicationError as exc:
                    self._try_reply(channel, {"ok": False, "error": f"bad request: {exc}"})
                    raise ReplicationError(f"bad request: {exc}") from None
                if isinstance(request, PingRequest):  # answered at full priority
                    channel.send({"ok": True, "round": self.round})
                    continue
                if isinstance(request, PutRequest):
                    if not lowered:  # replication's pushes: at its priority, from here on
                        lowered = True
                        lower_priority(self.nice)
                    self._put(channel, request, peer)
                else:  # a pull restores a host now: at full priority
                    self._get(channel, request)
        except ReplicationError as exc:
            if self._closed:
                logger.debug("transport: dropped %s on close: %s", peer, exc)
            elif not (isinstance(exc, _Broken) and exc.clean):
                self._reject(peer, str(exc))
        except Exception:  # a bug: keep the server up, say where
            logger.exception("transport: unexpected error serving %s", peer)
        finally:
            with self._lock:
                self._authenticated.pop(conn, None)
                self._idle.pop(conn, None)
                self._conns.pop(conn, None)
                conn.close()

    def _authenticate(self, conn: socket.socket) -> _Channel:
        deadline = time.monotonic() + self.handshake_timeout

        def left() -> float:
            return max(deadline - time.monotonic(), 0.001)

        # a close before the first byte (a port probe) is clean: not reported
        hello = _recv_exact(conn, HELLO.size, left(), boundary=True)
        client_nonce = parse_hello(hello, run_id=self.run_id)
        server_nonce = secrets.token_bytes(NONCE_SIZE)
        _sendall(conn, WELCOME.pack(MAGIC, server_nonce), left())
        try:
            answer = _recv_exact(conn, MAC_SIZE, left())
        except _Broken as exc:
            raise ReplicationError(f"authentication failed: client hung up ({exc}); it "
                                   f"probably has another secret or run id") from None
        expected = derive(self._secret, CLIENT_PROOF, self.run_id, client_nonce, server_nonce)
        if not hmac.compare_digest(answer, expected):
            raise ReplicationError("authentication failed: bad client proof (another secret?)")
        _sendall(conn, derive(self._secret, SERVER_PROOF, self.run_id, client_nonce,
                              server_nonce), left())
        key = derive(self._secret, SESSION, self.run_id, client_nonce, server_nonce)
        channel = _Channel(conn, key, outgoing=TO_CLIENT, incoming=TO_SERVER, timeout=self.timeout)
        channel.send({"ok": True, "run_id": self.run_id})
        return channel

    @staticmethod
    def _try_reply(channel: _Channel, message: dict[str, Any]) -> None:
        try:
            channel.send(message)
        except ReplicationError:
            pass

    def _admit(self, request: PutRequest) -> str | None:
        """Why a push is refused before anything is allocated or pinned, or None."""
        admission = self.admission
        if admission is None:
            if request.round and self.round and request.round != self.round:
                return f"push from round {request.round}, but this host is in round {self.round}"
            return None
        newest = max((h.step for segments in self.slots.segments().values() for seg in segments
                      if (h := _committed(seg)) is not None), default=-1)
        refused = admission.refusal(request, newest)
        if refused is not None:
            return refused
        own = self.slots.own_slot_bytes()
        size = memory.slot_size(request.header.data_len, len(request.meta))
        if size > REPLICA_SLACK * own:
            return (f"a replica of rank {request.header.rank} would take {size} bytes, more than "
                    f"{REPLICA_SLACK} x this host's own slots ({own} bytes)")
        return None

    def _rank_lock(self, rank: int) -> threading.Lock:
        with self._lock:
            return self._rank_locks.setdefault(rank, threading.Lock())

    def _held(self, header: memory.SlotHeader) -> bool:
        """Whether this host already holds exactly the slot ``header`` describes."""
        segment = self.slots.find(header.rank, header.step)
        if segment is None:
            return False
        try:
            held = memory.read_header(segment.view)
        except StorageError:
            return False
        return (memory.committed(held) and held.seq == header.seq
                and held.meta_hash == header.meta_hash and held.data_len == header.data_len)

    # Complexity above 10: one check per reason to refuse a push.
    def _put(self, channel: _Channel, request: PutRequest, peer: str) -> None:  # noqa: C901
        header = request.header
        refused = self._admit(request)
        if refused is not None:
            channel.send({"ok": False, "error": refused})
            return
        lock = self._rank_lock(header.rank)
        if not lock.acquire(timeout=self.timeout):
            channel.send({"ok": False, "error": f"rank {header.rank} is busy receiving"})
            return
        try:
            if request.keep >= 0:
                self.slots.pin(header.rank, request.keep)
            if self._held(header):
                channel.send({"ok": True, "have": True})
                return
            need = _need(header.data_len, len(request.meta))
            try:
                segment = self.slots.write_target(
                    header.rank, memory.slot_size(header.data_len, len(request.meta)), replica=True)
                too_small = segment.size < need
                buf = segment.view
            except StorageError as exc:
                logger.warning("transport: no slot for rank %d from %s: %s", header.rank, peer, exc)
                channel.send({"ok": False, "error": f"no slot for rank {header.rank}: {exc}"})
                return
            if too_small:
                channel.send({"ok": False, "error": f"slot {segment.name} is smaller than {need}"})
                return
            try:
                verifier = memory.stream_verifier(buf, header, request.meta)
            except CheckpointError as exc:
                self._try_reply(channel, {"ok": False, "error": f"bad metadata: {exc}"})
                raise ReplicationError(f"rank {header.rank} step {header.step}: bad metadata: "
                                       f"{exc}") from None
            skip, covered = reuse.skipped(verifier.ranges(), self._reuse.fill(buf, header, verifier))
            verifier.trust(covered)
            channel.send({"ok": True, "skip": [list(r) for r in skip]} if skip else {"ok": True})
            ranges = reuse.complement(skip, header.data_len) if skip else None
            wanted = sum(end - start for start, end in ranges) if ranges is not None \
                else header.data_len
            # the whole data within a deadline: a trickle would keep the rank's lock
            deadline = time.monotonic() + self.push_grace + wanted / self.min_rate
            with memoryview(buf) as whole, \
                    whole[memory.HEADER_SIZE:memory.HEADER_SIZE + header.data_len] as data:
                _recv_data(channel.sock, data, self.timeout, verifier, ranges,
                           deadline=deadline)
            stable = parse_trailer(channel.recv()[0])
            if not stable:
                channel.send({"ok": True, "aborted": True})
                logger.info("transport: %s aborted rank %d step %d (its slot changed)", peer,
                            header.rank, header.step)
                return
            try:
                memory.commit_received(buf, header, request.meta, verifier)
            except (CheckpointError, StorageError, RecursionError) as exc:
                self._try_reply(channel, {"ok": False, "error": f"verification failed: {exc}"})
                raise ReplicationError(f"rank {header.rank} step {header.step} failed "
                                       f"verification: {exc}") from None
            logger.debug("transport: replica of rank %d step %d from %s", header.rank,
                         header.step, peer)
            if self._on_replica is not None:  # before the pusher hears of it
                try:
                    self._on_replica(header.rank, header.step)
                except Exception:
                    logger.exception("transport: on_replica callback failed")
            channel.send({"ok": True, "step": header.step})
        finally:
            lock.release()

    def _get(self, channel: _Channel, request: GetRequest) -> None:
        missing = {"ok": False, "error": f"rank {request.rank} step {request.step} is not held here"}
        segment = self.slots.find(request.rank, request.step)
        if segment is None:
            channel.send(missing)
            return
        try:
            source = _SourceFile(segment)
        except ReplicationError as exc:
            channel.send({"ok": False, "error": str(exc)})
            return
        try:
            snapshot = source.snapshot()
            if snapshot is None or snapshot[0].rank != request.rank or snapshot[0].step != request.step:
                channel.send(missing)
                return
            header, meta = snapshot
            channel.send({"ok": True, **slot_message(header, self.run_id)}, meta)
            _send_file(channel.sock, source.fd, memory.HEADER_SIZE, header.data_len, self.timeout)
            channel.send({"op": "end", "stable": source.unchanged(header)})
        finally:
            source.close()


# -- client ---------------------------------------------------------------------------

class Client:
    """One authenticated connection to a peer's :class:`Server` (thread-safe: operations
    take turns). A connection found broken is reopened once per operation."""

    def __init__(self, address: tuple[str, int], *, secret: bytes, run_id: str,
                 timeout: float = 30.0) -> None:
        check_secret(secret)
        self.address = address
        self.run_id = run_id
        self.timeout = timeout
        self._secret = secret
        self._lock = threading.Lock()
        self._channel: _Channel | None = None
        self._opening: socket.socket | None = None  # a connection in its handshake
        self._closes = 0  # close() calls: an operation that sees one fail does not retry
        self.sent = 0
        """Data bytes pushed so far."""
        self.skipped = 0
        """Data bytes the peers already held, so not pushed (see :mod:`launcher.replication.reuse`)."""

    @property
    def peer(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def close(self) -> None:
        """Close the connection (idempotent), at once: an operation in flight fails now
        instead of waiting out its timeout on a peer that stopped reading (a frozen host);
        a later operation opens a new connection."""
        self._closes += 1
        channel = self._channel
        for sock in (self._opening, None if channel is None else channel.sock):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        with self._lock:
            self._drop()

    def _open(self, timeout: float) -> _Channel:
        """A new connection (under the lock); a close() while it connects (a peer
        that drops the connection request: a frozen or cut-off host) or during its
        handshake (one that accepts but never answers: a stopped server) aborts it at
        once."""
        closes = self._closes

        def opened(sock: socket.socket) -> None:
            self._opening = sock
            if self._closes != closes:
                raise ReplicationError(f"{self.peer}: closed while connecting")

        try:
            return _connect(self.address, secret=self._secret, run_id=self.run_id,
                            timeout=timeout, opened=opened)
        finally:
            self._opening = None

    def _drop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _call(self, op: Callable[[_Channel], Any]) -> Any:
        closes = self._closes
        with self._lock:
            for attempt in range(2):
                reused = self._channel is not None
                if self._channel is None:
                    self._channel = self._open(self.timeout)
                try:
                    return op(self._channel)
                except Refused:
                    raise
                except _Broken as exc:
                    self._drop()
                    if reused and attempt == 0 and self._closes == closes:
                        logger.debug("transport: reconnecting to %s: %s", self.peer, exc)
                        continue
                    raise ReplicationError(f"{self.peer}: {exc}") from None
                except BaseException:
                    self._drop()
                    raise
            raise AssertionError("unreachable")

    def push(self, segment: memory.Segment, *, pace: Callable[[int], None] | None = None,
             keep: int = -1, round_id: str = "",
             expect: memory.SlotHeader | None = None) -> int | None:
        """Send the committed step ``segment`` holds to the peer, which verifies and
        commits it in a replica slot; return that step. Return None without sending when
        the slot holds no committed step, and None after sending when the slot changed
        meanwhile (the peer discards it). ``pace`` is called before each chunk of the
        data with the bytes sent so far, and may wait (see ``replication.service``);
        ``keep`` is the step whose replica the peer must keep (the run's s*); a peer in
        another round than ``round_id`` refuses the push. With ``expect``, only the
        commit that header describes is sent (None if the slot holds another)."""
        source = _SourceFile(segment)
        try:
            snapshot = source.snapshot()
            if snapshot is None or expect is not None and (
                    snapshot[0].seq, snapshot[0].step) != (expect.seq, expect.step):
                return None
            header, meta = snapshot
            if header.run_id != header_run_id(self.run_id):
                raise ReplicationError(f"slot {segment.name} belongs to run {header.run_id!r}")
            if len(meta) > MAX_META or header.data_len > MAX_DATA:
                raise ReplicationError(f"slot {segment.name} is too large to send")
            result: int | None = self._call(
                lambda ch: self._push(ch, source, header, meta, pace, keep, round_id))
            return result
        finally:
            source.close()

    def _push(self, channel: _Channel, source: _SourceFile, header: memory.SlotHeader,
              meta: bytes, pace: Callable[[int], None] | None, keep: int,
              round_id: str) -> int | None:
        channel.send({"op": "put", **slot_message(header, self.run_id), "keep": keep,
                      "round": round_id}, meta)
        reply = parse_reply(channel.recv()[0])
        if reply.get("have") is True:
            return header.step
        skip = parse_skip(reply, header.data_len)
        sent = 0
        for start, end in reuse.complement(skip, header.data_len):
            _send_file(channel.sock, source.fd, memory.HEADER_SIZE + start, end - start,
                       self.timeout, pace=_offset(pace, sent))
            sent += end - start
        self.sent += sent
        self.skipped += header.data_len - sent
        stable = source.unchanged(header)
        channel.send({"op": "end", "stable": stable})
        reply = parse_reply(channel.recv()[0])
        if not stable:
            return None
        if reply.get("step") != header.step:
            raise ReplicationError(f"{self.peer} did not confirm step {header.step}")
        return header.step

    def ping(self, timeout: float) -> str:
        """A heartbeat: the peer's replication round, within ``timeout`` seconds (opening
        the connection included; no second try); raises ReplicationError when none comes."""
        with self._lock:
            try:
                if self._channel is None:
                    self._channel = self._open(timeout)
                channel = self._channel
                channel.timeout = timeout
                channel.send({"op": "ping"})
                round_id = parse_reply(channel.recv()[0]).get("round", "")
                channel.timeout = self.timeout
                return str(round_id)
            except BaseException:
                self._drop()
                raise

    def pull(self, rank: int, step: int, target: Callable[[int], memory.Segment]) -> memory.SlotHeader:
        """Fetch committed ``step`` of ``rank`` from the peer into ``target(nbytes)`` (a
        WRITING slot of at least ``nbytes``), verify and commit it; return its header.
        Raises ReplicationError when the peer lacks it, its slot changed while sending,
        or the bytes fail verification (the target then stays WRITING)."""
        if type(rank) is not int or type(step) is not int or rank < 0 or step < 0:
            raise ReplicationError(f"invalid rank {rank!r} or step {step!r}")
        result: memory.SlotHeader = self._call(lambda ch: self._pull(ch, rank, step, target))
        return result

    def _pull(self, channel: _Channel, rank: int, step: int,
              target: Callable[[int], memory.Segment]) -> memory.SlotHeader:
        channel.send({"op": "get", "rank": rank, "step": step})
        message, meta = channel.recv()
        header = parse_slot_reply(message, meta, run_id=self.run_id, rank=rank, step=step)
        segment = target(memory.slot_size(header.data_len, len(meta)))
        need = _need(header.data_len, len(meta))
        if segment.size < need:
            raise ReplicationError(f"target slot {segment.name} has {segment.size} bytes, "
                                   f"needs {need}")
        buf = segment.view
        try:
            verifier = memory.stream_verifier(buf, header, meta)
            with memoryview(buf) as whole, \
                    whole[memory.HEADER_SIZE:memory.HEADER_SIZE + header.data_len] as data:
                _recv_data(channel.sock, data, self.timeout, verifier)
            if not parse_trailer(channel.recv()[0]):
                raise Refused(f"{self.peer}'s slot of rank {rank} step {step} changed while "
                               "sending")
            memory.commit_received(buf, header, meta, verifier)
        except (CheckpointError, StorageError, RecursionError) as exc:
            raise Refused(f"rank {rank} step {step} from {self.peer} failed verification: "
                           f"{exc}") from None
        committed = memory.read_header(buf)
        if committed is None:
            raise ReplicationError(f"target slot {segment.name} lost its header")
        return committed
