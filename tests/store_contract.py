"""The coordination store's contract: one suite of tests, run against every implementation.

Not collected itself: tests/unit/test_store.py imports the fast part of the suite and runs
it on an :class:`EmbeddedStore` on a fresh file; tests/integration/test_store.py runs the
whole suite on an :class:`EtcdStore` on a real etcd (one server per module; each test works
under its own key prefix), and tests/integration/test_store_leases.py the tests that wait
out leases (seconds each) on the embedded store. Each of those modules provides the
``backend`` fixture.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from helpers import TimedOut, poll

from launcher.errors import StoreError
from launcher.store import Store, open_store

TTL = 1.0
"""Lease ttl of the suite: etcd grants 1 s because EtcdServer tunes its election timeout."""
SLACK = 3.0
"""How much later than its ttl a lease may be seen to expire (etcd checks every 0.5 s)."""


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds (:func:`helpers.poll`)."""
    try:
        poll(condition, timeout, "the condition", interval=interval)
    except TimedOut:
        return False
    return True


@dataclass(frozen=True)
class Backend:
    """How to open another client of the store under test."""

    name: str
    url: str

    def open(self, *, timeout: float = 5.0) -> Store:
        return open_store(self.url, timeout=timeout)


class Recorder:
    """A watch callback that keeps what it was given."""

    def __init__(self) -> None:
        self.events: list[tuple[str, bytes | None]] = []
        self._lock = threading.Lock()

    def __call__(self, key: str, value: bytes | None) -> None:
        with self._lock:
            self.events.append((key, value))

    def snapshot(self) -> list[tuple[str, bytes | None]]:
        with self._lock:
            return list(self.events)

    def wait_for(self, count: int, timeout: float = 5.0) -> list[tuple[str, bytes | None]]:
        wait_until(lambda: len(self.snapshot()) >= count, timeout)
        return self.snapshot()


@pytest.fixture
def store(backend: Backend) -> Iterator[Store]:
    opened = backend.open()
    yield opened
    opened.close()


@pytest.fixture
def other(backend: Backend) -> Iterator[Store]:
    """A second, independent client of the same store."""
    opened = backend.open()
    yield opened
    opened.close()


@pytest.fixture
def ns() -> str:
    """A key prefix of this test's own."""
    return f"test/{uuid.uuid4().hex[:10]}/"


# -- the contract ------------------------------------------------------------------------
def test_put_get_delete(store: Store, other: Store, ns: str) -> None:
    key = ns + "a"
    assert store.get(key) is None
    store.put(key, b"1")
    assert store.get(key) == b"1"
    assert other.get(key) == b"1"
    store.put(key, b"2")
    assert other.get(key) == b"2"
    every_byte = bytes(range(256))
    store.put(ns + "bytes", every_byte)
    assert other.get(ns + "bytes") == every_byte
    store.put(ns + "empty", b"")
    assert other.get(ns + "empty") == b""  # an empty value is not an absent key
    assert other.delete(key) is True
    assert store.get(key) is None
    assert store.delete(key) is False
    with pytest.raises(ValueError):
        store.put("", b"x")


def test_get_prefix(store: Store, other: Store, ns: str) -> None:
    inside = {ns + "host/0/rank/0": b"a", ns + "host/0/rank/1": b"b", ns + "host/1/rank/0": b"c",
              ns + "host/é/ü": "ünï".encode()}
    for key, value in inside.items():
        store.put(key, value)
    store.put(ns + "hos", b"outside")
    store.put(ns + "other", b"outside")
    assert other.get_prefix(ns + "host/") == inside
    assert other.get_prefix(ns + "host/0/") == {k: v for k, v in inside.items() if "/0/" in k}
    assert other.get_prefix(ns + "nothing/") == {}
    assert set(other.get_prefix(ns)) == set(inside) | {ns + "hos", ns + "other"}


def test_get_prefix_reads_a_thousand_hosts_at_once(store: Store, ns: str) -> None:
    # What `gemini status` reads: 1,000 hosts x 8 ranks, ~4.7 MiB in all (more than
    # gRPC's default 4 MiB message limit).
    keys = [f"{ns}host/{h:04d}/rank/{r}" for h in range(1000) for r in range(8)]

    def value(key: str) -> bytes:
        return key.encode().ljust(600, b".")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: store.put(k, value(k)), keys))
    found = store.get_prefix(ns + "host/")
    assert len(found) == len(keys)
    assert all(found[k] == value(k) for k in keys)


def test_compare_and_set(store: Store, other: Store, ns: str) -> None:
    key = ns + "cas"
    assert store.compare_and_set(key, None, b"a") is True
    assert other.compare_and_set(key, None, b"b") is False  # exists already
    assert store.get(key) == b"a"
    assert other.compare_and_set(key, b"a", b"c") is True
    assert store.compare_and_set(key, b"a", b"d") is False  # stale expectation
    assert store.get(key) == b"c"
    assert store.compare_and_set(ns + "absent", b"x", b"y") is False
    assert store.get(ns + "absent") is None
    assert store.compare_and_set(key, b"c", b"") is True
    assert store.compare_and_set(key, b"", b"e") is True  # b"" is a value, not absence
    assert store.get(key) == b"e"


def test_compare_and_set_with_lease(store: Store, ns: str) -> None:
    lease = store.grant_lease(30)
    assert store.compare_and_set(ns + "k", None, b"v", lease=lease) is True
    lease.revoke()
    assert store.get(ns + "k") is None
    assert store.compare_and_set(ns + "k", None, b"w") is True


def test_lease_expires(store: Store, other: Store, ns: str) -> None:
    lease = store.grant_lease(TTL)
    assert TTL <= lease.ttl < TTL + 1
    store.put(ns + "leased", b"v", lease=lease)
    store.put(ns + "kept", b"v")
    assert other.get(ns + "leased") == b"v"
    assert set(other.get_prefix(ns)) == {ns + "leased", ns + "kept"}
    assert wait_until(lambda: other.get(ns + "leased") is None, lease.ttl + SLACK)
    assert other.get_prefix(ns) == {ns + "kept": b"v"}
    assert lease.refresh() is False
    with pytest.raises(StoreError):
        store.put(ns + "late", b"v", lease=lease)
    assert store.get(ns + "late") is None


def test_keep_alive_keeps_a_lease_until_stopped(store: Store, other: Store, ns: str) -> None:
    lease = store.grant_lease(TTL)
    store.put(ns + "alive", b"v", lease=lease)
    keepalive = store.keep_alive(lease)
    time.sleep(2.5 * lease.ttl)
    assert other.get(ns + "alive") == b"v"
    assert keepalive.alive and keepalive.last_error is None
    keepalive.stop()
    assert wait_until(lambda: other.get(ns + "alive") is None, lease.ttl + SLACK)
    assert wait_until(lambda: not keepalive.alive, lease.ttl + SLACK)
    keepalive.stop()  # idempotent


def test_revoke_deletes_the_keys_of_a_lease(store: Store, other: Store, ns: str) -> None:
    lease = store.grant_lease(30)
    store.put(ns + "a", b"1", lease=lease)
    store.put(ns + "b", b"2", lease=lease)
    store.put(ns + "c", b"3")
    lease.revoke()
    assert other.get(ns + "a") is None
    assert other.get_prefix(ns) == {ns + "c": b"3"}
    assert lease.refresh() is False
    lease.revoke()  # idempotent
    with pytest.raises(StoreError):
        store.put(ns + "a", b"1", lease=lease)
    keepalive = store.keep_alive(lease)
    assert wait_until(lambda: keepalive.lost, 5)
    assert not keepalive.alive
    keepalive.stop()


def test_a_lease_is_usable_by_another_client(store: Store, other: Store, ns: str) -> None:
    lease = store.grant_lease(30)
    other.put(ns + "k", b"v", lease=lease)
    lease.revoke()
    assert other.get(ns + "k") is None


def test_watch_prefix_sees_puts_and_deletes_in_order(store: Store, other: Store, ns: str) -> None:
    seen = Recorder()
    watch = store.watch_prefix(ns + "w/", seen)
    lease = other.grant_lease(30)
    other.put(ns + "w/a", b"1")
    other.put(ns + "w/b", b"2")
    other.put(ns + "elsewhere", b"x")
    other.put(ns + "w/a", b"3")
    assert other.delete(ns + "w/a")
    assert not other.delete(ns + "w/missing")  # no event
    other.put(ns + "w/c", b"4", lease=lease)
    lease.revoke()
    assert other.compare_and_set(ns + "w/d", None, b"5")
    expected = [(ns + "w/a", b"1"), (ns + "w/b", b"2"), (ns + "w/a", b"3"), (ns + "w/a", None),
                (ns + "w/c", b"4"), (ns + "w/c", None), (ns + "w/d", b"5")]
    assert seen.wait_for(len(expected)) == expected
    watch.cancel()
    other.put(ns + "w/after", b"x")
    time.sleep(0.5)
    assert seen.snapshot() == expected
    watch.cancel()  # idempotent


def test_watch_sees_lease_expiry_as_delete(store: Store, other: Store, ns: str) -> None:
    seen = Recorder()
    watch = store.watch_prefix(ns, seen)
    lease = other.grant_lease(TTL)
    other.put(ns + "host", b"up", lease=lease)
    events = seen.wait_for(2, timeout=lease.ttl + SLACK)
    assert events == [(ns + "host", b"up"), (ns + "host", None)]
    watch.cancel()


def test_watch_callback_may_use_the_store(store: Store, ns: str) -> None:
    copied = threading.Event()

    def copy(key: str, value: bytes | None) -> None:
        if value is not None:
            store.put(ns + "copy/" + key.rsplit("/", 1)[1], value)
            copied.set()

    watch = store.watch_prefix(ns + "src/", copy)
    store.put(ns + "src/x", b"v")
    assert copied.wait(5)
    assert store.get(ns + "copy/x") == b"v"
    watch.cancel()


def test_election(store: Store, other: Store, ns: str) -> None:
    election = ns + "root"
    mine, theirs = store.grant_lease(30), other.grant_lease(30)
    assert store.leader(election) is None
    assert store.campaign(election, "host-a", mine) is True
    assert other.campaign(election, "host-b", theirs) is False
    assert other.leader(election) == "host-a"
    assert store.campaign(election, "host-a", mine) is True  # already leads
    assert other.campaign(election, "host-a", theirs) is False  # same name, other lease
    mine.revoke()
    assert other.leader(election) is None
    assert other.campaign(election, "host-b", theirs) is True
    assert store.leader(election) == "host-b"
    assert store.campaign(election, "host-a", store.grant_lease(30)) is False
    theirs.revoke()


def test_election_fails_over_when_the_leader_stops_refreshing(store: Store, other: Store,
                                                              ns: str) -> None:
    election = ns + "root"
    mine = store.grant_lease(TTL)
    keepalive = store.keep_alive(mine)
    assert store.campaign(election, "host-a", mine) is True
    theirs = other.grant_lease(30)
    time.sleep(2 * mine.ttl)  # refreshed, the leader keeps leading past its ttl
    assert other.campaign(election, "host-b", theirs) is False
    keepalive.stop()
    stopped = time.monotonic()
    assert wait_until(lambda: other.campaign(election, "host-b", theirs), mine.ttl + SLACK)
    assert time.monotonic() - stopped <= mine.ttl + SLACK
    assert store.leader(election) == "host-b"
    theirs.revoke()


def test_close_stops_keep_alives_and_watches(backend: Backend, other: Store, ns: str) -> None:
    store = backend.open()
    lease = store.grant_lease(TTL)
    store.put(ns + "k", b"v", lease=lease)
    store.keep_alive(lease)
    seen = Recorder()
    store.watch_prefix(ns, seen)
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreError):
        store.get(ns + "k")
    assert wait_until(lambda: other.get(ns + "k") is None, lease.ttl + SLACK)
    other.put(ns + "later", b"x")
    time.sleep(0.3)
    assert (ns + "later", b"x") not in seen.snapshot()
