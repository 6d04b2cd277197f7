"""Wall-clock stamps for benchmarks/framework_restart_bench.py: when a worker is killed,
and when rank 0 completes its first step after a restart ("kill at=T", "next_step at=T")."""

import os
import time

_restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
_said = False


def killed() -> None:
    """Right before a worker kills itself."""
    print(f"kill at={time.time():.6f}", flush=True)


def step_done(rank: int) -> None:
    """After each completed step: rank 0 says when the first one after a restart ended."""
    global _said
    if _restarted and rank == 0 and not _said:
        _said = True
        print(f"next_step at={time.time():.6f}", flush=True)
