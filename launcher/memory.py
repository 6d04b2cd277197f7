"""Shared-memory checkpoint slots: naming, layout, double buffering and checksums.

A *segment* is a file in ``/dev/shm`` (POSIX shared memory) created by the supervisor,
which owns it, so it outlives any worker. Segments live in a directory private to the
user (:func:`shm_dir`: ``/dev/shm/gemini-<uid>``, mode 0700, or a randomly named
fallback), resolved once by the supervisor and handed to its workers, where no other user
can plant a file or a symlink under gemini's predictable names, and every file is checked
when opened (:func:`open_segment`): never followed through a link, a regular file of
this user, mode 0600, one link. Workers only attach to it with ``os.open`` and
``mmap`` — never with ``multiprocessing.shared_memory``, whose resource tracker unlinks a
segment when an attaching process dies (before Python 3.13).

Each rank has two segments (slots 0 and 1), a double buffer: a save writes the slot that
does not hold the newest committed step. Which slot holds a step, or the newest, is decided
from headers alone by :func:`holding` and :func:`newest`, for every reader. A slot's layout::

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
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

import xxhash

from launcher.contract import ENV_SHM_DIR, ENV_SHM_PRIVATE_DIR
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


class SlotImage:
    """A committed slot's bytes in private memory (a copy-on-write map of a persisted file,
    or a copy of a shared-memory slot) with its decoded header and metadata. The bytes may
    be handed to ``launcher.codec.load_state``; nothing written to them reaches the source."""

    def __init__(self, source: str, header: SlotHeader, meta: dict[str, Any],
                 buf: mmap.mmap) -> None:
        self.source = source
        self.header = header
        self.meta = meta
        self.buf = buf

    def close(self) -> None:
        try:
            self.buf.close()
        except BufferError:  # a tensor still views it; it goes with the last reference
            pass

    def __enter__(self) -> SlotImage:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


# -- the double buffer: which slot holds what ----------------------------------------------
# Every reader that picks one of a rank's slots from their headers alone (a worker's
# restore and prefetch, the supervisor's slot owner, the persistent tier, export) decides
# with these, so that all of them take a step from the same slot and keep the same one.

def committed(header: SlotHeader | None, *, step: int | None = None, rank: int | None = None,
              world_size: int | None = None, run_id: str | None = None
              ) -> TypeGuard[SlotHeader]:
    """Whether ``header`` is a committed slot: of ``step``, of ``rank``, written by a world of
    ``world_size`` ranks and of the run ``run_id`` where given (a header keeps a run id's
    first 64 characters). Headers only: its bytes have yet to verify."""
    return (header is not None and header.state is SlotState.COMMITTED
            and (step is None or header.step == step)
            and (rank is None or header.rank == rank)
            and (world_size is None or header.world_size == world_size)
            and (run_id is None or header.run_id == run_id[:64]))


def by_step(headers: Sequence[SlotHeader | None], *, rank: int | None = None,
            world_size: int | None = None, run_id: str | None = None) -> dict[int, int]:
    """Step -> the index in ``headers`` of the slot holding it, among the :func:`committed`
    ones (of ``rank``, ``world_size`` and ``run_id`` where given). Of two slots with the
    same step, the later commit holds it (each commit of a rank takes a higher
    ``seq``); on equal seqs, the first."""
    held: dict[int, tuple[int, int]] = {}  # step -> (seq, index)
    for index, header in enumerate(headers):
        if committed(header, rank=rank, world_size=world_size, run_id=run_id) and (
                header.step not in held or header.seq > held[header.step][0]):
            held[header.step] = (header.seq, index)
    return {step: index for step, (_, index) in held.items()}


def holding(step: int, headers: Sequence[SlotHeader | None], *, rank: int | None = None,
            world_size: int | None = None, run_id: str | None = None) -> int | None:
    """The index in ``headers`` of the slot holding committed ``step`` (:func:`by_step`),
    or None."""
    return by_step(headers, rank=rank, world_size=world_size, run_id=run_id).get(step)


def newest(headers: Sequence[SlotHeader | None]) -> int | None:
    """The index in ``headers`` of the slot holding the newest committed step (of that
    step, the later commit; see :func:`by_step`), or None: the slot a save must not
    overwrite."""
    held = by_step(headers)
    return held[max(held)] if held else None


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


#: The heartbeat segment of a run on a host (``launcher.health``): two cache lines per
#: local rank of native 64-bit words, written by the worker's Checkpointer, read by its
#: supervisor: a counter bumped at every optimizer step and save (hang detection), and
#: the rank's progress (``launcher.goodput``): the number of steps done (the last step
#: saved or restored, plus one), when its save returned, how long saves and waits for
#: copies have blocked training (ns), when ``restore()`` began and ended, and the steps
#: done as it returned (times in ns of CLOCK_MONOTONIC, the same clock in every process
#: of a host; 0: not yet); and the rank's own work (``launcher.stragglers``): the ns it
#: spent between optimizer steps until its last gradient, and over how many steps.
HEARTBEAT_SUFFIX = "heartbeat"
HEARTBEAT_STRIDE = 128
(BEAT, STEPS_DONE, SAVED_AT, STALLED, RESTORE_BEGAN, RESTORE_ENDED, RESTORED, OWN_NS,
 OWN_STEPS) = range(9)
HEARTBEAT_WORDS = 9
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
#: a save could keep (while both slots are pinned, saves are skipped). A fourth is the
#: worker's too: the step its copy thread is about to write or writing (-1: none), which
#: the host's other ranks wait for before they overwrite the step they all hold.
PINS = struct.Struct("<qqqq")
_SUPERVISOR_PINS = struct.Struct("<qq")  # PINS' first two fields
_SEEN = struct.Struct("<q")
_SEEN_OFFSET = 16
_COPYING_OFFSET = 24


def pins_name(prefix: str, rank: int) -> str:
    return f"{prefix}p{rank}"


_PINS_NAME = re.compile(r"^(gemini-[0-9a-f]{12}-[A-Za-z0-9_.]+-)p\d+$")


def pins_prefix(name: str) -> str | None:
    """The run and host prefix of a pins segment's name, or None for other files."""
    match = _PINS_NAME.match(name)
    return match.group(1) if match else None


def read_pins(buf: mmap.mmap) -> tuple[int, int]:
    sstar, target = _SUPERVISOR_PINS.unpack_from(buf, 0)
    return int(sstar), int(target)


def write_pins(buf: mmap.mmap, sstar: int, target: int) -> None:
    """The supervisor's two fields (the worker's is left alone)."""
    _SUPERVISOR_PINS.pack_into(buf, 0, sstar, target)


def read_seen(buf: mmap.mmap) -> int:
    """The step of the worker's newest save (-1: none yet)."""
    return int(_SEEN.unpack_from(buf, _SEEN_OFFSET)[0])


def write_seen(buf: mmap.mmap, step: int) -> None:
    _SEEN.pack_into(buf, _SEEN_OFFSET, step)


def write_copying(buf: mmap.mmap, step: int) -> None:
    """The step the worker's copy thread is about to write or writing (-1: none)."""
    _SEEN.pack_into(buf, _COPYING_OFFSET, step)


def peek_copying(prefix: str, rank: int) -> int:
    """The step ``rank``'s copy thread is about to write or writing (-1: none, or no pins
    yet)."""
    raw = _peek(pins_name(prefix, rank), _SEEN.size, _COPYING_OFFSET)
    return int(_SEEN.unpack(raw)[0]) if raw is not None and len(raw) == _SEEN.size else -1


def pinned_slots(headers: list[SlotHeader | None], pins: tuple[int, int]) -> set[int]:
    """The indexes of the slots (of one rank's pair, by ``headers``) that hold a pinned
    step: the one holding s*, and the one holding the first committed step at or after
    the target."""
    sstar, target = pins
    steps = {i: h.step for i, h in enumerate(headers) if committed(h)}
    kept = {i for i, step in steps.items() if sstar >= 0 and step == sstar}
    due = [(step, i) for i, step in steps.items() if target >= 0 and step >= target]
    if due:
        kept.add(min(due)[1])
    return kept


# -- where segments live ------------------------------------------------------------------
_SHM_DIR: Path | None = None
_CLAIMED = False  # this process resolves the directory itself (a supervisor): see claim_shm_dir


def _base() -> Path:
    return Path(os.environ.get(ENV_SHM_DIR, "/dev/shm"))


def _private(path: Path) -> bool:
    """Whether ``path`` (not followed) is a directory of this user with mode 0700: no
    other user can create, replace or link anything in it."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
            and stat.S_IMODE(info.st_mode) == 0o700)


def _handed_over(base: Path) -> Path | None:
    """The directory this process's supervisor resolved and handed over in
    ``$GEMINI_SHM_PRIVATE_DIR``, if it names one under ``base`` (a value set for another
    base, inherited from elsewhere, is not this run's)."""
    value = os.environ.get(ENV_SHM_PRIVATE_DIR, "")
    path = Path(value)
    if not value or path.parent != base or not path.name.startswith(f"{PREFIX}{os.geteuid()}"):
        return None
    return path


def _existing(base: Path) -> Path | None:
    """This user's private directory under ``base`` if one exists: ``gemini-<uid>``, else
    the first by name of the fallbacks ``gemini-<uid>-<random>``. Found by what it is (a
    directory of this user, mode 0700), which no other user can fake; never by name alone."""
    uid = os.geteuid()
    primary = base / f"{PREFIX}{uid}"
    if _private(primary):
        return primary
    try:
        with os.scandir(base) as entries:
            names = sorted(e.name for e in entries if e.name.startswith(f"{PREFIX}{uid}-")
                           and e.is_dir(follow_symlinks=False))
    except OSError:
        return None
    return next((base / name for name in names if _private(base / name)), None)


def find_shm_dir() -> Path | None:
    """The directory segments live in if it exists, else None; creates nothing (for
    readers: ``gemini inspect``, ``export``, ``clean``, a worker's lookups)."""
    if _SHM_DIR is not None and _private(_SHM_DIR):
        return _SHM_DIR
    base = _base()
    handed = None if _CLAIMED else _handed_over(base)
    if handed is not None:
        return handed if _private(handed) else None
    return _existing(base)


def shm_dir() -> Path:
    """This user's private directory for segments, made where absent (mode 0700) under
    ``$GEMINI_SHM_DIR`` or ``/dev/shm``. A worker uses the one its supervisor resolved
    (``$GEMINI_SHM_PRIVATE_DIR``, see :func:`claim_shm_dir`), checked, and never resolves
    one of its own. Otherwise: an existing one (:func:`_existing`), else ``gemini-<uid>``,
    else, where another user took that name, a new ``gemini-<uid>-<random>`` (``mkdtemp``:
    a name no one can take first)."""
    global _SHM_DIR
    if _SHM_DIR is not None and _private(_SHM_DIR):
        return _SHM_DIR
    base = _base()
    handed = None if _CLAIMED else _handed_over(base)
    if handed is not None:
        if not _private(handed):
            raise StorageError(f"the shared-memory directory {handed} that the supervisor "
                               "made is gone or not a private directory of this user")
        _SHM_DIR = handed
        return handed
    # A supervisor whose directory another run of the user removed when it emptied makes
    # the same one anew first: its workers were handed that name.
    _SHM_DIR = _resolve(base, _SHM_DIR)
    return _SHM_DIR


def claim_shm_dir() -> Path:
    """:func:`shm_dir` for a supervisor: resolved by this process (a directory named in
    an inherited ``$GEMINI_SHM_PRIVATE_DIR`` is not its own), to be handed to its workers
    (``launcher.slots.SlotOwner`` sets ``$GEMINI_SHM_PRIVATE_DIR``)."""
    global _CLAIMED
    _CLAIMED = True
    return shm_dir()


def _resolve(base: Path, previous: Path | None) -> Path:
    uid = os.geteuid()
    found = _existing(base)
    if found is not None:
        return found
    for path in [p for p in (previous, base / f"{PREFIX}{uid}") if p is not None]:
        try:
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # mkdir's mode is masked by the umask
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise StorageError(f"the shared-memory directory {base} does not exist") from None
        except OSError as exc:
            raise StorageError(f"cannot create {path}: {exc.strerror}") from None
        if _private(path):
            return path
        info = os.lstat(path)
        logger.warning("ignoring %s: not a private directory of this user (owner uid %d, "
                       "mode %o)", path, info.st_uid, info.st_mode)
    # gemini-<uid> is another user's: a fallback whose name nobody can take first
    try:
        made = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{uid}-", dir=base))
        os.chmod(made, 0o700)
    except OSError as exc:
        raise StorageError(f"cannot create a private directory in {base}: "
                           f"{exc.strerror}") from None
    first = _existing(base)  # another run of the user made one at the same moment: share it
    if first is not None and first != made:
        try:
            made.rmdir()
            return first
        except OSError:  # already in use
            pass
    return made


def __getattr__(name: str) -> Any:
    if name == "SHM_DIR":  # the directory segments live in (or would): looking creates nothing
        return find_shm_dir() or _SHM_DIR or _base() / f"{PREFIX}{os.geteuid()}"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def release_shm_dir() -> None:
    """Remove this user's segment directory if it is empty (the last run on the host
    ended); a run still using it keeps it."""
    global _SHM_DIR
    where = _SHM_DIR or find_shm_dir()
    if where is None:
        return
    try:
        where.rmdir()
    except OSError:  # not empty, or already gone
        return
    _SHM_DIR = None


def open_segment(name: str, flags: int) -> int:
    """A descriptor of segment ``name`` opened with ``flags``, after checking that it is
    what gemini creates: not a link (O_NOFOLLOW), a regular file owned by this user,
    mode 0600, one link, not empty. Anything else raises StorageError
    (the caller reports it and leaves the file alone). Opening creates no directory."""
    where = find_shm_dir()
    if where is None:
        raise StorageError(f"shared-memory segment {name} does not exist")
    path = where / name
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
    where = find_shm_dir()
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
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    temporary = f".creating-{os.getpid()}-{threading.get_native_id()}-{name}"
    try:
        fd = os.open(shm_dir() / temporary, flags, 0o600)
    except FileNotFoundError:  # another run on the host released the directory just now
        fd = os.open(shm_dir() / temporary, flags, 0o600)  # made anew, same name first
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
    where = find_shm_dir()
    if where is not None:
        (where / name).unlink(missing_ok=True)


# -- header --------------------------------------------------------------------------

def read_header(buf: mmap.mmap | bytes) -> SlotHeader | None:
    """The slot's header, or None when the segment is too small or not a gemini slot."""
    if len(buf) < HEADER_SIZE:
        return None
    (magic, version, state, step, seq, rank, world_size, data_len, meta_offset, meta_len,
     meta_hash, capacity, run_id) = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC or version != FORMAT_VERSION or state not in SlotState._value2member_map_:
        return None
    return SlotHeader(SlotState(state), step, seq, rank, world_size, data_len, meta_offset,
                      meta_len, meta_hash, capacity, run_id.rstrip(b"\0").decode(errors="replace"))


def _peek(name: str, size: int, offset: int) -> bytes | None:
    """``size`` bytes of segment ``name`` at ``offset``, read through a descriptor closed at
    once (no mapping is kept: a segment replaced in the meantime is not held alive); None
    when there is no such segment."""
    try:
        fd = open_segment(name, os.O_RDONLY)
    except StorageError:
        return None
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def peek_header(name: str) -> SlotHeader | None:
    """The header of slot ``name`` (see :func:`_peek`); None when there is no such slot."""
    raw = _peek(name, HEADER_SIZE, 0)
    return read_header(raw) if raw is not None else None


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
    return StreamVerifier(buf, header.data_len, parse_meta(meta, header))



# -- metadata schema -------------------------------------------------------------------
# A checksum says the metadata is what its writer wrote, not that the writer was gemini:
# a peer with the secret, a co-tenant of a persist directory, a bug. Every reader (restore,
# replica receive, persisted files, inspect, export) gets the metadata from parse_meta,
# which admits only what gemini writes, so the codec never meets a name, an index or a
# size it did not make.

#: The tensor element types a slot may hold, with their sizes in bytes: names as
#: ``str(torch.<dtype>)`` gives them (no torch here: the codec maps them to dtypes).
DTYPE_SIZES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1}
MAX_META_DEPTH = 64
"""Nesting of the state tree (a training state is a few levels deep)."""
MAX_DIMS = 64
_META_KEYS = frozenset({"step", "replicated", "sharded", "tensors", "blocks", "agree", "shared",
                        "tree"})
_ENTRY_KEYS = frozenset({"path", "dtype", "shape", "offset", "nbytes", "device", "xxh3"})
_BLOCK_KEYS = frozenset({"offset", "nbytes", "xxh3"})
_DTENSOR_KEYS = frozenset({"__dtensor__", "mesh", "placements", "shape", "stride"})
_MARKERS = frozenset({"__tensor__", "__tuple__", "__items__", "__bytes__", "__dtype__"})
_SCALAR_TYPES = (type(None), bool, int, float, str)
_HEX64 = re.compile(r"[0-9a-f]{16}")
_DEVICE = re.compile(r"[a-z]{1,16}(:[0-9]{1,4})?")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_REDUCE = re.compile(r"[a-z_]{1,16}")


class _Bad(Exception):
    """A reason metadata is refused (turned into one CheckpointError by parse_meta)."""


def parse_meta(raw: bytes, header: SlotHeader) -> dict[str, Any]:
    """The metadata ``raw`` of the slot ``header`` describes, decoded and checked against
    the schema gemini writes: known keys and types only, element types from
    :data:`DTYPE_SIZES`, each tensor's shape times its element size equal to its bytes and
    those bytes inside the slot's data, every tensor index of the tree and of the shared
    list in range, the tree at most :data:`MAX_META_DEPTH` deep. Anything else raises
    CheckpointError; nothing of it is interpreted."""
    try:
        meta = json.loads(raw)
        _check_meta(meta, header)
    except _Bad as exc:
        raise CheckpointError(f"malformed metadata: {exc}") from None
    except (ValueError, RecursionError) as exc:  # not JSON, too deep, a 5000-digit int
        raise CheckpointError(f"malformed metadata: {str(exc)[:200]}") from None
    checked: dict[str, Any] = meta
    return checked


def _check_meta(meta: Any, header: SlotHeader) -> None:
    if type(meta) is not dict:
        raise _Bad(f"a JSON {type(meta).__name__}, not an object")
    if not _META_KEYS.issuperset(meta) or "tensors" not in meta or "tree" not in meta:
        raise _Bad(f"keys {sorted(meta)[:10]}")
    if "step" in meta:
        _int(meta["step"], "step", low=-1)
    if any(type(meta.get(key, False)) is not bool for key in ("replicated", "sharded")):
        raise _Bad("replicated or sharded is not true or false")
    tensors = _list(meta["tensors"], "tensors")
    for entry in tensors:
        _check_entry(entry, header.data_len)
    for block in _list(meta.get("blocks", []), "blocks"):
        if type(block) is not dict or set(block) != _BLOCK_KEYS:
            raise _Bad("a block is not {offset, nbytes, xxh3}")
        _range(block, header.data_len, "a block")
        _hex(block["xxh3"], "a block's xxh3")
    if "agree" in meta:
        agree = meta["agree"]
        if type(agree) is not dict or set(agree) != {"key", "digest"}:
            raise _Bad("agree is not {key, digest}")
        _hex(agree["key"], "agree's key")
        _hex(agree["digest"], "agree's digest")
    shared = _list(meta.get("shared") or [], "shared")
    _check_shared(shared, len(tensors) + len(shared), header.world_size)
    _check_tree(meta["tree"], len(tensors) + len(shared))


def _check_shared(shared: list[Any], count: int, world_size: int) -> None:
    """The tensors another rank of the host keeps (``[index, owner, path, dtype, shape]``,
    see ``launcher.codec.slot_tensors``): each index once, in range."""
    indexes = set()
    for item in shared:
        if type(item) is not list or len(item) != 5:
            raise _Bad("a shared tensor is not [index, owner, path, dtype, shape]")
        index, owner, path, dtype, shape = item
        indexes.add(_int(index, "a shared tensor's index", high=count - 1))
        _int(owner, "a shared tensor's owner", high=max(world_size - 1, 0))
        _str(path, "a shared tensor's path")
        _elements(shape, "a shared tensor's shape")
        _dtype(dtype)
    if len(indexes) != len(shared):
        raise _Bad("a shared tensor index repeats")


def _check_entry(entry: Any, data_len: int) -> None:
    if type(entry) is not dict or not _ENTRY_KEYS.issuperset(entry) or not (
            _ENTRY_KEYS - {"device"}).issubset(entry):
        raise _Bad("a tensor record is not {path, dtype, shape, offset, nbytes, device, xxh3}")
    path = _str(entry["path"], "a tensor's path")
    elements = _elements(entry["shape"], f"{path}: shape")
    nbytes = _range(entry, data_len, path)
    if elements * DTYPE_SIZES[_dtype(entry["dtype"])] != nbytes:
        raise _Bad(f"{path}: {entry['shape']} x {entry['dtype']} is not {nbytes} bytes")
    device = entry.get("device", "cpu")
    if type(device) is not str or not _DEVICE.fullmatch(device):
        raise _Bad(f"{path}: device {str(device)[:40]!r}")
    if entry["xxh3"] is not None:
        _hex(entry["xxh3"], f"{path}: xxh3")


def _check_tree(tree: Any, count: int) -> None:
    """The skeleton ``launcher.codec.flatten`` writes, with ``count`` tensors."""
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_META_DEPTH:
            raise _Bad(f"the state tree is deeper than {MAX_META_DEPTH} levels")
        if isinstance(node, _SCALAR_TYPES):
            continue
        stack.extend((child, depth + 1) for child in _children(node, count))


def _children(node: Any, count: int) -> list[Any]:
    """The nodes under the tree node ``node``, after checking ``node`` itself."""
    if type(node) is list:
        return node
    if type(node) is not dict:
        raise _Bad(f"a tree node is a {type(node).__name__}")
    marker = [key for key in node if key.startswith("__")]
    if not marker:  # a plain dict (flatten writes no other with such keys)
        return list(node.values())
    if "__dtensor__" in node:
        _check_dtensor(node, count)
        return []
    if len(node) != 1 or marker[0] not in _MARKERS:
        raise _Bad(f"a tree node with keys {sorted(node)[:4]}")
    return _marked(marker[0], node[marker[0]], count)


def _marked(marker: str, value: Any, count: int) -> list[Any]:
    """The nodes under a node ``{marker: value}``, after checking ``value``."""
    if marker == "__tuple__":
        return [_list(value, "a tuple")]
    if marker == "__items__":
        pairs = _list(value, "a mapping")
        if not all(type(p) is list and len(p) == 2 and _hashable(p[0]) for p in pairs):
            raise _Bad("a mapping item is not [key, value] with a hashable key")
        return pairs
    if marker == "__tensor__":
        _int(value, "a tensor index", high=count - 1)
    elif marker == "__bytes__":
        if type(value) is not str or not _BASE64.fullmatch(value) or len(value) % 4:
            raise _Bad("bytes that are not base64")
    else:
        _dtype(value)
    return []


def _hashable(key: Any) -> bool:
    """Whether the tree node ``key`` decodes to a valid dict key (a scalar, bytes, a dtype,
    a tensor, or a tuple of those): what ``flatten`` writes for a key."""
    if isinstance(key, _SCALAR_TYPES):
        return True
    if type(key) is not dict or len(key) != 1:
        return False
    if "__tuple__" in key:
        return type(key["__tuple__"]) is list and all(map(_hashable, key["__tuple__"]))
    return bool({"__bytes__", "__dtype__", "__tensor__"} & key.keys())


def _check_dtensor(node: dict[str, Any], count: int) -> None:
    if set(node) != _DTENSOR_KEYS:
        raise _Bad(f"a DTensor node with keys {sorted(node)[:6]}")
    _int(node["__dtensor__"], "a DTensor index", high=count - 1)
    mesh = json.loads(_str(node["mesh"], "a device mesh"))
    if type(mesh) is not list or len(mesh) != 3 or type(mesh[0]) is not str or type(
            mesh[2]) is not list or not all(type(name) is str for name in mesh[2]):
        raise _Bad("a device mesh is not [device type, ranks, dimension names]")
    ranks: list[tuple[Any, int]] = [(mesh[1], 0)]
    while ranks:
        item, depth = ranks.pop()
        if type(item) is list and depth < MAX_DIMS:
            ranks.extend((value, depth + 1) for value in item)
        else:
            _int(item, "a device mesh rank")
    for placement in _list(node["placements"], "placements"):
        kind = placement[0] if type(placement) is list and placement else None
        args = placement[1:] if kind is not None else []
        if kind == "Shard" and len(args) == 1:
            _int(args[0], "a Shard dimension", high=MAX_DIMS)
        elif kind == "_StridedShard" and len(args) == 2:
            _int(args[0], "a Shard dimension", high=MAX_DIMS)
            _int(args[1], "a split factor", low=1)
        elif kind == "Partial" and len(args) == 1 and type(args[0]) is str and (
                _REDUCE.fullmatch(args[0])):
            pass
        elif kind != "Replicate" or args:
            raise _Bad(f"a DTensor placement {str(placement)[:40]}")
    _elements(node["shape"], "a DTensor shape")
    _elements(node["stride"], "a DTensor stride")


def _dtype(name: Any) -> str:
    if type(name) is not str or name not in DTYPE_SIZES:
        raise _Bad(f"element type {str(name)[:40]!r} is not one gemini saves")
    return name


def _int(value: Any, what: str, *, low: int = 0, high: int = (1 << 63) - 1) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _Bad(f"{what} {str(value)[:40]} is not an integer in [{low}, {high}]")
    return value


def _str(value: Any, what: str) -> str:
    if type(value) is not str:
        raise _Bad(f"{what} is not a string")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if type(value) is not list:
        raise _Bad(f"{what} is not a list")
    return value


def _hex(value: Any, what: str) -> None:
    if type(value) is not str or not _HEX64.fullmatch(value):
        raise _Bad(f"{what} is not 16 hex digits")


def _elements(shape: Any, what: str) -> int:
    """The number of elements of ``shape`` (a list of at most MAX_DIMS sizes)."""
    if type(shape) is not list or len(shape) > MAX_DIMS:
        raise _Bad(f"{what} is not a list of at most {MAX_DIMS} sizes")
    count = 1
    for size in shape:
        count *= _int(size, what, high=1 << 62)
    return count


def _range(entry: dict[str, Any], data_len: int, what: str) -> int:
    """``entry``'s byte count after checking that its bytes lie in the slot's data."""
    start = _int(entry.get("offset"), f"{what}: offset")
    nbytes = _int(entry.get("nbytes"), f"{what}: nbytes")
    if start + nbytes > data_len:
        raise _Bad(f"{what}: bytes {start}..{start + nbytes} outside the "
                   f"{data_len} data bytes")
    return nbytes


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
    return parse_meta(raw, header)


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
        if self.error is None and committed(self.header):
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
