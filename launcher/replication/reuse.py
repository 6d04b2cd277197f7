"""Bytes a peer holds already are not sent: which ranges of a push a receiver fills itself.

Data-parallel hosts hold the same parameters and optimizer state, bit for bit (and frozen
weights stay the same from step to step), so before the data of a PUT the receiver looks
up every checksummed range of at least :data:`REUSE_MIN` bytes among the committed slots
it holds (its own ranks' and its replicas) by checksum and length, copies each one it
finds into the target slot and hashes the copy as it lands; only the ranges whose copy
matched are skipped. A range copied from a slot that was rewritten meanwhile fails its
checksum and is sent as usual. When the metadata says the state is a data-parallel
replica and the receiver's own ranks have not yet committed the pushed step (hosts commit
the same step at about the same time), it waits up to :data:`REUSE_WAIT` seconds for them.
The replica is a complete copy either way: it is served to a replacement host like any
other.

This is apart from :mod:`launcher.replication.transport` because it changes for another
reason: what a host may reuse and when, not how bytes cross a connection. The receiver's
reply names the skipped ranges (:func:`launcher.replication.wire.parse_skip`); which
ranges that leaves to send, and which filled ranges a reply can name, are pure functions
here, beside the index of held ranges they serve.
"""

from __future__ import annotations

import mmap
import threading
import time
from typing import Any, Protocol

from launcher import memory
from launcher.errors import CheckpointError
from launcher.replication.wire import MAX_SKIP

REUSE_MIN = 256 << 10
"""A checksummed range of a push at least this large is looked up in the receiver's memory."""
REUSE_WAIT = 1.0
"""Seconds a receiver waits for its own ranks to commit the step a data-parallel peer pushes."""


class HeldSlots(Protocol):
    """The slots a host holds; :class:`launcher.replication.transport.SlotSource` has them."""

    def segments(self, *, replica: bool = False) -> dict[int, list[memory.Segment]]:
        """The mapped own slots (or replica slots) per rank."""
        ...


def reusable(meta: dict[str, Any]) -> dict[tuple[int, int], int]:
    """``(xxh3, nbytes) -> offset`` of the checksummed ranges of at least :data:`REUSE_MIN`
    bytes a slot's metadata lists (a malformed entry raises ValueError, KeyError,
    TypeError or AttributeError)."""
    return {(int(e["xxh3"], 16), int(e["nbytes"])): int(e["offset"])
            for e in [*meta["tensors"], *meta.get("blocks", [])]
            if e.get("xxh3") is not None and int(e["nbytes"]) >= REUSE_MIN}


def skipped(ranges: list[tuple[int, int, int]], filled: list[int]
            ) -> tuple[list[tuple[int, int]], list[int]]:
    """The data ranges to skip on the wire, from the ``filled`` ones (indices into
    ``ranges``), neighbours merged, at most :data:`~launcher.replication.wire.MAX_SKIP`;
    and the starts of the filled ranges they cover (the others are sent after all)."""
    skip: list[tuple[int, int]] = []
    covered: list[int] = []
    last = -2
    for i in filled:
        start, end, _ = ranges[i]
        if i == last + 1 and skip:  # no checksummed range lies between them
            skip[-1] = (skip[-1][0], end)
        elif len(skip) < MAX_SKIP:
            skip.append((start, end))
        else:
            break
        covered.append(start)
        last = i
    return skip, covered


def complement(skip: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The ranges of ``[0, n)`` outside ``skip`` (sorted, disjoint): what is sent."""
    left, at = [], 0
    for start, end in skip:
        if start > at:
            left.append((at, start))
        at = end
    if at < n:
        left.append((at, n))
    return left


class HeldBytes:
    """The large checksummed ranges of the committed slots a host holds (its own ranks'
    and its replicas), by checksum and length: what a push need not carry (see the
    module's docstring)."""

    def __init__(self, slots: HeldSlots) -> None:
        self._slots = slots
        self._lock = threading.Lock()
        self._ranges: dict[str, tuple[int, dict[tuple[int, int], int]]] = {}  # see _of
        self._missed: dict[int, bool] = {}  # rank -> nothing of its step was held here

    def _of(self, segment: memory.Segment, header: memory.SlotHeader
            ) -> dict[tuple[int, int], int]:
        """``(xxh3, nbytes) -> start`` of the committed step ``header`` describes."""
        with self._lock:
            cached = self._ranges.get(segment.name)
        if cached is not None and cached[0] == header.seq:
            return cached[1]
        try:
            found = reusable(memory.read_meta(segment.view, header))
        except (CheckpointError, ValueError, KeyError, TypeError, AttributeError):
            found = {}
        with self._lock:
            self._ranges[segment.name] = (header.seq, found)
        return found

    def _index(self) -> tuple[dict[tuple[int, int], tuple[memory.Segment, int]], int | None]:
        """Where each large range is held, and the step every own rank has committed
        (None: no own ranks)."""
        index: dict[tuple[int, int], tuple[memory.Segment, int]] = {}
        newest: list[int] = []
        for replica in (False, True):
            for segments in self._slots.segments(replica=replica).values():
                steps = [-1]
                for segment in segments:
                    try:
                        header = memory.read_header(segment.view)
                    except ValueError:  # unmapped meanwhile (a regrow)
                        continue
                    if not memory.committed(header):
                        continue
                    steps.append(header.step)
                    for key, start in self._of(segment, header).items():
                        index.setdefault(key, (segment, start))
                if not replica:
                    newest.append(max(steps))
        return index, min(newest, default=None)

    def fill(self, buf: mmap.mmap, header: memory.SlotHeader, verifier: memory.StreamVerifier
             ) -> list[int]:
        """Copy into ``buf`` each large range of the pushed step that a held slot has,
        checking every copy; the indices (in ``verifier.ranges()``) of those that matched."""
        ranges = verifier.ranges()
        wanted = [i for i, (start, end, _) in enumerate(ranges) if end - start >= REUSE_MIN]
        if not wanted:
            return []
        meta = verifier.meta
        replica = meta.get("replicated") is True and meta.get("sharded") is not True
        wait = REUSE_WAIT if replica and not self._missed.get(header.rank) else 0.0
        deadline = time.monotonic() + wait
        while True:
            index, newest = self._index()
            hits = [i for i in wanted if (ranges[i][2], ranges[i][1] - ranges[i][0]) in index]
            if (len(hits) == len(wanted) or newest is None or newest >= header.step
                    or time.monotonic() >= deadline):
                break
            time.sleep(0.01)
        filled = []
        for i in hits:
            start, end, digest = ranges[i]
            segment, at = index[(digest, end - start)]
            try:
                if memory.copy_checked(segment.view, at, buf, start, end - start, digest):
                    filled.append(i)
            except ValueError:  # unmapped meanwhile
                continue
        if filled or newest is not None and newest >= header.step:
            # held nothing of it, though the own ranks had the step: not data-parallel
            self._missed[header.rank] = not filled
        return filled
