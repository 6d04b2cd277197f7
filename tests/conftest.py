from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher import memory
from launcher.slots import find_leftovers

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Under pytest-xdist (tests/run.sh runs the suite in parallel) each worker has a
# shared-memory base of its own (mode 1777, as /dev/shm), inherited by every gemini
# process it starts: a test that checks what its runs left behind, or removes dead runs'
# segments, sees only its own worker's.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and "GEMINI_SHM_DIR" not in os.environ:
    _base = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    os.environ["GEMINI_SHM_DIR"] = tempfile.mkdtemp(prefix=f"gemini-tests-{_WORKER}-", dir=_base)
    os.chmod(os.environ["GEMINI_SHM_DIR"], 0o1777)  # as /dev/shm
    atexit.register(shutil.rmtree, os.environ["GEMINI_SHM_DIR"], True)

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``long`` (many minutes each, or cases another test covers) run only
    where ``-m`` names them (``bash tests/run.sh long``): the suite keeps its time budget."""
    if "long" in (config.option.markexpr or ""):
        return
    long = [item for item in items if item.get_closest_marker("long") is not None]
    if long:
        config.hook.pytest_deselected(items=long)
        items[:] = [item for item in items if item.get_closest_marker("long") is None]
