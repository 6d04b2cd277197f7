"""CPU priority of background threads (replication, persistence) next to training."""

from __future__ import annotations

import os
import threading


def lower_priority(nice: int) -> None:
    """Give the calling thread (not its process) the niceness ``nice``, best-effort (Linux
    schedules threads individually): under CPU contention training threads then go first."""
    if nice > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (OSError, AttributeError):
            pass
