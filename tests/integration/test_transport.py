"""The transport's server against peers that stall or hold connections open: each test
waits out a timeout of the server's (seconds). The rest of the transport's tests are in
tests/unit/test_transport.py.
"""

from __future__ import annotations

import os
import socket

from transport_support import WORLD, Net, _connect_from, fill, make_meta, net, random_data, wait_for

from launcher import memory
from launcher.replication import wire
from launcher.replication.wire import HELLO, MAGIC, TO_SERVER

__all__ = ["net"]  # a fixture (transport_support), used by name


def test_stalled_peers_do_not_block_others(net: Net) -> None:
    server = net.server(timeout=1.5, handshake_timeout=1.5)
    half_hello = socket.create_connection(server.address, timeout=5)
    half_hello.sendall(HELLO.pack(MAGIC, os.urandom(32), wire.run_tag(net.run_id))[:10])
    half_frame = net.channel(server)
    half_frame.sock.sendall(wire.seal_frame(half_frame._key, TO_SERVER, 0,
                                            {"op": "get", "rank": 0, "step": 0})[:12])
    data = random_data(100_000, 16)
    source = fill(net.a, 1, 5, data)
    header = memory.read_header(source.view)
    assert header is not None
    half_data = net.channel(server)
    half_data.send({"op": "put", **wire.slot_message(header, net.run_id)}, make_meta(data, 5))
    assert wire.parse_reply(half_data.recv()[0]) == {"ok": True}
    half_data.sock.sendall(data[:1000])
    # while three peers stall mid-hello, mid-frame and mid-data, another one is served
    assert net.client(server).push(fill(net.a, 0, 1, random_data(100_000, 17))) == 1
    assert net.rejects == []
    # and each stalled connection is dropped after the timeout, not held forever
    assert wait_for(lambda: len(net.rejects) == 3, timeout=10)
    assert "timed out" in net.reasons() and "stalled" in net.reasons()
    assert net.b.holdings(None, WORLD, replica=True) == {0: [1], 1: []}
    for sock in (half_hello, half_frame.sock, half_data.sock):
        sock.close()


def test_idle_unauthenticated_connections_never_lock_peers_out(net: Net) -> None:
    """A neighbour opens 80 connections (more than the server's 64) and never says
    hello: past 4 from its address the server refuses them at once, a real peer pushes
    meanwhile, and the held ones are dropped at the handshake deadline."""
    server = net.server(handshake_timeout=3.0)
    idle = [_connect_from("127.0.0.2", server.address) for _ in range(80)]
    try:
        assert net.client(server).push(fill(net.a, 0, 1, random_data(10_000, 1))) == 1
        closed = 0
        for sock in idle:
            sock.settimeout(5)
            try:
                closed += sock.recv(1) == b""
            except OSError:
                closed += 1
        assert closed == 80  # refused at once, or dropped after the deadline
        assert net.client(server).push(fill(net.a, 0, 2, random_data(10_000, 2))) == 2
    finally:
        for sock in idle:
            sock.close()
