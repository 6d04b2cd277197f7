"""The rendezvous state codec: torch's state holder reads and writes signed JSON, and a
pickle (or anything else a party without the run's secret wrote) is refused unread."""

from __future__ import annotations

import base64
import datetime
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    RendezvousSettings,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)

from launcher import rendezvous_state
from launcher.rendezvous_state import StateRefused, decode, encode, state_key

KEY = state_key(b"0123456789abcdef0123456789abcdef", "job")
NOW = datetime.datetime.now(datetime.timezone.utc)


class _Backend(RendezvousBackend):
    """One value, the token its bytes, as torch's c10d backend keeps it."""

    def __init__(self) -> None:
        self.value: bytes | None = None

    @property
    def name(self) -> str:
        return "memory"

    def get_state(self) -> tuple[bytes, Any] | None:
        return None if self.value is None else (self.value, self.value)

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        if token != self.value:
            return self.get_state() + (False,)  # type: ignore[operator]
        self.value = state
        return state, state, True


def _state() -> _RendezvousState:
    now = NOW
    a, b, spare = _NodeDesc("h0", 10, 0), _NodeDesc("h1", 11, 0), _NodeDesc("h2", 12, 1)
    state = _RendezvousState()
    state.round, state.complete, state.closed = 3, True, False
    state.deadline = now.replace(tzinfo=None)
    state.participants = {a: 0, b: 1}
    state.wait_list = {spare}
    state.redundancy_list = {spare}
    state.last_heartbeats = {a: now, b: now, spare: now}
    return state


def _holder(backend: _Backend) -> Any:
    settings_ = RendezvousSettings("job", min_nodes=1, max_nodes=2,
                                   timeout=None, keep_alive_interval=datetime.timedelta(seconds=5),  # type: ignore[arg-type]
                                   keep_alive_max_attempt=3)
    return _BackendRendezvousStateHolder(backend, settings_, cache_duration=0)


def test_a_state_round_trips_exactly() -> None:
    state = _state()
    for key in (KEY, None):
        back = decode(encode(state, key), key)
        assert vars(back) == vars(state)


def test_torchs_holder_writes_and_reads_signed_json(monkeypatch: Any) -> None:
    rendezvous_state.install()
    monkeypatch.setattr(rendezvous_state.CODEC, "key", KEY)
    backend = _Backend()
    writer = _holder(backend)
    writer._state = _state()
    writer.mark_dirty()
    writer.sync()
    assert backend.value is not None and backend.value.startswith(rendezvous_state.MAGIC)
    json.loads(backend.value.split(b" ", 3)[3])  # the body is plain JSON
    reader = _holder(backend)
    reader.sync()
    assert vars(reader.state) == vars(writer.state)


class _Payload:
    """A pickle that would create a file when unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("key", [KEY, None])
def test_a_planted_pickle_runs_no_code(tmp_path: Path, monkeypatch: Any, key: bytes | None) -> None:
    """What an attacker on the c10d store's port writes (a pickle, raw or base64-encoded
    as torch's c10d backend stores it) is refused by the holder: no code runs."""
    rendezvous_state.install()
    monkeypatch.setattr(rendezvous_state.CODEC, "key", key)
    marker = tmp_path / "ran"
    for bits in (pickle.dumps(_Payload(marker)),
                 base64.b64encode(pickle.dumps(_Payload(marker)))):
        backend = _Backend()
        backend.value = bits
        with pytest.raises(RendezvousStateError):
            _holder(backend).sync()
    assert not marker.exists()


def test_a_state_without_the_runs_secret_is_refused() -> None:
    state = _state()
    with pytest.raises(StateRefused, match="not signed with this run's secret"):
        decode(encode(state, state_key(b"another secret of 32 bytes......", "job")), KEY)
    with pytest.raises(StateRefused, match="not signed with this run's secret"):
        decode(encode(state, None), KEY)  # unsigned, where the run has a secret
    with pytest.raises(StateRefused, match="has no secret"):
        decode(encode(state, KEY), None)
    forged = encode(state, KEY).replace(b'"round":3', b'"round":4')
    with pytest.raises(StateRefused):
        decode(forged, KEY)
    with pytest.raises(StateRefused):
        decode(encode(state, KEY), state_key(b"0123456789abcdef0123456789abcdef", "other-job"))


def test_a_state_signed_with_another_secret_reads_as_a_new_one(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An earlier run of this id left its state, signed with its own (dead) secret: the
    codec torch calls reads it as an empty state, so the new run rendezvous afresh
    (a forger without the secret changes nothing either), and says so once a minute."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    monkeypatch.setattr(rendezvous_state.CODEC, "key", KEY)
    monkeypatch.setattr(rendezvous_state.CODEC, "_warned", -1e9)
    old = encode(_state(), state_key(b"the earlier run's secret........", "job"))
    for _ in range(3):
        fresh = rendezvous_state.CODEC.loads(old)
        assert isinstance(fresh, _RendezvousState)
        # the next round: the keys round 3 left in the store are not read as this run's
        assert fresh.round == 4 and not fresh.participants and not fresh.complete
    assert capsys.readouterr().err.count("starting a new rendezvous state") == 1
    assert rendezvous_state.CODEC.loads(encode(_state(), KEY)).round == 3
    with pytest.raises(StateRefused):  # not gemini's format at all: still refused
        rendezvous_state.CODEC.loads(b"\x80\x04garbage")


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)
_fields = st.fixed_dictionaries({}, optional={
    name: _json for name in ("round", "complete", "deadline", "closed", "participants",
                             "wait_list", "redundancy_list", "last_heartbeats")})


@settings(max_examples=300, deadline=None)
@given(body=st.one_of(_fields, _json), signed=st.booleans(), noise=st.binary(max_size=64))
def test_any_unsigned_or_malformed_bytes_give_a_clean_refusal(body: Any, signed: bool,
                                                              noise: bytes) -> None:
    """Random JSON under a valid signature, and random bytes, decode to a state or fail
    with StateRefused; nothing else escapes."""
    import hashlib
    import hmac

    raw = json.dumps(body).encode()
    mac = hmac.new(KEY, raw, hashlib.sha256).hexdigest().encode()
    for bits in (rendezvous_state.MAGIC + mac + b" " + raw, noise,
                 rendezvous_state.MAGIC + noise):
        try:
            state = decode(bits, KEY if signed else None)
        except StateRefused:
            continue
        assert isinstance(state, _RendezvousState)
