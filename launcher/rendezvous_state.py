"""The rendezvous state as it travels: JSON, never pickle, and signed with the run's secret.

torch's dynamic rendezvous (the c10d, etcd-v2 and gemini's etcd-v3 backends) keeps its
state, the round, its participants and their heartbeats, as one pickled value in a store,
and every host unpickles whatever it reads there. The c10d backend's store is a TCPStore
that anyone who reaches its port can write to, without a password: a pickle written
there runs its code on every host of the job. :func:`install` makes torch's state holder
encode the state with this module instead (:data:`CODEC` stands in for the ``pickle``
module that ``dynamic_rendezvous`` calls), so that:

- nothing read from a rendezvous store is unpickled: the state is plain JSON, parsed by
  a strict schema into torch's own ``_RendezvousState``; nothing else is taken for one;
- with the run's secret (``--secret-file``, or the one an etcd or embedded store holds),
  every state carries an HMAC-SHA256 of its bytes;
- once a host has read a state of this run (its own first write, read back, is one), a
  value it cannot verify or parse changes nothing: it goes on with the last state it
  verified, says why at most once a minute, and its next write replaces the value by
  compare-and-set (torch's c10d backend is made to hand over any value it reads, and to
  compare-and-set against it). A party without the secret can neither run code nor
  change the membership or the round;
- before that (a host that comes to a running job), it reads again for up to
  :data:`PATIENCE` keep-alive intervals, in which the hosts of a running round write a
  signed state over the value (:func:`sync_patiently`). Then, where the store may hold
  an earlier run's state (etcd: not c10d's store, which dies with the run), a state
  signed with another secret counts as an empty state of the next round, so that the
  state an earlier run of the same id left (signed with that run's secret, which died
  with it) does not stop a new run; anything else is refused (:class:`StateRefused`:
  the host stops, with one line saying why).

Format: ``gemini-rdzv 1 <mac> <json>`` (``-`` as the mac without a secret), where the
MAC is keyed with ``HMAC(secret, "gemini rendezvous state" | run id)``.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import math
import pickle
import sys
import time
from collections.abc import Callable
from typing import Any

MAGIC = b"gemini-rdzv 1 "
MAX_BYTES = 32 << 20
"""The largest state accepted: about 200,000 nodes' entries."""
_UNSIGNED = b"-"
_MAC_LEN = 64  # hex digits of an HMAC-SHA256
WARN_EVERY = 60.0
"""Seconds between two warnings of one kind about a state this host does not use."""
PATIENCE = 2
"""Keep-alive intervals a host that has verified no state of its run yet reads again a
value it cannot verify: the hosts of a running round heartbeat once an interval (a beat
may come up to half an interval late), and their write replaces the value."""
_REREAD = 0.05


class StateRefused(pickle.UnpicklingError):
    """A rendezvous state that was not written by a host of this run, or is malformed
    (torch's state holder turns a ``pickle.PickleError`` into ``RendezvousStateError``)."""


class OtherSecret(StateRefused):
    """A state in gemini's format signed with another secret than this host's (or signed
    where this host has none, or the reverse)."""


def state_key(secret: bytes, run_id: str) -> bytes:
    """The MAC key of ``run_id``'s rendezvous states, derived from the run's secret."""
    return hmac.new(secret, b"gemini rendezvous state\0" + run_id.encode(), hashlib.sha256).digest()


def encode(state: Any, key: bytes | None) -> bytes:
    """``state`` (torch's ``_RendezvousState``) as signed JSON."""
    body = json.dumps({
        "round": state.round,
        "complete": state.complete,
        "deadline": _time(state.deadline),
        "closed": state.closed,
        "participants": [[*_node(n), rank] for n, rank in state.participants.items()],
        "wait_list": [_node(n) for n in state.wait_list],
        "redundancy_list": [_node(n) for n in state.redundancy_list],
        "last_heartbeats": [[*_node(n), _time(t)] for n, t in state.last_heartbeats.items()],
    }, separators=(",", ":")).encode()
    mac = _UNSIGNED if key is None else hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    return MAGIC + mac + b" " + body


def decode(bits: bytes, key: bytes | None) -> Any:
    """The ``_RendezvousState`` that ``bits`` hold; :class:`StateRefused` unless they are
    this module's encoding, signed with ``key`` when there is one."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    if not isinstance(bits, bytes) or len(bits) > MAX_BYTES or not bits.startswith(MAGIC):
        raise StateRefused("the rendezvous state is not gemini's signed JSON (written by "
                           "something other than a gemini host of this run)")
    mac, _, body = bits[len(MAGIC):].partition(b" ")
    if key is not None:
        expected = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
        if len(mac) != _MAC_LEN or not hmac.compare_digest(mac, expected):
            raise OtherSecret("the rendezvous state is not signed with this run's secret "
                               "(written by a party without it, or a host with another "
                               "--secret-file)")
    elif mac != _UNSIGNED:
        raise OtherSecret("the rendezvous state is signed but this host has no secret for "
                           "this run (give every host the same --secret-file)")
    try:
        raw = json.loads(body)
        state = _RendezvousState()
        state.round = _int(raw["round"])
        state.complete = _bool(raw["complete"])
        state.deadline = None if raw["deadline"] is None else _parse_time(raw["deadline"])
        state.closed = _bool(raw["closed"])
        state.participants = {_parse_node(e[:3]): _int(e[3]) for e in _entries(raw["participants"], 4)}
        state.wait_list = {_parse_node(e) for e in _entries(raw["wait_list"], 3)}
        state.redundancy_list = {_parse_node(e) for e in _entries(raw["redundancy_list"], 3)}
        state.last_heartbeats = {_parse_node(e[:3]): _parse_time(e[3])
                                 for e in _entries(raw["last_heartbeats"], 4)}
    except (ValueError, TypeError, KeyError, OverflowError) as exc:
        raise StateRefused(f"malformed rendezvous state: {exc}") from None
    return state


class Codec:
    """What torch's ``dynamic_rendezvous`` module calls as ``pickle``: ``dumps``/``loads``
    of its state with :func:`encode`/:func:`decode`, under :attr:`key`. One rendezvous per
    process: the state it verified last is the process's."""

    PickleError = pickle.PickleError

    def __init__(self) -> None:
        self.key: bytes | None = None
        self.leftovers = False
        """Whether, while no state of this run is verified, a state signed with another
        secret reads as an empty state of the next round (else it is refused):
        :func:`sync_patiently` sets it once such a state stayed too long to be a forgery
        the hosts of a running round would write over."""
        self._verified: tuple[bytes | None, bytes] | None = None  # (key, bits) last read
        self._warned: dict[str, float] = {}

    def dumps(self, state: Any) -> bytes:
        return encode(state, self.key)

    def holds_verified(self) -> bool:
        """Whether this process has read a state of this run (under :attr:`key`) back."""
        return self._verified is not None and self._verified[0] == self.key

    def loads(self, bits: bytes) -> Any:
        """The state ``bits`` hold; once this process has verified a state of this run,
        the last one it verified in place of any it cannot verify or parse (a value
        written by a party without the secret, which must change nothing: torch's holder
        then writes its own state over it, by compare-and-set against these bits), said
        on stderr at most once a minute for each kind.

        Before that, :class:`StateRefused`; with :attr:`leftovers`, a state signed with
        another secret (:class:`OtherSecret`) reads as a fresh, empty state of the next
        round instead: the state an earlier run of this id left behind (its secret died
        with it), which no host of this run can use."""
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

        try:
            state = decode(bits, self.key)
        except StateRefused as exc:
            last = self._verified
            if last is not None and last[0] == self.key:
                kept = decode(last[1], self.key)
                why = ("with a bad signature" if isinstance(exc, OtherSecret)
                       else "that is not a gemini state")
                self._warn(why, f"ignoring a rendezvous value {why}: {exc}; this host goes "
                                f"on with the last state it verified (round {kept.round}), "
                                "and its next write replaces the value")
                return kept
            if not (self.leftovers and isinstance(exc, OtherSecret)):
                raise
            self._warn("leftover", f"{exc}; starting a new rendezvous state (the one left "
                                   "by an earlier run of this id is ignored)")
            state = _RendezvousState()
            state.round = _next_round(bits)
            return state
        self._verified = (self.key, bits)
        return state

    def forget(self) -> None:
        """Drop the state last verified (a new run in this process)."""
        self._verified = None

    def _warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(kind, -math.inf) >= WARN_EVERY:
            self._warned[kind] = now
            print(f"gemini: warning: {message}", file=sys.stderr, flush=True)


CODEC = Codec()


class _Verbatim(bytes):
    """A c10d rendezvous token that is the stored value's own bytes: torch's c10d backend
    compares the stored value with ``token.decode()``, and for a value that is not base64
    (not UTF-8 either, or empty) there is no such string. This token hands the store its
    bytes, which it compares byte for byte, so that a host's compare-and-set replaces
    whatever was written there instead of failing against it for ever."""

    def __bool__(self) -> bool:  # torch reads an empty token as "no state yet"
        return True

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> Any:
        return bytes(self)


def _undecoded_values_verbatim(decode_state: Any) -> Any:
    """torch's c10d ``_decode_state``, which refuses a stored value that is not base64
    (``RendezvousStateError``: the host stops) and reads its "no state yet" marker as no
    state (the host starts over at round 0): such a value, and once this process holds
    a verified state also the marker (which only a stranger writes then), is handed to
    :data:`CODEC` as it is, and changes nothing."""
    from torch.distributed.elastic.rendezvous import RendezvousStateError

    def decode_state_verbatim(self: Any, base64_state: bytes) -> Any:
        value = bytes(base64_state)
        if value and value.isascii():  # else torch's token would not decode
            try:
                found = decode_state(self, base64_state)
            except RendezvousStateError:
                pass
            else:
                if found is not None or not CODEC.holds_verified():
                    return found
        return value, _Verbatim(value)

    return decode_state_verbatim


def install() -> None:
    """Make torch's rendezvous state holder, in this process, use :data:`CODEC`, and
    torch's c10d backend hand it any value it reads (idempotent)."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    setattr(dynamic_rendezvous, "pickle", CODEC)  # noqa: B010  (a module attribute of torch's)
    backend = c10d.C10dRendezvousBackend
    if not _VERBATIM:
        setattr(backend, "_decode_state",  # noqa: B010
                _undecoded_values_verbatim(backend._decode_state))
        _VERBATIM.append(True)


_VERBATIM: list[bool] = []
"""Whether :func:`install` made torch's c10d backend hand over values verbatim."""


def sync_patiently(sync: Callable[[Any], Any], holder: Any, keep_alive: datetime.timedelta,
                   *, leftovers: bool) -> Any:
    """``sync(holder)``: torch's state holder's sync, which reads (or compare-and-sets)
    the state. A process that has verified no state of its run yet and finds a value it
    cannot verify or parse reads again, for up to :data:`PATIENCE` ``keep_alive``
    intervals: a forgery in a running job's store lasts until its hosts' next heartbeat,
    and a host that came then must neither stop nor start a round of its own. Where the
    store may hold an earlier run's state (``leftovers``: not c10d's, which lives in a
    host of the run and dies with it), a state signed with another secret that stays is
    then that (:attr:`Codec.leftovers`); anything else is refused, in words that say why
    (torch's own, "corrupt, see the inner exception", are lost in the one line a host
    prints)."""
    from torch.distributed.elastic.rendezvous import RendezvousStateError

    deadline: float | None = None
    try:
        while True:
            try:
                return sync(holder)
            except RendezvousStateError as exc:
                refused = exc.__cause__
                if not isinstance(refused, StateRefused):
                    raise
                now = time.monotonic()
                if deadline is None:
                    deadline = now + PATIENCE * keep_alive.total_seconds()
                if now < deadline:
                    time.sleep(_REREAD)
                elif leftovers and isinstance(refused, OtherSecret) and not CODEC.leftovers:
                    CODEC.leftovers = True  # read once more, as an earlier run's
                else:
                    raise RendezvousStateError(str(refused)) from refused
    finally:
        CODEC.leftovers = False


def use_secret(secret: bytes | None, run_id: str) -> None:
    """Sign and check this process's rendezvous states with ``run_id``'s ``secret``
    (None: unsigned JSON, which still runs no code)."""
    CODEC.key = None if secret is None else state_key(secret, run_id)
    CODEC.forget()


def _next_round(bits: bytes) -> int:
    """The round after the one an unverified state names (0 if it names none): round
    numbers only grow, because the keys a round leaves in the store (its bootstrap store
    address, its replication addresses) are named by its number. The value is only a
    number; a forged one moves the rounds on, which changes nothing else."""
    try:
        value = json.loads(bits[len(MAGIC):].partition(b" ")[2])["round"]
        return _int(value) + 1 if _int(value) >= 0 else 0
    except (ValueError, TypeError, KeyError, IndexError, OverflowError):
        return 0


def _node(node: Any) -> list[Any]:
    return [node.addr, node.pid, node.local_id]


def _time(value: datetime.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _int(value: Any) -> int:
    if type(value) is not int or not -(1 << 62) < value < 1 << 62:
        raise ValueError(f"not an integer in range: {str(value)[:40]!r}")
    return value


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise ValueError(f"not a boolean: {str(value)[:40]!r}")
    return value


def _entries(value: Any, width: int) -> list[list[Any]]:
    if type(value) is not list or any(type(e) is not list or len(e) != width for e in value):
        raise ValueError(f"not a list of {width}-item entries")
    return value


def _parse_node(entry: list[Any]) -> Any:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    addr, pid, local_id = entry
    if type(addr) is not str or not 0 < len(addr) <= 1024:
        raise ValueError(f"not a node address: {str(addr)[:40]!r}")
    return _NodeDesc(addr, _int(pid), _int(local_id))


def _parse_time(value: Any) -> datetime.datetime:
    if type(value) is not str or len(value) > 40:
        raise ValueError(f"not a time: {str(value)[:40]!r}")
    return datetime.datetime.fromisoformat(value)
