"""The replication transport against an insider with the run's secret, a flood of
strangers and a rogue server: real sockets, real shared memory, real store files and
processes. Each test plays the attack and shows that it now fails safe.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import env_with, kill_group, poll, run, start
from transport_support import SECRET, WORLD, Net, fill, make_meta, net, random_data, wait_for

from launcher import memory
from launcher.errors import ConfigError
from launcher.events import EventLog
from launcher.replication import transport, wire
from launcher.replication.service import ReplicationService, load_secret
from launcher.replication.wire import HELLO, MAGIC, TO_CLIENT, TO_SERVER, WELCOME
from launcher.store import open_store

__all__ = ["net"]  # a fixture (transport_support), used by name

REPO = Path(__file__).resolve().parents[2]


# -- an insider's connection ------------------------------------------------------------

def _authenticated(address: tuple[str, int], run_id: str, *, source: str = "127.0.0.1",
                   secret: bytes = SECRET) -> transport._Channel:
    """A connection that proved the secret, from ``source`` (another loopback address:
    another host), as a peer with the secret would open it."""
    sock = socket.create_connection(address, timeout=5, source_address=(source, 0))
    nonce = os.urandom(wire.NONCE_SIZE)
    sock.sendall(HELLO.pack(MAGIC, nonce, wire.run_tag(run_id)))
    server_nonce = wire.parse_welcome(transport._recv_exact(sock, WELCOME.size, 5))
    sock.sendall(wire.derive(secret, wire.CLIENT_PROOF, run_id, nonce, server_nonce))
    proof = transport._recv_exact(sock, wire.MAC_SIZE, 5)
    assert hmac.compare_digest(proof, wire.derive(secret, wire.SERVER_PROOF, run_id, nonce, server_nonce))
    key = wire.derive(secret, wire.SESSION, run_id, nonce, server_nonce)
    channel = transport._Channel(sock, key, outgoing=TO_SERVER, incoming=TO_CLIENT, timeout=5)
    wire.parse_reply(channel.recv()[0])
    return channel


def _forged_put(channel: transport._Channel, run_id: str, *, rank: int, step: int,
                data_len: int, round_id: str, keep: int = -1, world_size: int = WORLD
                ) -> dict[str, object]:
    """An insider's PUT of ``data_len`` bytes (never sent); the server's reply."""
    meta = make_meta(bytes(16), step)
    channel.send({"op": "put", "run_id": run_id, "rank": rank, "step": step, "seq": 1,
                  "world_size": world_size, "data_len": data_len,
                  "meta_hash": __import__("xxhash").xxh3_64_intdigest(meta), "keep": keep,
                  "round": round_id}, meta)
    return channel.recv()[0]


def _replica_files(net: Net) -> list[str]:
    return [n for n in memory.list_segments(net.b.prefix) if ".r" in n or "replica" in n]


# -- finding: pushes outside the round's placement ----------------------------------------

@pytest.fixture
def service(net: Net, tmp_path: Path) -> Iterator[ReplicationService]:
    """Host b's replication service in round "r1" of two nodes (b is node 1, keeping the
    replicas of node 0: rank 0), as a supervisor runs it, on a real embedded store."""
    store = open_store(f"embedded://{tmp_path / 'store.db'}")
    events = EventLog(tmp_path / "run", host="hb")
    svc = ReplicationService(net.b, events, store, run_id=net.run_id, replicas=2, secret=SECRET,
                             bind=("127.0.0.1", 0), advertise="127.0.0.1", pace=False)
    fill(net.b, 1, 3, random_data(64 << 10, 7))  # b's own rank 1 has saved step 3
    svc.set_round(1, 2, {0: ("127.0.0.1", 1), 1: svc.address}, round_id="r1", restored=-1)
    try:
        yield svc
    finally:
        svc.stop_sending()
        svc.server.close()
        store.close()


def test_an_insider_cannot_push_outside_the_placement_nor_fill_shared_memory(
        net: Net, service: ReplicationService) -> None:
    """With the secret, an insider pushes: no round, another round, a rank this host keeps
    no replica of (2^31 - 2 too), a step far ahead, a keep step far ahead, and 1 TB for a
    rank it does keep. Each is refused before anything is allocated or pinned, and a
    legitimate push of the round still lands."""
    channel = _authenticated(service.server.address, net.run_id, source="127.0.0.2")
    free = memory.shm_free_bytes()
    attacks = [
        dict(rank=0, step=5, data_len=1000, round_id=""),
        dict(rank=0, step=5, data_len=1000, round_id="r0"),
        dict(rank=1, step=5, data_len=1000, round_id="r1"),  # b's own rank
        dict(rank=(1 << 31) - 2, step=5, data_len=1000, round_id="r1", world_size=(1 << 31) - 1),
        dict(rank=0, step=1 << 40, data_len=1000, round_id="r1"),
        dict(rank=0, step=5, data_len=1000, round_id="r1", keep=1 << 40),
        dict(rank=0, step=5, data_len=1 << 40, round_id="r1"),
    ]
    for attack in attacks:
        reply = _forged_put(channel, net.run_id, **attack)  # type: ignore[arg-type]
        assert reply["ok"] is False, (attack, reply)
    assert net.b.segments(replica=True) == {} and net.b.pinned(0) is None
    assert memory.shm_free_bytes() >= free - (1 << 20)
    channel.close()
    # a member of the round pushes rank 0's step 4: taken
    client = net.client(service.server)
    assert client.push(fill(net.a, 0, 4, random_data(64 << 10, 8)), round_id="r1", keep=-1) == 4
    assert net.b.holdings(None, WORLD, replica=True) == {0: [4]}


# -- finding: a slow push and idle connections ----------------------------------------------

def test_a_trickling_push_does_not_keep_a_rank_from_its_peer(net: Net) -> None:
    """An insider announces 8 MiB for rank 0 and sends 1 MiB every 1.5 s (each within the
    2 s timeout, so it never stalls): its push ends at its deadline, and the peer's push
    of the same rank lands within a few seconds instead of waiting out all 12."""
    server = net.server(timeout=2.0, min_rate=8 << 20, push_grace=0.5)
    data = random_data(8 << 20, 11)
    source = fill(net.a, 0, 5, data)
    header = memory.read_header(source.view)
    assert header is not None
    slow = _authenticated(server.address, net.run_id, source="127.0.0.2")
    slow.send({"op": "put", **wire.slot_message(header, net.run_id), "keep": -1,
               "round": ""}, make_meta(data, 5))
    assert wire.parse_reply(slow.recv()[0]) == {"ok": True}
    stop = threading.Event()

    def trickle() -> None:
        for at in range(0, len(data), 1 << 20):
            if stop.wait(0 if at == 0 else 1.5):
                return
            try:
                slow.sock.sendall(data[at:at + (1 << 20)])
            except OSError:
                return
    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    began = time.monotonic()
    try:
        time.sleep(0.3)
        landed = None
        while landed is None and time.monotonic() - began < 8:
            try:
                landed = net.client(server).push(fill(net.a, 0, 6, random_data(100_000, 12)))
            except transport.ReplicationError:
                time.sleep(0.2)
        assert landed == 6, net.reasons()
        net.wait_reject("too slow")
    finally:
        stop.set()
        slow.close()
        thread.join()


@pytest.mark.parametrize("insider", ["127.0.0.2", "127.0.0.1"], ids=["other-address", "same-address"])
def test_idle_authenticated_connections_never_lock_a_peer_out(net: Net, insider: str) -> None:
    """64 authenticated connections left idle (the server's whole limit) from one address:
    a peer from another address, or from the same one (a reconnecting peer, or a
    co-tenant of its host), still pushes at once."""
    server = net.server()
    held = []
    try:
        for _ in range(64):
            try:
                held.append(_authenticated(server.address, net.run_id, source=insider))
            except (transport.ReplicationError, OSError, AssertionError):
                pass  # refused: the address has its share
        assert net.client(server).push(fill(net.a, 0, 1, random_data(10_000, 1))) == 1
        with server._lock:
            assert len(server._authenticated) <= transport.MAX_CONNECTIONS_PER_SOURCE + 1
    finally:
        for channel in held:
            channel.close()


# -- finding: floods of refused connections ----------------------------------------------

def test_a_flood_from_a_thousand_addresses_is_reported_in_a_few_lines(
        net: Net, caplog: pytest.LogCaptureFixture) -> None:
    """1000 connections with a bad hello, each from another address: a bounded number of
    reports and log lines in all, a bounded table of sources, and a peer still pushes."""
    server = net.server()
    caplog.set_level(logging.WARNING, logger="launcher.replication.transport")
    for i in range(1000):
        sock = socket.create_connection(server.address, timeout=5,
                                        source_address=(f"127.1.{i // 250}.{i % 250 + 1}", 0))
        sock.sendall(b"\x00" * HELLO.size)
        sock.settimeout(5)
        try:
            sock.recv(1)
        except OSError:
            pass
        sock.close()
    assert wait_for(lambda: not server._authenticating, timeout=10)
    lines = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert 1 <= len(net.rejects) <= transport.REPORTS_TOTAL, len(net.rejects)
    assert len(lines) <= transport.REPORTS_TOTAL
    assert len(server._reports) <= transport.REPORTS_TOTAL
    assert net.client(server).push(fill(net.a, 0, 1, random_data(10_000, 3))) == 1


def test_strangers_from_many_addresses_leave_handshake_room_for_the_peers(net: Net) -> None:
    """Twelve addresses each hold 4 connections in the handshake (48: more than the 32
    strangers may hold): the round's peer, from its own address, still connects and
    pushes every time."""
    server = net.server(handshake_timeout=5.0)
    server.peers = frozenset({"127.0.0.1"})
    idle = []
    try:
        for host in range(12):
            for _ in range(4):
                try:
                    idle.append(socket.create_connection(
                        server.address, timeout=5, source_address=(f"127.0.2.{host + 1}", 0)))
                except OSError:
                    pass
        time.sleep(0.2)
        for step in range(1, 6):
            assert net.client(server).push(fill(net.a, 0, step,
                                                random_data(10_000, step))) == step
    finally:
        for sock in idle:
            sock.close()


# -- finding: a weak --secret-file -------------------------------------------------------

WEAK = {
    "repeated": b"s" * 32,
    "password": b"correct-horse",
    "hex-64-bits": b"0123456789abcdef",
    "base64-96-bits": b"QUJDREVGR0hJSktM",
    "raw-12-bytes": bytes(range(0x80, 0x8C)),
    "repeated-word": b"password1password1password1password1",
    "repeated-hex": b"0123456789abcdef0123456789abcdef",
}


def test_a_weak_secret_file_is_refused_with_one_line(tmp_path: Path) -> None:
    """A rogue server (a peer's address taken over) receives the client's proof first:
    an offline guessing oracle. So a secret file must hold 128 bits of material: ``gemini
    run`` refuses a weaker one before its workers start, one line, exit code 2."""
    path = tmp_path / "secret"
    path.write_bytes(WEAK["repeated"] + b"\n")
    path.chmod(0o600)
    script = tmp_path / "train.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    done = run([str(REPO / ".venv" / "bin" / "gemini"), "run", "--nnodes", "1",
                "--nproc-per-node", "1", "--secret-file", str(path),
                "--run-root", str(tmp_path / "runs"), str(script)], timeout=60,
               env=env_with(tmp_path))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.output
    assert len(lines) == 1 and lines[0].startswith("gemini: error: ") and "too weak" in lines[0]
    assert not (tmp_path / "train.py.ran").exists()


@pytest.mark.parametrize("make", [
    "head -c 32 /dev/urandom | base64",  # README's multi-host example
    "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'",  # templates/slurm.sbatch
    "head -c 16 /dev/urandom | base64",
    "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'",
])
def test_the_documented_secret_files_are_accepted(tmp_path: Path, make: str) -> None:
    path = tmp_path / "secret"
    subprocess.run(f"(umask 077; {make} > {path})", shell=True, check=True)
    assert load_secret(str(path), None, "run") == path.read_bytes().strip()  # type: ignore[arg-type]


@pytest.mark.parametrize("secret", [b"Qx7mP2vL9kR4tY8wZ1nB3Q", b"Qx7mP2vL9kR4tY8wZ1nBQx"])
def test_a_random_secret_that_ends_as_it_began_is_accepted(tmp_path: Path,
                                                           secret: bytes) -> None:
    """16 random bytes in base64 (22 symbols, 132 bits) end with their first symbol or
    two now and then (1 in 64, 1 in 4096): that is no repetition, so no material is lost."""
    path = tmp_path / "secret"
    path.write_bytes(secret + b"==\n")
    path.chmod(0o600)
    assert load_secret(str(path), None, "run") == secret + b"=="  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(WEAK))
def test_weak_secrets_are_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / "secret"
    path.write_bytes(WEAK[name])
    with pytest.raises(ConfigError, match="too weak"):
        load_secret(str(path), None, "run")  # type: ignore[arg-type]


# -- finding: a crashed run's secret ------------------------------------------------------

_SUPERVISOR = """
import sys, time
from launcher.replication.service import load_secret
from launcher.store import open_store
store = open_store(sys.argv[1])
lease = store.grant_lease(1.0)
store.keep_alive(lease)
print(load_secret("", store, sys.argv[2], lease=lease).decode(), flush=True)
time.sleep(float(sys.argv[3]))
store.close()
"""


def _supervisor(url: str, run_id: str, hold: float) -> subprocess.Popen[str]:
    return start([sys.executable, "-c", _SUPERVISOR, url, run_id, str(hold)], cwd=REPO)


def _secret_of(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert len(line) == 64, line
    return line


def test_a_crashed_runs_secret_is_not_reused(tmp_path: Path) -> None:
    """A supervisor (a real process) is killed with SIGKILL: no exit deletes the run's
    secret from the store. A supervisor joining while another holder lives gets the
    same secret; once none lives, the next run of the same id gets a new one, and four
    supervisors starting together agree on it."""
    url, run_id = f"embedded://{tmp_path / 'store.db'}", "job42"
    first = _supervisor(url, run_id, 60)
    try:
        old = _secret_of(first)
        joiner = _supervisor(url, run_id, 0)
        assert _secret_of(joiner) == old  # a live run shares its secret
        joiner.wait(timeout=30)
    finally:
        kill_group(first)  # SIGKILL: the secret stays in the store
    store = open_store(url)
    try:
        assert store.get(f"gemini/runs/{run_id}/secret") is not None
        poll(lambda: not store.get_prefix(f"gemini/runs/{run_id}/secret-holders/"), 10,
             "the crashed holder's lease to expire")
    finally:
        store.close()
    news = [_supervisor(url, run_id, 2) for _ in range(4)]
    try:
        secrets = {_secret_of(proc) for proc in news}
    finally:
        for proc in news:
            kill_group(proc)
    assert len(secrets) == 1 and old not in secrets
