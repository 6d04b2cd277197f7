"""The replication transport's wire format: what a peer sends and how it is checked.

Everything here is pure (bytes and JSON in, bytes and checked values out: no socket, no
thread, no shared memory), so the one part a stranger or an insider controls is
fuzzed and unit-tested on its own, and both ends (:mod:`launcher.replication.transport`'s
server and client) build and parse it from one place.

Wire protocol (all integers little endian)::

    handshake (fixed sizes, before any frame)
      client -> server  HELLO    "GEMtrns1" | client nonce (32) | run tag (16)
      server -> client  WELCOME  "GEMtrns1" | server nonce (32)
      client -> server  PROOF    client proof (32)
      server -> client  PROOF    server proof (32)   (only once the client's verified: a
                                 stranger learns nothing to test guesses of the secret on;
                                 a rogue server does get the client's proof, so a secret
                                 file must hold 128 bits: ``service.read_secret_file``)
      server -> client  frame {"ok": true, "run_id": ...}        (the first sealed frame)

    run tag      = SHA-256("gemini-transport run" | run id)[:16]  (cheap early rejection)
    X proof      = HMAC-SHA256(secret, "gemini-transport X proof" | len | run id | nonces)
    session key  = HMAC-SHA256(secret, "gemini-transport session" | len | run id | nonces)

    frame        json_len u32 | blob_len u32 | json | blob | MAC (32)
    MAC          = HMAC-SHA256(session key, direction | seq u64 | json_len | blob_len |
                               json | blob); direction is b"c" (to the server) or b"s";
                   seq counts the frames of one direction of one connection from 0, so a
                   frame cannot be replayed, reordered or reflected.

    PUT   c: {"op":"put", run_id, rank, step, seq, world_size, data_len, meta_hash, keep,
             round} + meta; keep: the run's globally restorable step s*, whose replica the
             server must not overwrite (-1: none known); round: the sender's rendezvous
             round, refused when the server is in another one (a sender frozen past
             --host-ttl and woken must not overwrite the current round's replicas); a
             supervisor's server also refuses ranks it keeps no replica of, steps far
             from the round's plan and slots far larger than its own
             (``transport.Admission``)
          s: {"ok":true} | {"ok":true,"have":true} (already held; nothing follows)
             | {"ok":true,"skip":[[start,end],...]} (data ranges it filled from its own
             memory, checksums matched: see :mod:`launcher.replication.reuse`)
          c: data_len raw bytes, less the skipped ranges (sendfile from the slot's file)
          c: {"op":"end","stable":bool}     s: {"ok":true,"step":S} | {"ok":true,"aborted":true}
    GET   c: {"op":"get", rank, step}
          s: {"ok":true, run_id, rank, step, seq, world_size, data_len, meta_hash} + meta
          s: data_len raw bytes             s: {"op":"end","stable":bool}
    PING  c: {"op":"ping"}                 s: {"ok":true,"round":R}   (heartbeats: see
                                           ``launcher.heartbeat``)
    any reply may instead be {"ok":false,"error":"..."}

The raw data bytes are not MAC'd (an HMAC would cost more than the copy): the receiver
verifies every tensor's xxh3 checksum, and the checksums come in the metadata, which is
inside a MAC'd frame. Secrets never travel; nothing is unpickled; every length is checked
against a hard limit before anything is allocated.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from launcher import memory
from launcher.errors import ConfigError, ReplicationError

MAGIC = b"GEMtrns1"
NONCE_SIZE = 32
TAG_SIZE = 16
MAC_SIZE = 32
HELLO = struct.Struct(f"<8s{NONCE_SIZE}s{TAG_SIZE}s")
WELCOME = struct.Struct(f"<8s{NONCE_SIZE}s")
FRAME = struct.Struct("<II")
_SEQ = struct.Struct("<Q")
TO_SERVER = b"c"
TO_CLIENT = b"s"

MAX_JSON = 64 << 10
"""Largest JSON part of a frame."""
MAX_META = 64 << 20
"""Largest blob (a slot's metadata) of a frame."""
MAX_DATA = 1 << 46
"""Largest data length a peer may announce."""
MAX_RANK = (1 << 31) - 1
MIN_SECRET = 16
"""Fewest bytes a transport secret may have."""
MAX_SKIP = 2048
"""Most skipped ranges one reply names (adjacent ranges are merged first)."""

SERVER_PROOF = b"gemini-transport server proof"
"""Label of the server's proof of the secret (see :func:`derive`)."""
CLIENT_PROOF = b"gemini-transport client proof"
"""Label of the client's proof of the secret."""
SESSION = b"gemini-transport session"
"""Label of the session key that MACs a connection's frames."""


class Refused(ReplicationError):
    """The peer answered ``ok: false``; the connection is still in step."""


# -- frames ---------------------------------------------------------------------------

def _mac(key: bytes, direction: bytes, seq: int, head: bytes, body: bytes, blob: bytes) -> bytes:
    digest = hmac.new(key, direction + _SEQ.pack(seq) + head, hashlib.sha256)
    digest.update(body)
    digest.update(blob)
    return digest.digest()


def seal_raw(key: bytes, direction: bytes, seq: int, body: bytes, blob: bytes = b"") -> bytes:
    """A frame carrying ``body`` (JSON bytes, not checked here) and ``blob``."""
    if len(body) > MAX_JSON or len(blob) > MAX_META:
        raise ReplicationError(f"frame too large ({len(body)} + {len(blob)} bytes)")
    head = FRAME.pack(len(body), len(blob))
    return head + body + blob + _mac(key, direction, seq, head, body, blob)


def seal_frame(key: bytes, direction: bytes, seq: int, message: dict[str, Any],
               blob: bytes = b"") -> bytes:
    """The frame number ``seq`` of ``direction`` carrying ``message`` and ``blob``."""
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    return seal_raw(key, direction, seq, body, blob)


def frame_lengths(head: bytes) -> tuple[int, int]:
    """The JSON and blob lengths a frame header announces, checked against the limits."""
    if len(head) != FRAME.size:
        raise ReplicationError(f"truncated frame header ({len(head)} bytes)")
    json_len, blob_len = FRAME.unpack(head)
    if json_len > MAX_JSON or blob_len > MAX_META:
        raise ReplicationError(f"oversized frame: {json_len} + {blob_len} bytes announced "
                               f"(limits {MAX_JSON} + {MAX_META})")
    return json_len, blob_len


def open_frame(key: bytes, direction: bytes, seq: int, frame: bytes) -> tuple[dict[str, Any], bytes]:
    """Check the MAC of one whole frame and decode it: its JSON object and its blob."""
    if len(frame) < FRAME.size + MAC_SIZE:
        raise ReplicationError(f"truncated frame ({len(frame)} bytes)")
    json_len, blob_len = frame_lengths(frame[:FRAME.size])
    end = FRAME.size + json_len + blob_len
    if len(frame) != end + MAC_SIZE:
        raise ReplicationError(f"frame of {len(frame)} bytes announces {end + MAC_SIZE}")
    body = frame[FRAME.size:FRAME.size + json_len]
    blob = frame[FRAME.size + json_len:end]
    expected = _mac(key, direction, seq, frame[:FRAME.size], body, blob)
    if not hmac.compare_digest(frame[end:], expected):
        raise ReplicationError("bad frame MAC (forged, corrupted, replayed or reordered)")
    return decode_json(body), blob


def decode_json(body: bytes) -> dict[str, Any]:
    """A JSON object from a frame; anything else is a ReplicationError."""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ReplicationError(f"malformed frame JSON: {str(exc)[:200]}") from None
    if not isinstance(message, dict):
        raise ReplicationError("frame JSON is not an object")
    return message


# -- requests and replies -------------------------------------------------------------

def _int(message: dict[str, Any], key: str, low: int, high: int) -> int:
    value = message.get(key)
    if type(value) is not int or not low <= value <= high:
        raise ReplicationError(f"invalid {key}: {str(value)[:40]!r} (want an int in [{low}, {high}])")
    return value


def _bool(message: dict[str, Any], key: str) -> bool:
    value = message.get(key)
    if not isinstance(value, bool):
        raise ReplicationError(f"invalid {key}: {str(value)[:40]!r} (want a bool)")
    return value


@dataclass(frozen=True)
class PutRequest:
    """A peer offers the committed slot ``header`` describes, with its metadata."""

    header: memory.SlotHeader
    meta: bytes
    keep: int = -1
    """The step whose replica must survive this put (-1: none)."""
    round: str = ""
    """The sender's replication round ("": not said)."""


@dataclass(frozen=True)
class GetRequest:
    """A peer asks for committed ``step`` of ``rank``."""

    rank: int
    step: int


@dataclass(frozen=True)
class PingRequest:
    """A peer's heartbeat: is this supervisor answering?"""


Request = PutRequest | GetRequest | PingRequest


def _slot_fields(message: dict[str, Any], meta: bytes, run_id: str) -> memory.SlotHeader:
    if message.get("run_id") != run_id:
        raise ReplicationError(f"run id {str(message.get('run_id'))[:80]!r} is not {run_id!r}")
    world_size = _int(message, "world_size", 1, MAX_RANK)
    header = memory.SlotHeader(
        state=memory.SlotState.COMMITTED,
        step=_int(message, "step", 0, (1 << 63) - 1),
        seq=_int(message, "seq", 0, (1 << 64) - 1),
        rank=_int(message, "rank", 0, world_size - 1),
        world_size=world_size,
        data_len=_int(message, "data_len", 0, MAX_DATA),
        meta_offset=0, meta_len=len(meta),
        meta_hash=_int(message, "meta_hash", 0, (1 << 64) - 1),
        capacity=0, run_id=header_run_id(run_id))
    if xxhash.xxh3_64_intdigest(meta) != header.meta_hash:
        raise ReplicationError("metadata does not match its hash")
    return header


def parse_request(message: dict[str, Any], blob: bytes, *, run_id: str) -> Request:
    """A validated request from a client's frame."""
    op = message.get("op")
    if op == "put":
        keep = _int(message, "keep", -1, (1 << 63) - 1) if "keep" in message else -1
        round_id = message.get("round", "")
        if not isinstance(round_id, str) or len(round_id) > 64:
            raise ReplicationError("invalid round (want a string of at most 64 characters)")
        return PutRequest(_slot_fields(message, blob, run_id), blob, keep, round_id)
    if op == "get":
        if blob:
            raise ReplicationError("unexpected blob in a get request")
        return GetRequest(_int(message, "rank", 0, MAX_RANK), _int(message, "step", 0, (1 << 63) - 1))
    if op == "ping":
        if blob:
            raise ReplicationError("unexpected blob in a ping")
        return PingRequest()
    raise ReplicationError(f"unknown op {str(op)[:40]!r}")


def parse_reply(message: dict[str, Any]) -> dict[str, Any]:
    """A reply that says ok; raises ReplicationError with the peer's reason otherwise."""
    ok = _bool(message, "ok")
    if not ok:
        error = message.get("error")
        raise Refused(f"peer refused: {str(error)[:500]}")
    return message


def parse_slot_reply(message: dict[str, Any], meta: bytes, *, run_id: str, rank: int,
                     step: int) -> memory.SlotHeader:
    """The slot a GET reply announces, checked against what was asked."""
    header = _slot_fields(parse_reply(message), meta, run_id)
    if header.rank != rank or header.step != step:
        raise ReplicationError(f"asked for rank {rank} step {step}, got rank {header.rank} "
                               f"step {header.step}")
    return header


def slot_message(header: memory.SlotHeader, run_id: str) -> dict[str, Any]:
    """The fields of a PUT request or a GET reply that describe the slot ``header`` heads."""
    return {"run_id": run_id, "rank": header.rank, "step": header.step, "seq": header.seq,
            "world_size": header.world_size, "data_len": header.data_len,
            "meta_hash": header.meta_hash}


def parse_skip(message: dict[str, Any], data_len: int) -> list[tuple[int, int]]:
    """The data ranges a PUT reply says the receiver filled itself: sorted, disjoint,
    within the data."""
    raw = message.get("skip", [])
    if not isinstance(raw, list) or len(raw) > MAX_SKIP:
        raise ReplicationError("invalid skip list")
    skip, at = [], 0
    for item in raw:
        if (not isinstance(item, list) or len(item) != 2
                or not all(type(x) is int for x in item)
                or not at <= item[0] < item[1] <= data_len):
            raise ReplicationError("invalid skip list")
        skip.append((item[0], item[1]))
        at = item[1]
    return skip


def parse_trailer(message: dict[str, Any]) -> bool:
    """Whether the sender's slot stayed unchanged while its data was sent."""
    if message.get("op") != "end":
        raise ReplicationError(f"expected an end frame, got op {str(message.get('op'))[:40]!r}")
    return _bool(message, "stable")


# -- handshake ------------------------------------------------------------------------

def run_tag(run_id: str) -> bytes:
    """The tag a HELLO carries: a client of another run is turned away before any proof."""
    return hashlib.sha256(b"gemini-transport run\0" + run_id.encode()).digest()[:TAG_SIZE]


def derive(secret: bytes, label: bytes, run_id: str, client_nonce: bytes,
           server_nonce: bytes) -> bytes:
    """A proof or the session key (by ``label``) of one connection's nonces."""
    rid = run_id.encode()
    message = label + b"\0" + struct.pack("<I", len(rid)) + rid + client_nonce + server_nonce
    return hmac.new(secret, message, hashlib.sha256).digest()


def parse_hello(data: bytes, *, run_id: str) -> bytes:
    """The client nonce of a HELLO from a client of ``run_id``."""
    if len(data) != HELLO.size:
        raise ReplicationError(f"truncated hello ({len(data)} bytes)")
    magic, nonce, tag = HELLO.unpack(data)
    if magic != MAGIC:
        raise ReplicationError("not a gemini transport client (bad magic)")
    if not hmac.compare_digest(tag, run_tag(run_id)):
        raise ReplicationError("client belongs to another run")
    return bytes(nonce)


def parse_welcome(data: bytes) -> bytes:
    """The server nonce of a WELCOME."""
    if len(data) != WELCOME.size:
        raise ReplicationError(f"truncated welcome ({len(data)} bytes)")
    magic, nonce = WELCOME.unpack(data)
    if magic != MAGIC:
        raise ReplicationError("not a gemini transport server (bad magic)")
    return bytes(nonce)


def check_secret(secret: bytes) -> None:
    """Refuse a secret too short to authenticate with."""
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET:
        raise ConfigError(f"the transport secret must be at least {MIN_SECRET} bytes",
                          field="secret")


def header_run_id(run_id: str) -> str:
    """``run_id`` as a slot header stores it (64 bytes at most)."""
    return run_id.encode()[:64].decode(errors="replace")
