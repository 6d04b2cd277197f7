"""Property-based fuzzing (hypothesis) of sealed frames and of the transport's request and
reply validation: what a peer that knows the secret may send. A few seconds each; the rest
of the fuzzing is in tests/unit/test_fuzz.py.

The property everywhere: any input either parses into something within the protocol's
bounds or raises ReplicationError; nothing else escapes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.errors import ReplicationError
from launcher.replication import wire
from launcher.replication.wire import TO_CLIENT, TO_SERVER, GetRequest, PingRequest

KEY = bytes(range(32))
RUN = "fuzz-run"
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# JSON values a peer may send, biased toward the protocol's field names and edge values.
_FIELDS = st.sampled_from(["op", "ok", "error", "run_id", "rank", "step", "seq", "world_size",
                           "data_len", "meta_hash", "keep", "round", "stable", "have",
                           "aborted"])
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False), st.text(max_size=80),
    st.sampled_from(["put", "get", "ping", "end", RUN, "0" * 64]))
_JSON = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=20)
_MESSAGES = st.dictionaries(st.one_of(_FIELDS, st.text(max_size=10)), _JSON, max_size=12)


def _check_request(request: wire.Request) -> None:
    if isinstance(request, PingRequest):
        return
    if isinstance(request, GetRequest):
        assert 0 <= request.rank and 0 <= request.step
        return
    header = request.header
    assert 0 <= header.rank < header.world_size <= wire.MAX_RANK
    assert 0 <= header.data_len <= wire.MAX_DATA and len(request.meta) == header.meta_len


@FAST
@given(_MESSAGES, st.binary(max_size=64), st.integers(0, 2**64 - 1), st.data())
def test_a_sealed_frame_opens_once_and_any_change_is_caught(
        message: dict[str, Any], blob: bytes, seq: int, data: st.DataObject) -> None:
    try:
        frame = wire.seal_frame(KEY, TO_CLIENT, seq, message, blob)
    except ValueError:  # not JSON (an infinite float): the sender refuses it
        return
    assert wire.open_frame(KEY, TO_CLIENT, seq, frame) == (
        json.loads(json.dumps(message)), blob)
    for wrong in ((KEY, TO_SERVER, seq), (KEY, TO_CLIENT, (seq + 1) % 2**64),
                  (bytes(32), TO_CLIENT, seq)):
        with pytest.raises(ReplicationError):
            wire.open_frame(*wrong, frame)
    position = data.draw(st.integers(0, len(frame) - 1))
    flip = data.draw(st.integers(1, 255))
    changed = bytearray(frame)
    changed[position] ^= flip
    with pytest.raises(ReplicationError):
        wire.open_frame(KEY, TO_CLIENT, seq, bytes(changed))


@FAST
@given(_MESSAGES, st.binary(max_size=256))
def test_any_message_behind_a_valid_mac_is_validated(message: dict[str, Any], blob: bytes) -> None:
    """What a peer that knows the secret may send: only ReplicationError, and whatever
    passes is within the protocol's bounds."""
    for parse in (lambda: _check_request(wire.parse_request(message, blob, run_id=RUN)),
                  lambda: wire.parse_reply(message),
                  lambda: wire.parse_slot_reply(message, blob, run_id=RUN, rank=0, step=1),
                  lambda: wire.parse_trailer(message)):
        try:
            parse()
        except ReplicationError:
            pass
