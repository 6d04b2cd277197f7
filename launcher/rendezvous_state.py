"""The rendezvous state as it travels: JSON, never pickle, and signed with the run's secret.

torch's dynamic rendezvous (the c10d, etcd-v2 and gemini's etcd-v3 backends) keeps its
state, the round, its participants and their heartbeats, as one pickled value in a store,
and every host unpickles whatever it reads there. The c10d backend's store is a TCPStore
that anyone who reaches its port can write to, without a password: a pickle written
there runs its code on every host of the job. :func:`install` makes torch's state holder
encode the state with this module instead (:data:`CODEC` stands in for the ``pickle``
module that ``dynamic_rendezvous`` calls), so that:

- nothing read from a rendezvous store is unpickled: the state is plain JSON, parsed by
  a strict schema into torch's own ``_RendezvousState`` (anything else is refused);
- with the run's secret (``--secret-file``, or the one an etcd or embedded store holds),
  every state carries an HMAC-SHA256 of its bytes, and a state that does not verify
  counts as empty: a party without the secret can neither run code nor change the
  membership, and the state an earlier run of the same id left (signed with that run's
  secret, which died with it) does not stop a new run.

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
from typing import Any

MAGIC = b"gemini-rdzv 1 "
MAX_BYTES = 32 << 20
"""The largest state accepted: about 200,000 nodes' entries."""
_UNSIGNED = b"-"
_MAC_LEN = 64  # hex digits of an HMAC-SHA256
WARN_EVERY = 60.0
"""Seconds between two warnings about a state signed with another secret."""


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
    of its state with :func:`encode`/:func:`decode`, under :attr:`key`."""

    PickleError = pickle.PickleError

    def __init__(self) -> None:
        self.key: bytes | None = None
        self._warned = -math.inf

    def dumps(self, state: Any) -> bytes:
        return encode(state, self.key)

    def loads(self, bits: bytes) -> Any:
        """The state ``bits`` hold; a fresh, empty state for one signed with another
        secret (:class:`OtherSecret`): the state an earlier run of this id left behind
        (its secret died with it), which no host of this run can use, or one forged by
        a party without the secret, which must change nothing. Said on stderr at most
        once a minute, naming the other cause too (a host with another
        ``--secret-file`` would never meet this one)."""
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

        try:
            return decode(bits, self.key)
        except OtherSecret as exc:
            now = time.monotonic()
            if now - self._warned >= WARN_EVERY:
                self._warned = now
                print(f"gemini: warning: {exc}; starting a new rendezvous state (the one "
                      "left by an earlier run of this id is ignored)", file=sys.stderr,
                      flush=True)
            state = _RendezvousState()
            state.round = _next_round(bits)
            return state


CODEC = Codec()


def install() -> None:
    """Make torch's rendezvous state holder, in this process, use :data:`CODEC`
    (idempotent)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    setattr(dynamic_rendezvous, "pickle", CODEC)  # noqa: B010  (a module attribute of torch's)


def use_secret(secret: bytes | None, run_id: str) -> None:
    """Sign and check this process's rendezvous states with ``run_id``'s ``secret``
    (None: unsigned JSON, which still runs no code)."""
    CODEC.key = None if secret is None else state_key(secret, run_id)


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
