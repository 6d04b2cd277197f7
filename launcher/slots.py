"""The supervisor's side of the memory tier: it owns every slot segment of its workers.

:class:`SlotOwner` creates slots when a worker asks (over a Unix socket), grows them when
the state grows, adopts the segments a previous supervisor of the same run left on this
host, scans them for recovery, and unlinks them all when the run ends. An owner file
(``gemini-<run>-<host>-owner``, JSON with the supervisor's pid and start time) tells
``gemini clean`` whether the segments of a run still have a live owner.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from launcher import memory
from launcher.contract import ENV_SHM_PRIVATE_DIR
from launcher.errors import CheckpointError, StorageError

if TYPE_CHECKING:

    pass

logger = logging.getLogger(__name__)

OWNER_SUFFIX = "owner"


def owner_name(prefix: str) -> str:
    return prefix + OWNER_SUFFIX


def owner_alive(record: dict[str, Any]) -> bool:
    """Whether the supervisor an owner file names is still running."""
    try:
        proc = psutil.Process(int(record["pid"]))
        return abs(proc.create_time() - float(record["started"])) < 1.0
    except (psutil.Error, KeyError, ValueError, TypeError):
        return False


def read_owner(prefix: str) -> dict[str, Any] | None:
    try:
        fd = memory.open_segment(owner_name(prefix), os.O_RDONLY)
    except StorageError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            data = json.loads(fh.read(4096))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class SlotOwner:
    """Owns the slot segments of one run on one host (thread-safe)."""

    def __init__(self, *, run_id: str, host_id: str, local_world_size: int,
                 fixed_host_id: bool = True) -> None:
        """Claim the slots of ``run_id`` on ``host_id``. Another live supervisor of the run
        on the same id is an error when ``fixed_host_id``; otherwise (several supervisors
        of one run on one machine, as in a one-machine test) this one takes the first free
        id among ``host_id``, ``host_id-1``, ``host_id-2``, ... (see :attr:`host_id`)."""
        self.run_id = run_id
        self.local_world_size = local_world_size
        self._fixed = fixed_host_id
        self._lock = threading.Lock()
        self._slots: dict[int, list[memory.Segment | None]] = {}
        self._replicas: dict[int, list[memory.Segment | None]] = {}  # copies for peer hosts
        self._pins: dict[int, int] = {}  # rank -> the replica step no write may overwrite
        self._own_pins: dict[int, memory.Segment] = {}  # rank -> its pins (memory.PINS)
        self._reserved: list[memory.Segment] = []  # mapped and faulted in: see reserve()
        self._reserve_names = 0  # reserved segments ever made: each gets a new name
        self._reserving = threading.Lock()
        self.copies = 1
        """Copies of each rank's checkpoint this host keeps: its own ranks' and, with
        replication, those of the peers it holds replicas for (placement's m)."""
        self._keep = False
        for n in range(1 if fixed_host_id else 1024):
            self.host_id = host_id if n == 0 else f"{host_id}-{n}"
            self.prefix = memory.segment_prefix(run_id, self.host_id)
            if self._claim():
                break
        else:
            raise StorageError(f"no free host id for run {run_id} on this machine")

    # -- ownership ------------------------------------------------------------------------
    def _claim(self) -> bool:
        """Take ownership of :attr:`prefix` (adopting a dead owner's segments); False if a
        live supervisor holds it and another id may be tried."""
        path = memory.claim_shm_dir() / owner_name(self.prefix)
        previous = read_owner(self.prefix)
        if previous is not None and previous.get("pid") != os.getpid() and owner_alive(previous):
            return self._busy(previous)
        if previous is not None or path.exists():
            path.unlink(missing_ok=True)  # a dead owner's claim
        me = psutil.Process()
        record = {"pid": me.pid, "started": me.create_time(), "run_id": self.run_id,
                  "host": self.host_id}
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:  # another supervisor claimed it a moment ago
            return False
        except FileNotFoundError:  # the last other run of this user removed the directory
            path = memory.claim_shm_dir() / owner_name(self.prefix)  # just now: made anew
            fd = os.open(path, flags, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(record))
        # The workers use this directory, not one they would resolve for themselves: a
        # name another user takes or frees meanwhile cannot send them elsewhere. The owner
        # file keeps it from being removed as empty while the run lasts.
        self.directory = path.parent
        os.environ[ENV_SHM_PRIVATE_DIR] = str(self.directory)
        adopted = 0
        for name in memory.list_segments(self.prefix):
            parsed = memory.parse_slot_name(name)
            if parsed is None:
                continue
            pairs = self._replicas if parsed.replica else self._slots
            try:
                pairs.setdefault(parsed.rank, [None, None])[parsed.slot] = (
                    memory.attach_segment(name))
                adopted += 1
            except StorageError as exc:
                logger.warning("not adopting %s: %s", name, exc)
                self._drop_empty(name)
        if adopted:
            logger.info("adopted %d shared-memory slots of run %s", adopted, self.run_id)
        return True

    def _drop_empty(self, name: str) -> None:
        """Remove a refused slot file of this run and host that is empty (a supervisor
        killed while it made it): it holds nothing, and a worker looking for its slots
        would otherwise trip over it. Anything else refused is left alone."""
        path = self.directory / name
        try:
            info = os.lstat(path)
        except OSError:
            return
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and info.st_size == 0:
            path.unlink(missing_ok=True)
            logger.warning("removed the empty slot file %s", path)

    def _busy(self, owner: dict[str, Any]) -> bool:
        if self._fixed:
            raise StorageError(
                f"run {self.run_id} already has a live supervisor with host id {self.host_id} "
                f"(pid {owner['pid']}); give this one another GEMINI_HOST_ID or --rdzv-id")
        return False

    def keep_segments(self) -> None:
        """Leave the slots in shared memory when closing, for the next supervisor of this
        run and host to adopt (its owner file then names a dead process)."""
        self._keep = True

    def close(self) -> None:
        """Unmap and unlink every slot and the owner file (idempotent); with
        :meth:`keep_segments`, unmap only."""
        with self._lock:
            pins: list[memory.Segment | None] = list(self._own_pins.values())
            for pair in [*self._slots.values(), *self._replicas.values(), pins]:
                for segment in pair:
                    if segment is not None:
                        segment.close()
                        if not self._keep:
                            memory.unlink_segment(segment.name)
            self._slots.clear()
            self._replicas.clear()
            self._own_pins.clear()
            for reserved in self._reserved:  # they hold nothing: never kept
                reserved.close()
                memory.unlink_segment(reserved.name)
            self._reserved.clear()
            if os.environ.get(ENV_SHM_PRIVATE_DIR) == str(self.directory):
                del os.environ[ENV_SHM_PRIVATE_DIR]  # handed to no later process
            if self._keep:
                return
            for name in memory.list_segments(self.prefix):
                memory.unlink_segment(name)
        memory.release_shm_dir()

    # -- allocation -----------------------------------------------------------------------
    def allocate(self, rank: int, nbytes: int, *, replica: bool = False) -> list[str]:
        """Make both slots of ``rank`` (with ``replica``, both replica slots) hold at least
        ``nbytes``; return their names.

        A slot that is too small is recreated, unless it holds the rank's newest committed
        step: that one is grown on the next request, once the other slot has taken over.
        """
        with self._lock:
            self._allocate(rank, nbytes, replica)
            return [memory.slot_name(self.prefix, rank, i, replica=replica) for i in range(2)]

    def _allocate(self, rank: int, nbytes: int, replica: bool) -> list[memory.Segment | None]:
        if not replica and rank not in self._own_pins:
            segment = memory.create_segment(memory.pins_name(self.prefix, rank),
                                            memory.PINS.size)
            memory.write_pins(segment.view, -1, -1)
            memory.write_seen(segment.view, -1)
            memory.write_copying(segment.view, -1)
            self._own_pins[rank] = segment
        pair = (self._replicas if replica else self._slots).setdefault(rank, [None, None])
        kept = self._kept_index(pair, self._pins.get(rank) if replica else None)
        grow = [i for i, seg in enumerate(pair)
                if (seg is None or seg.size < nbytes) and i != kept]
        self._check_capacity(pair, grow, nbytes)
        for i in grow:
            old = pair[i]
            if old is not None:
                old.close()
                pair[i] = None
            name = memory.slot_name(self.prefix, rank, i, replica=replica)
            reserved = next((r for r in self._reserved if r.size >= nbytes), None)
            if reserved is not None:
                self._reserved.remove(reserved)
                segment = memory.take_reserved(reserved, name, nbytes)
            else:
                segment = memory.create_segment(name, nbytes)
            memory.init_header(segment.view, rank=rank, run_id=self.run_id)
            pair[i] = segment
        return pair

    def reserve(self, count: int, nbytes: int) -> int:
        """Allocate and pre-fault ``count`` segments of ``nbytes`` ahead of need (a spare
        host, for the slots of the ranks it will take over), as far as shared memory
        allows; the slots created next take them instead of allocating. Returns how many
        are reserved now. Slow (page allocation): call it off the recovery path."""
        with self._reserving:
            with self._lock:
                have = sum(1 for r in self._reserved if r.size >= nbytes)
            for _ in range(count - have):
                if memory.shm_free_bytes() < 2 * nbytes:
                    break  # room stays for what the job itself needs first
                self._reserve_names += 1
                name = memory.reserve_name(self.prefix, self._reserve_names)
                try:
                    segment = memory.create_segment(name, nbytes)
                    segment.populate()  # this process writes it first: its pull
                except StorageError as exc:
                    logger.info("cannot reserve shared memory ahead: %s", exc)
                    break
                with self._lock:
                    self._reserved.append(segment)
            with self._lock:
                return sum(1 for r in self._reserved if r.size >= nbytes)

    def own_slot_bytes(self) -> int:
        """The size of this host's largest own slot (0 before any)."""
        with self._lock:
            return max((seg.size for pair in self._slots.values() for seg in pair
                        if seg is not None), default=0)

    def write_target(self, rank: int, nbytes: int, *, replica: bool) -> memory.Segment:
        """The slot of ``rank`` that a copy from elsewhere (a peer, a file) may overwrite:
        one of at least ``nbytes``, already marked WRITING. With ``replica`` a replica
        slot: never the one holding the rank's pinned step (see :meth:`pin`), else not
        the one holding the newest committed step. Without, one of the rank's own slots
        (only while no worker of this host runs), not the newest."""
        with self._lock:
            pair = self._allocate(rank, nbytes, replica)
            kept = self._kept_index(pair, self._pins.get(rank) if replica else None)
            index = next(i for i, seg in enumerate(pair)
                         if i != kept and seg is not None and seg.size >= nbytes)
            segment = pair[index]
            assert segment is not None
            memory.set_state(segment.view, memory.SlotState.WRITING)
        segment.populate()  # the whole slot is written from here next: no fault per page
        return segment

    def restore_local(self, rank: int, step: int, *, source: int | None = None) -> None:
        """Make one of ``rank``'s own slots hold committed ``step`` of rank ``source``
        (``rank`` itself by default; another rank of the world the job had before it
        shrank or grew), copied from this host's own or replica slots of ``source``
        unless an own slot of ``rank`` holds it already; only while no worker of this
        host runs."""
        source = rank if source is None else source

        def holding(segments: Iterable[memory.Segment | None]) -> memory.Segment | None:
            """The first of ``segments`` holding the step: any copy will do (verified as
            it is copied), so an own slot before a replica."""
            return next((seg for seg in segments if seg is not None and memory.committed(
                memory.read_header(seg.view), step=step, rank=source)), None)

        with self._lock:
            if holding(self._slots.get(rank, [])) is not None:
                return
            found = holding([*self._slots.get(source, []), *self._replicas.get(source, [])])
        header = memory.read_header(found.view) if found is not None else None
        if found is None or header is None:
            raise CheckpointError(f"rank {rank}: no copy of step {step} of rank {source} here")
        target = self.write_target(rank, memory.slot_size(header.data_len, header.meta_len),
                                   replica=False)
        if not memory.copy_slot(found.view, target.view, header):
            raise CheckpointError(f"rank {rank}: the copy of step {step} changed")

    def pin(self, rank: int, step: int) -> None:
        """Keep the replica of ``rank``'s ``step`` (the globally restorable step s*): no
        write into this host's replica slots of ``rank`` overwrites it until a newer step
        is pinned. Pins only move forward; :meth:`reset_pins` starts them over."""
        with self._lock:
            if step > self._pins.get(rank, -1):
                self._pins[rank] = step

    def pin_own(self, rank: int, sstar: int, target: int) -> None:
        """Tell ``rank``'s worker which steps its own slots must keep (see
        ``memory.PINS``): its saves never overwrite them, skipping a save while both
        slots hold one. A rank without slots yet has nothing to keep."""
        with self._lock:
            segment = self._own_pins.get(rank)
            if segment is not None and segment.buf is not None:
                memory.write_pins(segment.view, sstar, target)

    def seen(self, rank: int) -> int:
        """The step of ``rank``'s worker's newest save, kept or skipped (-1: none)."""
        with self._lock:
            segment = self._own_pins.get(rank)
            if segment is None or segment.buf is None:
                return -1
            return memory.read_seen(segment.view)

    def forget_seen(self) -> None:
        """A new round: the workers start over from the restored step (and a copy a dead
        worker was writing is not waited for)."""
        with self._lock:
            for segment in self._own_pins.values():
                if segment.buf is not None:
                    memory.write_seen(segment.view, -1)
                    memory.write_copying(segment.view, -1)

    def pinned(self, rank: int) -> int | None:
        with self._lock:
            return self._pins.get(rank)

    def reset_pins(self, step: int) -> None:
        """Pin ``step`` for every rank (the step a new round restored) in the replica
        slots, or nothing for a negative ``step``."""
        with self._lock:
            self._pins = {rank: step for rank in self._replicas} if step >= 0 else {}

    def discard_newer_than(self, step: int) -> None:
        """Forget the slots, own and replica, holding steps after ``step`` (the step the job
        restores): they belong to an abandoned attempt, and the same step numbers are about
        to be trained again. (A restored worker forgets its own as well, but replication
        resumes before that and would otherwise push the abandoned step to the peers.)"""
        with self._lock:
            for pair in [*self._slots.values(), *self._replicas.values()]:
                for segment in pair:
                    header = memory.read_header(segment.view) if segment is not None else None
                    if segment is not None and header is not None and header.step > step:
                        memory.set_state(segment.view, memory.SlotState.EMPTY)

    def segments(self, *, replica: bool = False) -> dict[int, list[memory.Segment]]:
        """A snapshot of the mapped slots per rank: own slots, or with ``replica`` the
        replica slots. The segments stay valid until :meth:`close` (or a regrow)."""
        with self._lock:
            pairs = self._replicas if replica else self._slots
            return {rank: [seg for seg in pair if seg is not None] for rank, pair in pairs.items()}

    def find(self, rank: int, step: int) -> memory.Segment | None:
        """A slot (own first, then replica) whose header says it holds committed ``step``
        of ``rank``; the caller verifies checksums."""
        with self._lock:
            for pairs in (self._slots, self._replicas):
                pair = pairs.get(rank, [])
                index = memory.holding(step, [memory.read_header(seg.view) if seg is not None
                                              else None for seg in pair])
                if index is not None:
                    return pair[index]
            return None

    def _check_capacity(self, pair: list[memory.Segment | None], grow: list[int],
                        nbytes: int) -> None:
        released = sum(seg.size for i in grow if (seg := pair[i]) is not None)
        need_now = len(grow) * nbytes - released
        free = memory.shm_free_bytes() + sum(r.size for r in self._reserved)
        if need_now > free:
            raise StorageError(self._too_small(nbytes, free))

    def check_capacity(self, rank: int, nbytes: int) -> None:
        """Raise StorageError now if slots of ``nbytes`` for every local rank cannot fit,
        with :attr:`copies` copies of each (its own and the peers' it keeps a replica of,
        taken to be as large)."""
        with self._lock:
            have = sum(seg.size for pair in [*self._slots.values(), *self._replicas.values()]
                       for seg in pair if seg is not None)
            total = 2 * self.copies * nbytes * self.local_world_size
            free = memory.shm_free_bytes()
            if total - have > free:
                raise StorageError(self._too_small(nbytes, free))

    def _too_small(self, nbytes: int, free: int) -> str:
        total = 2 * self.copies * nbytes * self.local_world_size
        copies = f" x {self.copies} copies (its own, {self.copies - 1} of peers)" * (
            self.copies > 1)
        held = sum(_size(memory.SHM_DIR / name)
                   for names in find_leftovers().values() for name in names)
        leftovers = (f" ({held} more are held by the segments of dead runs: `gemini clean` "
                     f"frees them)" if held else "")
        return (f"{memory.SHM_DIR} is too small for in-memory checkpoints: need {total} bytes "
                f"(2 slots x {nbytes} bytes x {self.local_world_size} local ranks{copies}), "
                f"{free} bytes available{leftovers}; enlarge it (e.g. docker run --shm-size) "
                f"or use fewer workers per host")

    @staticmethod
    def _kept_index(pair: list[memory.Segment | None], pinned: int | None) -> int | None:
        """The slot a write must not touch: the first one holding the committed ``pinned``
        step if any does (one copy of it is all a pin keeps), else the one holding the
        newest committed step."""
        headers = [memory.read_header(seg.view) if seg is not None else None for seg in pair]
        if pinned is not None:
            kept = next((i for i, h in enumerate(headers) if memory.committed(h, step=pinned)),
                        None)
            if kept is not None:
                return kept
        return memory.newest(headers)

    def newest_steps(self, *, replica: bool = False) -> dict[int, int | None]:
        """The newest committed step of each local rank, or with ``replica`` of each rank
        this host keeps a replica of (headers only, not verified)."""
        with self._lock:
            steps: dict[int, int | None] = {}
            for rank, pair in (self._replicas if replica else self._slots).items():
                headers = [memory.read_header(seg.view) for seg in pair if seg is not None]
                steps[rank] = max((h.step for h in headers if memory.committed(h)), default=None)
            return steps

    def copying(self, ranks: Iterable[int]) -> set[tuple[int, str]]:
        """(rank, slot name) of each own slot of ``ranks`` a save is being written into (a
        slot in WRITING: a round's start empties those a dead writer left)."""
        with self._lock:
            return {(rank, seg.name) for rank in ranks for seg in self._slots.get(rank, [])
                    if seg is not None and (header := memory.read_header(seg.view)) is not None
                    and header.state is memory.SlotState.WRITING}

    # -- recovery -------------------------------------------------------------------------
    def holdings(self, ranks: Iterable[int] | None, world_size: int, *,
                 replica: bool = False) -> dict[int, list[int]]:
        """Verified committed steps per rank, for the given ranks of this run (own slots),
        or with ``replica`` in the replica slots (every rank held when ``ranks`` is None)."""
        with self._lock:
            pairs = self._replicas if replica else self._slots
            wanted = sorted(pairs) if ranks is None else list(ranks)
            segments = [s for rank in wanted for s in pairs.get(rank, []) if s is not None]
            # Hashing releases the GIL: verify the slots side by side.
            with ThreadPoolExecutor(max_workers=max(1, min(len(segments), os.cpu_count() or 1))
                                    ) as pool:
                infos = dict(zip(map(id, segments), pool.map(memory.describe, segments),
                                 strict=True))
            found: dict[int, list[int]] = {}
            for rank in wanted:
                steps: list[int] = []
                for segment in pairs.get(rank, []):
                    if segment is None:
                        continue
                    info = infos[id(segment)]
                    header = info.header
                    if info.valid_step is not None and memory.committed(
                            header, rank=rank, world_size=world_size, run_id=self.run_id):
                        steps.append(info.valid_step)
                    elif info.error and not replica and header is not None and (
                            memory.unchanged(segment.view, header)):
                        # Called before workers start: nothing else writes own slots.
                        # Uncommit it, so that no one picks it for its step (a good copy
                        # of the same step and seq may be pulled next to it).
                        logger.warning("slot %s is corrupt, discarded: %s", segment.name,
                                       info.error)
                        memory.set_state(segment.view, memory.SlotState.EMPTY)
                    elif info.error:
                        logger.warning("slot %s unusable: %s", segment.name, info.error)
                found[rank] = sorted(steps)
            return found


    def resizable(self, world_size: int) -> dict[str, dict[int, dict[int, list[int]]]]:
        """Verified committed steps written by a world of another size than
        ``world_size``, per world size and rank, from this host's own and replica slots:
        what a job that shrank or grew may restore. Under ``"replicated"`` those of state
        that every data-parallel rank holds whole (the slot's metadata says so; see
        ``recovery.plan_resized``), under ``"sharded"`` those of state sharded as DTensors
        (``recovery.plan_resharded``). Each slot is verified once for both."""
        with self._lock:
            segments = [seg for pairs in (self._slots, self._replicas) for pair in pairs.values()
                        for seg in pair if seg is not None
                        and memory.committed(h := memory.read_header(seg.view),
                                             run_id=self.run_id)
                        and h.world_size not in (0, world_size)]
            with ThreadPoolExecutor(max_workers=max(1, min(len(segments), os.cpu_count() or 1))
                                    ) as pool:
                infos = list(pool.map(memory.describe, segments))
        found: dict[str, dict[int, dict[int, set[int]]]] = {"replicated": {}, "sharded": {}}
        for info in infos:
            header = info.header
            if info.valid_step is None or header is None or header.rank != info.rank:
                continue
            for kind, ranks in found.items():
                if (info.meta or {}).get(kind):
                    ranks.setdefault(header.world_size, {}).setdefault(header.rank, set()).add(
                        info.valid_step)
        return {kind: {world: {rank: sorted(steps) for rank, steps in ranks.items()}
                       for world, ranks in worlds.items()} for kind, worlds in found.items()}


REFUSALS_LOGGED = 10
REFUSAL_WINDOW = 10.0


class SlotServer:
    """Serves worker requests on an abstract Unix socket, one thread per connection.

    Requests and replies are single JSON lines: ``{"op": "alloc", "rank": R, "nbytes": N}``
    -> ``{"ok": true, "slots": [name0, name1]}``; ``{"op": "check", ...}`` (can /dev/shm
    hold slots of N bytes?) -> ``{"ok": true}``; ``{"op": "await", "rank": R}`` -> once
    the restore step of rank R is in this host's memory (a pull from a peer may still be
    on its way when the worker starts), ``{"ok": true, "seq": S}`` (S: the seq of the
    slot the supervisor verified, or null). An allocation that /dev/shm cannot hold
    is fatal for the run: it is kept in :attr:`fatal` for the supervisor to stop the job.

    The socket's name is visible to every local user (/proc/net/unix): a connection is
    served only if its peer (SO_PEERCRED) runs as this user and descends from this
    supervisor, and a request only for a rank this host runs (:attr:`ranks`); anything
    else gets an error and changes nothing.
    """

    def __init__(self, owner: SlotOwner) -> None:
        self.owner = owner
        self.address = f"\0{owner.prefix}{os.getpid()}-{time.monotonic_ns()}"
        self.fatal: StorageError | None = None
        self.ranks: frozenset[int] | None = None
        """The global ranks this host runs in the current round (None: any)."""
        self.arrival: Callable[[int], int | None] = lambda rank: None
        """Blocks until ``rank``'s restore step is in memory; its verified seq, or None.
        Raises CheckpointError when it could not be brought in."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(64)
        self._closed = False
        self._refusals = (0.0, 0, 0)  # window start, refusals logged in it, not logged
        self._refusals_lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="gemini-slots",
                                        daemon=True)
        self._thread.start()

    @property
    def env_address(self) -> str:
        """The socket address as an environment variable can carry it ('@' for NUL)."""
        return "@" + self.address[1:]

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="gemini-slots-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rwb") as stream:
            refused = _foreign_peer(conn)
            if refused is not None:
                self._log_refusal(refused)
                stream.write((json.dumps({"ok": False, "error": refused}) + "\n").encode())
                stream.flush()
                return
            for line in stream:
                try:
                    reply = self._handle(json.loads(line))
                except StorageError as exc:
                    self.fatal = self.fatal or exc
                    reply = {"ok": False, "error": str(exc), "fatal": True}
                except CheckpointError as exc:  # this round's restore failed: the worker says so
                    reply = {"ok": False, "error": str(exc)}
                except (ValueError, KeyError, TypeError) as exc:
                    reply = {"ok": False, "error": f"bad request: {exc}"}
                stream.write((json.dumps(reply) + "\n").encode())
                stream.flush()

    def _log_refusal(self, refused: str) -> None:
        """Log a refused connection: at most :data:`REFUSALS_LOGGED` every
        :data:`REFUSAL_WINDOW` seconds (anyone on the host can connect, thousands of
        times a second); the next line logged says how many were not."""
        now = time.monotonic()
        with self._refusals_lock:
            since, logged, quiet = self._refusals
            if now - since >= REFUSAL_WINDOW:
                since, logged = now, 0
            if logged >= REFUSALS_LOGGED:
                self._refusals = (since, logged, quiet + 1)
                return
            self._refusals = (since, logged + 1, 0)
        more = f" (and {quiet} more refusals not logged)" if quiet else ""
        logger.warning("slot socket: refused a connection: %s%s", refused, more)

    def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        rank = int(request["rank"])
        if self.ranks is not None and rank not in self.ranks:
            raise ValueError(f"rank {rank} does not run on this host")
        if op == "alloc":
            nbytes = int(request["nbytes"])
            if nbytes <= 0 or nbytes > 1 << 46:
                raise ValueError(f"nbytes={nbytes}")
            return {"ok": True, "slots": self.owner.allocate(rank, nbytes)}
        if op == "check":
            self.owner.check_capacity(rank, int(request["nbytes"]))
            return {"ok": True}
        if op == "await":
            return {"ok": True, "seq": self.arrival(rank)}
        raise ValueError(f"unknown op {op!r}")

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _foreign_peer(conn: socket.socket) -> str | None:
    """Why the process at the other end of ``conn`` may not use the slot socket (another
    user's, or not one of this supervisor's descendants), or None."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    if uid != os.geteuid():
        return f"process {pid} of uid {uid} is not this run's"
    if pid == os.getpid():
        return None
    try:
        ancestors = {p.pid for p in psutil.Process(pid).parents()}
    except psutil.Error:
        return f"process {pid} is gone"
    if os.getpid() not in ancestors:
        return f"process {pid} is not one of this supervisor's workers"
    return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # removed meanwhile
        return 0


def find_leftovers() -> dict[str, list[str]]:
    """Segments whose owning supervisor is gone, grouped by run/host prefix."""
    groups: dict[str, list[str]] = {}
    for name in memory.list_segments():
        parsed = memory.parse_slot_name(name)
        prefix = parsed[0] if parsed else memory.pins_prefix(name) or next(
            (name[: -len(suffix)] for suffix in (OWNER_SUFFIX, memory.HEARTBEAT_SUFFIX)
             if name.endswith(suffix)), None)
        if prefix is not None:
            groups.setdefault(prefix, []).append(name)
    dead: dict[str, list[str]] = {}
    for prefix, names in groups.items():
        owner = read_owner(prefix)
        if owner is None or not owner_alive(owner):
            dead[prefix] = sorted(names)
    return dead


def clean(*, dry_run: bool = False) -> dict[str, list[str]]:
    """Remove the segments of dead runs on this host; return what was (or would be) removed."""
    dead = find_leftovers()
    if not dry_run:
        for names in dead.values():
            for name in names:
                memory.unlink_segment(name)
        memory.release_shm_dir()  # and the directory, once no run is left in it
    return dead
