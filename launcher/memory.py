"""Shared-memory checkpoint slots: naming, layout, double buffering and checksums.

A *segment* is a file in ``/dev/shm`` (POSIX shared memory) created by the supervisor,
which owns it, so it outlives any worker. Segments live in a directory private to the
user (:func:`shm_dir`: ``/dev/shm/gemini-<uid>``, mode 0700), where no other user can
plant a file or a symlink under gemini's predictable names, and every file is checked
when opened (:func:`open_segment`): never followed through a link, a regular file of
this user, mode 0600, one link. Workers only attach to it with ``os.open`` and
``mmap`` — never with ``multiprocessing.shared_memory``, whose resource tracker unlinks a
segment when an attaching process dies (before Python 3.13).

Each rank has two segments (slots 0 and 1), a double buffer: a save writes the slot that
does not hold the newest committed step. A slot's layout::

    [0, 4096)                      header (fixed binary layout, see ``_HEADER``)
    [4096, 4096 + data_len)        tensor bytes, each tensor aligned to 64 bytes
    [meta_offset, + meta_len)      metadata: UTF-8 JSON (tree, per-tensor offset and size,
                                   xxh3 of each large tensor and of each batch of small
                                   ones, back to back before them)

The header's ``state`` field is the commit point: it is set to WRITING before any byte of
a new step is written and to COMMITTED only after every byte, checksum and the metadata
are in place, so a crash at any moment leaves either a committed step or a slot that
readers ignore. No pickle: a slot is read with ``json`` and ``torch.frombuffer``.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import hashlib
import itertools
import json
import logging
import mmap
import os
import re
import stat
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import xxhash

from launcher.contract import ENV_SHM_DIR
from launcher.errors import CheckpointError, StorageError

logger = logging.getLogger(__name__)

PREFIX = "gemini-"
MAGIC = b"GEMINIck"
FORMAT_VERSION = 1
HEADER_SIZE = 4096
ALIGN = 64
COPY_CHUNK = 512 << 10  # bytes copied, then hashed from the cache, at a time (half an L2)
SMALL_TENSOR = 4 << 20  # tensors up to this size are copied in one batch, one checksum

# magic, version, state, step, seq, rank, world_size, data_len, meta_offset, meta_len,
# meta_hash, capacity, run_id (64 bytes, NUL padded)
_HEADER = struct.Struct("<8sIIqQIIQQQQQ64s")
_STATE_OFFSET = 12  # byte offset of ``state`` inside the header


class SlotState(enum.IntEnum):
    """Lifecycle of a slot: EMPTY -> WRITING -> COMMITTED -> WRITING -> COMMITTED ...

    EMPTY: created, never written. WRITING: a save is (or was, if its writer died) in
    progress; the content is garbage. COMMITTED: a complete, checksummed step.
    """

    EMPTY = 0
    WRITING = 1
    COMMITTED = 2


@dataclass(frozen=True)
class SlotHeader:
    """The decoded header of a slot."""

    state: SlotState
    step: int
    seq: int
    rank: int
    world_size: int
    data_len: int
    meta_offset: int
    meta_len: int
    meta_hash: int
    capacity: int
    run_id: str


def run_key(run_id: str) -> str:
    """A short, file-name-safe key for a run id."""
    return hashlib.sha1(run_id.encode()).hexdigest()[:12]


def host_key(host_id: str) -> str:
    """A file-name-safe form of a host id."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", host_id)[:48] or "host"


def segment_prefix(run_id: str, host_id: str) -> str:
    """Prefix of every segment of ``run_id`` on ``host_id``."""
    return f"{PREFIX}{run_key(run_id)}-{host_key(host_id)}-"


def slot_name(prefix: str, rank: int, index: int, *, replica: bool = False) -> str:
    """Name of slot ``index`` (0 or 1) of global ``rank``: this host's own copy, or with
    ``replica`` the copy this host keeps for a peer host (see ``launcher.replication``)."""
    return f"{prefix}{'x' if replica else 'r'}{rank}-s{index}"


_SLOT_NAME = re.compile(
    r"^(?P<prefix>gemini-[0-9a-f]{12}-[A-Za-z0-9_.]+-)(?P<kind>[rx])(?P<rank>\d+)-s(?P<index>[01])$")


class SlotName(NamedTuple):
    """The parts of a slot segment's name."""

    prefix: str
    rank: int
    slot: int
    """0 or 1: which of the rank's two slots."""
    replica: bool


def parse_slot_name(name: str) -> SlotName | None:
    """The parts of a slot segment name, or None for other files."""
    match = _SLOT_NAME.match(name)
    if not match:
        return None
    return SlotName(match.group("prefix"), int(match.group("rank")), int(match.group("index")),
                    match.group("kind") == "x")


#: The heartbeat segment of a run on a host (``launcher.health``): one native 64-bit
#: counter per local rank, each in a cache line of its own, bumped by the worker.
HEARTBEAT_SUFFIX = "heartbeat"
HEARTBEAT_STRIDE = 64
#: The count a worker leaves when it closes its Checkpointer: nothing more to watch.
HEARTBEAT_DONE = (1 << 64) - 1


def heartbeat_name(prefix: str) -> str:
    return prefix + HEARTBEAT_SUFFIX


#: A rank's pins (written by its supervisor, ``SlotOwner.pin_own``, read by its worker):
#: two steps its own slots must keep, which a save never overwrites: s*, the newest step
#: every holder of every rank has (a host loss restores it), and the replication target
#: (the first committed step at or after it is being pushed from its slot); -1: none.
#: A third field is the worker's: the step of its newest ``save()``, skipped or not, so
#: that replication plans its next target from where training is, not from the last step
#: a save could keep (while both slots are pinned, saves are skipped).
PINS = struct.Struct("<qqq")
_SUPERVISOR_PINS = struct.Struct("<qq")  # PINS' first two fields
_SEEN = struct.Struct("<q")
_SEEN_OFFSET = 16


def pins_name(prefix: str, rank: int) -> str:
    return f"{prefix}p{rank}"


_PINS_NAME = re.compile(r"^(gemini-[0-9a-f]{12}-[A-Za-z0-9_.]+-)p\d+$")


def pins_prefix(name: str) -> str | None:
    """The run and host prefix of a pins segment's name, or None for other files."""
    match = _PINS_NAME.match(name)
    return match.group(1) if match else None


def read_pins(buf: mmap.mmap) -> tuple[int, int]:
    sstar, target, _ = PINS.unpack_from(buf, 0)
    return int(sstar), int(target)


def write_pins(buf: mmap.mmap, sstar: int, target: int) -> None:
    """The supervisor's two fields (the worker's is left alone)."""
    _SUPERVISOR_PINS.pack_into(buf, 0, sstar, target)


def read_seen(buf: mmap.mmap) -> int:
    """The step of the worker's newest save (-1: none yet)."""
    return int(_SEEN.unpack_from(buf, _SEEN_OFFSET)[0])


def write_seen(buf: mmap.mmap, step: int) -> None:
    _SEEN.pack_into(buf, _SEEN_OFFSET, step)


def pinned_slots(headers: list[SlotHeader | None], pins: tuple[int, int]) -> set[int]:
    """The indexes of the slots (of one rank's pair, by ``headers``) that hold a pinned
    step: the one holding s*, and the one holding the first committed step at or after
    the target."""
    sstar, target = pins
    steps = {i: h.step for i, h in enumerate(headers)
             if h is not None and h.state is SlotState.COMMITTED}
    kept = {i for i, step in steps.items() if sstar >= 0 and step == sstar}
    due = [(step, i) for i, step in steps.items() if target >= 0 and step >= target]
    if due:
        kept.add(min(due)[1])
    return kept


# -- where segments live ------------------------------------------------------------------
_SHM_DIR: Path | None = None


def shm_dir() -> Path:
    """This user's private directory for segments: the first of ``<base>/gemini-<uid>``,
    ``<base>/gemini-<uid>-1``, ... that is a directory of this user with mode 0700
    (created so where absent), ``<base>`` being ``$GEMINI_SHM_DIR`` or ``/dev/shm``. A
    name another user took first (a file, a link, a directory not ours) is reported and
    skipped: it can delay nothing but the adoption of an earlier run's memory."""
    global _SHM_DIR
    if _SHM_DIR is not None and not os.path.isdir(_SHM_DIR):
        _SHM_DIR = None  # another run of this user removed it when it emptied: make it anew
    if _SHM_DIR is None:
        found = _private_dir(Path(os.environ.get(ENV_SHM_DIR, "/dev/shm")))
        assert found is not None  # created
        _SHM_DIR = found
    return _SHM_DIR


def _private_dir(base: Path, *, create: bool = True) -> Path | None:
    uid = os.geteuid()
    for n in range(64):
        path = base / (f"{PREFIX}{uid}" if n == 0 else f"{PREFIX}{uid}-{n}")
        try:
            if not create and not os.path.lexists(path):
                return None
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # mkdir's mode is masked by the umask
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise StorageError(f"the shared-memory directory {base} does not exist") from None
        except OSError as exc:
            raise StorageError(f"cannot create {path}: {exc.strerror}") from None
        info = os.lstat(path)
        if (stat.S_ISDIR(info.st_mode) and info.st_uid == uid
                and stat.S_IMODE(info.st_mode) == 0o700):
            return path
        logger.warning("ignoring %s: not a private directory of this user (owner uid %d, "
                       "mode %o)", path, info.st_uid, info.st_mode)
    raise StorageError(f"no private directory for shared memory in {base}: every "
                       f"{PREFIX}{uid}[-N] name is taken by another user")


def __getattr__(name: str) -> Any:
    if name == "SHM_DIR":  # the directory segments live in, resolved when first needed
        return shm_dir()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def release_shm_dir() -> None:
    """Remove this user's segment directory if it is empty (the last run on the host
    ended); a run still using it keeps it."""
    global _SHM_DIR
    if _SHM_DIR is None:
        return
    try:
        _SHM_DIR.rmdir()
    except OSError:  # not empty, or already gone
        return
    _SHM_DIR = None


def open_segment(name: str, flags: int) -> int:
    """A descriptor of segment ``name`` opened with ``flags``, after checking that it is
    what gemini creates: not a link (O_NOFOLLOW), a regular file owned by this user,
    mode 0600, one link, not empty. Anything else raises StorageError
    (the caller reports it and leaves the file alone)."""
    path = shm_dir() / name
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StorageError(f"shared-memory segment {name} does not exist") from None
    except OSError as exc:
        raise StorageError(f"cannot open shared-memory segment {name}: {exc.strerror}") from None
    info = os.fstat(fd)
    why = ("not a regular file" if not stat.S_ISREG(info.st_mode)
           else f"owned by uid {info.st_uid}" if info.st_uid != os.geteuid()
           else f"mode {stat.S_IMODE(info.st_mode):o}" if stat.S_IMODE(info.st_mode) != 0o600
           else f"{info.st_nlink} links" if info.st_nlink != 1
           else "empty" if info.st_size == 0
           else None)
    if why is not None:
        os.close(fd)
        raise StorageError(f"refusing shared-memory file {path}: {why}")
    return fd


def list_segments(prefix: str = PREFIX) -> list[str]:
    """Names of the segments in the shared-memory directory that start with ``prefix``."""
    where = _SHM_DIR or _private_dir(Path(os.environ.get(ENV_SHM_DIR, "/dev/shm")),
                                     create=False)
    if where is None:  # no run has made it: nothing to list (and nothing created)
        return []
    try:
        return sorted(p.name for p in where.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []


def shm_free_bytes() -> int:
    """Bytes still available in the shared-memory file system."""
    stats = os.statvfs(shm_dir())
    return stats.f_bavail * stats.f_frsize


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
POPULATE_CHUNK = 32 << 20


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)  # ctypes calls release the GIL
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _populate(buf: mmap.mmap) -> None:
    """Map every page of ``buf`` for writing now, with the GIL released: first-touch
    faults cost several times a warm copy. ``mmap``'s MAP_POPULATE does the same but
    holds the GIL (CPython before 3.13) and the process's memory-map lock for the whole
    call: a supervisor mapping a fresh 1 GiB replica answered no heartbeat for most of a
    second, and a worker's copy thread would stall its training loop as long. A kernel
    without the advice leaves the pages to fault in on first use."""
    if not len(buf):
        return
    anchor = ctypes.c_char.from_buffer(buf)
    address = ctypes.addressof(anchor)
    del anchor  # release the buffer export: the mapping itself stays
    # In chunks: each call holds the process's memory-map lock, which the other threads'
    # allocations (large ones map memory) wait for.
    for start in range(0, len(buf), POPULATE_CHUNK):
        length = min(POPULATE_CHUNK, len(buf) - start)
        if _libc().madvise(address + start, length, _MADV_POPULATE_WRITE) != 0:
            return


class Segment:
    """A mapped shared-memory segment. ``close`` unmaps; only its owner unlinks it."""

    def __init__(self, name: str, fd: int, size: int, *, populate: bool = True) -> None:
        self.name = name
        self.size = size
        try:
            self.buf: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.populated = False
        """Whether every page is mapped for writing in this process (see :meth:`populate`)."""
        if populate:
            self.populate()

    def populate(self) -> None:
        """Map every page for writing now (once): a process about to write the whole
        segment saves a page fault per page (see :func:`_populate`)."""
        if not self.populated:
            _populate(self.view)
            self.populated = True

    @property
    def path(self) -> Path:
        return shm_dir() / self.name

    @property
    def view(self) -> mmap.mmap:
        if self.buf is None:
            raise StorageError(f"segment {self.name} is closed")
        return self.buf

    def close(self) -> None:
        if self.buf is not None:
            try:
                self.buf.close()
            except BufferError:  # a tensor still views it; the mapping dies with the process
                pass
            self.buf = None


def create_segment(name: str, size: int) -> Segment:
    """Create (replacing any old file of that name) and pre-fault a segment of ``size``.
    It is made under a temporary name and renamed into place once sized, so that no
    reader ever opens it empty or half-allocated."""
    global _SHM_DIR
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    temporary = f".creating-{os.getpid()}-{threading.get_native_id()}-{name}"
    try:
        fd = os.open(shm_dir() / temporary, flags, 0o600)
    except FileNotFoundError:  # another run on the host released the directory just now
        _SHM_DIR = None
        fd = os.open(shm_dir() / temporary, flags, 0o600)
    where = shm_dir()
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)  # pre-fault: first-touch pages cost ~7x a warm copy
        os.rename(where / temporary, where / name)
    except OSError as exc:
        os.close(fd)
        (where / temporary).unlink(missing_ok=True)
        raise StorageError(f"cannot allocate {size} bytes in {where} for {name}: "
                           f"{exc.strerror}") from None
    return Segment(name, fd, size, populate=False)  # its writer maps it for itself


def attach_segment(name: str, *, populate: bool = True) -> Segment:
    """Map an existing segment read-write (no resource tracker involved); ``populate``
    maps every page up front, which a writer wants and a one-off reader does not."""
    fd = open_segment(name, os.O_RDWR)
    return Segment(name, fd, os.fstat(fd).st_size, populate=populate)


def reserve_name(prefix: str, index: int) -> str:
    """Name of a reserved segment: allocated and pre-faulted, not yet a slot."""
    return f"{prefix}v{index}"


def take_reserved(reserved: Segment, name: str, size: int) -> Segment:
    """Turn the reserved segment ``reserved`` (mapped, its pages faulted in, at least
    ``size`` bytes) into the segment ``name`` of ``size`` bytes, replacing any old file of
    that name. Nothing is allocated or faulted in again: the mapping is kept (shrunk with
    its file when larger), so the first write into it costs no page fault either."""
    where = shm_dir()
    try:
        if reserved.size > size:
            reserved.view.resize(size)  # the file with it; the pages kept stay mapped
        os.rename(where / reserved.name, where / name)
    except (OSError, ValueError, BufferError) as exc:
        reserved.close()
        unlink_segment(reserved.name)
        raise StorageError(f"cannot turn {reserved.name} into {name}: {exc}") from None
    reserved.name, reserved.size = name, size
    return reserved


def unlink_segment(name: str) -> None:
    """Remove a segment (idempotent); mappings stay valid until unmapped."""
    (shm_dir() / name).unlink(missing_ok=True)


# -- header --------------------------------------------------------------------------

def read_header(buf: mmap.mmap) -> SlotHeader | None:
    """The slot's header, or None when the segment is too small or not a gemini slot."""
    if len(buf) < HEADER_SIZE:
        return None
    (magic, version, state, step, seq, rank, world_size, data_len, meta_offset, meta_len,
     meta_hash, capacity, run_id) = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC or version != FORMAT_VERSION or state not in SlotState._value2member_map_:
        return None
    return SlotHeader(SlotState(state), step, seq, rank, world_size, data_len, meta_offset,
                      meta_len, meta_hash, capacity, run_id.rstrip(b"\0").decode(errors="replace"))


def init_header(buf: mmap.mmap, *, rank: int, run_id: str) -> None:
    """Write an EMPTY header into a fresh slot."""
    _HEADER.pack_into(buf, 0, MAGIC, FORMAT_VERSION, SlotState.EMPTY, -1, 0, rank, 0, 0, 0,
                      0, 0, len(buf), run_id.encode()[:64])


def set_state(buf: mmap.mmap, state: SlotState) -> None:
    struct.pack_into("<I", buf, _STATE_OFFSET, state)


def write_commit(buf: mmap.mmap, *, step: int, seq: int, rank: int, world_size: int,
                 run_id: str, data_len: int, meta: bytes) -> None:
    """Write the metadata, then the header, then flip the state to COMMITTED (last)."""
    meta_offset = HEADER_SIZE + _aligned(data_len)
    if meta_offset + len(meta) > len(buf):
        raise StorageError(f"slot too small: need {meta_offset + len(meta)} bytes, "
                           f"have {len(buf)}")
    buf[meta_offset:meta_offset + len(meta)] = meta
    _HEADER.pack_into(buf, 0, MAGIC, FORMAT_VERSION, SlotState.WRITING, step, seq, rank,
                      world_size, data_len, meta_offset, len(meta),
                      xxhash.xxh3_64_intdigest(meta), len(buf), run_id.encode()[:64])
    set_state(buf, SlotState.COMMITTED)


def unchanged(buf: mmap.mmap, header: SlotHeader) -> bool:
    """Whether the slot still holds the committed step ``header`` describes: a reader that
    copied the slot's bytes without a lock checks this afterwards (a writer flips the state
    to WRITING before it changes any byte, and every commit has a new ``seq``)."""
    now = read_header(buf)
    return (now is not None and now.state is SlotState.COMMITTED and now.seq == header.seq
            and now.step == header.step)


def commit_received(buf: mmap.mmap, header: SlotHeader, meta: bytes,
                    verifier: StreamVerifier | None = None) -> None:
    """Commit a slot whose tensor bytes were written (at ``HEADER_SIZE``) by a copy from
    elsewhere (a peer host, a file): check the metadata against ``header.meta_hash``, verify
    every checksum (what ``verifier``, from :func:`stream_verifier`, has not checked yet
    while the bytes arrived), then commit with ``header``'s step, seq, rank and world
    size. The slot must be in the WRITING state. Raises CheckpointError and leaves it
    WRITING on any mismatch."""
    if verifier is None:
        verifier = stream_verifier(buf, header, meta)
    verifier.finish()
    write_commit(buf, step=header.step, seq=header.seq, rank=header.rank,
                 world_size=header.world_size, run_id=header.run_id,
                 data_len=header.data_len, meta=meta)


def copy_slot(src: mmap.mmap, dst: mmap.mmap, header: SlotHeader,
              wait: Callable[[], object] | None = None) -> bool:
    """Copy the committed step ``header`` describes from slot ``src`` into ``dst`` (WRITING,
    big enough), verifying each chunk while it is in the cache, and commit it there.
    ``wait`` runs before each chunk (pacing). False, with ``dst`` left WRITING, if a writer
    changed ``src`` meanwhile; CheckpointError if the copy does not verify."""
    with memoryview(src) as view:
        meta = bytes(view[header.meta_offset:header.meta_offset + header.meta_len])
    verifier = stream_verifier(dst, header, meta)
    with memoryview(src) as source, memoryview(dst) as target:
        for low in range(0, header.data_len, COPY_CHUNK):
            if wait is not None:
                wait()
            high = min(low + COPY_CHUNK, header.data_len)
            target[HEADER_SIZE + low:HEADER_SIZE + high] = source[HEADER_SIZE + low:
                                                                  HEADER_SIZE + high]
            verifier.advance(high)
    if not unchanged(src, header):
        return False
    commit_received(dst, header, meta, verifier)
    return True


def stream_verifier(buf: mmap.mmap, header: SlotHeader, meta: bytes) -> StreamVerifier:
    """A verifier for ``header``'s data arriving in ``buf``, from its raw metadata (checked
    against ``header.meta_hash`` first); CheckpointError if the metadata is bad."""
    if xxhash.xxh3_64_intdigest(meta) != header.meta_hash:
        raise CheckpointError("metadata checksum mismatch")
    try:
        return StreamVerifier(buf, header.data_len, json.loads(meta))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"malformed metadata: {exc}") from None


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def slot_size(data_len: int, meta_len: int) -> int:
    """Bytes a slot needs for ``data_len`` tensor bytes and ``meta_len`` metadata bytes,
    rounded up to whole pages with headroom for metadata growth."""
    need = HEADER_SIZE + _aligned(data_len) + meta_len * 2 + (64 << 10)
    page = mmap.PAGESIZE
    return (need + page - 1) // page * page


# -- checksums ------------------------------------------------------------------------

def checksum(view: memoryview) -> int:
    """xxh3-64 of ``view`` (releases nothing; xxh3 runs close to memory bandwidth)."""
    return xxhash.xxh3_64_intdigest(view)


def read_meta(buf: mmap.mmap, header: SlotHeader) -> dict[str, Any]:
    """The slot's metadata, checked against the header's hash."""
    end = header.meta_offset + header.meta_len
    if header.meta_offset < HEADER_SIZE or end > len(buf):
        raise CheckpointError("metadata out of bounds")
    raw = bytes(buf[header.meta_offset:end])
    if xxhash.xxh3_64_intdigest(raw) != header.meta_hash:
        raise CheckpointError("metadata checksum mismatch")
    meta: dict[str, Any] = json.loads(raw)
    return meta


def verify(buf: mmap.mmap, header: SlotHeader, meta: dict[str, Any]) -> None:
    """Recompute every tensor's checksum; raise CheckpointError on the first mismatch."""
    StreamVerifier(buf, header.data_len, meta).finish()


class StreamVerifier:
    """Checks a slot's checksums while its data bytes arrive in order.

    ``advance(n)``, once the first ``n`` data bytes are in place, hashes the checksummed
    ranges they complete (still in the cache when called right after each chunk is
    written, so checking costs no second pass over memory); ``finish()`` hashes what is
    left and raises CheckpointError unless every checksum matched. A mismatch is only
    reported by ``finish()``, so that a reader can first learn whether its source
    changed while it copied (a torn copy, not a corrupt one). Metadata whose ranges fall
    outside ``data_len``, overlap, or leave a tensor without a checksum is rejected when
    the verifier is made.
    """

    def __init__(self, buf: mmap.mmap, data_len: int, meta: dict[str, Any]) -> None:
        if HEADER_SIZE + data_len > len(buf):
            raise CheckpointError(f"{data_len} data bytes do not fit a {len(buf)}-byte slot")
        ranges: list[tuple[int, int, int, str]] = []  # start, end, xxh3, what
        block_end = 0
        for block in meta.get("blocks", []):
            what = f"the small tensors at {block.get('offset')}"
            start, end = _bounds(block, data_len, what)
            block_end = max(block_end, end)
            ranges.append((start, end, int(block["xxh3"], 16), what))
        for entry in meta["tensors"]:
            what = f"tensor {entry['path']}"
            start, end = _bounds(entry, data_len, what)
            if entry["xxh3"] is None:
                if end > block_end:
                    raise CheckpointError(f"{what} has no checksum")
            else:
                ranges.append((start, end, int(entry["xxh3"], 16), what))
        for start, end, digest, what in ranges:
            if start == end and digest != _EMPTY:
                raise CheckpointError(f"checksum mismatch in {what}")
        self._ranges = sorted(r for r in ranges if r[0] < r[1])
        for before, after in itertools.pairwise(self._ranges):
            if after[0] < before[1]:
                raise CheckpointError(f"{before[3]} and {after[3]} overlap")
        self.meta = meta
        self._buf = buf
        self._data_len = data_len
        self._trusted: set[int] = set()  # starts of ranges checked as they were filled
        self._next = 0  # index of the first range not yet complete
        self._done = 0  # data offset up to which the current range is hashed
        self._hasher = xxhash.xxh3_64()
        self._error: CheckpointError | None = None

    def ranges(self) -> list[tuple[int, int, int]]:
        """The checksummed data ranges, in order: ``(start, end, xxh3)``."""
        return [(start, end, digest) for start, end, digest, _ in self._ranges]

    def trust(self, starts: Iterable[int]) -> None:
        """The ranges beginning at ``starts`` were filled and checked another way (see
        :func:`copy_checked`): :meth:`advance` skips them."""
        self._trusted.update(starts)

    def advance(self, upto: int) -> None:
        """The first ``upto`` data bytes are in place: check every range they complete
        (those :meth:`trust` names are in place already, and checked)."""
        with memoryview(self._buf) as view:
            while self._next < len(self._ranges) and self._error is None:
                start, end, digest, what = self._ranges[self._next]
                if start in self._trusted:
                    self._next += 1
                    continue
                lo, hi = max(start, self._done), min(end, upto)
                if hi <= lo:
                    break
                self._hasher.update(view[HEADER_SIZE + lo:HEADER_SIZE + hi])
                self._done = hi
                if hi < end:
                    break
                if self._hasher.intdigest() != digest:
                    self._error = CheckpointError(f"checksum mismatch in {what}")
                self._hasher.reset()
                self._next += 1

    def finish(self) -> None:
        """Check what is left; raise CheckpointError unless every checksum matched."""
        self.advance(self._data_len)
        if self._error is not None:
            raise self._error


_EMPTY = xxhash.xxh3_64_intdigest(b"")

def copy_checked(src: mmap.mmap, src_start: int, dst: mmap.mmap, dst_start: int, nbytes: int,
                 digest: int) -> bool:
    """Copy ``nbytes`` data bytes of slot ``src`` from ``src_start`` into slot ``dst`` at
    ``dst_start``, hashing the copy as it lands; whether it matched ``digest`` (a source
    rewritten meanwhile does not: the caller gets the bytes elsewhere)."""
    hasher = xxhash.xxh3_64()
    a, b = HEADER_SIZE + src_start, HEADER_SIZE + dst_start
    if a + nbytes > len(src) or b + nbytes > len(dst):
        return False
    with memoryview(src) as source, memoryview(dst) as target:
        for done in range(0, nbytes, COPY_CHUNK):
            n = min(COPY_CHUNK, nbytes - done)
            target[b + done:b + done + n] = source[a + done:a + done + n]
            hasher.update(target[b + done:b + done + n])
    return hasher.intdigest() == digest


def _bounds(entry: dict[str, Any], data_len: int, what: str) -> tuple[int, int]:
    start, nbytes = int(entry["offset"]), int(entry["nbytes"])
    if start < 0 or nbytes < 0 or start + nbytes > data_len:
        raise CheckpointError(f"{what} out of bounds")
    return start, start + nbytes


@dataclass(frozen=True)
class SlotInfo:
    """What ``scan`` found in one slot segment."""

    name: str
    rank: int
    index: int
    size: int
    header: SlotHeader | None
    meta: dict[str, Any] | None
    error: str | None
    replica: bool = False
    """A copy this host keeps for a peer host, not its own."""

    @property
    def valid_step(self) -> int | None:
        """The committed step this slot can restore, or None."""
        if self.error is None and self.header is not None and (
            self.header.state is SlotState.COMMITTED
        ):
            return self.header.step
        return None


def describe(segment: Segment, *, check: bool = True) -> SlotInfo:
    """Read (and with ``check`` verify) a mapped slot without modifying it."""
    parsed = parse_slot_name(segment.name)
    rank, index = (parsed.rank, parsed.slot) if parsed else (-1, -1)
    replica = parsed.replica if parsed else False
    header = read_header(segment.view)
    meta: dict[str, Any] | None = None
    error: str | None = None
    if header is None:
        error = "not a gemini slot"
    elif header.state is SlotState.COMMITTED:
        try:
            meta = read_meta(segment.view, header)
            if check:
                verify(segment.view, header, meta)
        except (CheckpointError, ValueError, KeyError) as exc:
            error = str(exc)
    return SlotInfo(segment.name, rank, index, segment.size, header, meta, error, replica)


def inspect_slot(name: str, *, check: bool = True) -> SlotInfo:
    """Attach to the slot called ``name`` and :func:`describe` it."""
    try:
        segment = attach_segment(name, populate=False)
    except StorageError as exc:
        parsed = parse_slot_name(name)
        rank, index = (parsed.rank, parsed.slot) if parsed else (-1, -1)
        return SlotInfo(name, rank, index, 0, None, None, str(exc))
    try:
        return describe(segment, check=check)
    finally:
        segment.close()


def run_slots(run_id: str | None = None, *, check: bool = True) -> Iterator[SlotInfo]:
    """Inspect every slot segment of ``run_id`` on this host (of every run: None)."""
    return iter_slots(PREFIX + (run_key(run_id) if run_id else ""), check=check)


def iter_slots(prefix: str = PREFIX, *, check: bool = True) -> Iterator[SlotInfo]:
    """Inspect every slot segment whose name starts with ``prefix``."""
    for name in list_segments(prefix):
        if parse_slot_name(name):
            yield inspect_slot(name, check=check)
