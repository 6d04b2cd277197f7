"""The coordination store on an etcd v3 cluster (``etcd://HOST:PORT[,HOST:PORT...]``): see
:mod:`launcher.store`."""

from __future__ import annotations

import functools
import importlib
import logging
import math
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from launcher.errors import ConfigError, StoreError, StoreUnavailableError, StoreUncertainError
from launcher.store import (
    KEY_PREFIX,
    EtcdCredentials,
    KeepAlive,
    Lease,
    StoreLease,
    Watch,
    WatchCallback,
    _check_key,
    _check_ttl,
    _one_line,
    _outage_of,
    _prefix_end,
    _StoreBase,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_GRPC_OPTIONS = [
    # ``gemini status`` reads whole runs in one response; gRPC's default cap is 4 MiB.
    ("grpc.max_receive_message_length", 512 << 20),
    # Reconnect within a second of etcd coming back (the default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Notice a vanished peer under a long-lived watch (etcd allows pings every 5 s).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


def _parse_endpoint(text: str) -> tuple[str, int]:
    spec = text.strip()
    if spec.startswith("http://"):
        spec = spec[len("http://"):]
    if "://" in spec:
        raise ConfigError(f"etcd endpoint {text!r}: only plain http endpoints are supported")
    spec = spec.rstrip("/")
    host, sep, port = spec.rpartition(":")
    if not sep or host.endswith(":") or spec.endswith("]"):  # no port (IPv6 in brackets)
        host, port = spec, "2379"
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"etcd endpoint {text!r} is not HOST:PORT ([ADDRESS]:PORT for IPv6)")
    return host, int(port)


@functools.cache
def _grpc() -> Any:
    # gRPC's C core prints its own view of every failed connection (a refused TLS
    # handshake: four lines) to stderr; gemini reports the failure itself, in one line.
    # It reads the variable once; the workers' environment stays as it was.
    quiet = "GRPC_VERBOSITY" not in os.environ
    if quiet:
        os.environ["GRPC_VERBOSITY"] = "NONE"
    try:
        grpc = importlib.import_module("grpc")
        grpc.insecure_channel("127.0.0.1:1").close()  # initialises the core
    finally:
        if quiet:
            del os.environ["GRPC_VERBOSITY"]
    return grpc


class EtcdStore(_StoreBase):
    """A :class:`Store` on an etcd v3 cluster (via ``pyetcd``, from ``etcd-sdk-python``).

    ``endpoints`` are ``host:port`` strings of members of one cluster. A call goes to the
    endpoint that answered last; if that one cannot be reached, to the next, each with a
    deadline of ``timeout`` seconds, shortened to a quarter of a short outage window (not
    below 1 s) so that giving up does not overrun the window by much. When none answers,
    the call is retried with exponential backoff and jitter until the cluster answers or
    ``outage`` seconds have passed since the outage began (0: give up at once); then it
    raises
    :class:`~launcher.errors.StoreUnavailableError`. A compare-and-set that timed out
    is not retried (it may have been applied): it raises
    :class:`~launcher.errors.StoreUncertainError` for the caller to read back. Opening the
    store checks that it answers, without waiting. Lease ttls are rounded up to whole
    seconds. ``credentials`` say how to authenticate to an etcd that asks (TLS, client
    certificates, users); a user's token is renewed when etcd stops accepting it.
    """

    def __init__(self, endpoints: Sequence[str], *, timeout: float = 5.0,
                 outage: float = 0.0, credentials: EtcdCredentials | None = None) -> None:
        self._grpc = _grpc()  # first: pyetcd imports gRPC
        import pyetcd

        if not endpoints:
            raise ConfigError("an etcd store needs at least one endpoint")
        if not timeout > 0:
            raise ConfigError(f"store timeout must be positive, not {timeout!r}")
        if not outage >= 0:
            raise ConfigError(f"store outage window must be >= 0, not {outage!r}")
        members = [_parse_endpoint(e) for e in endpoints]
        self.endpoints = [f"{host}:{port}" for host, port in members]
        self.timeout = min(timeout, max(1.0, outage / 4)) if outage > 0 else timeout
        self.outage = outage
        self._outage = _outage_of(self.endpoints)
        self._exceptions = importlib.import_module("pyetcd.exceptions")
        credentials = credentials or EtcdCredentials()
        tls = self._channel_credentials(credentials) if credentials.secure else None
        self._user = (credentials.user, credentials.password()) if credentials.user else None
        # One single-endpoint client per member. time_retry=0: pyetcd would otherwise
        # refuse to use an endpoint for 300 s after one failed call, so a client could
        # not reconnect after an etcd restart. Users authenticate on a client's first call
        # (through the outage handling here, unlike pyetcd's own, in its constructor).
        self._clients: list[Any] = [
            pyetcd.MultiEndpointEtcd3Client(
                endpoints=[pyetcd.Endpoint(host, port, secure=tls is not None, creds=tls,
                                           time_retry=0, opts=_GRPC_OPTIONS)],
                timeout=self.timeout)
            for host, port in members]
        self._current = 0
        self._lock = threading.RLock()
        self._closed = False
        self._watches: list[_EtcdWatch] = []
        self._keepalives: list[KeepAlive] = []
        # The probe reads a key under gemini's own prefix: an etcd user whose role is
        # limited to that prefix (least privilege) may read nothing else.
        probe = KEY_PREFIX.encode()
        try:
            self._call("connect", lambda c: c.get_response(probe, count_only=True),
                       patient=False)
        except StoreError:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"EtcdStore({','.join(self.endpoints)})"

    def _channel_credentials(self, credentials: EtcdCredentials) -> Any:
        def read(path: str, what: str) -> bytes | None:
            return credentials.read(path, what) if path else None

        return self._grpc.ssl_channel_credentials(
            root_certificates=read(credentials.cacert, "etcd CA certificate"),
            private_key=read(credentials.key, "etcd client key"),
            certificate_chain=read(credentials.cert, "etcd client certificate"))

    def _authenticate(self, client: Any) -> None:
        """Get a token for the configured user and send it with the client's calls (and
        its watches'). A plain-text channel carries it as metadata: gRPC call credentials
        would need TLS."""
        from pyetcd.etcdrpc import AuthenticateRequest

        assert self._user is not None
        name, password = self._user
        response = client.authstub.Authenticate(
            AuthenticateRequest(name=name, password=password), self.timeout)
        client.metadata = (("token", response.token),)
        watcher = client._stubs.get("watcher")
        if watcher is not None:  # pyetcd's watcher copied the old metadata
            watcher._metadata = client.metadata

    # -- the edge: every pyetcd call goes through here -------------------------------------
    def _call(self, what: str, fn: Callable[[Any], _T], *, retry_timeout: bool = True,
              patient: bool = True) -> _T:
        """``fn(client)`` on the first endpoint that answers, through an outage of up to
        the window when ``patient``; pyetcd and gRPC errors become StoreError. A timed-out
        call is not retried unless ``retry_timeout`` (its effect is unknown, which matters
        for compare-and-set)."""
        delay = 0.05
        while True:
            if self._closed:
                raise StoreError(f"{what}: the etcd store is closed")
            sent = time.monotonic()
            try:
                result = self._call_once(what, fn, retry_timeout)
            except _Unreachable as exc:
                if not (patient and self.outage > 0):
                    raise StoreError(str(exc)) from exc.__cause__
                lasted = self._outage.failed(str(exc), self.outage, sent)
                if exc.uncertain:
                    raise StoreUncertainError(str(exc)) from exc.__cause__
                if lasted >= self.outage:
                    raise StoreUnavailableError(
                        f"the coordination store {self._outage.name} has been unreachable "
                        f"for {lasted:.0f} s (--store-timeout {self.outage:g}): {exc}"
                    ) from exc.__cause__
                time.sleep(min(delay, self.outage - lasted) * random.uniform(0.5, 1.0))
                delay = min(1.0, delay * 2)
                continue
            self._outage.succeeded()
            return result

    def unreachable_within(self, seconds: float) -> bool:
        return self._outage.within(seconds)

    def _call_once(self, what: str, fn: Callable[[Any], _T], retry_timeout: bool) -> _T:
        grpc, exceptions = self._grpc, self._exceptions
        unreachable = (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError,
                       exceptions.NoServerAvailableError, exceptions.WatchTimedOut)
        first = self._current
        failures: list[str] = []
        cause: BaseException | None = None
        for i in range(len(self._clients)):
            index = (first + i) % len(self._clients)
            client = self._clients[index]
            try:
                if self._user is not None and client.metadata is None:
                    self._authenticate(client)
                try:
                    result = fn(client)
                except grpc.RpcError as exc:
                    if self._user is None or not _token_refused(exc):
                        raise
                    self._authenticate(client)  # the token expired, or etcd restarted
                    result = fn(client)
            except (exceptions.Etcd3Exception, grpc.RpcError) as exc:
                code = _grpc_code(exc)
                timed_out = code == grpc.StatusCode.DEADLINE_EXCEEDED
                if not (isinstance(exc, unreachable) or code == grpc.StatusCode.UNAVAILABLE
                        or timed_out):
                    raise StoreError(f"etcd {what} failed: {_describe(exc)}") from exc
                failures.append(f"{self.endpoints[index]}: {_describe(exc)}")
                cause = exc
                if timed_out and not retry_timeout:
                    raise _Unreachable(f"etcd {what} timed out: {'; '.join(failures)}",
                                       uncertain=True) from exc
                continue
            self._current = index
            return result
        raise _Unreachable(f"etcd unreachable ({what}): {'; '.join(failures)}") from cause

    # -- keys ------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        k = _check_key(key)
        value, _ = self._call("get", lambda c: c.get(k))
        return None if value is None else bytes(value)

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> None:
        k, v, lease_id = _check_key(key), bytes(value), lease.id if lease is not None else 0
        self._call("put", lambda c: c.put(k, v, lease=lease_id))

    def compare_and_set(self, key: str, expected: bytes | None, value: bytes, *,
                        lease: Lease | None = None) -> bool:
        k, v, lease_id = _check_key(key), bytes(value), lease.id if lease is not None else 0

        def txn(c: Any) -> bool:
            t = c.transactions
            compare = t.create(k) == 0 if expected is None else t.value(k) == bytes(expected)
            succeeded, _ = c.transaction(compare=[compare], success=[t.put(k, v, lease=lease_id)],
                                         failure=[])
            return bool(succeeded)

        return self._call("compare-and-set", txn, retry_timeout=False)

    def delete(self, key: str) -> bool:
        k = _check_key(key)
        return bool(self._call("delete", lambda c: c.delete(k)))

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        start, end = self._range(prefix)
        response = self._call("get-prefix", lambda c: c.get_range_response(start, end))
        return {kv.key.decode(): bytes(kv.value) for kv in response.kvs}

    @staticmethod
    def _range(prefix: str) -> tuple[bytes, bytes]:
        if not prefix:
            return b"\0", b"\0"  # etcd's "every key"
        start = prefix.encode()
        return start, _prefix_end(start) or b"\0"

    # -- leases ----------------------------------------------------------------------------
    def grant_lease(self, ttl: float) -> Lease:
        _check_ttl(ttl)
        granted = self._call("grant-lease", lambda c: c.lease(max(1, math.ceil(ttl))))
        return StoreLease(int(granted.id), float(granted.ttl), self)

    def _refresh_lease(self, lease_id: int) -> bool:
        responses = self._call("refresh-lease", lambda c: list(c.refresh_lease(lease_id)),
                               patient=False)  # KeepAlive retries, and must stop promptly
        if not responses:
            raise StoreError(f"etcd refresh-lease: no answer for lease {lease_id:x}")
        return int(responses[0].TTL) > 0

    def _revoke_lease(self, lease_id: int) -> None:
        grpc = self._grpc

        def revoke(c: Any) -> None:
            try:
                c.revoke_lease(lease_id)
            except grpc.RpcError as exc:
                if _grpc_code(exc) != grpc.StatusCode.NOT_FOUND:  # already gone
                    raise

        self._call("revoke-lease", revoke)

    # -- watches ---------------------------------------------------------------------------
    def watch_prefix(self, prefix: str, callback: WatchCallback) -> Watch:
        start, _ = self._range(prefix)
        header = self._call("watch", lambda c: c.get_response(start, count_only=True).header)
        watch = _EtcdWatch(self, prefix, callback, int(header.revision) + 1)
        with self._lock:
            self._watches = [w for w in self._watches if not w._cancelled.is_set()]
            self._watches.append(watch)
        return watch

    def _subscribe(self, prefix: str, start_revision: int,
                   deliver: Callable[[Any], None]) -> tuple[Any, int]:
        """Start a pyetcd watch; returns (client, watch id) for cancelling it."""
        start, end = self._range(prefix)

        def subscribe(c: Any) -> tuple[Any, int]:
            if self._user is not None:
                # etcd checks the token a watch stream starts with, and cancels its watches
                # in silence (for pyetcd) if it forgot it: start each with a fresh one.
                self._authenticate(c)
            return c, c.add_watch_callback(start, deliver, range_end=end,
                                           start_revision=start_revision)

        # patient=False: a broken watch resumes itself, and must cancel promptly
        return self._call("watch", subscribe, patient=False)

    # -- election --------------------------------------------------------------------------
    def campaign(self, election: str, candidate: str, lease: Lease) -> bool:
        k, me = _check_key(election), candidate.encode()

        def txn(c: Any) -> bool:
            t = c.transactions
            won, responses = c.transaction(compare=[t.create(k) == 0],
                                           success=[t.put(k, me, lease=lease.id)],
                                           failure=[t.get(k)])
            if won:
                return True
            held = responses[0] if responses else []
            return any(bytes(value) == me and meta.lease_id == lease.id for value, meta in held)

        return self._call("campaign", txn)

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        if not self._stop_children():
            return
        self._closed = True
        for client in self._clients:
            try:
                client.close()
            except Exception:  # closing a broken channel: nothing left to release
                logger.debug("closing an etcd client failed", exc_info=True)


class _Unreachable(Exception):
    """No endpoint answered one attempt of a call (``uncertain``: a write timed out)."""

    def __init__(self, message: str, *, uncertain: bool = False) -> None:
        super().__init__(message)
        self.uncertain = uncertain


def _grpc_code(exc: BaseException) -> Any:
    """The gRPC status code behind a pyetcd or gRPC exception, or None."""
    for candidate in (exc, exc.__context__):
        code = getattr(candidate, "code", None)
        if callable(code):
            return code()
    return None


def _token_refused(exc: BaseException) -> bool:
    """Whether etcd refused a user's token (expired, lost in a restart, or issued before
    a change of its users): a new one is needed."""
    grpc = _grpc()
    code = _grpc_code(exc)
    details = getattr(exc, "details", None)
    return code == grpc.StatusCode.UNAUTHENTICATED or (
        code == grpc.StatusCode.INVALID_ARGUMENT and callable(details)
        and "auth store is old" in str(details()))


def _describe(exc: BaseException) -> str:
    for candidate in (exc, exc.__context__):
        code, details = getattr(candidate, "code", None), getattr(candidate, "details", None)
        if callable(code) and callable(details):
            return _one_line(f"{code().name}: {details()}")
    return _one_line(str(exc) or type(exc).__name__)


class _EtcdWatch:
    """One etcd watch, resumed at the next revision whenever its stream breaks.

    pyetcd calls back on its own thread; responses go through a queue to this watch's
    thread, which calls the user's callback, so a slow callback never stalls pyetcd and
    a callback may use the store.
    """

    def __init__(self, store: EtcdStore, prefix: str, callback: WatchCallback,
                 start_revision: int) -> None:
        self._store = store
        self._prefix = prefix
        self._callback = callback
        self._next = start_revision
        self._queue: queue.Queue[tuple[int, Any]] = queue.Queue()
        self._generation = 0
        self._cancelled = threading.Event()
        self._subscription: tuple[Any, int] | None = None
        self._subscribe()
        self._thread = threading.Thread(target=self._run, name="gemini-watch", daemon=True)
        self._thread.start()

    def _subscribe(self) -> None:
        self._generation += 1
        generation = self._generation
        self._subscription = self._store._subscribe(
            self._prefix, self._next, lambda item: self._queue.put((generation, item)))

    def _unsubscribe(self) -> None:
        if self._subscription is not None:
            client, watch_id = self._subscription
            self._subscription = None
            try:
                client.cancel_watch(watch_id)
            except Exception:  # the stream is already gone
                logger.debug("cancelling an etcd watch failed", exc_info=True)

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        self._queue.put((-1, None))
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._unsubscribe()

    def _run(self) -> None:
        from pyetcd.events import DeleteEvent

        while not self._cancelled.is_set():
            generation, item = self._queue.get()
            if self._cancelled.is_set():
                return
            if generation != self._generation:
                continue  # left over from a stream that was replaced
            if item is None or isinstance(item, BaseException):
                self._resume(item)
                continue
            first = self._next
            for event in item.events:
                revision = int(event.mod_revision)
                if revision < first:
                    continue  # delivered before the stream was resumed
                self._next = revision + 1
                value = None if isinstance(event, DeleteEvent) else bytes(event.value)
                try:
                    self._callback(event.key.decode(), value)
                except Exception:
                    logger.exception("watch callback for prefix %r failed", self._prefix)

    def _resume(self, error: BaseException | None) -> None:
        logger.warning("etcd watch on %r broken (%s); resuming at revision %d", self._prefix,
                       _describe(error) if error is not None else "stream ended", self._next)
        self._unsubscribe()
        delay = 0.1
        while not self._cancelled.wait(delay):
            try:
                self._subscribe()
            except StoreError as exc:
                compacted = getattr(exc.__cause__, "compacted_revision", None)
                if isinstance(compacted, int) and compacted > self._next:
                    logger.warning("etcd compacted revisions %d..%d; changes under %r in "
                                   "between are lost", self._next, compacted - 1, self._prefix)
                    self._next = compacted
                    delay = 0.0
                    continue
                delay = min(1.0, delay * 2)
                continue
            logger.info("etcd watch on %r resumed", self._prefix)
            return

