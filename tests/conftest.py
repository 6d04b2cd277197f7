from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher import memory
from launcher.slots import find_leftovers

sys.path.insert(0, str(Path(__file__).resolve().parent))

if os.environ.get("CI") == "true":  # CI replays the same examples; elsewhere they vary
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, database=None)
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _remove_dead_runs_segments() -> Iterator[None]:
    """Tests that kill a supervisor, as a host loss does, leave its shared memory behind
    on purpose (a restarted supervisor would adopt it): remove what such a test left,
    only of runs whose supervisor is dead, so the suite leaves /dev/shm as it found it."""
    before = set(memory.list_segments())
    yield
    for names in find_leftovers().values():
        for name in names:
            if name not in before:
                memory.unlink_segment(name)
