"""The coordination store: keys, leases, compare-and-set, watches and leader election.

Supervisors publish who they are and what they hold under keys bound to their lease, so
that a lost host's keys vanish when its lease expires; one supervisor is elected root;
``gemini status`` reads a whole run with one prefix read. :class:`Store` is the small
protocol every part of gemini uses; two implementations fulfil it:

* :class:`EtcdStore` talks to an etcd v3 cluster (``etcd://host:port[,host:port...]``),
  for runs that span hosts. Every call has a deadline. A supervisor's store rides out an
  outage of the whole cluster (a restart, a hung or lost quorum) for up to an *outage
  window* (``--store-timeout``), retrying with backoff; past it a call raises
  :class:`~launcher.errors.StoreUnavailableError` instead of hanging. Outages are logged
  once when they begin and once when they end, and reported to :func:`watch_outages`.
* :class:`EmbeddedStore` keeps everything in one SQLite file (``embedded:///path.db``),
  the default for single-host runs: no server, and every process on the host that opens
  the same file sees the same keys.

Keys are ``str`` (compared and matched by prefix as UTF-8 bytes), values are ``bytes``.
:func:`open_store` turns a store URL into a store. Leases are kept alive with
:class:`KeepAlive`, which both stores hand out.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import os
import queue
import random
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol, TypeVar

from launcher.errors import ConfigError, StoreError, StoreUnavailableError, StoreUncertainError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Called with ``(key, value)`` for a put and ``(key, None)`` for a delete (or expiry).
WatchCallback = Callable[[str, bytes | None], None]

#: The forms :func:`open_store` accepts, for error messages and help texts.
STORE_URL_FORMS = "etcd://HOST:PORT[,HOST:PORT...], embedded:///PATH/TO/FILE.db or embedded://"

#: Keys whose last segment is this hold credentials (the run's replication secret): the
#: embedded store keeps their values out of its change log (watchers of such a key see
#: an empty value) and overwrites deleted bytes in its file.
PRIVATE_SEGMENT = "secret"

MAX_CREDENTIAL_FILE = 1 << 20  # bytes: a certificate, key or password file


@dataclass(frozen=True)
class EtcdCredentials:
    """How to prove who we are to an etcd that asks: TLS (``cacert`` verifies the server
    and turns TLS on; ``cert`` and ``key`` are a client certificate for etcd's
    ``--client-cert-auth``) and etcd's own users (``user`` with the password in
    ``password_file``; a password never goes on a command line). Empty fields are unused."""

    cacert: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password_file: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("an etcd client certificate needs both --store-cert and "
                              "--store-key")
        if (self.cert or self.key) and not self.cacert:
            raise ConfigError("an etcd client certificate needs --store-cacert (TLS)")
        if bool(self.user) != bool(self.password_file):
            raise ConfigError("etcd user authentication needs both --store-user and "
                              "--store-password-file")

    @property
    def secure(self) -> bool:
        return bool(self.cacert)

    def read(self, path: str, what: str) -> bytes:
        """The bytes of one credential file (bounded), or a ConfigError naming it."""
        try:
            with open(os.path.expanduser(path), "rb") as fh:
                data = fh.read(MAX_CREDENTIAL_FILE + 1)
        except OSError as exc:
            raise ConfigError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
        if not data or len(data) > MAX_CREDENTIAL_FILE:
            raise ConfigError(f"the {what} {path} is empty or larger than "
                              f"{MAX_CREDENTIAL_FILE} bytes")
        return data

    @classmethod
    def from_values(cls, values: Mapping[str, Any], prefix: str = "") -> EtcdCredentials:
        """The credentials in ``values`` under ``prefix + field name`` (missing: unused)."""
        return cls(**{f.name: str(values.get(prefix + f.name) or "") for f in fields(cls)})

    def password(self) -> str:
        text = self.read(self.password_file, "etcd password file")
        try:
            return text.decode().rstrip("\r\n")
        except UnicodeDecodeError:
            raise ConfigError(f"the etcd password file {self.password_file} is not UTF-8") from None


# -- the protocol --------------------------------------------------------------------------
class Lease(Protocol):
    """A time to live that keys can be bound to.

    Keys put with a lease disappear, for every reader, when the lease expires (nobody
    refreshed it for ``ttl`` seconds) or is revoked. Lease ids are meaningful to every
    client of the same store, so one process may put keys with another's lease.
    """

    @property
    def id(self) -> int:
        """The store's id of the lease."""
        ...

    @property
    def ttl(self) -> float:
        """Seconds the lease lives after a refresh, as granted (etcd rounds up to whole
        seconds and to its minimum, 2 s with default settings)."""
        ...

    def refresh(self) -> bool:
        """Restart the lease's time to live. False when the lease has already expired or
        was revoked (its keys are gone for good: grant a new one). Raises StoreError when
        the store cannot be reached."""
        ...

    def revoke(self) -> None:
        """End the lease now and delete its keys (idempotent)."""
        ...


class Watch(Protocol):
    """A running watch; its events arrive on a thread of its own, in store order."""

    def cancel(self) -> None:
        """Stop delivering events (idempotent; returns once no callback is running,
        unless called from the callback itself)."""
        ...


class Store(Protocol):
    """A consistent key-value store for coordinating the supervisors of a run.

    Every method is thread-safe, returns or raises within a bounded time (the store's
    timeout), and raises :class:`~launcher.errors.StoreError` for any failure of the
    store itself. A store is not to be shared across ``fork``.
    """

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None if it does not exist."""
        ...

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> None:
        """Set ``key`` to ``value``, bound to ``lease`` if given (else to no lease).
        Raises StoreError if ``lease`` has expired or was revoked."""
        ...

    def compare_and_set(self, key: str, expected: bytes | None, value: bytes, *,
                        lease: Lease | None = None) -> bool:
        """Atomically set ``key`` to ``value`` if its value is ``expected`` (None: if the
        key does not exist). True if the value was set."""
        ...

    def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        ...

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key that starts with ``prefix`` and its value, read in one consistent
        request (thousands of keys are fine: this is how ``gemini status`` reads a run)."""
        ...

    def grant_lease(self, ttl: float) -> Lease:
        """A new lease that expires ``ttl`` seconds from now unless refreshed."""
        ...

    def keep_alive(self, lease: Lease) -> KeepAlive:
        """Refresh ``lease`` on a daemon thread every ``ttl/3`` seconds until
        :meth:`KeepAlive.stop` (or :meth:`close`)."""
        ...

    def revoke_lease(self, lease_id: int) -> None:
        """End the lease with id ``lease_id``, whichever client holds it, and delete its
        keys (idempotent)."""
        ...

    def watch_prefix(self, prefix: str, callback: WatchCallback) -> Watch:
        """Call ``callback(key, value)`` for every later change of a key under ``prefix``:
        ``value`` is the new value of a put and None for a delete, a revocation or an
        expiry. Changes made after this returns are delivered exactly once and in order;
        the watch resumes by itself after the store was unreachable for a while."""
        ...

    def campaign(self, election: str, candidate: str, lease: Lease) -> bool:
        """Become the leader of ``election`` if nobody is; never blocks for long.

        Leadership is the key ``election`` holding ``candidate``, bound to ``lease``: it
        ends when the lease expires or is revoked, and then the next campaign wins. True
        if ``candidate`` now leads with this lease (also when it already did).
        """
        ...

    def leader(self, election: str) -> str | None:
        """The candidate leading ``election``, or None."""
        ...

    def unreachable_within(self, seconds: float) -> bool:
        """Whether the store was unreachable at some moment of the last ``seconds``
        (or is now): what other hosts failed to refresh meanwhile says nothing about them."""
        ...

    def close(self) -> None:
        """Stop this client's watches and keep-alives and release its connection
        (idempotent). Leases are left to expire."""
        ...


# -- keeping a lease alive -----------------------------------------------------------------
class KeepAlive:
    """Refreshes a lease on a daemon thread until :meth:`stop`.

    A refresh that fails because the store is unreachable is retried every
    ``min(interval, max(0.1, ttl/10))`` seconds; :attr:`alive` says whether the lease is
    still believed to live: it was refreshed less than ``ttl`` ago, and the store never
    answered that it is gone.
    """

    def __init__(self, lease: Lease, *, interval: float | None = None) -> None:
        self.lease = lease
        self.interval = interval if interval is not None else lease.ttl / 3
        self._retry = min(self.interval, max(0.1, lease.ttl / 10))
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._last_ok = time.monotonic()
        self._lost = False
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name=f"gemini-keepalive-{lease.id:x}",
                                        daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the lease is believed to live (see the class documentation)."""
        with self._lock:
            return not self._lost and time.monotonic() < self._last_ok + self.lease.ttl

    @property
    def lost(self) -> bool:
        """True once the store answered that the lease has expired or was revoked."""
        with self._lock:
            return self._lost

    @property
    def last_error(self) -> Exception | None:
        """Why the latest refresh failed (a StoreError, unless gemini has a bug), or None
        if it succeeded."""
        with self._lock:
            return self._error

    def stop(self) -> None:
        """Stop refreshing (idempotent); the lease then expires after its ttl. Returns
        once no refresh is in flight."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        delay = 0.0
        while not self._stopped.wait(delay):
            sent = time.monotonic()
            try:
                ok = self.lease.refresh()
            except Exception as exc:  # StoreError, or a bug that must not end the refreshes
                with self._lock:
                    first, self._error = self._error is None, exc
                if first:
                    logger.warning("cannot refresh lease %x, retrying: %s", self.lease.id, exc,
                                   exc_info=not isinstance(exc, StoreError))
                delay = self._retry
                continue
            with self._lock:
                recovered, self._error = self._error is not None, None
                if ok:
                    self._last_ok = sent
                else:
                    self._lost = True
            if not ok:
                logger.warning("lease %x has expired; its keys are gone", self.lease.id)
                return
            if recovered:
                logger.info("lease %x refreshed again", self.lease.id)
            delay = self.interval


# -- shared pieces ---------------------------------------------------------------------------
class _LeaseOwner(Protocol):
    def _refresh_lease(self, lease_id: int) -> bool: ...

    def _revoke_lease(self, lease_id: int) -> None: ...


@dataclass(frozen=True)
class StoreLease:
    """A lease of :class:`EtcdStore` or :class:`EmbeddedStore`."""

    id: int
    ttl: float
    owner: _LeaseOwner = field(repr=False, compare=False)

    def refresh(self) -> bool:
        return self.owner._refresh_lease(self.id)

    def revoke(self) -> None:
        self.owner._revoke_lease(self.id)


def _check_key(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise ValueError(f"store keys are non-empty strings, not {key!r}")
    return key.encode()


def _check_ttl(ttl: float) -> None:
    if not (ttl > 0 and math.isfinite(ttl)):
        raise ValueError(f"a lease ttl is a positive number of seconds, not {ttl!r}")


def _prefix_end(prefix: bytes) -> bytes | None:
    """The smallest key above every key that starts with ``prefix`` (None: no bound)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


# -- outages ---------------------------------------------------------------------------------
#: Called with ``("store_unreachable", {"store", "error", "window"})`` when an outage begins
#: and ``("store_back", {"store", "seconds"})`` when it ends.
OutageCallback = Callable[[str, dict[str, Any]], None]
_OUTAGE_LISTENERS: list[OutageCallback] = []


def watch_outages(callback: OutageCallback) -> Callable[[], None]:
    """Report every store outage of this process to ``callback``; returns the function
    that stops the reports."""
    _OUTAGE_LISTENERS.append(callback)
    return lambda: _OUTAGE_LISTENERS.remove(callback) if callback in _OUTAGE_LISTENERS else None


class _Outage:
    """Whether one cluster (a set of endpoints) can be reached, shared by every client of
    it in this process: one outage is logged and reported once, and its window is counted
    from its first failed call, whichever thread made it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self.since: float | None = None  # monotonic start of the current outage
        self.ended = -math.inf  # monotonic end of the last one

    def failed(self, error: str, window: float, sent: float) -> float:
        """Record a call sent at monotonic time ``sent`` that failed; the seconds the outage
        has lasted (since the first failed call was sent)."""
        now = time.monotonic()
        with self._lock:
            first = self.since is None
            since = self.since = sent if self.since is None else self.since
        if first:
            logger.warning("coordination store %s unreachable; retrying for up to %g s "
                           "(--store-timeout): %s", self.name, window, error)
            _report("store_unreachable", store=self.name, error=error, window=window)
        return now - since

    def succeeded(self) -> None:
        with self._lock:
            if self.since is None:
                return
            now = time.monotonic()
            seconds, self.since, self.ended = now - self.since, None, now
        logger.warning("coordination store %s is back after %.1f s", self.name, seconds)
        _report("store_back", store=self.name, seconds=round(seconds, 3))

    def within(self, seconds: float) -> bool:
        with self._lock:
            return self.since is not None or time.monotonic() - self.ended < seconds


_OUTAGES: dict[tuple[str, ...], _Outage] = {}
_OUTAGES_LOCK = threading.Lock()


def _outage_of(endpoints: Sequence[str]) -> _Outage:
    key = tuple(sorted(endpoints))
    with _OUTAGES_LOCK:
        return _OUTAGES.setdefault(key, _Outage("etcd://" + ",".join(endpoints)))


def _report(event: str, **fields: Any) -> None:
    for callback in list(_OUTAGE_LISTENERS):
        try:
            callback(event, fields)
        except Exception:  # a listener's bug must not break the store
            logger.exception("outage listener failed")


# -- etcd ------------------------------------------------------------------------------------
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


class _StoreBase:
    """What both stores share: ``leader`` and the bookkeeping of watches and keep-alives."""

    _lock: threading.RLock
    _closed: bool
    _watches: list[Any]
    _keepalives: list[KeepAlive]

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def leader(self, election: str) -> str | None:
        value = self.get(election)
        return None if value is None else value.decode()

    def unreachable_within(self, seconds: float) -> bool:
        return False  # a local file: never away

    def revoke_lease(self, lease_id: int) -> None:
        self._revoke_lease(lease_id)

    def _revoke_lease(self, lease_id: int) -> None:
        raise NotImplementedError

    def keep_alive(self, lease: Lease) -> KeepAlive:
        keepalive = KeepAlive(lease)
        with self._lock:
            self._keepalives = [k for k in self._keepalives if not k._stopped.is_set()]
            self._keepalives.append(keepalive)
        return keepalive

    def _stop_children(self) -> bool:
        """Cancel the watches and stop the keep-alives; False if already closed."""
        with self._lock:
            if self._closed:
                return False
            watches, self._watches = self._watches, []
            keepalives, self._keepalives = self._keepalives, []
        for watch in watches:
            watch.cancel()
        for keepalive in keepalives:
            keepalive.stop()
        return True


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
        try:
            self._call("connect", lambda c: c.get_response(b"\0", count_only=True),
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


# -- embedded (SQLite) -------------------------------------------------------------------------
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS kv (key BLOB PRIMARY KEY, value BLOB NOT NULL, lease INTEGER,"
    " revision INTEGER NOT NULL) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS kv_lease ON kv (lease) WHERE lease IS NOT NULL",
    "CREATE TABLE IF NOT EXISTS leases (id INTEGER PRIMARY KEY AUTOINCREMENT, ttl REAL NOT NULL,"
    " expires REAL NOT NULL)",
    "CREATE INDEX IF NOT EXISTS leases_expires ON leases (expires)",
    # The change log that watches poll: value NULL is a delete.
    "CREATE TABLE IF NOT EXISTS events (revision INTEGER PRIMARY KEY, key BLOB NOT NULL,"
    " value BLOB, time REAL NOT NULL)",
    # 'revision': the latest change; 'trimmed': the latest change no longer in the log.
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO meta (name, value) VALUES ('revision', 0), ('trimmed', 0)",
)

#: A key is visible if it has no lease or its lease has not expired (parameter: now).
_VISIBLE = "(lease IS NULL OR lease IN (SELECT id FROM leases WHERE expires > ?))"

_PRIVATE = PRIVATE_SEGMENT.encode()

#: Seconds the change log keeps events for watchers (a watcher polls every 50 ms).
EVENT_RETENTION = 600.0
_TRIM_EVERY = 30.0


class EmbeddedStore(_StoreBase):
    """A :class:`Store` in one SQLite file, shared by every process on the host that
    opens it.

    The file is in WAL mode, so readers never wait for a writer; every change is one
    ``BEGIN IMMEDIATE`` transaction, so compare-and-set is atomic across processes. Each
    change gets the next revision and is appended to a change log that watches poll every
    ``poll_interval`` seconds. Leases are expiry times on the wall clock: a key whose
    lease has expired is invisible at once and is deleted (with a delete event) by the
    next change or watch poll. ``timeout`` bounds how long a call waits for the file's
    lock.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 5.0,
                 poll_interval: float = 0.05) -> None:
        if not timeout > 0:
            raise ConfigError(f"store timeout must be positive, not {timeout!r}")
        self.path = Path(path)
        self.timeout = timeout
        self.poll_interval = poll_interval
        self._lock = threading.RLock()
        self._closed = False
        self._watches: list[_EmbeddedWatch] = []
        self._keepalives: list[KeepAlive] = []
        self._last_trim = 0.0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                         0o600)
            try:
                info = os.fstat(fd)
            finally:
                os.close(fd)
            if info.st_uid != os.geteuid() or not stat.S_ISREG(info.st_mode):
                raise StoreError(f"cannot open the embedded store {self.path}: not a regular "
                                 "file of this user (it holds the run's secret)")
            self._db: sqlite3.Connection = self._connect()
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the embedded store {self.path}: "
                             f"{getattr(exc, 'strerror', None) or exc}") from exc
        try:
            self._write("open", self._create_schema, maintain=False)
        except StoreError:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"EmbeddedStore({str(self.path)!r})"

    @staticmethod
    def _create_schema(db: sqlite3.Connection, now: float) -> None:
        for statement in _SCHEMA:
            db.execute(statement)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None,
                             check_same_thread=False)
        try:
            # Switching a new file to WAL takes an exclusive lock and SQLite answers "locked"
            # at once, without its busy handler, while another process does the same.
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                    break
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            if str(mode).lower() != "wal":
                logger.warning("%s is not in WAL mode (%s): readers will wait for writers",
                               self.path, mode)
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA secure_delete=ON")  # a deleted secret leaves no bytes behind
        except sqlite3.Error:
            db.close()
            raise
        return db

    # -- the edge: every SQLite call goes through here -------------------------------------
    def _read(self, what: str, sql: str, args: tuple[Any, ...]) -> list[Any]:
        with self._lock:
            if self._closed:
                raise StoreError(f"{what}: the embedded store is closed")
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"embedded store {what} failed ({self.path}): {exc}") from exc

    def _write(self, what: str, fn: Callable[[sqlite3.Connection, float], _T], *,
               maintain: bool = True) -> _T:
        """Run ``fn(db, now)`` in one write transaction; with ``maintain``, first delete the
        keys of expired leases and now and then trim the change log."""
        with self._lock:
            if self._closed:
                raise StoreError(f"{what}: the embedded store is closed")
            db = self._db
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreError(f"embedded store {what} failed ({self.path}): {exc}") from exc
            try:
                now = time.time()  # after taking the lock: expiry decisions are ordered
                if maintain:
                    self._purge(db, now)
                result = fn(db, now)
                if maintain:
                    self._trim(db, now)
                db.execute("COMMIT")
            except BaseException as exc:
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # the failed statement already ended the transaction
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(
                        f"embedded store {what} failed ({self.path}): {exc}") from exc
                raise
            return result

    @staticmethod
    def _record(db: sqlite3.Connection, key: bytes, value: bytes | None, now: float) -> int:
        """Take the next revision and log the change under it (a private key's value
        stays out of the log)."""
        if value is not None and key.rsplit(b"/", 1)[-1] == _PRIVATE:
            value = b""
        db.execute("UPDATE meta SET value = value + 1 WHERE name = 'revision'")
        (revision,) = db.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()
        db.execute("INSERT INTO events (revision, key, value, time) VALUES (?, ?, ?, ?)",
                   (revision, key, value, now))
        return int(revision)

    def _drop_lease(self, db: sqlite3.Connection, lease_id: int, now: float) -> None:
        keys = db.execute("SELECT key FROM kv WHERE lease = ? ORDER BY key",
                          (lease_id,)).fetchall()
        for (key,) in keys:
            self._record(db, key, None, now)
        db.execute("DELETE FROM kv WHERE lease = ?", (lease_id,))
        db.execute("DELETE FROM leases WHERE id = ?", (lease_id,))

    def _purge(self, db: sqlite3.Connection, now: float) -> None:
        for (lease_id,) in db.execute("SELECT id FROM leases WHERE expires <= ? ORDER BY expires",
                                      (now,)).fetchall():
            self._drop_lease(db, lease_id, now)

    def _trim(self, db: sqlite3.Connection, now: float) -> None:
        if now - self._last_trim < _TRIM_EVERY:
            return
        self._last_trim = now
        (last,) = db.execute("SELECT MAX(revision) FROM events WHERE time < ?",
                             (now - EVENT_RETENTION,)).fetchone()
        if last is not None:
            db.execute("DELETE FROM events WHERE revision <= ?", (last,))
            db.execute("UPDATE meta SET value = MAX(value, ?) WHERE name = 'trimmed'", (last,))

    # -- keys ------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        rows = self._read("get", f"SELECT value FROM kv WHERE key = ? AND {_VISIBLE}",
                          (_check_key(key), time.time()))
        return bytes(rows[0][0]) if rows else None

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> None:
        k, v = _check_key(key), bytes(value)

        def put(db: sqlite3.Connection, now: float) -> None:
            lease_id = self._live_lease(db, lease)
            revision = self._record(db, k, v, now)
            db.execute("INSERT OR REPLACE INTO kv (key, value, lease, revision) "
                       "VALUES (?, ?, ?, ?)", (k, v, lease_id, revision))

        self._write("put", put)

    @staticmethod
    def _live_lease(db: sqlite3.Connection, lease: Lease | None) -> int | None:
        """The lease's id, after checking it still lives (expired ones are purged)."""
        if lease is None:
            return None
        if db.execute("SELECT 1 FROM leases WHERE id = ?", (lease.id,)).fetchone() is None:
            raise StoreError(f"lease {lease.id:x} has expired or was revoked")
        return lease.id

    def compare_and_set(self, key: str, expected: bytes | None, value: bytes, *,
                        lease: Lease | None = None) -> bool:
        k, v = _check_key(key), bytes(value)

        def cas(db: sqlite3.Connection, now: float) -> bool:
            row = db.execute("SELECT value FROM kv WHERE key = ?", (k,)).fetchone()
            current = None if row is None else bytes(row[0])
            if current != (None if expected is None else bytes(expected)):
                return False
            lease_id = self._live_lease(db, lease)
            revision = self._record(db, k, v, now)
            db.execute("INSERT OR REPLACE INTO kv (key, value, lease, revision) "
                       "VALUES (?, ?, ?, ?)", (k, v, lease_id, revision))
            return True

        return self._write("compare-and-set", cas)

    def delete(self, key: str) -> bool:
        k = _check_key(key)

        def delete(db: sqlite3.Connection, now: float) -> bool:
            if db.execute("DELETE FROM kv WHERE key = ?", (k,)).rowcount == 0:
                return False
            self._record(db, k, None, now)
            return True

        return self._write("delete", delete)

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        start = prefix.encode()
        end = _prefix_end(start)
        sql = f"SELECT key, value FROM kv WHERE key >= ? AND {_VISIBLE}"
        args: tuple[Any, ...] = (start, time.time())
        if end is not None:
            sql += " AND key < ?"
            args += (end,)
        return {bytes(k).decode(): bytes(v) for k, v in self._read("get-prefix", sql, args)}

    # -- leases ----------------------------------------------------------------------------
    def grant_lease(self, ttl: float) -> Lease:
        _check_ttl(ttl)

        def grant(db: sqlite3.Connection, now: float) -> int:
            cursor = db.execute("INSERT INTO leases (ttl, expires) VALUES (?, ?)",
                                (ttl, now + ttl))
            return int(cursor.lastrowid or 0)

        return StoreLease(self._write("grant-lease", grant), float(ttl), self)

    def _refresh_lease(self, lease_id: int) -> bool:
        return self._write("refresh-lease", lambda db, now: db.execute(
            "UPDATE leases SET expires = ? + ttl WHERE id = ?", (now, lease_id)).rowcount > 0)

    def _revoke_lease(self, lease_id: int) -> None:
        self._write("revoke-lease", lambda db, now: self._drop_lease(db, lease_id, now))

    # -- watches ---------------------------------------------------------------------------
    def watch_prefix(self, prefix: str, callback: WatchCallback) -> Watch:
        (revision,) = self._read("watch", "SELECT value FROM meta WHERE name = 'revision'", ())[0]
        watch = _EmbeddedWatch(self, prefix, callback, int(revision))
        with self._lock:
            self._watches = [w for w in self._watches if not w._cancelled.is_set()]
            self._watches.append(watch)
        return watch

    def _expire(self) -> None:
        """Delete the keys of expired leases now (so that watchers see the deletes)."""
        self._write("expire", lambda db, now: None)

    # -- election --------------------------------------------------------------------------
    def campaign(self, election: str, candidate: str, lease: Lease) -> bool:
        k, me = _check_key(election), candidate.encode()

        def campaign(db: sqlite3.Connection, now: float) -> bool:
            row = db.execute("SELECT value, lease FROM kv WHERE key = ?", (k,)).fetchone()
            if row is not None:
                return bytes(row[0]) == me and row[1] == lease.id
            lease_id = self._live_lease(db, lease)
            revision = self._record(db, k, me, now)
            db.execute("INSERT INTO kv (key, value, lease, revision) VALUES (?, ?, ?, ?)",
                       (k, me, lease_id, revision))
            return True

        return self._write("campaign", campaign)

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        if not self._stop_children():
            return
        with self._lock:
            self._closed = True
            self._db.close()


class _EmbeddedWatch:
    """Polls the change log of an :class:`EmbeddedStore` on a thread of its own."""

    def __init__(self, store: EmbeddedStore, prefix: str, callback: WatchCallback,
                 revision: int) -> None:
        self._store = store
        self._prefix = prefix
        self._callback = callback
        self._last = revision
        self._start = prefix.encode()
        self._end = _prefix_end(self._start)
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gemini-watch", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._cancelled.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        db: sqlite3.Connection | None = None
        failing = False
        sql = "SELECT revision, key, value FROM events WHERE revision > ? AND key >= ?"
        if self._end is not None:
            sql += " AND key < ?"
        try:
            while not self._cancelled.wait(self._store.poll_interval):
                try:
                    if db is None:
                        db = self._store._connect()
                    if db.execute("SELECT 1 FROM leases WHERE expires <= ? LIMIT 1",
                                  (time.time(),)).fetchone() is not None:
                        self._store._expire()
                    args = (self._last, self._start) + ((self._end,) if self._end else ())
                    db.execute("BEGIN")  # one snapshot for both reads
                    try:
                        (trimmed,) = db.execute(
                            "SELECT value FROM meta WHERE name = 'trimmed'").fetchone()
                        rows = db.execute(sql + " ORDER BY revision", args).fetchall()
                    finally:
                        db.execute("COMMIT")
                except (sqlite3.Error, StoreError) as exc:
                    if not failing:
                        logger.warning("watch on %r cannot read %s, retrying: %s",
                                       self._prefix, self._store.path, exc)
                    failing = True
                    continue
                failing = False
                if trimmed > self._last:
                    logger.warning("watch on %r fell behind the change log; changes up to "
                                   "revision %d are lost", self._prefix, trimmed)
                for revision, key, value in rows:
                    if self._cancelled.is_set():
                        return
                    self._last = revision
                    try:
                        self._callback(bytes(key).decode(),
                                       None if value is None else bytes(value))
                    except Exception:
                        logger.exception("watch callback for prefix %r failed", self._prefix)
                self._last = max(self._last, trimmed)
        finally:
            if db is not None:
                db.close()


# -- opening a store by URL ----------------------------------------------------------------
def open_store(url: str, *, timeout: float = 5.0, outage: float = 0.0,
               default_path: str | os.PathLike[str] | None = None,
               credentials: EtcdCredentials | None = None) -> Store:
    """The store a URL names.

    ``etcd://HOST:PORT[,HOST:PORT...]``: an :class:`EtcdStore` on those endpoints (checked
    to answer within ``timeout``, riding out outages of up to ``outage`` seconds,
    authenticating with ``credentials``);
    ``embedded:///PATH/TO/FILE.db``: an
    :class:`EmbeddedStore` in that file; ``embedded://``: one in ``default_path``.
    """
    scheme, sep, rest = url.partition("://")
    if sep and scheme == "etcd":
        endpoints = [e for e in rest.split(",") if e.strip()]
        if not endpoints:
            raise ConfigError(f"store URL {url!r} names no etcd endpoint (etcd://HOST:PORT)")
        return EtcdStore(endpoints, timeout=timeout, outage=outage, credentials=credentials)
    if sep and scheme == "embedded":
        if not rest:
            if default_path is None:
                raise ConfigError(f"store URL {url!r} needs a path here: embedded:///PATH/TO/FILE.db")
            return EmbeddedStore(default_path, timeout=timeout)
        if not rest.startswith("/"):
            raise ConfigError(f"store URL {url!r}: the path must be absolute "
                              "(embedded:///PATH/TO/FILE.db)")
        return EmbeddedStore(rest, timeout=timeout)
    raise ConfigError(f"unknown store URL {url!r}; use one of: {STORE_URL_FORMS}")
