"""Worker health on one host: hang detection from progress heartbeats.

torch elastic's monitor loop already sees a worker that exits. A worker that stops making
progress without exiting (a deadlock, a stopped process, a stuck collective) is found
here: every worker's ``Checkpointer`` bumps a counter in a small shared-memory segment at
each optimizer step and each ``save()`` (``memory.heartbeat_name``, one cache line per
local rank). A worker whose counter has not moved for ``--hang-timeout`` seconds is hung,
from its first beat in the round until it closes its Checkpointer: the supervisor then
SIGKILLs the round's workers, and torch elastic restarts them as after a crash (counting
a restart); they resume from the in-memory checkpoint.

Workers that never beat (scripts without a Checkpointer) are not watched.
"""

from __future__ import annotations

import logging
import os
import signal
import struct
import time
from typing import TYPE_CHECKING, Any

from launcher import memory
from launcher.events import EventLog

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import WorkerGroup

logger = logging.getLogger(__name__)

class HealthService:
    """Supervisor service (see ``agent.SupervisorService``): hang detection."""

    def __init__(self, prefix: str, local_world_size: int, *, hang_timeout: float,
                 events: EventLog) -> None:
        self.hang_timeout = hang_timeout
        self._events = events
        self._segment = memory.create_segment(memory.heartbeat_name(prefix),
                                              memory.HEARTBEAT_STRIDE * local_world_size)
        self._pids: dict[int, int] = {}  # local rank -> worker pid, this round
        self._last: dict[int, tuple[int, float]] = {}  # local rank -> (count, when it moved)
        self._killed = False
        os.environ[memory.ENV_HEARTBEAT] = self._segment.name

    def _count(self, local_rank: int) -> int:
        value: int = struct.unpack_from("Q", self._segment.view,
                                        local_rank * memory.HEARTBEAT_STRIDE)[0]
        return value

    def before_start(self, group: WorkerGroup, store: Any) -> None:
        # No worker runs: start the round's counters from zero.
        self._segment.view[:] = bytes(self._segment.size)

    def after_start(self, group: WorkerGroup) -> None:
        self._pids = {w.local_rank: int(w.id) for w in group.workers if w.id is not None}
        self._last = {}
        self._killed = False

    def after_stop(self, group: WorkerGroup) -> None:
        self._pids = {}

    def check(self) -> None:
        if self.hang_timeout <= 0 or self._killed or not self._pids:
            return
        now = time.monotonic()
        for local_rank in self._pids:
            count = self._count(local_rank)
            last = self._last.get(local_rank)
            if count == memory.HEARTBEAT_DONE:  # closed its Checkpointer: training is over
                self._last.pop(local_rank, None)
            elif last is None or count != last[0]:
                if count:  # armed from the first beat of the round on
                    self._last[local_rank] = (count, now)
            elif now - last[1] > self.hang_timeout:
                self._kill_hung(local_rank, now - last[1])
                return

    def _kill_hung(self, local_rank: int, silent: float) -> None:
        """SIGKILL every worker of the round; torch elastic then restarts them."""
        self._killed = True
        logger.error("local rank %d made no progress for %.0f s (--hang-timeout %g): "
                     "killing this host's workers to restart them", local_rank, silent,
                     self.hang_timeout)
        self._events.write("hang", local_rank=local_rank, silent_seconds=round(silent, 1),
                           hang_timeout=self.hang_timeout, pids=sorted(self._pids.values()))
        for pid in self._pids.values():
            try:  # torch elastic starts each worker in a session of its own
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        self._segment.close()
        memory.unlink_segment(self._segment.name)
