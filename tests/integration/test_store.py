"""The coordination store with real servers and processes: the whole contract suite
(store_contract) on an :class:`EtcdStore` on a real etcd (one server per module; each test
works under its own key prefix), several processes on one SQLite file, and an etcd that is
unreachable, restarted, or asks for credentials.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from etcd_server import EtcdServer
from helpers import REPO, free_port, kill_group, run, start
from store_contract import (
    SLACK,
    TTL,
    Backend,
    Recorder,
    ns,
    other,
    store,
    test_a_lease_is_usable_by_another_client,
    test_close_stops_keep_alives_and_watches,
    test_compare_and_set,
    test_compare_and_set_with_lease,
    test_election,
    test_election_fails_over_when_the_leader_stops_refreshing,
    test_get_prefix,
    test_get_prefix_reads_a_thousand_hosts_at_once,
    test_keep_alive_keeps_a_lease_until_stopped,
    test_lease_expires,
    test_put_get_delete,
    test_revoke_deletes_the_keys_of_a_lease,
    test_watch_callback_may_use_the_store,
    test_watch_prefix_sees_puts_and_deletes_in_order,
    test_watch_sees_lease_expiry_as_delete,
    wait_until,
)

from launcher.errors import ConfigError, StoreError, StoreUnavailableError
from launcher.store import EtcdCredentials, Store, open_store, watch_outages
from launcher.store.embedded import EmbeddedStore
from launcher.store.etcd import EtcdStore

__all__ = [  # the contract's fixtures and tests (store_contract), found by name
    "ns", "other", "store",
    "test_a_lease_is_usable_by_another_client", "test_close_stops_keep_alives_and_watches",
    "test_compare_and_set", "test_compare_and_set_with_lease", "test_election",
    "test_election_fails_over_when_the_leader_stops_refreshing", "test_get_prefix",
    "test_get_prefix_reads_a_thousand_hosts_at_once", "test_keep_alive_keeps_a_lease_until_stopped",
    "test_lease_expires", "test_put_get_delete", "test_revoke_deletes_the_keys_of_a_lease",
    "test_watch_callback_may_use_the_store", "test_watch_prefix_sees_puts_and_deletes_in_order",
    "test_watch_sees_lease_expiry_as_delete",
]


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


@pytest.fixture(params=[pytest.param("etcd", marks=pytest.mark.etcd)])
def backend(etcd: EtcdServer) -> Backend:
    return Backend("etcd", etcd.url)


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


@pytest.mark.etcd
def test_a_role_limited_to_geminis_prefix_runs_a_job(tmp_path: Path) -> None:
    """A user whose only role is `readwrite --prefix gemini/` runs a job whose
    coordination store and etcd-v3 rendezvous are that etcd: gemini touches no other key
    (its connect probe included)."""
    from helpers import GEMINI, SCRIPTS, env_with

    password = tmp_path / "password"
    password.write_text("gem-pass\n")
    with EtcdServer() as server:
        server.etcdctl("user", "add", "gem:gem-pass")
        server.etcdctl("role", "add", "gemini")
        server.etcdctl("role", "grant-permission", "gemini", "--prefix=true", "readwrite",
                       "gemini/")
        server.etcdctl("user", "grant-role", "gem", "gemini")
        server.enable_auth("root-pass")
        done = run([*GEMINI, "run", "--nnodes", "1", "--nproc-per-node", "1", "--no-standby",
                    "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", server.endpoint,
                    "--rdzv-id", "limited", "--store", server.url, "--store-user", "gem",
                    "--store-password-file", str(password),
                    str(SCRIPTS / "train_ckpt.py"), "--steps", "3"],
                   env=env_with(tmp_path), timeout=120)
        assert done.returncode == 0, done.output[-3000:]
        keys = server.etcdctl("--user", "root:root-pass", "get", "", "--prefix",
                              "--keys-only").split()
        assert keys and all(k.startswith("gemini/") for k in keys), keys
