"""Property-based fuzzing (hypothesis) of what a hostile peer controls: the transport's
frame parser, and the handshake of a live server.

The property everywhere: any input either parses into something within the protocol's
bounds or raises ReplicationError; nothing else escapes, and a live server keeps serving
real peers whatever strangers sent it. The fuzzing of sealed frames and of the request and
reply validation (seconds each) is in tests/integration/test_fuzz.py.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transport_support import SECRET, fill, slot_bytes

from launcher.errors import ReplicationError
from launcher.replication import wire
from launcher.replication.transport import Client, Server
from launcher.replication.wire import (
    FRAME,
    HELLO,
    MAC_SIZE,
    MAGIC,
    MAX_JSON,
    NONCE_SIZE,
    TO_SERVER,
    WELCOME,
)
from launcher.slots import SlotOwner

KEY = bytes(range(32))
RUN = "fuzz-run"
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.binary(max_size=4 * (FRAME.size + MAC_SIZE)), st.integers(0, 3))
def test_arbitrary_bytes_never_open_as_a_frame(data: bytes, seq: int) -> None:
    with pytest.raises(ReplicationError):
        wire.open_frame(KEY, TO_SERVER, seq, data)
    try:
        json_len, blob_len = wire.frame_lengths(data[:FRAME.size])
    except ReplicationError:
        return
    assert json_len <= MAX_JSON and blob_len <= wire.MAX_META


@FAST
@given(st.binary(max_size=2 * HELLO.size))
def test_arbitrary_hello_and_welcome(data: bytes) -> None:
    for parse, size in ((lambda d: wire.parse_hello(d, run_id=RUN), HELLO.size),
                        (wire.parse_welcome, WELCOME.size)):
        try:
            nonce = parse(data)
        except ReplicationError:
            continue
        assert len(data) == size and data.startswith(MAGIC) and len(nonce) == NONCE_SIZE


# -- a live server -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live() -> Iterator[tuple[Server, SlotOwner, list[str]]]:
    run_id = f"fuzz-{os.getpid()}"
    a = SlotOwner(run_id=run_id, host_id="fa", local_world_size=1)
    b = SlotOwner(run_id=run_id, host_id="fb", local_world_size=1)
    rejects: list[str] = []
    server = Server(b, secret=SECRET, run_id=run_id, handshake_timeout=0.3,
                    on_reject=lambda peer, reason: rejects.append(reason))
    try:
        yield server, a, rejects
    finally:
        server.close()
        a.close()
        b.close()


_HELLOS = st.one_of(
    st.binary(max_size=2 * HELLO.size),
    st.builds(lambda magic, nonce, tag: HELLO.pack(magic, nonce, tag),
              st.sampled_from([MAGIC, b"GEMtrns0", bytes(8)]), st.binary(min_size=32, max_size=32),
              st.binary(min_size=16, max_size=16)))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(hello=_HELLOS, rest=st.lists(st.binary(max_size=80), max_size=3), right_tag=st.booleans())
def test_strangers_never_get_through_the_handshake(
        live: tuple[Server, SlotOwner, list[str]], hello: bytes, rest: list[bytes],
        right_tag: bool) -> None:
    """A stranger's bytes at every step of the handshake, with the right run tag or not:
    the server answers at most its nonce, never a proof or a frame, and closes."""
    server, _, _ = live
    if right_tag and len(hello) == HELLO.size:
        magic, nonce, _ = HELLO.unpack(hello)
        hello = HELLO.pack(magic, nonce, wire.run_tag(server.run_id))
    received = b""
    with socket.create_connection(server.address, timeout=5) as sock:
        try:
            for chunk in (hello, *rest):
                sock.sendall(chunk)
            sock.shutdown(socket.SHUT_WR)
            while True:
                got = sock.recv(4096)
                if not got:
                    break
                received += got
        except OSError:
            pass  # reset by the server: as good as closed
    assert len(received) in (0, WELCOME.size), received[:80]


def test_real_peers_are_served_after_the_fuzzing(live: tuple[Server, SlotOwner, list[str]]) -> None:
    server, a, _ = live
    data = os.urandom(64 << 10)
    client = Client(server.address, secret=SECRET, run_id=server.run_id, timeout=10.0)
    try:
        assert client.push(fill(a, 0, 5, data)) == 5
    finally:
        client.close()
    replica = server.slots.find(0, 5)
    assert replica is not None and slot_bytes(replica) == data
