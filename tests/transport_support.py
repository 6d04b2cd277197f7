"""Helpers of the transport tests, shared by tests/unit/test_transport.py,
tests/integration/test_transport.py and the fuzz tests: committed slots of random bytes
with hook-format metadata, and two SlotOwners (hosts a and b) with b's servers and a's
clients."""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import xxhash
from helpers import TimedOut, poll

from launcher import memory
from launcher.replication import transport
from launcher.replication.transport import Client, Server
from launcher.slots import SlotOwner

SECRET = b"0123456789abcdef-test-secret"
WORLD = 2
_seq = itertools.count(1)


def make_meta(data: bytes, step: int, **fields: Any) -> bytes:
    """Hook-format metadata for ``data`` as two tensors with xxh3 checksums (``fields``
    added at the top level, e.g. ``replicated=True``)."""
    half = len(data) // 2
    tensors = [{"path": path, "dtype": "uint8", "shape": [end - start], "offset": start,
                "nbytes": end - start, "device": "cpu",
                "xxh3": f"{xxhash.xxh3_64_intdigest(data[start:end]):016x}"}
               for path, start, end in (("a", 0, half), ("b", half, len(data)))]
    return json.dumps({"step": step, **fields, "tensors": tensors, "blocks": [],
                       "tree": {}}).encode()


def fill(owner: SlotOwner, rank: int, step: int, data: bytes, **fields: Any) -> memory.Segment:
    """Commit ``data`` as ``step`` of ``rank`` in one of ``owner``'s own slots."""
    meta = make_meta(data, step, **fields)
    segment = owner.write_target(rank, memory.slot_size(len(data), len(meta)), replica=False)
    segment.view[memory.HEADER_SIZE:memory.HEADER_SIZE + len(data)] = data
    memory.write_commit(segment.view, step=step, seq=next(_seq), rank=rank, world_size=WORLD,
                        run_id=owner.run_id, data_len=len(data), meta=meta)
    return segment


def slot_bytes(segment: memory.Segment) -> bytes:
    header = memory.read_header(segment.view)
    assert header is not None
    return bytes(segment.view[memory.HEADER_SIZE:memory.HEADER_SIZE + header.data_len])


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether ``predicate()`` became true within ``timeout`` seconds (:func:`helpers.poll`)."""
    try:
        poll(predicate, timeout, "the condition", interval=0.01)
    except TimedOut:
        return False
    return True


@dataclass
class Net:
    """Host a (pusher), host b (runs the server), and what b's server reported."""

    run_id: str
    a: SlotOwner
    b: SlotOwner
    rejects: list[tuple[str, str]] = field(default_factory=list)
    replicas: list[tuple[int, int]] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)
    clients: list[Client] = field(default_factory=list)

    def server(self, **kwargs: Any) -> Server:
        server = Server(self.b, secret=SECRET, run_id=self.run_id,
                        on_reject=lambda peer, reason: self.rejects.append((peer, reason)),
                        on_replica=lambda rank, step: self.replicas.append((rank, step)), **kwargs)
        self.servers.append(server)
        return server

    def client(self, server: Server, *, secret: bytes = SECRET, run_id: str | None = None,
               timeout: float = 10.0) -> Client:
        client = Client(server.address, secret=secret, run_id=run_id or self.run_id,
                        timeout=timeout)
        self.clients.append(client)
        return client

    def channel(self, server: Server) -> transport._Channel:
        """A raw authenticated connection, for playing a misbehaving peer."""
        return transport._connect(server.address, secret=SECRET, run_id=self.run_id, timeout=5.0)

    def replica_steps(self) -> list[int]:
        return self.b.holdings(None, WORLD, replica=True).get(0, [])

    def reasons(self) -> str:
        return " | ".join(reason for _, reason in self.rejects)

    def wait_reject(self, text: str) -> None:
        assert wait_for(lambda: text in self.reasons()), f"no reject with {text!r}: {self.rejects}"


@pytest.fixture
def net(request: pytest.FixtureRequest) -> Iterator[Net]:
    run_id = f"test-{os.getpid()}-{request.node.name}"
    a = SlotOwner(run_id=run_id, host_id="ha", local_world_size=1)
    b = SlotOwner(run_id=run_id, host_id="hb", local_world_size=1)
    network = Net(run_id, a, b)
    try:
        yield network
    finally:
        for client in network.clients:
            client.close()
        for server in network.servers:
            server.close()
        a.close()
        b.close()
        prefix = memory.PREFIX + memory.run_key(run_id)
        left = memory.list_segments(prefix)
        for name in left:
            memory.unlink_segment(name)
        assert left == []


def random_data(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _connect_from(source: str, address: tuple[str, int]) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))  # another loopback address: another "host"
    sock.connect(address)
    return sock
