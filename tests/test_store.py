"""Contract tests of the coordination store: one suite, run against every implementation.

The ``store`` fixture is an :class:`EmbeddedStore` on a fresh file and an
:class:`EtcdStore` on a real etcd (one server per module; each test works under its own
key prefix). The tests after the suite cover what only one implementation has: several
processes on one SQLite file, and an etcd that is unreachable or restarted.
"""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from etcd_server import EtcdServer
from helpers import REPO, free_port, kill_group, run, start

from launcher.errors import ConfigError, StoreError, StoreUnavailableError
from launcher.store import (
    PRIVATE_SEGMENT,
    EtcdCredentials,
    Store,
    open_store,
    watch_outages,
)
from launcher.store.embedded import EmbeddedStore
from launcher.store.etcd import EtcdStore

TTL = 1.0
"""Lease ttl of the suite: etcd grants 1 s because EtcdServer tunes its election timeout."""
SLACK = 3.0
"""How much later than its ttl a lease may be seen to expire (etcd checks every 0.5 s)."""


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


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


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


@pytest.fixture(params=["embedded", pytest.param("etcd", marks=pytest.mark.etcd)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "embedded":
        return Backend("embedded", f"embedded://{tmp_path / 'store.db'}")
    server: EtcdServer = request.getfixturevalue("etcd")
    return Backend("etcd", server.url)


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


# -- embedded: several processes on one file ------------------------------------------------
WRITER = """
import sys
from launcher.store import open_store
store = open_store(sys.argv[1])
store.put("child/plain", b"hello")
lease = store.grant_lease(60)
store.put("child/leased", b"mine", lease=lease)
print(lease.id)
store.close()
"""

RACER = """
import json, sys, time
from pathlib import Path
from launcher.store import open_store
url, me, ready, go, keys, increments = sys.argv[1:7]
store = open_store(url, timeout=30)
Path(ready).touch()
deadline = time.monotonic() + 60
while not Path(go).exists():
    if time.monotonic() > deadline:
        sys.exit("no go signal")
    time.sleep(0.002)
wins = [i for i in range(int(keys)) if store.compare_and_set(f"race/{i}", None, me.encode())]
for _ in range(int(increments)):
    while True:
        old = store.get("counter")
        if store.compare_and_set("counter", old, str(int(old or 0) + 1).encode()):
            break
print(json.dumps(wins))
store.close()
"""


def test_embedded_store_is_shared_between_processes(tmp_path: Path) -> None:
    url = f"embedded://{tmp_path / 'shared.db'}"
    store = open_store(url)
    assert isinstance(store, EmbeddedStore)
    seen = Recorder()
    watch = store.watch_prefix("child/", seen)
    done = run([sys.executable, "-c", WRITER, url], timeout=60, cwd=REPO)
    assert done.returncode == 0, done.output
    lease_id = int(done.stdout)
    assert store.get_prefix("child/") == {"child/plain": b"hello", "child/leased": b"mine"}
    assert seen.wait_for(2) == [("child/plain", b"hello"), ("child/leased", b"mine")]
    # The child's lease is usable here: a supervisor's keys outlive nothing but it.
    store._revoke_lease(lease_id)
    assert store.get_prefix("child/") == {"child/plain": b"hello"}
    assert seen.wait_for(3)[-1] == ("child/leased", None)
    watch.cancel()
    store.close()


def test_embedded_compare_and_set_race_between_processes(tmp_path: Path) -> None:
    url = f"embedded://{tmp_path / 'race.db'}"
    names, keys, increments = ["p0", "p1", "p2"], 40, 60
    go = tmp_path / "go"
    procs = [start([sys.executable, "-c", RACER, url, name, str(tmp_path / f"ready-{name}"),
                    str(go), str(keys), str(increments)], cwd=REPO) for name in names]
    try:
        assert wait_until(lambda: all((tmp_path / f"ready-{n}").exists() for n in names), 60)
        go.touch()
        outputs = []
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            kill_group(proc)
    store = open_store(url)
    wins = {name: set(won) for name, won in zip(names, outputs, strict=True)}
    for i in range(keys):
        winners = [name for name in names if i in wins[name]]
        assert len(winners) == 1, (i, winners)
        assert store.get(f"race/{i}") == winners[0].encode()
    assert store.get("counter") == str(len(names) * increments).encode()  # no lost update
    store.close()


# -- etcd: unreachable, several endpoints, restarted ----------------------------------------
def test_etcd_unreachable_raises_store_error_promptly() -> None:
    port = free_port()  # nothing listens here: connection refused
    began = time.monotonic()
    with pytest.raises(StoreError) as refused:
        open_store(f"etcd://127.0.0.1:{port}", timeout=1.0)
    assert time.monotonic() - began < 15
    assert f"127.0.0.1:{port}" in str(refused.value)
    assert "\n" not in str(refused.value)

    # A peer that accepts connections and never answers: only the deadline ends the call.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        began = time.monotonic()
        with pytest.raises(StoreError) as hung:
            open_store(f"etcd://127.0.0.1:{silent.getsockname()[1]}", timeout=1.0)
        assert time.monotonic() - began < 15
        assert "\n" not in str(hung.value)


@pytest.mark.etcd
def test_etcd_tries_endpoints_in_order(etcd: EtcdServer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    store = open_store(f"etcd://{dead},{etcd.endpoint}", timeout=2.0)
    assert isinstance(store, EtcdStore)
    key = f"test/{uuid.uuid4().hex[:10]}/k"
    store.put(key, b"v")
    assert store.get(key) == b"v"
    store.close()


@pytest.mark.etcd
def test_etcd_restart_reconnects_and_resumes(ns: str) -> None:
    with EtcdServer() as server:
        store = open_store(server.url, timeout=1.0)
        try:
            lease = store.grant_lease(2)
            store.put(ns + "leased", b"v", lease=lease)
            store.put(ns + "plain", b"p")
            keepalive = store.keep_alive(lease)
            seen = Recorder()
            watch = store.watch_prefix(ns + "w/", seen)
            store.put(ns + "w/before", b"1")
            assert seen.wait_for(1) == [(ns + "w/before", b"1")]

            server.stop()
            began = time.monotonic()
            with pytest.raises(StoreError):
                store.get(ns + "plain")
            assert time.monotonic() - began < 15
            assert wait_until(lambda: not keepalive.alive, lease.ttl + SLACK)
            assert keepalive.last_error is not None and not keepalive.lost

            server.start()

            def answers() -> bool:
                try:
                    return store.get(ns + "plain") == b"p"
                except StoreError:
                    return False

            assert wait_until(answers, 15, interval=0.1)
            store.put(ns + "w/after", b"2")
            assert seen.wait_for(2, timeout=15) == [(ns + "w/before", b"1"), (ns + "w/after", b"2")]
            assert wait_until(lambda: keepalive.alive, 10)
            time.sleep(2 * lease.ttl)  # the resumed keep-alive holds the key past its ttl
            assert store.get(ns + "leased") == b"v"
            assert keepalive.alive and not keepalive.lost
            watch.cancel()
            keepalive.stop()
        finally:
            store.close()


@pytest.mark.etcd
def test_etcd_crash_kill_and_restart(ns: str) -> None:
    with EtcdServer() as server:
        store = open_store(server.url, timeout=1.0)
        try:
            store.put(ns + "k", b"v")
            server.stop(sig=signal.SIGKILL)
            with pytest.raises(StoreError):
                store.get(ns + "k")
            server.start()
            assert wait_until(lambda: _get_or_none(store, ns + "k") == b"v", 15, interval=0.1)
        finally:
            store.close()


@pytest.mark.etcd
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_etcd_outage_shorter_than_the_window_is_ridden_out(ns: str, sig: signal.Signals) -> None:
    """etcd killed (restarted on its data) or frozen (then continued) for 2 s: calls made
    meanwhile wait and then answer; the outage is reported once when it begins and once,
    with its length, when it ends."""
    seen: list[tuple[str, dict[str, Any]]] = []
    unwatch = watch_outages(lambda event, fields: seen.append((event, fields)))
    with EtcdServer() as server:
        store = open_store(server.url, timeout=0.5, outage=30)
        try:
            store.put(ns + "k", b"v")
            if sig == signal.SIGKILL:
                server.stop(sig=sig)
            else:
                server.send(sig)
            began = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                calls = [pool.submit(store.get, ns + "k") for _ in range(4)]
                time.sleep(2)
                assert not any(call.done() for call in calls)
                if sig == signal.SIGKILL:
                    server.start()
                else:
                    server.send(signal.SIGCONT)
                assert [call.result(timeout=30) for call in calls] == [b"v"] * 4
            assert time.monotonic() - began < 15
            assert store.unreachable_within(5) and not store.unreachable_within(0)
        finally:
            store.close()
            unwatch()
    assert [event for event, _ in seen] == ["store_unreachable", "store_back"], seen
    assert seen[0][1]["store"] == server.url and seen[0][1]["window"] == 30
    assert 1.5 < seen[1][1]["seconds"] < 15, seen


@pytest.mark.etcd
def test_etcd_outage_longer_than_the_window_raises_store_unavailable(ns: str) -> None:
    """Past the window a call raises StoreUnavailableError, one line naming the window;
    a refused connection is not retried at all with a window of 0."""
    with EtcdServer() as server:
        store = open_store(server.url, timeout=0.5, outage=2)
        patient_not = open_store(server.url, timeout=0.5)
        try:
            server.stop(sig=signal.SIGKILL)
            began = time.monotonic()
            with pytest.raises(StoreError) as at_once:
                patient_not.get(ns + "k")
            assert time.monotonic() - began < 1.5
            assert not isinstance(at_once.value, StoreUnavailableError)
            began = time.monotonic()
            with pytest.raises(StoreUnavailableError) as past:
                store.get(ns + "k")
            assert 2 <= time.monotonic() - began < 5
            assert "--store-timeout 2" in str(past.value) and "\n" not in str(past.value)
            with pytest.raises(StoreUnavailableError):  # later calls: no new wait
                store.put(ns + "k", b"v")
            assert time.monotonic() - began < 6
        finally:
            store.close()
            patient_not.close()


def _get_or_none(store: Store, key: str) -> bytes | None:
    try:
        return store.get(key)
    except StoreError:
        return None


# -- opening stores by URL --------------------------------------------------------------------
def test_open_store_urls(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as unknown:
        open_store("redis://localhost:6379")
    assert "etcd://" in str(unknown.value) and "embedded://" in str(unknown.value)
    for bad in ("etcd://", "etcd://host:notaport", "etcd://host:99999", "embedded://relative/x.db",
                "https://x", "", "etcd:/x"):
        with pytest.raises(ConfigError):
            open_store(bad)
    with pytest.raises(ConfigError):
        open_store("embedded://")  # no default path given
    default = open_store("embedded://", default_path=tmp_path / "deep" / "default.db")
    assert isinstance(default, EmbeddedStore)
    default.put("k", b"v")
    default.close()
    explicit = open_store(f"embedded://{tmp_path / 'deep' / 'default.db'}")
    assert explicit.get("k") == b"v"
    explicit.close()


def test_embedded_store_in_an_unusable_place_raises_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError):
        open_store(f"embedded://{blocker / 'store.db'}")
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError):
        open_store(f"embedded://{garbage}")


def test_store_import_stays_light() -> None:
    code = ("import sys, launcher.store; "
            "print(sorted(m for m in ('torch', 'pyetcd', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=60, check=True).stdout
    assert out.strip() == "[]"


def _open_and_put(path: str, barrier: Any) -> None:
    barrier.wait()
    store = EmbeddedStore(path)
    store.put("k", b"v")
    store.close()


def test_embedded_store_opened_by_many_processes_at_once(tmp_path: Path) -> None:
    """A new file switched to WAL by several supervisors at the same moment: SQLite answers
    "database is locked" without waiting; every opener must still succeed."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    for attempt in range(10):
        path = str(tmp_path / f"race{attempt}.db")
        barrier = ctx.Barrier(6)
        procs = [ctx.Process(target=_open_and_put, args=(path, barrier)) for _ in range(6)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=60)
        assert [p.exitcode for p in procs] == [0] * 6


# -- credentials ---------------------------------------------------------------------------
@pytest.mark.etcd
def test_etcd_with_client_certificates(tmp_path: Path, ns: str) -> None:
    """An etcd started with --client-cert-auth: the client certificate opens it (keys,
    leases, watches); without one, or without TLS, one clear StoreError, promptly."""
    with EtcdServer(tls=True) as server:
        assert server.tls is not None
        tls = EtcdCredentials(cacert=str(server.tls.ca), cert=str(server.tls.client),
                              key=str(server.tls.client_key))
        store = open_store(server.url, timeout=2.0, credentials=tls)
        try:
            seen = Recorder()
            watch = store.watch_prefix(ns, seen)
            lease = store.grant_lease(TTL)
            store.put(ns + "k", b"v", lease=lease)
            assert store.get(ns + "k") == b"v"
            assert seen.wait_for(1) == [(ns + "k", b"v")]
            watch.cancel()
        finally:
            store.close()
        for credentials in (None, EtcdCredentials(cacert=str(server.tls.ca))):
            began = time.monotonic()
            with pytest.raises(StoreError) as refused:
                open_store(server.url, timeout=1.0, credentials=credentials)
            assert time.monotonic() - began < 15
            assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="both --store-cert and --store-key"):
        EtcdCredentials(cacert="ca", cert="c")
    with pytest.raises(ConfigError, match="cannot read the etcd CA certificate"):
        open_store("etcd://127.0.0.1:1", credentials=EtcdCredentials(cacert=str(tmp_path / "x")))


@pytest.mark.etcd
def test_etcd_with_user_authentication(tmp_path: Path, ns: str) -> None:
    """etcd with `auth enable`: a user and a password file open it, and the client gets a
    new token when etcd forgot the old one in a restart; a wrong password is one clear
    error, and a client without credentials is refused."""
    password = tmp_path / "password"
    password.write_text("s3cret-pass\n")
    with EtcdServer() as server:
        server.enable_auth("s3cret-pass")
        user = EtcdCredentials(user="root", password_file=str(password))
        store = open_store(server.url, timeout=2.0, outage=30.0, credentials=user)
        try:
            seen = Recorder()
            store.watch_prefix(ns, seen)
            store.put(ns + "a", b"1")
            assert seen.wait_for(1) == [(ns + "a", b"1")]
            server.stop()
            server.start()  # simple tokens live in etcd's memory only
            store.put(ns + "b", b"2")
            assert store.get(ns + "b") == b"2"
            assert seen.wait_for(2, timeout=15) == [(ns + "a", b"1"), (ns + "b", b"2")]
        finally:
            store.close()
        password.write_text("wrong\n")
        with pytest.raises(StoreError, match="authentication failed") as wrong:
            open_store(server.url, timeout=2.0, credentials=user)
        assert "\n" not in str(wrong.value)
        with pytest.raises(StoreError, match="user name is empty"):
            open_store(server.url, timeout=2.0)


def test_embedded_store_keeps_private_values_out_of_its_change_log(tmp_path: Path) -> None:
    """A secret under a private key is in the key table only; once deleted, its bytes are
    nowhere in the store's files. The store refuses a file of another kind or a symlink."""
    path = tmp_path / "store.db"
    store = open_store(f"embedded://{path}")
    secret, public = uuid.uuid4().hex.encode(), uuid.uuid4().hex.encode()
    seen = Recorder()
    store.watch_prefix("run/", seen)
    store.compare_and_set(f"run/{PRIVATE_SEGMENT}", None, secret)
    store.put("run/public", public)
    assert store.get(f"run/{PRIVATE_SEGMENT}") == secret
    assert seen.wait_for(2) == [(f"run/{PRIVATE_SEGMENT}", b""), ("run/public", public)]
    db = sqlite3.connect(path)
    logged = [bytes(v) for (v,) in db.execute("SELECT value FROM events")]
    db.close()
    assert logged == [b"", public]
    store.delete(f"run/{PRIVATE_SEGMENT}")
    store.close()
    assert [p.name for p in tmp_path.iterdir() if public in p.read_bytes()] == ["store.db"]
    assert [p.name for p in tmp_path.iterdir() if secret in p.read_bytes()] == []
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    link = tmp_path / "link.db"
    link.symlink_to(path)
    with pytest.raises(StoreError, match="cannot open the embedded store"):
        open_store(f"embedded://{link}")
