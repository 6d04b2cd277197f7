"""The rendezvous state codec: torch's state holder reads and writes signed JSON, and a
pickle (or anything else a party without the run's secret wrote) is refused unread; once
a host holds a verified state, such a value changes nothing and is written over."""

from __future__ import annotations

import base64
import datetime
import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousStateError, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    RendezvousSettings,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)

from launcher import rendezvous, rendezvous_state
from launcher.rendezvous_state import Codec, StateRefused, decode, encode, state_key

KEY = state_key(b"0123456789abcdef0123456789abcdef", "job")
NOW = datetime.datetime.now(datetime.timezone.utc)


@pytest.fixture(autouse=True)
def codec(monkeypatch: pytest.MonkeyPatch) -> Iterator[Codec]:
    """A codec of its own for each test (one that has verified no state yet), the one
    torch's holder and c10d backend use."""
    rendezvous_state.install()
    fresh = Codec()
    monkeypatch.setattr(rendezvous_state, "CODEC", fresh)
    monkeypatch.setattr(dynamic_rendezvous, "pickle", fresh)
    yield fresh


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


KEEP_ALIVE = datetime.timedelta(seconds=0.25)


def _holder(backend: RendezvousBackend) -> Any:
    """torch's holder; a newcomer's patience (rendezvous_state.PATIENCE keep-alives) is
    half a second, and no node's heartbeat goes stale during a test."""
    settings_ = RendezvousSettings("job", min_nodes=1, max_nodes=2,
                                   timeout=None, keep_alive_interval=KEEP_ALIVE,  # type: ignore[arg-type]
                                   keep_alive_max_attempt=100_000)
    return _BackendRendezvousStateHolder(backend, settings_, cache_duration=0)


def test_a_state_round_trips_exactly() -> None:
    state = _state()
    for key in (KEY, None):
        back = decode(encode(state, key), key)
        assert vars(back) == vars(state)


def test_torchs_holder_writes_and_reads_signed_json(codec: Codec) -> None:
    codec.key = KEY
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


@pytest.mark.parametrize("key", [KEY, None], ids=["secret", "no-secret"])
def test_a_planted_pickle_runs_no_code(tmp_path: Path, codec: Codec, key: bytes | None) -> None:
    """What an attacker on the c10d store's port writes (a pickle, raw or base64-encoded
    as torch's c10d backend stores it) is refused by the holder of a host that holds no
    state yet, and ignored by one that does: no code runs either way."""
    codec.key = key
    marker = tmp_path / "ran"
    payloads = (pickle.dumps(_Payload(marker)), base64.b64encode(pickle.dumps(_Payload(marker))))
    for bits in payloads:
        backend = _Backend()
        backend.value = bits
        with pytest.raises(RendezvousStateError):
            _holder(backend).sync()
    backend = _Backend()
    backend.value = encode(_state(), key)
    holder = _holder(backend)
    holder.sync()
    for bits in payloads:
        backend.value = bits
        holder.sync()
        assert vars(holder.state) == vars(_state())
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
        codec: Codec, capsys: pytest.CaptureFixture[str]) -> None:
    """An earlier run of this id left its state, signed with its own (dead) secret: a
    host of the new run that has verified no state yet reads it, once it is taken for
    such a leftover (see test_a_newcomer_*), as an empty state, so the new run
    rendezvous afresh, and says so once a minute."""
    codec.key = KEY
    old = encode(_state(), state_key(b"the earlier run's secret........", "job"))
    with pytest.raises(StateRefused, match="not signed with this run's secret"):
        codec.loads(old)
    codec.leftovers = True
    for _ in range(3):
        fresh = codec.loads(old)
        assert isinstance(fresh, _RendezvousState)
        # the next round: the keys round 3 left in the store are not read as this run's
        assert fresh.round == 4 and not fresh.participants and not fresh.complete
    assert capsys.readouterr().err.count("starting a new rendezvous state") == 1
    with pytest.raises(StateRefused):  # not gemini's format at all: still refused
        codec.loads(b"\x80\x04garbage")
    assert not codec.holds_verified()
    assert codec.loads(encode(_state(), KEY)).round == 3
    assert codec.holds_verified()


def _unverifiable(state: _RendezvousState) -> dict[str, bytes]:
    """What a party without the run's secret can write over ``state``, by what a host
    that reads it says about it."""
    later = _state()
    later.round, later.participants, later.complete = state.round + 5, {}, False
    signed = encode(later, KEY)
    return {
        "forged MAC": signed.replace(signed.split(b" ")[2], b"0" * 64),
        "another secret": encode(later, state_key(b"another secret of 32 bytes......", "job")),
        "unsigned": encode(later, None),
        "junk": b"garbage",
        "empty": b"",
        "pickle": pickle.dumps(later),
        "gemini's magic, no JSON": rendezvous_state.MAGIC + b"- {",
    }


def test_once_a_state_is_verified_an_unverifiable_one_changes_nothing(
        codec: Codec, capsys: pytest.CaptureFixture[str]) -> None:
    """A host that verified a state of this run reads anything it cannot verify or parse
    as that state (a fresh copy each time: torch's holder changes it in place), and says
    why once a minute for each kind; a state it verifies later is the one kept next."""
    codec.key = KEY
    verified = _state()
    assert vars(codec.loads(encode(verified, KEY))) == vars(verified)
    for _ in range(3):
        for bits in _unverifiable(verified).values():
            kept = codec.loads(bits)
            assert vars(kept) == vars(verified)
            kept.round, kept.participants = 99, {}
    err = capsys.readouterr().err.splitlines()
    bad_signature = [line for line in err if "ignoring a rendezvous value with a bad signature" in line]
    not_gemini = [line for line in err if "ignoring a rendezvous value that is not a gemini state" in line]
    assert len(bad_signature) == 1 and len(not_gemini) == 1 and len(err) == 2, err
    assert "last state it verified (round 3)" in bad_signature[0]
    newer = _state()
    newer.round = 4
    codec.loads(encode(newer, KEY))
    assert codec.loads(b"garbage").round == 4
    rendezvous_state.use_secret(b"0123456789abcdef0123456789abcdef", "job")  # a new run
    assert not rendezvous_state.CODEC.holds_verified()
    with pytest.raises(StateRefused):
        rendezvous_state.CODEC.loads(b"garbage")


def test_without_a_secret_a_verified_state_is_kept_against_junk(codec: Codec) -> None:
    """A run without a secret reads unsigned JSON (anyone may write it), but a value that
    is not a gemini state changes nothing there either."""
    assert vars(codec.loads(encode(_state(), None))) == vars(_state())
    for bits in (b"garbage", pickle.dumps(_state()), encode(_state(), KEY)):
        assert vars(codec.loads(bits)) == vars(_state())


def test_the_holder_writes_a_signed_state_over_a_forged_one(codec: Codec) -> None:
    """torch's holder, over a backend whose token is the value's bytes (as etcd-v3's):
    a forged value read changes nothing, and the next write replaces it."""
    codec.key = KEY
    backend = _Backend()
    backend.value = encode(_state(), KEY)
    holder = _holder(backend)
    holder.sync()
    for bits in _unverifiable(_state()).values():
        backend.value = bits
        assert holder.sync() is None and vars(holder.state) == vars(_state())
        holder.state.last_heartbeats[_NodeDesc("h0", 10, 0)] = NOW
        holder.mark_dirty()
        assert holder.sync() is True
        assert backend.value is not None and vars(decode(backend.value, KEY)) == vars(_state())


@pytest.fixture
def c10d_store() -> Iterator[TCPStore]:
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    yield store
    del store


#: What a party without the secret can write into the c10d store's key, as it is stored
#: (torch's c10d backend keeps the state in base64): every value of _unverifiable, and
#: values that are not base64 or not even UTF-8, nothing, and torch's "no state yet".
_RAW = [b"garbage", b"\xff\xfe\x00junk", b"", b"Y2FuaW1hZGFt", b"!!!"]


@pytest.fixture
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's holders sync as ``gemini run`` makes them (launcher.rendezvous: patient
    with a value a newcomer cannot verify), in this test alone."""
    monkeypatch.setattr(_BackendRendezvousStateHolder, "sync",
                        rendezvous._fresh_after_change(_BackendRendezvousStateHolder.sync))


@pytest.mark.usefixtures("patient")
def test_the_c10d_backend_hands_any_value_over_and_writes_over_it(
        codec: Codec, c10d_store: TCPStore) -> None:
    """Two hosts on torch's c10d backend, between heartbeats of a running round: whatever
    a stranger writes into the key (a forged state, junk, bytes that are not base64 or
    UTF-8, nothing, torch's own "no state yet" marker) changes neither host's round; the
    first host to write replaces it by compare-and-set, and the other, whose write then
    fails, reads that signed state and writes again: nothing loops, nothing stops."""
    codec.key = KEY
    hosts = [_holder(C10dRendezvousBackend(c10d_store, "job")) for _ in range(2)]
    vars(hosts[0].state).update(vars(_state()))
    hosts[0].mark_dirty()
    assert hosts[0].sync() is True
    assert hosts[1].sync() is None and vars(hosts[1].state) == vars(_state())
    key = "torch.rendezvous.job"
    values = [base64.b64encode(bits) for bits in _unverifiable(_state()).values()] + _RAW
    nodes = sorted(_state().participants)
    for number, value in enumerate(values):
        signed = vars(decode(base64.b64decode(c10d_store.get(key)), KEY))
        c10d_store.set(key, value)
        for host in hosts:  # the newest state this process verified: the one in the store
            assert host.sync() is None and vars(host.state) == signed, value
        beat = NOW + datetime.timedelta(seconds=number + 1)
        for host, node in zip(hosts, nodes, strict=True):  # both heartbeat at once
            host.state.last_heartbeats[node] = beat
            host.mark_dirty()
        assert hosts[0].sync() is True, value
        assert hosts[1].sync() is False, value  # its token was the stranger's value
        assert hosts[1].state.last_heartbeats == {**signed["last_heartbeats"], nodes[0]: beat}
        hosts[1].state.last_heartbeats[nodes[1]] = beat  # as torch's op does once more
        hosts[1].mark_dirty()
        assert hosts[1].sync() is True, value
        stored = decode(base64.b64decode(c10d_store.get(key)), KEY)
        assert (stored.round, stored.participants, stored.complete) == (3, _state().participants,
                                                                        True)
        assert [stored.last_heartbeats[node] for node in nodes] == [beat, beat]
    codec.forget()  # a newcomer: what stays stops it, and says why
    c10d_store.set(key, b"\xff\xfe\x00junk")
    with pytest.raises(RendezvousStateError, match="not gemini's signed JSON"):
        _holder(C10dRendezvousBackend(c10d_store, "job")).sync()
    # a c10d store dies with its run: a state signed with another secret is no earlier
    # run's, and the newcomer does not start a round of its own over the running one
    c10d_store.set(key, base64.b64encode(_unverifiable(_state())["another secret"]))
    with pytest.raises(RendezvousStateError, match="not signed with this run's secret"):
        _holder(C10dRendezvousBackend(c10d_store, "job")).sync()


def _patient_holder(codec: Codec, value: bytes) -> tuple[_Backend, Any]:
    """A newcomer's holder (its codec has verified nothing) over a store holding ``value``."""
    codec.key = KEY
    backend = _Backend()
    backend.value = value
    return backend, _holder(backend)


@pytest.mark.usefixtures("patient")
def test_a_newcomer_waits_for_the_running_hosts_to_write_over_a_forgery(codec: Codec) -> None:
    """A host that comes while a forged state of a later round sits in the store (or
    junk) reads again until the running hosts' next heartbeat writes their signed state
    over it, and joins that round: it neither stops nor starts a round of its own."""
    import threading

    for forged in _unverifiable(_state()).values():
        codec.forget()
        backend, newcomer = _patient_holder(codec, forged)
        heartbeat = threading.Timer(0.2, lambda b=backend: setattr(b, "value", encode(_state(), KEY)))
        heartbeat.start()
        assert newcomer.sync() is None
        heartbeat.join()
        assert vars(newcomer.state) == vars(_state()) and codec.holds_verified()


@pytest.mark.usefixtures("patient")
def test_a_newcomer_takes_another_secrets_state_that_stays_for_an_earlier_runs(
        codec: Codec) -> None:
    """A state signed with another secret that no running host writes over within the
    newcomer's patience is an earlier run's: an empty state of its next round."""
    import time

    old = encode(_state(), state_key(b"the earlier run's secret........", "job"))
    _, newcomer = _patient_holder(codec, old)
    began = time.monotonic()
    assert newcomer.sync() is None
    assert time.monotonic() - began >= rendezvous_state.PATIENCE * KEEP_ALIVE.total_seconds()
    assert newcomer.state.round == 4 and not newcomer.state.participants
    assert not codec.leftovers  # only for that read
    with pytest.raises(StateRefused):
        codec.loads(old)


@pytest.mark.usefixtures("patient")
@pytest.mark.parametrize("value", [b"garbage", pickle.dumps(_state())], ids=["junk", "pickle"])
def test_a_newcomer_stops_on_junk_that_stays_and_says_why(codec: Codec, value: bytes) -> None:
    """Junk that stays in the store stops a newcomer (it has no state of its own to go
    on with), with why in the message rather than torch's "corrupt"."""
    _, newcomer = _patient_holder(codec, value)
    with pytest.raises(RendezvousStateError, match="^the rendezvous state is not gemini's "
                                                   "signed JSON"):
        newcomer.sync()


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
