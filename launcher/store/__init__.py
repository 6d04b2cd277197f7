"""The coordination store: keys, leases, compare-and-set, watches and leader election.

Supervisors publish who they are and what they hold under keys bound to their lease, so
that a lost host's keys vanish when its lease expires; one supervisor is elected root;
``gemini status`` reads a whole run with one prefix read. :class:`Store` is the small
protocol every part of gemini uses; two implementations fulfil it:

* :class:`~launcher.store.etcd.EtcdStore` talks to an etcd v3 cluster (``etcd://host:port[,host:port...]``),
  for runs that span hosts. Every call has a deadline. A supervisor's store rides out an
  outage of the whole cluster (a restart, a hung or lost quorum) for up to an *outage
  window* (``--store-timeout``), retrying with backoff; past it a call raises
  :class:`~launcher.errors.StoreUnavailableError` instead of hanging. Outages are logged
  once when they begin and once when they end, and reported to :func:`watch_outages`.
* :class:`~launcher.store.embedded.EmbeddedStore` keeps everything in one SQLite file (``embedded:///path.db``),
  the default for single-host runs: no server, and every process on the host that opens
  the same file sees the same keys.

Keys are ``str`` (compared and matched by prefix as UTF-8 bytes), values are ``bytes``.
:func:`open_store` turns a store URL into a store. Leases are kept alive with
:class:`KeepAlive`, which both stores hand out.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar

from launcher.errors import ConfigError, StoreError
from launcher.files import read_user_file

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

#: Every key gemini reads or writes starts with this (the coordination records, the
#: etcd-v3 rendezvous): an etcd user needs no more than ``readwrite --prefix gemini/``.
KEY_PREFIX = "gemini/"


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
        data = read_user_file(path, what, MAX_CREDENTIAL_FILE)
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
        from launcher.store.etcd import EtcdStore

        return EtcdStore(endpoints, timeout=timeout, outage=outage, credentials=credentials)
    if sep and scheme == "embedded":
        from launcher.store.embedded import EmbeddedStore

        if not rest:
            if default_path is None:
                raise ConfigError(f"store URL {url!r} needs a path here: embedded:///PATH/TO/FILE.db")
            return EmbeddedStore(default_path, timeout=timeout)
        if not rest.startswith("/"):
            raise ConfigError(f"store URL {url!r}: the path must be absolute "
                              "(embedded:///PATH/TO/FILE.db)")
        return EmbeddedStore(rest, timeout=timeout)
    raise ConfigError(f"unknown store URL {url!r}; use one of: {STORE_URL_FORMS}")
