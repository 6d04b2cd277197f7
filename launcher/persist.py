"""The persistent tier: asynchronous flush of committed slots to durable storage, and back.

Layout under a directory ``D`` (local, or a shared file system that every host sees)::

    D/<run_key>/step-<step:012d>/rank-<rank:05d>.gslot   the slot's bytes [0, meta_offset + meta_len)
    D/<run_key>/step-<step:012d>/rank-<rank:05d>.json    its manifest (see :class:`Manifest`)

``run_key`` is :func:`launcher.memory.run_key` of the run id. A ``.gslot`` file is a slot
as :mod:`launcher.memory` lays it out (header, tensor bytes, JSON metadata), so the
per-tensor checksums of the metadata and the metadata checksum of the header come with it;
the manifest adds the xxh3 of the header and the file's size, which makes a cheap scan
(manifest + 4 KiB header, no data read) trustworthy.

Publication: each file is written under a hidden temporary name in its step directory,
fsynced, renamed into place and the directory fsynced; the ``.gslot`` first, the manifest
last. A file is *published* when its manifest exists and matches it (step, rank, seq, size,
header and metadata checksums), so a crash at any moment leaves the previous version of a
file, or no usable file for that step — never one that loads. Loading checks every
checksum again (:func:`load_into`, :func:`read_slot_file`).

Only this user's own files are trusted: the run directory, each step directory and each
file must be owned by the effective uid (a shared directory lets another user plant a run
directory or a step that would otherwise pass every checksum), and no link is followed.
Anything else is skipped (:func:`scan`), reported (:func:`inspect_dir`) or refused
(:func:`check_run_dir`, :meth:`PersistWriter.start`).

A step is *complete* when published files exist for all ``world_size`` ranks (the header
of each file says the world size). :class:`PersistWriter` runs in the supervisor and
keeps the ``keep`` newest complete steps; each host deletes only its own ranks' files.

This module imports the standard library, xxhash and ``launcher.memory``/``errors`` only;
torch is imported inside :func:`export_checkpoint`.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import mmap
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from launcher import memory
from launcher.errors import CheckpointError, ConfigError, StorageError, UsageError
from launcher.priority import IdleGate, lower_priority

logger = logging.getLogger(__name__)

SCHEMA = "gemini.persist/v1"
SLOT_SUFFIX = ".gslot"
MANIFEST_SUFFIX = ".json"
COPY_CHUNK = 8 << 20  # bytes per write() while copying a slot to its file
# Seconds a file's copy waits, chunk by chunk, for the workers to leave the CPU idle
# (launcher.priority.IdleGate) before it goes on regardless.
GATE_WAIT = 1.0
WRITER_NICE = 10  # the writer thread yields the CPU to training

_STEP_DIR = re.compile(r"^step-(\d{12})$")
_RANK_FILE = re.compile(r"^rank-(\d{5})\.gslot$")
_TEMP_FILE = re.compile(r"^\.rank-(\d{5})\..*\.tmp$")
_RUN_DIR = re.compile(r"^[0-9a-f]{12}$")
MAX_MANIFEST = 64 << 10  # bytes: a manifest is a few hundred


# -- paths -------------------------------------------------------------------------------

def run_dir(directory: Path, run_id: str) -> Path:
    """The directory holding every persisted step of ``run_id``."""
    return Path(directory) / memory.run_key(run_id)


def step_dir(directory: Path, run_id: str, step: int) -> Path:
    return run_dir(directory, run_id) / f"step-{step:012d}"


def slot_path(directory: Path, run_id: str, rank: int, step: int) -> Path:
    """The ``.gslot`` file of ``rank`` at ``step`` (its manifest: same name, ``.json``)."""
    return step_dir(directory, run_id, step) / f"rank-{rank:05d}{SLOT_SUFFIX}"


def manifest_path(path: Path) -> Path:
    """The manifest of the ``.gslot`` file ``path``."""
    return path.with_suffix(MANIFEST_SUFFIX)


def _not_ours(info: os.stat_result, kind: str = "file") -> str | None:
    """Why an entry with ``info`` (from ``lstat``/``fstat``) is not a ``kind`` ("file" or
    "directory") this user may trust, or None if it is."""
    is_kind = stat.S_ISDIR if kind == "directory" else stat.S_ISREG
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link: not trusted"
    if not is_kind(info.st_mode):
        return "not a regular file" if kind == "file" else "not a directory"
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}, not by this user: not trusted"
    return None


def _dir_refusal(path: Path) -> str | None:
    """Why the directory ``path`` (not followed if a link) is not to be trusted; None if
    it is this user's, or does not exist."""
    try:
        return _not_ours(os.lstat(path), "directory")
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return "not a directory"


def check_run_dir(directory: Path, run_id: str) -> Path:
    """The run directory of ``run_id`` under ``directory`` (which may not exist yet);
    StorageError if another user made it or it is a link or a file."""
    where = run_dir(directory, run_id)
    why = _dir_refusal(where)
    if why is not None:
        raise StorageError(f"{where}: {why} (another user's run directory in a shared "
                           "directory?)")
    return where


_ignored: set[str] = set()  # paths already warned about (the writer scans every poll)


def _ignore(path: str, why: str) -> None:
    if path not in _ignored:
        _ignored.add(path)
        logger.warning("persisted checkpoints in %s ignored: %s", path, why)


def _step_dirs(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step directory of this user under a run directory of this
    user, oldest first (another user's are skipped: they could plant any step)."""
    why = _dir_refusal(folder)
    if why is not None:
        _ignore(str(folder), why)
        return []
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        match = _STEP_DIR.match(entry.name)
        if not match:
            continue
        try:
            why = _not_ours(entry.stat(follow_symlinks=False), "directory")
        except FileNotFoundError:
            continue
        if why is None:
            found.append((int(match.group(1)), Path(entry.path)))
        else:
            _ignore(entry.path, why)
    return sorted(found)


def _rank_files(folder: Path) -> list[tuple[int, Path]]:
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        match = _RANK_FILE.match(name)
        if match:
            found.append((int(match.group(1)), folder / name))
    return sorted(found)


# -- manifest and checks -------------------------------------------------------------------

@dataclass(frozen=True)
class Manifest:
    """The JSON record published next to a ``.gslot`` file (schema ``gemini.persist/v1``)."""

    run_id: str
    rank: int
    step: int
    seq: int
    world_size: int
    nbytes: int
    """The size of the ``.gslot`` file: the slot's ``meta_offset + meta_len``."""
    header_xxh3: int
    """xxh3-64 of the file's first ``memory.HEADER_SIZE`` bytes."""
    meta_xxh3: int
    """The header's metadata checksum (each tensor's checksum is in the metadata)."""
    host: str
    time: float
    """When the file was published (seconds since the epoch)."""

    def to_json(self) -> bytes:
        return json.dumps({
            "schema": SCHEMA, "run_id": self.run_id, "rank": self.rank, "step": self.step,
            "seq": self.seq, "world_size": self.world_size, "nbytes": self.nbytes,
            "header_xxh3": f"{self.header_xxh3:016x}", "meta_xxh3": f"{self.meta_xxh3:016x}",
            "host": self.host, "time": self.time}, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        try:
            data = json.loads(raw)
            if data.get("schema") != SCHEMA:
                raise CheckpointError(f"manifest schema {data.get('schema')!r}, "
                                      f"expected {SCHEMA}")
            return cls(str(data["run_id"]), int(data["rank"]), int(data["step"]),
                       int(data["seq"]), int(data["world_size"]), int(data["nbytes"]),
                       int(data["header_xxh3"], 16), int(data["meta_xxh3"], 16),
                       str(data["host"]), float(data["time"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"malformed manifest: {exc}") from None


def _read_manifest(path: Path) -> Manifest:
    where = manifest_path(path)
    fd = _open(where, missing="unpublished: no manifest")
    try:
        if os.fstat(fd).st_size > MAX_MANIFEST:
            raise CheckpointError(f"{where.name}: larger than {MAX_MANIFEST} bytes")
        raw = os.read(fd, MAX_MANIFEST + 1)
    except OSError as exc:
        raise StorageError(f"cannot read {where}: {exc.strerror}") from None
    finally:
        os.close(fd)
    return Manifest.from_json(raw)


def _header_of(fd: int) -> tuple[memory.SlotHeader | None, int]:
    """The header at the start of the open file ``fd`` and the xxh3 of its bytes."""
    with mmap.mmap(fd, memory.HEADER_SIZE, access=mmap.ACCESS_READ) as head:
        return memory.read_header(head), xxhash.xxh3_64_intdigest(head)


def _check(path: Path, fd: int, manifest: Manifest, *, run_id: str | None = None,
           rank: int | None = None, step: int | None = None) -> memory.SlotHeader:
    """The header of the open ``.gslot`` file ``fd`` after the cheap checks: size, header
    checksum, and agreement of header, manifest, and what the caller expects."""
    size = os.fstat(fd).st_size
    if size != manifest.nbytes:
        raise CheckpointError(f"{path.name}: {size} bytes, manifest says {manifest.nbytes} "
                              f"(truncated or replaced)")
    if size < memory.HEADER_SIZE:
        raise CheckpointError(f"{path.name}: too small for a slot header")
    header, digest = _header_of(fd)
    if digest != manifest.header_xxh3:
        raise CheckpointError(f"{path.name}: header checksum mismatch")
    if not memory.committed(header):
        raise CheckpointError(f"{path.name}: not a committed gemini slot")
    want = {"step": (header.step, manifest.step), "rank": (header.rank, manifest.rank),
            "seq": (header.seq, manifest.seq), "world_size": (header.world_size,
                                                              manifest.world_size),
            "meta checksum": (header.meta_hash, manifest.meta_xxh3),
            "size": (header.meta_offset + header.meta_len, size),
            "run id": (header.run_id, manifest.run_id[:64])}
    for what, (have, expected) in want.items():
        if have != expected:
            raise CheckpointError(f"{path.name}: {what} {have!r} in the header, "
                                  f"{expected!r} in the manifest")
    if header.meta_offset < memory.HEADER_SIZE + header.data_len:
        raise CheckpointError(f"{path.name}: metadata overlaps the tensor data")
    for what, have, expected in (("run id", manifest.run_id, run_id),
                                 ("rank", manifest.rank, rank), ("step", manifest.step, step)):
        if expected is not None and have != expected:
            raise CheckpointError(f"{path.name}: {what} {have!r}, expected {expected!r}")
    return header


def _open(path: Path, *, missing: str | None = None) -> int:
    """A read-only descriptor of a persisted file: CheckpointError (``missing`` or
    "<name>: missing" if it is gone) if it is gone, a link, not a regular file or not this
    user's (O_NONBLOCK: a FIFO in its place is refused, not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointError(missing or f"{path.name}: missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"{path.name}: a symbolic link: not trusted") from None
        raise StorageError(f"cannot open {path}: {exc.strerror}") from None
    why = _not_ours(os.fstat(fd))
    if why is not None:
        os.close(fd)
        raise CheckpointError(f"{path.name}: {why}")
    return fd


def _check_path(path: Path, **expect: Any) -> tuple[Manifest, memory.SlotHeader]:
    manifest = _read_manifest(path)
    fd = _open(path)
    try:
        return manifest, _check(path, fd, manifest, **expect)
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


# -- reading --------------------------------------------------------------------------------

def _published(directory: Path, run_id: str) -> dict[int, dict[int, Manifest]]:
    """step -> rank -> manifest of every file that passes the cheap checks."""
    found: dict[int, dict[int, Manifest]] = {}
    for step, folder in _step_dirs(run_dir(directory, run_id)):
        for rank, path in _rank_files(folder):
            try:
                manifest, _ = _check_path(path, run_id=run_id, rank=rank, step=step)
            except (CheckpointError, StorageError) as exc:
                logger.debug("persisted %s skipped: %s", path, exc)
                continue
            found.setdefault(step, {})[rank] = manifest
    return found


def scan(directory: Path, run_id: str) -> dict[int, list[int]]:
    """The steps per rank that have a published file in ``directory`` whose manifest and
    header check out (cheap: no tensor data is read; :func:`load_into` verifies it)."""
    steps: dict[int, list[int]] = {}
    for step, ranks in _published(directory, run_id).items():
        for rank in ranks:
            steps.setdefault(rank, []).append(step)
    return {rank: sorted(found) for rank, found in sorted(steps.items())}


def _complete(published: Mapping[int, Mapping[int, Manifest]]) -> list[int]:
    complete = []
    for step, ranks in published.items():
        sizes = {m.world_size for m in ranks.values()}
        if len(sizes) == 1:
            world_size = sizes.pop()
            if world_size > 0 and set(ranks) == set(range(world_size)):
                complete.append(step)
    return sorted(complete)


def complete_steps(directory: Path, run_id: str) -> list[int]:
    """Steps (oldest first) with a published file for every rank of the world size their
    headers record (cheap checks only, as :func:`scan`)."""
    return _complete(_published(directory, run_id))


def read_slot_file(path: Path, *, check: bool = True) -> memory.SlotImage:
    """Map a published ``.gslot`` file privately after checking it against its manifest;
    with ``check`` verify every tensor checksum too. Raises CheckpointError if the file
    is unpublished, truncated or corrupt, StorageError if it cannot be read."""
    path = Path(path)
    manifest = _read_manifest(path)
    fd = _open(path)
    try:
        header = _check(path, fd, manifest)
        buf = mmap.mmap(fd, manifest.nbytes, access=mmap.ACCESS_COPY)
    except OSError as exc:
        raise StorageError(f"cannot map {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    try:
        meta = memory.read_meta(buf, header)
        if check:
            memory.verify(buf, header, meta)
    except (ValueError, KeyError, TypeError) as exc:
        buf.close()
        raise CheckpointError(f"{path.name}: malformed metadata: {exc}") from None
    except CheckpointError as exc:
        buf.close()
        raise CheckpointError(f"{path.name}: {exc}") from None
    except OSError as exc:  # EIO while reading the mapped pages surfaces as SIGBUS, not here
        buf.close()
        raise StorageError(f"cannot read {path}: {exc.strerror}") from None
    return memory.SlotImage(str(path), header, meta, buf)


def load_into(directory: Path, run_id: str, rank: int, step: int,
              target: Callable[[int], memory.Segment]) -> memory.SlotHeader:
    """Copy the persisted file of ``rank`` at ``step`` into a shared-memory slot and commit
    it there after verifying every checksum; return the slot's committed header.

    ``target(nbytes)`` returns a slot of at least ``nbytes`` in the WRITING state (e.g.
    ``functools.partial(owner.write_target, rank, replica=False)``); ``nbytes`` includes the
    headroom of ``memory.slot_size``, so the worker's next save fits without regrowing it.
    Raises CheckpointError (the slot stays WRITING) when the file is missing, unpublished,
    truncated or corrupt; StorageError when it cannot be read."""
    path = slot_path(directory, run_id, rank, step)
    manifest = _read_manifest(path)
    try:
        with open(_open(path), "rb", buffering=0) as src:
            header = _check(path, src.fileno(), manifest, run_id=run_id, rank=rank, step=step)
            segment = target(memory.slot_size(header.data_len, header.meta_len))
            buf = segment.view
            if len(buf) < header.meta_offset + header.meta_len:
                raise StorageError(f"slot {segment.name} has {len(buf)} bytes, need "
                                   f"{header.meta_offset + header.meta_len}")
            src.seek(memory.HEADER_SIZE)
            with memoryview(buf) as view:
                _read_exact(src, view[memory.HEADER_SIZE:memory.HEADER_SIZE + header.data_len])
            src.seek(header.meta_offset)
            meta = src.read(header.meta_len)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc.strerror}") from None
    try:
        memory.commit_received(buf, header, meta)
    except CheckpointError as exc:
        raise CheckpointError(f"persisted rank {rank} step {step} ({path}): {exc}") from None
    committed = memory.read_header(buf)
    assert committed is not None
    return committed


def _read_exact(src: Any, view: memoryview) -> None:
    done = 0
    while done < len(view):
        with view[done:done + COPY_CHUNK] as chunk:
            n = src.readinto(chunk)
        if not n:
            raise CheckpointError("file ended before its data did (truncated)")
        done += n


@dataclass(frozen=True)
class FileInfo:
    """What :func:`inspect_dir` found in one ``.gslot`` file."""

    path: Path
    rank: int
    step: int
    size: int
    header: memory.SlotHeader | None
    manifest: Manifest | None
    meta: dict[str, Any] | None
    error: str | None

    @property
    def published(self) -> bool:
        return self.manifest is not None

    @property
    def valid_step(self) -> int | None:
        """The step this file can restore, or None."""
        return self.step if self.error is None and self.meta is not None else None


def inspect_dir(directory: Path, run_id: str | None = None, *,
                check: bool = True) -> list[FileInfo]:
    """Describe (and with ``check`` verify) every persisted file of ``run_id``, or of every
    run, under ``directory``. Raises StorageError if ``directory`` is not a directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise StorageError(f"{directory} is not a directory")
    if run_id is not None:
        runs = [check_run_dir(directory, run_id)]
    else:  # another user's runs are skipped (with a warning) by _step_dirs
        runs = sorted(p for p in directory.iterdir()
                      if _RUN_DIR.match(p.name) and p.is_dir() and not p.is_symlink())
    infos = []
    for run in runs:
        for step, folder in _step_dirs(run):
            for rank, path in _rank_files(folder):
                infos.append(_describe(path, rank, step, check))
    return infos


def _describe(path: Path, rank: int, step: int, check: bool) -> FileInfo:
    try:
        size = os.lstat(path).st_size
    except OSError as exc:
        return FileInfo(path, rank, step, 0, None, None, None, exc.strerror or str(exc))
    try:
        manifest: Manifest | None = _read_manifest(path)
    except (CheckpointError, StorageError) as exc:  # unpublished: show what the header says
        return FileInfo(path, rank, step, size, _raw_header(path, size), None, None, str(exc))
    try:
        with read_slot_file(path, check=check) as image:
            header, meta = image.header, image.meta
        if (rank, step) != (header.rank, header.step):
            raise CheckpointError(f"holds rank {header.rank} step {header.step}")
    except (CheckpointError, StorageError) as exc:
        return FileInfo(path, rank, step, size, _raw_header(path, size), manifest, None,
                        str(exc))
    return FileInfo(path, rank, step, size, header, manifest, meta, None)


def _raw_header(path: Path, size: int) -> memory.SlotHeader | None:
    """The header a file starts with, unchecked (for reports on files that fail checks)."""
    if size < memory.HEADER_SIZE:
        return None
    try:
        fd = _open(path)  # not another user's file, nor a link or FIFO
    except (CheckpointError, StorageError):
        return None
    try:
        return _header_of(fd)[0]
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


# -- writing --------------------------------------------------------------------------------

def _current_header(segment: memory.Segment) -> memory.SlotHeader | None:
    """The header of ``segment``, or None once it is closed (regrown meanwhile)."""
    try:
        return memory.read_header(segment.view)
    except (StorageError, ValueError):
        return None


class _Aborted(Exception):
    """The writer was closed in the middle of a copy."""


def _copy_out(view: memoryview, fd: int, end: int, stop: threading.Event,
              gate: IdleGate | None) -> None:
    """Write ``view[:end]`` to ``fd`` in chunks (each write releases the GIL), each once
    ``gate`` says the workers are idle, for up to :data:`GATE_WAIT` seconds."""
    pos = 0
    until = time.monotonic() + GATE_WAIT
    while pos < end:
        if gate is not None and not gate.wait(until, stop):
            gate = None
        if stop.is_set():
            raise _Aborted()
        with view[pos:min(pos + COPY_CHUNK, end)] as chunk:
            pos += os.write(fd, chunk)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems cannot fsync a directory
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _preallocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes (an early ENOSPC instead of one mid-copy), where supported."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            raise


def _create(path: Path) -> int:
    """A new file of this user at ``path`` (mode 0600), opened for writing: a stale file
    of that name (a crash's temporary) is replaced, a link is never followed."""
    path.unlink(missing_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   0o600)


def _write_small(path: Path, data: bytes, token: str) -> None:
    """Write ``data`` to ``path`` atomically (temporary file, fsync, rename, fsync dir)."""
    tmp = path.parent / f".{path.name}.{token}.tmp"
    fd = _create(tmp)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _remove_rank(folder: Path, rank: int) -> int:
    """Unpublish (manifest first) and delete ``rank``'s files and temporaries in ``folder``."""
    path = folder / f"rank-{rank:05d}{SLOT_SUFFIX}"
    removed = 0
    for victim in (manifest_path(path), path):
        try:
            victim.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    for name in _listdir(folder):
        match = _TEMP_FILE.match(name)
        if match and int(match.group(1)) == rank:
            (folder / name).unlink(missing_ok=True)
    return removed


def _listdir(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _rmdir_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # not empty (another host's files), or gone
        pass


def discard_newer(directory: Path, run_id: str, step: int, ranks: Collection[int]) -> int:
    """Delete the files of ``ranks`` for every step after ``step`` (a restore of ``step``
    makes them part of an abandoned attempt); return how many files were removed."""
    removed = 0
    for found, folder in _step_dirs(run_dir(directory, run_id)):
        if found > step:
            for rank in ranks:
                removed += _remove_rank(folder, rank)
            _rmdir_if_empty(folder)
    return removed


def plan(held: Mapping[int, Collection[int]], persisted: Mapping[int, int], *,
         every_steps: int | None, time_due: Collection[int],
         intents: Collection[int] = ()) -> dict[int, int]:
    """Which step to persist now for each rank (a pure decision).

    ``held``: the committed steps each local rank has in memory; ``persisted``: the newest
    step persisted per rank; ``time_due``: ranks whose interval in seconds has passed;
    ``intents``: steps whose directory exists already (another rank or host started them).

    A rank's candidates are its steps newer than its persisted one that are multiples of
    ``every_steps`` (aligned, so that every rank on every host picks the same steps), or
    in ``intents`` (join a step others persist). When it is ``time_due``: the newest
    intent among its steps, else the steps that every rank in ``held`` holds (a rank that
    has committed nothing yet holds none: the host waits for it), since a step is only
    useful once it is complete for every rank. Each rank takes its newest candidate that
    every rank with candidates shares, else its newest.
    """
    candidates: dict[int, set[int]] = {}
    everyone = set.intersection(*map(set, held.values())) if held else set()
    for rank, steps in held.items():
        fresh = {s for s in steps if s > persisted.get(rank, -1)}
        chosen = {s for s in fresh if (every_steps and s % every_steps == 0) or s in intents}
        if rank in time_due:  # one others started first, else one every local rank holds
            joined = fresh & set(intents)
            chosen = {max(joined)} if joined else fresh & everyone
        if chosen:
            candidates[rank] = chosen
    common = set.intersection(*candidates.values()) if candidates else set()
    return {rank: max(common or chosen) for rank, chosen in sorted(candidates.items())}


class PersistWriter:
    """Copies committed slots of this host's ranks to files in the background.

    A daemon thread polls the slots every ``poll_interval`` seconds, picks for each rank
    the step to persist (:func:`plan`: every ``every_steps`` steps, aligned to multiples of
    it, and/or once ``every_seconds`` have passed since the rank's last persist), and copies
    the slot into a file, at low CPU priority, chunk by chunk from the mapping, each chunk
    once the workers leave the CPU idle (for at most :data:`GATE_WAIT` seconds per file):
    the workers never wait for it. The slot is not locked: the header is read first and checked with
    ``memory.unchanged`` after the copy; a slot that a worker rewrote meanwhile is discarded
    and a newer step is tried later. After each publish the ``keep`` newest complete steps
    are kept and this host's files of older steps are deleted (never the only complete
    step; never another host's files).

    I/O failures (disk full, permission) are logged, kept in :attr:`last_error`, and
    retried with a back-off; training goes on. Thread-safe.
    """

    def __init__(self, directory: Path, *, run_id: str,
                 sources: Callable[[], Mapping[int, Sequence[memory.Segment]]],
                 every_steps: int | None = None, every_seconds: float | None = None,
                 keep: int = 2, on_persisted: Callable[[int, int], None] | None = None,
                 poll_interval: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``sources()`` returns the slots of each local rank (``SlotOwner.segments``);
        ``on_persisted(rank, step)`` is called in the writer's thread after each publish;
        ``clock`` (monotonic seconds) drives ``every_seconds``."""
        if every_steps is None and every_seconds is None:
            raise UsageError("persisting needs every_steps or every_seconds")
        if every_steps is not None and every_steps < 1:
            raise UsageError(f"every_steps must be >= 1, got {every_steps}")
        if every_seconds is not None and not every_seconds > 0:
            raise UsageError(f"every_seconds must be > 0, got {every_seconds}")
        if keep < 1:
            raise UsageError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.run_id = run_id
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.keep = keep
        self.poll_interval = poll_interval
        self._sources = sources
        self._on_persisted = on_persisted
        self._clock = clock
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._persisted: dict[int, int] = {}
        self._persisted_at: dict[int, float] = {}
        self._own: set[int] = set()  # ranks this writer has persisted or seen locally
        self._last_error: StorageError | None = None
        self._logged: str | None = None
        self._backoff = 0.0
        self._retry_at = -math.inf
        self._token = f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self._host = socket.gethostname()
        self._gate = IdleGate() if IdleGate.available() else None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Check that the run's directory is this user's and can be written (a ConfigError
        naming it if not: better now than at the first persist, hours in), then start the
        background thread (idempotent; a closed writer stays closed)."""
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            where = run_dir(self.directory, self.run_id)
            try:
                where.mkdir(parents=True, exist_ok=True, mode=0o700)
                check_run_dir(self.directory, self.run_id)
                probe = where / f".probe-{self._token}"
                os.close(_create(probe))
                probe.unlink()
            except StorageError as exc:
                raise ConfigError(f"--persist-dir {self.directory}: {exc}",
                                  field="persist_dir") from None
            except OSError as exc:
                raise ConfigError(f"--persist-dir {self.directory}: cannot write {where}: "
                                  f"{exc.strerror or exc}") from None
            self._thread = threading.Thread(target=self._loop, name="gemini-persist",
                                            daemon=True)
            self._thread.start()

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the thread, abandoning a copy in progress (its temporary file is removed);
        wait up to ``timeout`` seconds for it. Idempotent."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("persist thread still busy after %s s; left behind", timeout)

    def _loop(self) -> None:
        lower_priority(WRITER_NICE)
        while not self._stop.wait(self.poll_interval):
            try:
                self.run_once()
            except Exception:  # a bug or an unexpected source error: keep training going
                logger.exception("persist round failed")

    # -- state ------------------------------------------------------------------------------
    def status(self) -> dict[int, int]:
        """The newest step this writer persisted, per rank (never waits for a copy)."""
        return dict(self._persisted)  # one C-level copy under the GIL

    @property
    def last_error(self) -> StorageError | None:
        """The most recent failure to write (None if there was none)."""
        return self._last_error

    def scan(self) -> dict[int, list[int]]:
        """:func:`scan` of this writer's directory and run: published steps per rank (every
        host's ranks, where the directory is shared)."""
        return scan(self.directory, self.run_id)

    def load(self, rank: int, step: int,
             target: Callable[[int], memory.Segment]) -> memory.SlotHeader:
        """:func:`load_into` from this writer's directory and run."""
        return load_into(self.directory, self.run_id, rank, step, target)

    def rewind(self, step: int) -> None:
        """A restore of ``step``: forget and delete this host's persisted steps after it
        (they belong to the abandoned attempt and must not mix with the new one)."""
        with self._lock:
            for rank, persisted in list(self._persisted.items()):
                if persisted > step:
                    del self._persisted[rank]
            try:
                discard_newer(self.directory, self.run_id, step, self._own_ranks())
            except OSError as exc:
                self._fail(StorageError(f"cannot delete persisted steps after {step} in "
                                        f"{run_dir(self.directory, self.run_id)}: "
                                        f"{exc.strerror}"))

    def final(self, choose: Callable[[dict[int, list[int]]], int | None],
              deadline: float) -> tuple[int | None, list[int]]:
        """Persist one step of every local rank as the job ends (a signal: a preemption),
        after the workers stopped: the background writer is stopped first, then each rank's
        copy of the step that ``choose`` picks from what the ranks hold (rank -> committed
        steps) is written at full speed, ungated, until the monotonic ``deadline`` (a copy
        still under way then is abandoned). Returns the step and the ranks whose copy of
        it is published (persisted before included)."""
        self.close()
        with self._lock:
            held = self._held()
            step = choose({rank: sorted(steps) for rank, steps in held.items()})
            if step is None:
                return None, []
            stop = threading.Event()
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), stop.set)
            timer.daemon = True
            timer.start()
            done: list[int] = []
            try:
                for rank, steps in sorted(held.items()):
                    if step not in steps:
                        continue
                    path = slot_path(self.directory, self.run_id, rank, step)
                    try:
                        if self._persist(rank, step, steps[step], path, stop=stop,
                                         gated=False):
                            self._persisted[rank] = step
                            done.append(rank)
                    except _Aborted:
                        break
                    except (StorageError, OSError) as exc:
                        logger.warning("cannot persist rank %d step %d as the job ends: %s",
                                       rank, step, exc)
                if done:
                    self._prune()
            finally:
                timer.cancel()
            return step, done

    def watch_workers(self, pids: Iterable[int]) -> None:
        """The processes of this round's local workers: copies go while they are idle."""
        if self._gate is not None:
            self._gate.watch(pids)

    def _own_ranks(self) -> set[int]:
        try:
            self._own.update(self._sources())
        except Exception:  # the owner may be closing; the ranks seen before still count
            pass
        return set(self._own)

    # -- one round --------------------------------------------------------------------------
    # Complexity above 10: one pass of the writer: due ranks, write, publish.
    def run_once(self) -> list[tuple[int, int]]:  # noqa: C901
        """Persist whatever is due now; return the (rank, step) pairs published. The thread
        calls this every ``poll_interval``; a caller may too (e.g. before shutting down)."""
        with self._lock:
            if self._stop.is_set():
                return []
            now = self._clock()
            if now < self._retry_at:
                return []
            held = self._held()
            self._own.update(held)
            time_due = set()
            if self.every_seconds is not None:
                time_due = {rank for rank in held if now - self._persisted_at.get(
                    rank, -math.inf) >= self.every_seconds}
            intents: set[int] = set()
            if self.every_seconds is not None and held:
                intents = {step for step, _ in _step_dirs(run_dir(self.directory, self.run_id))}
            targets = plan({rank: list(steps) for rank, steps in held.items()},
                           self._persisted, every_steps=self.every_steps, time_due=time_due,
                           intents=intents)
            published: list[tuple[int, int]] = []
            for rank, step in targets.items():
                if self._stop.is_set():
                    break
                path = slot_path(self.directory, self.run_id, rank, step)
                try:
                    done = self._persist(rank, step, held[rank][step], path)
                except _Aborted:
                    break
                except StorageError as exc:
                    self._fail(exc)
                    break
                except OSError as exc:
                    self._fail(StorageError(f"cannot persist rank {rank} step {step} to "
                                            f"{path}: {exc.strerror or exc}"))
                    break
                if done:
                    self._persisted[rank] = step
                    self._persisted_at[rank] = self._clock()
                    self._backoff = 0.0
                    published.append((rank, step))
            if published:
                self._prune()
        for rank, step in published:
            if self._on_persisted is not None:
                try:
                    self._on_persisted(rank, step)
                except Exception:
                    logger.exception("on_persisted callback failed")
        return published

    def _held(self) -> dict[int, dict[int, memory.Segment]]:
        """rank -> step -> the slot holding it (``memory.by_step``) of this run, for every
        local rank with slots (a rank that has committed nothing yet holds no step)."""
        held: dict[int, dict[int, memory.Segment]] = {}
        for rank, segments in self._sources().items():
            headers = [_current_header(segment) for segment in segments]
            held[rank] = {step: segments[index] for step, index in memory.by_step(
                headers, rank=rank, run_id=self.run_id).items()}
        return held

    def _persist(self, rank: int, step: int, segment: memory.Segment, path: Path, *,
                 stop: threading.Event | None = None, gated: bool = True) -> bool:
        """Copy ``segment`` (holding ``step`` of ``rank``) to ``path`` and publish it; False
        if the slot changed before or during the copy (nothing is published). The copy
        aborts once ``stop`` (default: the writer's own) is set; ``gated``: chunk by chunk
        as the workers leave the CPU idle."""
        try:
            buf = segment.view
        except StorageError:
            return False
        header = memory.read_header(buf)
        if not memory.committed(header, step=step, rank=rank):
            return False
        end = header.meta_offset + header.meta_len
        if header.meta_offset < memory.HEADER_SIZE + header.data_len or end > len(buf):
            logger.warning("slot %s has a malformed header; not persisted", segment.name)
            return False
        if self._same_published(path, header):
            return True
        folder = path.parent
        tmp = folder / f".{path.name}.{self._token}.tmp"
        self._step_folder(folder)
        try:
            fd = _create(tmp)
        except FileNotFoundError:  # another host's prune removed the empty directory
            self._step_folder(folder)
            fd = _create(tmp)
        try:
            _preallocate(fd, end)
            with memoryview(buf) as view:
                header_xxh3 = xxhash.xxh3_64_intdigest(view[:memory.HEADER_SIZE])
                _copy_out(view, fd, end, self._stop if stop is None else stop,
                          self._gate if gated else None)
            if not memory.unchanged(buf, header):
                logger.debug("rank %d step %d changed during the copy; retried later",
                             rank, step)
                os.close(fd)
                tmp.unlink(missing_ok=True)
                return False
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # don't crowd out training
        except (OSError, AttributeError):
            pass
        os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(folder)
        manifest = Manifest(self.run_id, rank, step, header.seq, header.world_size, end,
                            header_xxh3, header.meta_hash, self._host, time.time())
        _write_small(manifest_path(path), manifest.to_json(), self._token)
        return True

    @staticmethod
    def _step_folder(folder: Path) -> None:
        """Make the step directory ``folder`` if missing; StorageError if it is not this
        user's (another user made it first: what is written there is theirs to swap)."""
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        why = _dir_refusal(folder)
        if why is not None:
            raise StorageError(f"cannot persist into {folder}: {why}")

    def _same_published(self, path: Path, header: memory.SlotHeader) -> bool:
        """Whether ``path`` is already published with exactly this commit."""
        try:
            manifest, found = _check_path(path, run_id=self.run_id, rank=header.rank,
                                          step=header.step)
        except (CheckpointError, StorageError):
            return False
        return found.seq == header.seq and found.meta_hash == header.meta_hash

    def _fail(self, exc: StorageError) -> None:
        self._last_error = exc
        message = str(exc)
        if message != self._logged:
            logger.warning("persistent checkpoint failed (training goes on): %s", message)
            self._logged = message
        else:
            logger.debug("persistent checkpoint failed again: %s", message)
        self._backoff = min(max(2 * self._backoff, 1.0), 60.0)
        self._retry_at = self._clock() + self._backoff

    def _prune(self) -> None:
        """Keep the ``keep`` newest complete steps; delete this host's files of older steps
        and its stale temporaries (left by a crash)."""
        own = self._own_ranks()
        folder = run_dir(self.directory, self.run_id)
        try:
            complete = complete_steps(self.directory, self.run_id)
            oldest_kept = complete[-self.keep:][0] if complete else None
            for step, sub in _step_dirs(folder):
                if oldest_kept is not None and step < oldest_kept:
                    for rank in own:
                        _remove_rank(sub, rank)
                    _rmdir_if_empty(sub)
                    continue
                for name in _listdir(sub):
                    match = _TEMP_FILE.match(name)
                    if match and int(match.group(1)) in own:
                        (sub / name).unlink(missing_ok=True)
        except OSError as exc:
            self._fail(StorageError(f"cannot prune {folder}: {exc.strerror or exc}"))
