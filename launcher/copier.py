"""The copy engine: where each tensor of a state goes in a slot (:class:`Layout`), and the
background thread that copies and hashes it there (:class:`CopyWorker`).

On the CPU the thread runs only on CPU time that nothing else wants
(``priority.idle_priority``); CUDA tensors are copied on a side stream into the slot's
pinned memory.
"""

from __future__ import annotations

import ctypes
import json
import queue
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from launcher import memory
from launcher.codec import tensor_bytes
from launcher.priority import idle_priority

META_FRAME = 256  # metadata bytes besides the tree and the tensor records (step, block)


def slot_bytes(tensors: list[tuple[str, torch.Tensor]], tree_len: int) -> int:
    """The size of a slot for ``tensors`` with a tree of ``tree_len`` bytes of JSON: the
    aligned tensors and room for the metadata (a record per tensor, at most one per batch
    of small ones), which grows a little (values in ``extra`` like a list of losses)."""
    data = sum((tensor_bytes(t) + memory.ALIGN - 1) // memory.ALIGN * memory.ALIGN
               for _, t in tensors)
    return memory.slot_size(data, tree_len + META_FRAME + sum(len(p) + 280 for p, _ in tensors))


@dataclass
class Layout:
    """The placement of one state's tensors in one slot (see :func:`plan_layout`)."""

    signature: tuple[Any, ...]
    segment: memory.Segment
    data_len: int
    offsets: list[int]
    nbytes: list[int]
    small: list[bool]  # copied in batches, checked by the batches' checksums
    # The tensors' metadata JSON, in the tree's order: a string for each run of small
    # tensors (complete), a pair for a large one (split around its checksum).
    records: list[str | tuple[str, str]]
    dsts: list[torch.Tensor]  # the small tensors' places in the slot, shaped like them
    groups: list[tuple[int, int, int]]  # batches of ``dsts`` copied and hashed together
    group_ranges: list[tuple[int, int]]  # each group's bytes in the slot's data: a checksum each
    blocks: list[torch.Tensor]  # each group's bytes in the slot
    parts: list[list[torch.Tensor]]  # each group's torch.cat inputs: byte views and padding
    where: list[tuple[int, int]]  # each small tensor's (group, index in its parts)
    ptrs: list[int]  # each small tensor's address when its byte view was made (-1: none)
    meta_room: int  # bytes of the slot left for the metadata
    records_len: int  # bytes of the records in the metadata, with their checksums
    # Replica agreement: which batches and which large tensors (by their index among the
    # large ones) hold only state every data-parallel replica has, and a key naming them
    # (the same on every rank that keeps the same share of it; 0: none).
    agree_groups: list[bool] = field(default_factory=list)
    agree_large: list[int] = field(default_factory=list)
    agree_key: int = 0


def plan_layout(segment: memory.Segment, tensors: list[tuple[str, torch.Tensor]],
                signature: tuple[Any, ...], agree: Sequence[bool] = ()) -> Layout:
    """Where each of ``tensors`` goes in ``segment``: the small CPU tensors first, back to
    back (copied in batches of about ``memory.COPY_CHUNK`` bytes, one checksum per batch),
    then the others (one checksum each). ``agree`` marks the tensors every data-parallel
    replica holds bit for bit: a batch never mixes them with others, so that the
    checksums of theirs can be compared between replicas (``Layout.agree_*``)."""
    agree = list(agree) or [False] * len(tensors)
    sizes = [tensor_bytes(t) for _, t in tensors]
    small = [0 < n <= memory.SMALL_TENSOR and t.device.type == "cpu"
             and t.layout == torch.strided
             for n, (_, t) in zip(sizes, tensors, strict=True)]
    offsets, offset = [0] * len(tensors), 0
    for first_pass in (True, False):
        for i, nbytes in enumerate(sizes):
            if small[i] == first_pass:
                offsets[i] = offset
                offset += (nbytes + memory.ALIGN - 1) // memory.ALIGN * memory.ALIGN
    small_at = [o for o, is_small in zip(offsets, small, strict=True) if is_small]
    small_end = max((o + n for o, n, f in zip(offsets, sizes, small, strict=True) if f),
                    default=0)
    small_agree = [a for a, f in zip(agree, small, strict=True) if f]
    groups = _groups(small_at, small_end, small_agree)
    parts, where = _group_parts(groups, small_at,
                                [n for n, f in zip(sizes, small, strict=True) if f])
    buf = segment.view
    layout = Layout(
        signature=signature, segment=segment, data_len=offset, offsets=offsets,
        nbytes=sizes, small=small, records=_records(tensors, offsets, small),
        dsts=[torch.frombuffer(buf, dtype=t.dtype, count=t.numel(),
                               offset=memory.HEADER_SIZE + o).view(t.shape)
              for o, (_, t), f in zip(offsets, tensors, small, strict=True) if f],
        groups=groups, group_ranges=[(small_at[lo], end) for lo, _, end in groups],
        blocks=[torch.frombuffer(buf, dtype=torch.uint8, count=end - small_at[lo],
                                 offset=memory.HEADER_SIZE + small_at[lo])
                for lo, _, end in groups],
        parts=parts, where=where, ptrs=[-1] * len(small_at),
        meta_room=segment.size - memory.HEADER_SIZE - offset, records_len=0,
        agree_groups=[small_agree[lo] for lo, _, _ in groups],
        agree_large=[j for j, i in enumerate(i for i, f in enumerate(small) if not f)
                     if agree[i]],
        agree_key=_agree_key([(path, t) for (path, t), a in zip(tensors, agree, strict=True)
                              if a]))
    layout.records_len = sum(len(r) + 1 if isinstance(r, str) else len(r[0]) + len(r[1]) + 19
                             for r in layout.records) + sum(
        len(block_record(start, end, 0)) + 1 for start, end in layout.group_ranges)
    return layout


def block_record(start: int, end: int, digest: int) -> str:
    """The metadata JSON of one batch of small tensors: its bytes and their checksum."""
    return f'{{"offset":{start},"nbytes":{end - start},"xxh3":"{digest:016x}"}}'


def _agree_key(tensors: list[tuple[str, torch.Tensor]]) -> int:
    """A name for the replicated tensors a rank keeps: their paths, types and shapes (0
    when there are none)."""
    if not tensors:
        return 0
    names = json.dumps([[path, str(t.dtype), list(t.shape)] for path, t in tensors])
    return xxhash.xxh3_64_intdigest(names.encode()) or 1


def agree_digest(layout: Layout, batches: list[int], digests: list[int]) -> int:
    """One checksum of the replicated tensors' checksums (no byte hashed again)."""
    items = [b for b, a in zip(batches, layout.agree_groups, strict=True) if a] + [
        digests[j] for j in layout.agree_large]
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(items)}Q", *items))


def _groups(small_at: list[int], small_end: int, agree: list[bool] | None = None
            ) -> list[tuple[int, int, int]]:
    """Batches of the small tensors at ``small_at`` of about ``memory.COPY_CHUNK`` bytes,
    each hashed from the cache right after it is copied: (first, last + 1, end offset),
    in slot order. A batch ends where ``agree`` changes."""
    groups: list[tuple[int, int, int]] = []
    first = 0
    for i, start in enumerate(small_at):
        if start - small_at[first] >= memory.COPY_CHUNK or (
                agree and i > first and agree[i] != agree[i - 1]):
            groups.append((first, i, start))
            first = i
    if small_at:
        groups.append((first, len(small_at), small_end))
    return groups


def _group_parts(groups: list[tuple[int, int, int]], small_at: list[int],
                 small_sizes: list[int]) -> tuple[list[list[torch.Tensor]], list[tuple[int, int]]]:
    """Each group is copied by one ``torch.cat`` of byte views of its tensors (and zero
    padding up to the next tensor's offset) into the group's bytes in the slot: one call
    instead of a copy dispatch per tensor. The inputs of each group's cat (the tensors'
    places are filled by the copy, with byte views made when a tensor's address changed),
    and each small tensor's (group, index in its inputs)."""
    parts: list[list[torch.Tensor]] = []
    where: list[tuple[int, int]] = []
    zeros = torch.zeros(memory.ALIGN, dtype=torch.uint8)
    for g, (lo, hi, end) in enumerate(groups):
        group: list[torch.Tensor] = []
        for i in range(lo, hi):
            where.append((g, len(group)))
            group.append(zeros[:0])
            pad = (small_at[i + 1] if i + 1 < hi else end) - small_at[i] - small_sizes[i]
            if pad:
                group.append(zeros[:pad])
        parts.append(group)
    return parts, where


def _records(tensors: list[tuple[str, torch.Tensor]], offsets: list[int], small: list[bool]
             ) -> list[str | tuple[str, str]]:
    """The tensors' metadata JSON: runs of small tensors' records joined once, here; a
    large tensor's split around its checksum, filled in by each copy."""
    records: list[str | tuple[str, str]] = []
    for (path, tensor), start, is_small in zip(tensors, offsets, small, strict=True):
        record = json.dumps({"path": path, "dtype": str(tensor.dtype).split(".")[-1],
                             "shape": list(tensor.shape), "offset": start,
                             "nbytes": tensor_bytes(tensor), "device": str(tensor.device),
                             "xxh3": None if is_small else "@"}, separators=(",", ":"))
        if is_small:
            if records and isinstance(records[-1], str):
                records[-1] += "," + record
            else:
                records.append(record)
        else:
            head, tail = record.split('"@"')
            records.append((head, tail))
    return records


class CopyWorker:
    """A daemon thread that runs one job at a time: the background copy."""

    def __init__(self, *, idle: bool) -> None:
        self._idle = idle
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = (
            queue.SimpleQueue())
        self._streams: dict[torch.device, Any] = {}  # a side stream per CUDA device
        self.thread = threading.Thread(target=self._run, name="gemini-save", daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[], None], done: threading.Event) -> None:
        self._jobs.put((job, done))

    def _run(self) -> None:
        if self._idle:
            idle_priority()
        while True:
            job, done = self._jobs.get()
            try:
                job()
            finally:
                done.set()

    def copy_all(self, buf: Any, layout: Layout, tensors: list[torch.Tensor],
                 ready: Any = None) -> tuple[list[int], list[int]]:
        """Copy every tensor to its place in the slot; return the checksums of the
        batches of small tensors (``layout.group_ranges``) and of the large ones.

        Small CPU tensors are copied in batches, a checksum per batch (a batch unchanged
        from a peer's copy is not sent again: see ``replication.reuse``); other
        large CPU tensors go through ``copy_and_hash``. CUDA
        tensors are copied by the GPU on a side stream, once the training stream reaches
        ``ready`` (the event save() recorded), into the pinned slot, while this thread
        copies the CPU tensors; they are hashed when that stream is done.
        """
        # save() records ``ready`` exactly when the state has CUDA tensors
        on_gpu = self._start_gpu_copies(buf, layout, tensors, ready) if ready is not None else []
        srcs = [t for t, small in zip(tensors, layout.small, strict=True) if small]
        ptrs = list(map(torch.Tensor.data_ptr, srcs))
        if ptrs != layout.ptrs:
            _refresh_byte_views(layout, srcs, ptrs)
        # A byte view covers its tensor's bytes while the tensor is contiguous and at the
        # address it was made for (the view keeps that storage alive: no other tensor can
        # move there); a tensor that is not contiguous, or is a lazily conjugated or
        # negated view (its bytes are not its values), has none: torch copies them all.
        whole = all(map(torch.Tensor.is_contiguous, srcs)) and not (
            any(map(torch.Tensor.is_conj, srcs)) or any(map(torch.Tensor.is_neg, srcs)))
        batches = []
        view = memoryview(buf)
        try:
            with torch.no_grad():
                for group, ((first, last, _), (start, end)) in enumerate(
                        zip(layout.groups, layout.group_ranges, strict=True)):
                    if whole:
                        torch.cat(layout.parts[group], out=layout.blocks[group])
                    else:
                        torch._foreach_copy_(layout.dsts[first:last], srcs[first:last])
                    batches.append(xxhash.xxh3_64_intdigest(
                        view[memory.HEADER_SIZE + start:memory.HEADER_SIZE + end]))
        finally:
            view.release()
        big = [(tensor, memory.HEADER_SIZE + start, nbytes)
               for tensor, start, nbytes, small in zip(
                   tensors, layout.offsets, layout.nbytes, layout.small, strict=True)
               if not small]
        digests = [-1 if tensor.is_cuda else copy_and_hash(buf, start, tensor, nbytes)
                   for tensor, start, nbytes in big]
        if on_gpu:  # the GPU's copies: hash them once they have landed
            for done in on_gpu:
                done.synchronize()
            with memoryview(buf) as view:
                digests = [memory.checksum(view[start:start + nbytes]) if tensor.is_cuda
                           else digest for (tensor, start, nbytes), digest in zip(
                               big, digests, strict=True)]
        return batches, digests

    def _start_gpu_copies(self, buf: Any, layout: Layout, tensors: list[torch.Tensor],
                          ready: Any) -> list[Any]:
        """Queue the copies of the CUDA tensors into the slot on a side stream per device,
        after ``ready``; return an event per device that marks their end."""
        by_device: dict[torch.device, list[int]] = {}
        for i, tensor in enumerate(tensors):
            if tensor.is_cuda:
                by_device.setdefault(tensor.device, []).append(i)
        done = []
        for device, indices in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                self._streams[device] = stream
            with torch.cuda.device(device), torch.cuda.stream(stream), torch.no_grad():
                stream.wait_event(ready)
                for i in indices:
                    tensor, nbytes = tensors[i], layout.nbytes[i]
                    if nbytes:
                        dst = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes,
                                               offset=memory.HEADER_SIZE + layout.offsets[i])
                        dst.view(tensor.dtype).view(tensor.shape).copy_(tensor,
                                                                        non_blocking=True)
                done.append(stream.record_event())
        return done


def _refresh_byte_views(layout: Layout, srcs: list[torch.Tensor], ptrs: list[int]) -> None:
    """Remake the byte views of the small tensors that moved since their view was made."""
    for i, (src, ptr) in enumerate(zip(srcs, ptrs, strict=True)):
        if ptr != layout.ptrs[i]:
            group, index = layout.where[i]
            contiguous = src.is_contiguous() and not (src.is_conj() or src.is_neg())
            layout.parts[group][index] = (src.detach().reshape(-1).view(torch.uint8)
                                          if contiguous else layout.parts[group][index][:0])
            layout.ptrs[i] = ptr if contiguous else -1


def copy_and_hash(buf: Any, start: int, tensor: torch.Tensor, nbytes: int) -> int:
    """Copy ``tensor`` to byte ``start`` of ``buf``; return the xxh3 of the copied bytes.

    A CPU tensor is copied and hashed in chunks that fit the core's L2 cache, so the hash
    reads each chunk from cache right after the copy wrote it: the checksum costs no extra
    pass over memory (about 0.9x a plain memcpy here, against 0.7x for a copy followed by
    a hash of the destination). ``ctypes.memmove`` and xxhash both release the GIL.
    """
    if nbytes == 0:
        return xxhash.xxh3_64_intdigest(b"")
    dst = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start)
    src = tensor.detach()
    view = memoryview(buf)
    try:
        if not src.is_contiguous() or src.device.type != "cpu" or src.is_conj() or (
                src.is_neg()):
            dst.view(src.dtype).view(src.shape).copy_(src)
            return memory.checksum(view[start:start + nbytes])
        hasher = xxhash.xxh3_64()
        to, frm = dst.data_ptr(), src.data_ptr()
        for lo in range(0, nbytes, memory.COPY_CHUNK):
            size = min(memory.COPY_CHUNK, nbytes - lo)
            ctypes.memmove(to + lo, frm + lo, size)
            hasher.update(view[start + lo:start + lo + size])
        return hasher.intdigest()
    finally:
        view.release()
