"""Restart prefetch: the large CPU tensors a restarting worker will restore, copied out of
its slot by a thread while the script starts, builds its model and reaches ``restore``.

:func:`prefetch` starts it (a standby calls it as it takes its job; ``Checkpointer`` as
it is made); ``Checkpointer.restore`` takes the copies with :func:`take`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

from launcher import memory
from launcher.codec import slot_tensor
from launcher.contract import ENV_PREFIX, ENV_RESTORE_STEP, ENV_RESTORE_VERIFIED, ENV_SOCKET

logger = logging.getLogger(__name__)


class Prefetch:
    """The large CPU tensors that ``restore`` copies out of the slot (optimizer state and
    ``extra``; model tensors go straight into the parameters), copied into this process's
    memory by a thread while the script starts, builds its model and reaches ``restore``.

    Fresh memory costs a page fault per 4 KiB page here: the copies of a 1 GiB state's
    optimizer tensors took about 0.25 s of a recovery, now spent while the script is busy
    elsewhere. ``restore`` uses them only if they come from the slot it restores (same
    name and seq; nothing writes to a committed slot before the worker's next save).
    """

    def __init__(self, prefix: str, rank: int, step: int) -> None:
        self.key: tuple[str, int] | None = None  # (slot name, seq) they were copied from
        self.tensors: dict[int, torch.Tensor] = {}  # index in the slot's metadata -> copy
        self._thread = threading.Thread(target=self._copy, args=(prefix, rank, step),
                                        name="gemini-prefetch", daemon=True)
        self._thread.start()

    def take(self, name: str, seq: int) -> dict[int, torch.Tensor]:
        self._thread.join()
        return self.tensors if self.key == (name, seq) else {}

    def _copy(self, prefix: str, rank: int, step: int) -> None:
        segments: list[memory.Segment | None] = []
        try:
            for index in range(2):
                name = memory.slot_name(prefix, rank, index)
                segments.append(memory.attach_segment(name, populate=False)
                                if (memory.SHM_DIR / name).exists() else None)
            headers = [memory.read_header(s.view) if s else None for s in segments]
            newest = memory.holding(step, headers)
            if newest is None:
                return
            segment, header = segments[newest], headers[newest]
            assert segment is not None and header is not None
            meta = memory.read_meta(segment.view, header)
            copies = {}
            for i, entry in enumerate(meta["tensors"]):
                if entry["path"].startswith(("/optimizer/", "/extra/")) and (
                        entry.get("device", "cpu") == "cpu"
                        and int(entry["nbytes"]) > memory.SMALL_TENSOR):
                    src = slot_tensor(segment.view, entry)
                    copies[i] = torch.empty_like(src)
                    # a plain memcpy that releases the GIL: torch's own copy would start a
                    # pool of compute threads for this thread
                    ctypes.memmove(copies[i].data_ptr(), src.data_ptr(), src.nbytes)
            self.key, self.tensors = (segment.name, header.seq), copies
        except Exception:  # restore() reads the slot itself, and reports what is wrong
            logger.debug("prefetch failed", exc_info=True)
            self.key, self.tensors = None, {}
        finally:
            for segment in segments:
                if segment is not None:
                    segment.close()


_prefetch: Prefetch | None = None


def take(name: str, seq: int) -> dict[int, torch.Tensor]:
    """The prefetched copies (by index in the slot's metadata) if they come from slot
    ``name`` at ``seq``, else none; either way the prefetch is over."""
    global _prefetch
    found = _prefetch.take(name, seq) if _prefetch is not None else {}
    _prefetch = None
    return found


def prefetch() -> None:
    """Start copying the step this worker will restore (``GEMINI_RESTORE_STEP``) out of
    its slot in the background; see ``Prefetch``. Called as a standby takes its job, and
    by ``Checkpointer`` as it is made, before the script reaches ``restore``."""
    global _prefetch
    step = os.environ.get(ENV_RESTORE_STEP, "")
    prefix = os.environ.get(ENV_PREFIX, "")
    if _prefetch is None and prefix and step.isdigit() and os.environ.get(ENV_SOCKET):
        _prefetch = Prefetch(prefix, int(os.environ.get("RANK", "0")), int(step))


def verified_seqs() -> dict[int, int]:
    """Rank -> seq of the slot holding the restore step that the supervisor verified in
    this round, from ``GEMINI_RESTORE_VERIFIED`` ("rank:seq,...")."""
    pairs = (item.split(":") for item in os.environ.get(ENV_RESTORE_VERIFIED, "").split(",")
             if item)
    return {int(rank): int(seq) for rank, seq in pairs}
