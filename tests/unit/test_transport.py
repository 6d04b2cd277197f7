"""The supervisor-to-supervisor transport over real loopback sockets and real shared memory.

Two (or three) SlotOwners with different host ids stand in for hosts; slots are filled
with random bytes and hook-format metadata (xxh3 per tensor) and committed with
``memory.write_commit``. Hostile peers are raw sockets or channels that speak just enough
of the protocol to misbehave at a chosen point. The tests that wait out the server's
timeouts (seconds) are in tests/integration/test_transport.py.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import xxhash
from transport_support import (
    SECRET,
    WORLD,
    Net,
    _connect_from,
    _seq,
    fill,
    make_meta,
    net,
    random_data,
    slot_bytes,
    wait_for,
)

from launcher import memory
from launcher.errors import CheckpointError, ConfigError, ReplicationError
from launcher.replication import reuse, transport, wire
from launcher.replication.transport import Client
from launcher.replication.wire import (
    FRAME,
    HELLO,
    MAGIC,
    MAX_JSON,
    MAX_META,
    TO_CLIENT,
    TO_SERVER,
    GetRequest,
    PutRequest,
)
from launcher.slots import SlotOwner

__all__ = ["net"]  # a fixture (transport_support), used by name


# -- the happy paths ----------------------------------------------------------------------

def test_push_makes_a_bitwise_equal_verified_replica(net: Net) -> None:
    data = random_data((1 << 20) + 123, 1)
    source = fill(net.a, 0, 7, data)
    server = net.server()
    assert net.client(server).push(source) == 7
    assert net.replicas == [(0, 7)]
    replica = net.b.find(0, 7)
    assert replica is not None
    parsed = memory.parse_slot_name(replica.name)
    assert parsed is not None and parsed.replica and parsed.prefix == net.b.prefix
    assert slot_bytes(replica) == data
    info = memory.describe(replica)
    assert info.error is None and info.valid_step == 7
    src_header, dst_header = memory.read_header(source.view), memory.read_header(replica.view)
    assert src_header is not None and dst_header is not None
    assert (dst_header.seq, dst_header.rank, dst_header.world_size, dst_header.meta_hash) == (
        src_header.seq, 0, WORLD, src_header.meta_hash)
    assert net.rejects == []


def test_a_push_does_not_send_the_bytes_the_receiver_holds(net: Net) -> None:
    """Data-parallel hosts hold the same tensors: the receiver copies those it holds in
    any committed slot (found by checksum and length, each copy checked as it lands), and
    only the rest travels. The replica is complete and verified either way."""
    half = 2 << 20
    same, other = random_data(half, 1), random_data(half, 2)
    fill(net.b, 1, 7, same + other)  # host b's own rank 1 holds both tensors
    server = net.server()
    client = net.client(server)
    for data, skipped in ((same + other, 2 * half),  # all of it held
                          (same + random_data(half, 3), half)):  # tensor "b" differs
        source = fill(net.a, 0, 7 if skipped == 2 * half else 8, data)
        before = client.sent
        assert client.push(source) is not None
        replica = net.b.find(0, memory.read_header(source.view).step)  # type: ignore[union-attr]
        assert replica is not None and slot_bytes(replica) == data
        assert memory.describe(replica).valid_step is not None
        assert client.sent - before == 2 * half - skipped
    assert client.skipped == 3 * half
    assert net.rejects == []


def test_a_held_copy_that_fails_its_checksum_is_sent_instead(net: Net) -> None:
    """A held slot whose bytes no longer match its checksums (rewritten, or corrupt) is
    never copied into a replica: the range is sent."""
    half = 2 << 20
    data = random_data(2 * half, 1)
    held = fill(net.b, 1, 7, data)
    held.view[memory.HEADER_SIZE + 10] ^= 0xFF  # tensor "a" of b's copy is corrupt
    client = net.client(net.server())
    assert client.push(fill(net.a, 0, 7, data)) == 7
    replica = net.b.find(0, 7)
    assert replica is not None and slot_bytes(replica) == data
    assert (client.sent, client.skipped) == (half, half)


def test_a_data_parallel_push_waits_briefly_for_the_receivers_own_step(net: Net) -> None:
    """Hosts commit the same step at about the same time: for a data-parallel replica
    (``replicated`` in the metadata) the receiver waits for its own ranks to commit the
    pushed step, then copies what it holds."""
    half = 2 << 20
    data = random_data(2 * half, 1)
    fill(net.b, 1, 6, random_data(2 * half, 2), replicated=True)
    client = net.client(net.server())
    later = threading.Timer(0.3, lambda: fill(net.b, 1, 7, data, replicated=True))
    later.start()
    try:
        assert client.push(fill(net.a, 0, 7, data, replicated=True)) == 7
    finally:
        later.join()
    replica = net.b.find(0, 7)
    assert replica is not None and slot_bytes(replica) == data
    assert (client.sent, client.skipped) == (0, 2 * half)


def test_skipped_ranges_are_merged_bounded_and_checked() -> None:
    ranges = [(0, 10, 1), (16, 30, 2), (30, 50, 3), (64, 80, 4)]
    # neighbours merge over the padding between them, never over a range to be sent
    assert reuse.skipped(ranges, [0, 2, 3]) == ([(0, 10), (30, 80)], [0, 30, 64])
    many = [(10 * i, 10 * i + 5, i) for i in range(2 * wire.MAX_SKIP + 10)]
    skip, covered = reuse.skipped(many, list(range(0, len(many), 2)))  # none adjacent
    assert len(skip) == len(covered) == wire.MAX_SKIP  # the rest is sent
    assert reuse.complement([(16, 50), (64, 80)], 90) == [(0, 16), (50, 64), (80, 90)]
    assert wire.parse_skip({"skip": [[0, 5], [5, 9]]}, 10) == [(0, 5), (5, 9)]
    for bad in ([[5, 9], [0, 5]], [[0, 11]], [[3, 3]], [[0, "5"]], [[0, 5, 6]], {"a": 1},
                [[0, 1]] * (wire.MAX_SKIP + 1), [[-1, 4]], [[0, True]]):
        with pytest.raises(ReplicationError, match="invalid skip list"):
            wire.parse_skip({"skip": bad}, 10)


def test_only_large_checksummed_ranges_are_looked_up() -> None:
    big = reuse.REUSE_MIN
    meta = {"tensors": [{"xxh3": "00000000000000ff", "nbytes": big, "offset": 4096},
                        {"xxh3": "0000000000000001", "nbytes": big - 1, "offset": 0},
                        {"xxh3": None, "nbytes": 2 * big, "offset": 8192}],
            "blocks": [{"xxh3": "000000000000000a", "nbytes": 3 * big, "offset": 0}]}
    assert reuse.reusable(meta) == {(0xff, big): 4096, (0xa, 3 * big): 0}
    assert reuse.reusable({"tensors": []}) == {}  # a slot with no blocks
    with pytest.raises(KeyError):
        reuse.reusable({"blocks": []})


def test_repeated_pushes_alternate_the_double_buffer(net: Net) -> None:
    server = net.server()
    client = net.client(server)
    names = []
    for step in (1, 2, 3):
        assert client.push(fill(net.a, 0, step, random_data(50_000 + step, step))) == step
        replica = net.b.find(0, step)
        assert replica is not None
        names.append(replica.name)
    assert names[0] != names[1] and names[2] == names[0]
    assert net.replica_steps() == [2, 3]  # the older committed replica is kept
    # pushing the step the peer already holds changes nothing
    newest = net.a.find(0, 3)
    assert newest is not None and client.push(newest) == 3
    assert net.replica_steps() == [2, 3]
    assert net.replicas == [(0, 1), (0, 2), (0, 3)]
    assert net.rejects == []


def test_a_push_never_overwrites_the_replica_of_the_pinned_step(net: Net) -> None:
    """A push names s*, the globally restorable step: the holder keeps its replica of s*
    and lets newer pushes take turns in the other slot, until a newer s* is named."""
    server = net.server()
    client = net.client(server)
    assert client.push(fill(net.a, 0, 4, random_data(40_000, 40))) == 4
    for step in (5, 6, 7):
        assert client.push(fill(net.a, 0, step, random_data(40_000, step)), keep=4) == step
        assert net.replica_steps() == [4, step]
    assert client.push(fill(net.a, 0, 8, random_data(40_000, 8)), keep=7) == 8
    assert net.replica_steps() == [7, 8]
    assert net.b.pinned(0) == 7
    assert client.push(fill(net.a, 0, 9, random_data(40_000, 9)), keep=5) == 9  # pins only move on
    assert net.replica_steps() == [7, 9]


def test_a_push_from_another_round_is_refused(net: Net) -> None:
    """A sender whose round moved on without it (frozen, then woken) changes nothing on
    a holder that is in the new round: neither its replicas nor its pin."""
    server = net.server()
    server.round = "new"
    client = net.client(server)
    assert client.push(fill(net.a, 0, 4, random_data(40_000, 4)), round_id="new") == 4
    with pytest.raises(ReplicationError, match="round old"):
        client.push(fill(net.a, 0, 5, random_data(40_000, 5)), keep=5, round_id="old")
    assert net.replica_steps() == [4] and net.b.pinned(0) != 5
    assert client.push(fill(net.a, 0, 6, random_data(40_000, 6)), keep=4, round_id="new") == 6
    assert net.replica_steps() == [4, 6]


def test_a_local_copy_is_restored_into_an_own_slot(net: Net) -> None:
    """``restore_local``: a replica slot's copy (of the rank itself, or of another rank
    of the world before the job shrank) goes into an own slot, unless one holds it."""
    data = random_data(300_000, 41)
    own = fill(net.a, 0, 12, data)
    header = memory.read_header(own.view)
    assert header is not None
    kept = net.a.write_target(0, own.size, replica=True)
    assert memory.copy_slot(own.view, kept.view, header)
    fill(net.a, 0, 13, random_data(300_000, 42))
    fill(net.a, 0, 14, random_data(300_000, 43))  # the worker's own slots moved on
    assert net.a.holdings([0], WORLD) == {0: [13, 14]}
    net.a.restore_local(0, 12)
    assert net.a.holdings([0], WORLD) == {0: [12, 14]}
    restored = next(s for s in net.a.segments()[0] if memory.read_header(s.view).step == 12)
    assert slot_bytes(restored) == data
    net.a.restore_local(0, 14)  # already in an own slot: nothing to copy
    with pytest.raises(CheckpointError, match="no copy of step 3 of rank 0"):
        net.a.restore_local(0, 3)
    net.a.restore_local(1, 14, source=0)  # rank 1 of a smaller world takes rank 0's copy
    moved = next(s for s in net.a.segments()[1] if memory.read_header(s.view).step == 14)
    assert slot_bytes(moved) == slot_bytes(next(
        s for s in net.a.segments()[0] if memory.read_header(s.view).step == 14))


def test_pull_into_a_fresh_own_slot(net: Net) -> None:
    data = random_data(300_001, 2)
    server = net.server()
    assert net.client(server).push(fill(net.a, 0, 4, data)) == 4
    c = SlotOwner(run_id=net.run_id, host_id="hc", local_world_size=1)  # a replacement host
    try:
        client = net.client(server)
        asked: list[int] = []

        def target(nbytes: int) -> memory.Segment:
            asked.append(nbytes)
            return c.write_target(0, nbytes, replica=False)

        with pytest.raises(ReplicationError, match="not held"):
            client.pull(0, 5, target)
        assert asked == []
        header = client.pull(0, 4, target)  # the same connection goes on after a refusal
        assert header.step == 4 and header.state is memory.SlotState.COMMITTED
        assert asked and asked[0] >= memory.HEADER_SIZE + len(data)
        own = c.find(0, 4)
        assert own is not None and not memory.parse_slot_name(own.name).replica  # type: ignore[union-attr]
        assert slot_bytes(own) == data
        assert c.holdings([0], WORLD) == {0: [4]}
        # the server also serves its own slots
        fill(net.b, 1, 9, data[:1000])
        assert client.pull(1, 9, lambda n: c.write_target(1, n, replica=True)).step == 9
    finally:
        c.close()
    assert net.rejects == []


# -- hostile and broken peers -------------------------------------------------------------

def test_wrong_secret_is_rejected_and_commits_nothing(net: Net) -> None:
    server = net.server()
    assert net.client(server).push(fill(net.a, 0, 1, random_data(10_000, 3))) == 1
    intruder = net.client(server, secret=b"not-the-secret-of-this-run")
    with pytest.raises(ReplicationError, match="authentication"):
        intruder.push(fill(net.a, 0, 2, random_data(10_000, 4)))
    net.wait_reject("authentication failed")
    assert net.replica_steps() == [1] and net.replicas == [(0, 1)]


def test_secret_too_short_is_a_config_error(net: Net) -> None:
    with pytest.raises(ConfigError, match="secret"):
        Client(("127.0.0.1", 1), secret=b"short", run_id=net.run_id)


def test_other_run_is_rejected(net: Net) -> None:
    server = net.server()
    stranger = net.client(server, run_id=net.run_id + "-other")
    with pytest.raises(ReplicationError, match="belongs to run"):  # checked before sending
        stranger.push(fill(net.a, 0, 1, random_data(1000, 5)))
    with pytest.raises(ReplicationError, match="closed the connection during authentication"):
        stranger.pull(0, 1, lambda n: pytest.fail("no data expected"))
    net.wait_reject("another run")
    # the run id is also bound into the proofs, not only into the run tag
    with socket.create_connection(server.address, timeout=5) as sock:
        nonce = os.urandom(wire.NONCE_SIZE)
        sock.sendall(HELLO.pack(MAGIC, nonce, wire.run_tag(net.run_id)))
        server_nonce = wire.parse_welcome(transport._recv_exact(sock, wire.WELCOME.size, 5))
        sock.sendall(wire.derive(SECRET, wire.CLIENT_PROOF, "another-run", nonce, server_nonce))
        assert sock.recv(1) == b""
    net.wait_reject("bad client proof")
    assert net.replica_steps() == [] and net.replicas == []


def test_the_server_proves_nothing_to_a_stranger(net: Net) -> None:
    """A client that does not know the secret gets only a random nonce, never a value
    derived from the secret to test guesses of a weak --secret-file against."""
    server = net.server()
    with socket.create_connection(server.address, timeout=5) as sock:
        nonce = os.urandom(wire.NONCE_SIZE)
        sock.sendall(HELLO.pack(MAGIC, nonce, wire.run_tag(net.run_id)))
        welcome = transport._recv_exact(sock, wire.WELCOME.size, 5)
        assert welcome.startswith(MAGIC) and len(welcome) == len(MAGIC) + wire.NONCE_SIZE
        sock.sendall(os.urandom(wire.MAC_SIZE))  # a guess
        assert sock.recv(64) == b""  # closed: no proof of the server's
    net.wait_reject("bad client proof")


def test_connection_dropped_mid_data_keeps_the_committed_replica(net: Net) -> None:
    server = net.server()
    assert net.client(server).push(fill(net.a, 0, 1, random_data(200_000, 6))) == 1
    before = net.b.find(0, 1)
    assert before is not None
    old_bytes = slot_bytes(before)
    data = random_data(200_000, 7)
    source = fill(net.a, 0, 2, data)
    header = memory.read_header(source.view)
    assert header is not None
    meta = make_meta(data, 2)
    channel = net.channel(server)
    channel.send({"op": "put", **wire.slot_message(header, net.run_id)}, meta)
    assert wire.parse_reply(channel.recv()[0]) == {"ok": True}
    channel.sock.sendall(data[:100_000])
    channel.close()
    net.wait_reject("truncated data")
    assert net.replica_steps() == [1]
    assert net.b.newest_steps(replica=True) == {0: 1}
    assert slot_bytes(before) == old_bytes and memory.describe(before).valid_step == 1
    assert net.replicas == [(0, 1)]


def test_truncated_frame_is_rejected(net: Net) -> None:
    server = net.server()
    channel = net.channel(server)
    frame = wire.seal_frame(channel._key, TO_SERVER, 0, {"op": "get", "rank": 0, "step": 1})
    channel.sock.sendall(frame[:len(frame) - 5])
    channel.sock.shutdown(socket.SHUT_WR)
    net.wait_reject("truncated frame")
    channel.close()


def test_corrupted_data_in_flight_fails_the_checksum(net: Net,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    server = net.server()
    client = net.client(server)
    assert client.push(fill(net.a, 0, 1, random_data(100_000, 8))) == 1

    def corrupting(sock: socket.socket, fd: int, offset: int, count: int, timeout: float, *,
                   pace: Callable[[int], None] | None = None) -> None:
        data = bytearray(os.pread(fd, count, offset))
        data[count // 3] ^= 0x10
        sock.settimeout(timeout)
        sock.sendall(data)

    monkeypatch.setattr(transport, "_send_file", corrupting)
    with pytest.raises(ReplicationError, match="verification failed.*checksum mismatch"):
        client.push(fill(net.a, 0, 2, random_data(100_000, 9)))
    net.wait_reject("checksum mismatch")
    assert net.replica_steps() == [1] and net.replicas == [(0, 1)]
    monkeypatch.undo()
    # the client reconnects after the server dropped the connection
    assert client.push(fill(net.a, 0, 3, random_data(100_000, 10))) == 3
    assert net.replica_steps() == [1, 3]


@pytest.mark.parametrize("when", ["before-hello", "after-welcome", "after-auth"])
def test_random_bytes_are_rejected(net: Net, when: str) -> None:
    server = net.server()
    junk = random_data(4096, 11)
    if when == "after-auth":
        channel = net.channel(server)
        sock = channel.sock
    else:
        sock = socket.create_connection(server.address, timeout=5)
        if when == "after-welcome":
            sock.sendall(HELLO.pack(MAGIC, os.urandom(32), wire.run_tag(net.run_id)))
            transport._recv_exact(sock, wire.WELCOME.size, 5)
    try:
        sock.sendall(junk)
    except OSError:
        pass  # the server may already have hung up
    assert wait_for(lambda: len(net.rejects) == 1)
    expected = {"before-hello": "bad magic", "after-welcome": "bad client proof",
                "after-auth": "oversized frame"}[when]
    assert expected in net.reasons()
    sock.close()
    assert net.replica_steps() == []


@pytest.mark.parametrize("lengths", [(MAX_JSON + 1, 0), (10, MAX_META + 1), (2**32 - 1, 2**32 - 1)])
def test_oversized_lengths_are_rejected(net: Net, lengths: tuple[int, int]) -> None:
    server = net.server()
    channel = net.channel(server)
    channel.sock.sendall(FRAME.pack(*lengths))
    net.wait_reject("oversized frame")
    assert channel.sock.recv(1) == b""  # closed without reading what was announced
    channel.close()


def test_an_announced_frame_costs_memory_only_as_it_arrives(net: Net) -> None:
    """An authenticated peer announces the largest blob and sends a few bytes of it: the
    server holds about what arrived, not the 64 MiB announced."""
    import tracemalloc

    server = net.server()
    channel = net.channel(server)
    tracemalloc.start()
    try:
        channel.sock.sendall(FRAME.pack(100, wire.MAX_META) + b"x" * 10_000)
        time.sleep(0.5)  # the server's connection thread reads what arrived
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        channel.close()
    assert peak < 8 << 20, peak


def test_forged_and_replayed_frames_are_rejected(net: Net) -> None:
    server = net.server()
    channel = net.channel(server)
    frame = wire.seal_frame(channel._key, TO_SERVER, 0, {"op": "get", "rank": 0, "step": 1})
    channel.sock.sendall(frame)
    reply, _ = wire.open_frame(channel._key, TO_CLIENT, 1, transport._recv_exact(
        channel.sock, FRAME.size + len(json.dumps(
            {"ok": False, "error": "rank 0 step 1 is not held here"}, separators=(",", ":")))
        + wire.MAC_SIZE, 5))
    assert reply["ok"] is False
    channel.sock.sendall(frame)  # the same frame again: its sequence number is stale
    net.wait_reject("bad frame MAC")
    channel.close()
    forger = net.channel(server)
    forger.sock.sendall(wire.seal_frame(os.urandom(32), TO_SERVER, 0, {"op": "get"}))
    assert wait_for(lambda: net.reasons().count("bad frame MAC") == 2)
    forger.close()


def test_invalid_requests_are_refused(net: Net) -> None:
    server = net.server()
    data = random_data(1000, 12)
    meta = make_meta(data, 1)
    good = {"op": "put", "run_id": net.run_id, "rank": 0, "step": 1, "seq": 1, "world_size": WORLD,
            "data_len": len(data), "meta_hash": xxhash.xxh3_64_intdigest(meta)}
    bad: list[dict[str, Any]] = [
        {**good, "rank": -1}, {**good, "rank": WORLD}, {**good, "step": "1"}, {**good, "seq": True},
        {**good, "run_id": "other"}, {**good, "meta_hash": 1}, {**good, "data_len": -5},
        {**good, "op": "delete"}]
    for n, message in enumerate(bad, 1):
        channel = net.channel(server)
        channel.send(message, meta)
        with pytest.raises(ReplicationError, match="bad request"):
            wire.parse_reply(channel.recv()[0])
        assert wait_for(lambda: len(net.rejects) == n)  # noqa: B023
        channel.close()
    # a well-formed request too big for this host is refused; the connection stays usable
    channel = net.channel(server)
    channel.send({**good, "data_len": 1 << 45}, meta)
    with pytest.raises(ReplicationError, match="no slot"):
        wire.parse_reply(channel.recv()[0])
    channel.send({"op": "get", "rank": 0, "step": 1})
    with pytest.raises(ReplicationError, match="not held"):
        wire.parse_reply(channel.recv()[0])
    channel.close()
    assert len(net.rejects) == len(bad) and net.replica_steps() == [] and net.replicas == []


def test_slot_changing_during_push_is_aborted(net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    server = net.server()
    client = net.client(server)
    assert client.push(fill(net.a, 0, 1, random_data(100_000, 13))) == 1
    source = fill(net.a, 0, 2, random_data(100_000, 14))
    original = transport._send_file

    def racing_writer(sock: socket.socket, fd: int, offset: int, count: int, timeout: float, *,
                      pace: Callable[[int], None] | None = None) -> None:
        original(sock, fd, offset, count, timeout, pace=pace)
        # a new save lands in the slot while (here: right after) it is being sent
        memory.set_state(source.view, memory.SlotState.WRITING)
        source.view[memory.HEADER_SIZE] ^= 0xFF
        memory.write_commit(source.view, step=3, seq=next(_seq), rank=0, world_size=WORLD,
                            run_id=net.run_id, data_len=100_000, meta=make_meta(b"", 3))

    monkeypatch.setattr(transport, "_send_file", racing_writer)
    assert client.push(source) is None
    assert net.replica_steps() == [1] and net.replicas == [(0, 1)]
    assert net.rejects == []
    monkeypatch.undo()
    memory.set_state(source.view, memory.SlotState.WRITING)  # a save in progress: nothing to send
    assert client.push(source) is None
    assert net.replica_steps() == [1]


def test_pull_of_a_changing_or_corrupt_slot_commits_nothing(
        net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    server = net.server()
    assert net.client(server).push(fill(net.a, 0, 1, random_data(100_000, 22))) == 1
    held = net.b.find(0, 1)
    assert held is not None
    c = SlotOwner(run_id=net.run_id, host_id="hc", local_world_size=1)
    try:
        client = net.client(server)
        original = transport._send_file

        def rewritten(sock: socket.socket, fd: int, offset: int, count: int, timeout: float, *,
                      pace: Callable[[int], None] | None = None) -> None:
            original(sock, fd, offset, count, timeout, pace=pace)
            memory.set_state(held.view, memory.SlotState.WRITING)  # a new push lands there
            memory.write_commit(held.view, step=1, seq=next(_seq), rank=0, world_size=WORLD,
                                run_id=net.run_id, data_len=100_000,
                                meta=make_meta(slot_bytes(held), 1))

        monkeypatch.setattr(transport, "_send_file", rewritten)
        with pytest.raises(ReplicationError, match="changed while sending"):
            client.pull(0, 1, lambda n: c.write_target(0, n, replica=False))
        assert c.holdings([0], WORLD) == {0: []}

        def corrupting(sock: socket.socket, fd: int, offset: int, count: int, timeout: float, *,
                       pace: Callable[[int], None] | None = None) -> None:
            data = bytearray(os.pread(fd, count, offset))
            data[-1] ^= 0x01
            sock.settimeout(timeout)
            sock.sendall(data)

        monkeypatch.setattr(transport, "_send_file", corrupting)
        with pytest.raises(ReplicationError, match="failed verification"):
            client.pull(0, 1, lambda n: c.write_target(0, n, replica=False))
        assert c.holdings([0], WORLD) == {0: []}
        monkeypatch.undo()
        assert client.pull(0, 1, lambda n: c.write_target(0, n, replica=False)).step == 1
        assert c.holdings([0], WORLD) == {0: [1]}
    finally:
        c.close()


def test_port_probe_is_not_reported(net: Net) -> None:
    server = net.server()
    socket.create_connection(server.address, timeout=5).close()
    assert net.client(server).push(fill(net.a, 0, 1, random_data(1000, 23))) == 1
    time.sleep(0.05)
    assert net.rejects == []


def test_push_calls_pace_before_each_chunk(net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "SEND_CHUNK", 100_000)
    server = net.server()
    source = fill(net.a, 0, 1, random_data(400_000, 15))
    calls: list[int] = []

    def pace(sent: int) -> None:
        calls.append(sent)
        time.sleep(0.05)

    start = time.monotonic()
    assert net.client(server).push(source, pace=pace) == 1
    assert time.monotonic() - start >= 0.2  # four chunks, each after a 50 ms wait
    assert calls == [0, 100_000, 200_000, 300_000, 400_000]  # before each chunk and at the end
    assert {0, 100_000, 200_000, 300_000} <= set(calls)
    assert net.replica_steps() == [1]


def test_idle_connection_is_reopened(net: Net) -> None:
    server = net.server(idle_timeout=0.2)
    client = net.client(server)
    assert client.push(fill(net.a, 0, 1, random_data(1000, 18))) == 1
    time.sleep(0.5)  # the server has closed the idle connection
    assert client.push(fill(net.a, 0, 2, random_data(1000, 19))) == 2
    assert net.rejects == []


def test_close_joins_threads_and_is_idempotent(net: Net) -> None:
    server = net.server()
    client = net.client(server)
    assert client.push(fill(net.a, 0, 1, random_data(1000, 20))) == 1
    server.close()
    server.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("gemini-transport")]
    with pytest.raises(ReplicationError):
        client.push(fill(net.a, 0, 2, random_data(1000, 21)))
    client.close()
    client.close()


# -- the parser on bytes, fuzzed ----------------------------------------------------------

def _mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(6)
        pos = rng.randrange(len(out) + 1)
        if choice == 0 and out:
            out[min(pos, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif choice == 1:
            out[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif choice == 2:
            del out[pos:pos + rng.randint(1, 8)]
        elif choice == 3:
            out = out[:pos]
        elif choice == 4 and len(out) >= FRAME.size:
            out[0:FRAME.size] = FRAME.pack(rng.choice([0, 1, len(out), MAX_JSON, MAX_JSON + 1,
                                                       2**32 - 1]), rng.randrange(2**32))
        else:
            out[pos:pos] = rng.choice([b"{", b"}", b"[", b'"', b"\\u", b"\xff", b"1e999", b"-"])
    return bytes(out)


_VALUES: list[Any] = [None, True, False, 0, -1, 1, 2**63, 2**64, 2**70, -(2**70), 1.5, float("inf"),
                      "", "x", "put", "get", "end", [], {}, [1], {"a": 1}, "0" * 50]


def _parse_everything(message: dict[str, Any], blob: bytes, run_id: str) -> None:
    for parse in (lambda: wire.parse_request(message, blob, run_id=run_id),
                  lambda: wire.parse_reply(message),
                  lambda: wire.parse_slot_reply(message, blob, run_id=run_id, rank=0, step=1),
                  lambda: wire.parse_trailer(message)):
        try:
            parse()
        except ReplicationError:
            pass


# Complexity above 10: one fuzz loop with a branch per way a frame may be mangled.
def test_frame_parser_fuzz() -> None:  # noqa: C901
    rng = random.Random(20231023)
    key, run_id = bytes(range(32)), "fuzz-run"
    meta = make_meta(b"abc", 1)
    messages: list[tuple[dict[str, Any], bytes]] = [
        ({"op": "put", "run_id": run_id, "rank": 0, "step": 1, "seq": 3, "world_size": 2,
          "data_len": 3, "meta_hash": xxhash.xxh3_64_intdigest(meta)}, meta),
        ({"op": "get", "rank": 1, "step": 2}, b""),
        ({"op": "end", "stable": True}, b""),
        ({"ok": True, "run_id": run_id, "rank": 0, "step": 1, "seq": 3, "world_size": 2,
          "data_len": 3, "meta_hash": xxhash.xxh3_64_intdigest(meta)}, meta),
        ({"ok": False, "error": "no"}, b""),
    ]
    frames = [wire.seal_frame(key, TO_SERVER, 5, m, b) for m, b in messages]
    for frame, (message, blob) in zip(frames, messages, strict=True):
        assert wire.open_frame(key, TO_SERVER, 5, frame) == (message, blob)
        for seq, direction in ((4, TO_SERVER), (6, TO_SERVER), (5, TO_CLIENT)):
            with pytest.raises(ReplicationError, match="MAC"):
                wire.open_frame(key, direction, seq, frame)
    assert isinstance(wire.parse_request(*messages[0], run_id=run_id), PutRequest)
    assert wire.parse_request(*messages[1], run_id=run_id) == GetRequest(1, 2)

    start = time.monotonic()
    outcomes = {"rejected": 0, "accepted": 0}
    for i in range(10_000):
        if i % 4 == 0:
            data = rng.randbytes(rng.randrange(0, 300))
        else:
            data = _mutate(rng, rng.choice(frames))
        try:
            wire.open_frame(key, TO_SERVER, 5, data)
            outcomes["accepted"] += 1
            assert data in frames  # only an unmodified frame passes the MAC
        except ReplicationError:
            outcomes["rejected"] += 1
        for parse in (lambda: wire.parse_hello(data[:HELLO.size], run_id=run_id),  # noqa: B023
                      lambda: wire.parse_welcome(data[:wire.WELCOME.size]),  # noqa: B023
                      lambda: wire.frame_lengths(data[:FRAME.size])):  # noqa: B023
            try:
                parse()
            except ReplicationError:
                pass
    assert outcomes["rejected"] > 9000

    # behind a valid MAC (a peer that knows the secret): mutated JSON text and values
    for i in range(10_000):
        message, blob = rng.choice(messages)
        if i % 2:
            body = _mutate(rng, json.dumps(message).encode())
        else:
            changed = dict(message)
            for _ in range(rng.randint(1, 3)):
                changed[rng.choice([*message, "op", "ok", "x"])] = rng.choice(_VALUES)
            body = json.dumps(changed).encode()
        if rng.random() < 0.2:
            blob = _mutate(rng, blob)
        frame = wire.seal_raw(key, TO_CLIENT, i, body, blob)
        try:
            opened, opened_blob = wire.open_frame(key, TO_CLIENT, i, frame)
        except ReplicationError:
            continue
        _parse_everything(opened, opened_blob, run_id)
    deep = b"[" * 50_000 + b"]" * 50_000
    with pytest.raises(ReplicationError):
        wire.decode_json(deep[:MAX_JSON])
    assert time.monotonic() - start < 10


def test_secret_file_is_read_bounded() -> None:
    """--secret-file /dev/zero (endless, a device), a long or a missing file: one clear
    error, read bounded."""
    import tempfile

    from launcher.replication.service import load_secret

    with pytest.raises(ConfigError, match="is not a regular file"):
        load_secret("/dev/zero", None, "run")  # type: ignore[arg-type]
    with tempfile.NamedTemporaryFile() as long:
        long.write(b"k" * 10_000)
        long.flush()
        with pytest.raises(ConfigError, match="longer than 4096 bytes"):
            load_secret(long.name, None, "run")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot read the secret file"):
        load_secret("/nonexistent/secret", None, "run")  # type: ignore[arg-type]


def test_replication_listens_on_the_network_that_reaches_the_rendezvous() -> None:
    """Without --replication-addr the transport binds the address of the interface that
    routes to the rendezvous endpoint (here loopback), not every interface."""
    from launcher.replication.service import address_towards

    assert address_towards("127.0.0.1") == "127.0.0.1"
    assert address_towards("localhost") in ("127.0.0.1", "::1")
    assert address_towards("") is None and address_towards("no-such-host.invalid") is None


def test_a_flood_of_bad_hellos_is_reported_in_a_few_lines(net: Net) -> None:
    server = net.server()
    for _ in range(100):
        sock = _connect_from("127.0.0.3", server.address)
        sock.sendall(b"\x00" * wire.HELLO.size)
        sock.settimeout(5)
        try:
            sock.recv(1)
        except OSError:
            pass
        sock.close()
    time.sleep(0.2)
    assert 1 <= len(net.rejects) <= transport.REPORTS_PER_SOURCE, len(net.rejects)
    assert net.client(server).push(fill(net.a, 0, 1, random_data(10_000, 3))) == 1


def _close_during_push(client: Client, segment: memory.Segment) -> tuple[list[Any], float]:
    """Push ``segment`` from a thread; once it is blocked on the peer (1 s), close the
    client: what the push ended with, and seconds from the close to its end."""
    outcome: list[Any] = []

    def push() -> None:
        try:
            outcome.append(client.push(segment))
        except BaseException as exc:
            outcome.append(exc)

    pusher = threading.Thread(target=push, daemon=True)
    pusher.start()
    pusher.join(1.0)
    assert pusher.is_alive() and outcome == []  # blocked on the peer
    began = time.monotonic()
    client.close()
    pusher.join(30.0)
    assert not pusher.is_alive(), outcome
    return outcome, time.monotonic() - began


def test_closing_a_client_aborts_a_push_to_a_peer_that_stopped_reading(net: Net) -> None:
    """A peer that stops reading mid-push (a frozen host; here its server waits on its
    slot owner's lock) leaves the sender blocked until the client's timeout; closing the
    client (a new round without that peer) ends the push at once, without a retry."""
    server = net.server(timeout=60.0)
    client = net.client(server, timeout=60.0)
    assert client.push(fill(net.a, 0, 1, random_data(10_000, 3))) == 1  # connected
    big = fill(net.a, 0, 2, random_data(64 << 20, 4))
    with net.b._lock:  # the server cannot take a replica slot: it stops reading
        outcome, took = _close_during_push(client, big)
    assert took < 30  # not the 60 s timeout
    assert len(outcome) == 1 and isinstance(outcome[0], ReplicationError), outcome
    assert client.push(fill(net.a, 0, 3, random_data(10_000, 5))) == 3  # a new connection


@pytest.mark.parametrize("peer", ["accepts, never answers", "drops connection requests"])
def test_closing_a_client_aborts_a_connection_to_a_frozen_peer(net: Net, peer: str) -> None:
    """A stopped server's kernel still completes the TCP connection but nobody answers
    the handshake; a frozen or cut-off host answers no connection request at all (here:
    a listener whose accept queue is full, so its kernel drops them). Either way, closing
    the client (a new round without that peer) ends the push at once, not after the
    client's timeout."""
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(0)  # never accepted, never answered
    queued = []
    if peer == "drops connection requests":
        while True:  # fill the accept queue: later connection requests are dropped
            filler = socket.create_connection(frozen.getsockname(), timeout=5)
            queued.append(filler)
            probe = socket.socket()
            probe.settimeout(0.3)
            try:
                probe.connect(frozen.getsockname())
                queued.append(probe)
            except OSError:
                probe.close()
                break
    client = Client(frozen.getsockname(), secret=SECRET, run_id=net.run_id, timeout=60.0)
    try:
        outcome, took = _close_during_push(client, fill(net.a, 0, 1, random_data(10_000, 3)))
        assert took < 5, outcome
        assert len(outcome) == 1 and isinstance(outcome[0], ReplicationError), outcome
    finally:
        for sock in [frozen, *queued]:
            sock.close()
