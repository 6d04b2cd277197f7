"""Helpers of the persistent-tier tests, shared by tests/unit/test_persist.py and
tests/integration/test_persist.py: committed slots written as a worker would, a host's
slots, and the fixtures of a private shared-memory directory.

The crash-test writer subprocess imports :func:`commit_slot` from here: no torch.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from launcher import memory, persist
from launcher.slots import SlotOwner


def payload(seq: int, nbytes: int) -> bytes:
    """Deterministic slot content for commit number ``seq``."""
    return (seq.to_bytes(8, "little") + b"gemini!!") * (nbytes // 16) + b"\x5a" * (nbytes % 16)


def commit_slot(buf: Any, *, step: int, seq: int, rank: int, world_size: int, run_id: str,
                nbytes: int = 4096) -> None:
    """Write a committed slot holding one uint8 tensor, as a worker would."""
    memory.set_state(buf, memory.SlotState.WRITING)
    data = payload(seq, nbytes)
    buf[memory.HEADER_SIZE:memory.HEADER_SIZE + nbytes] = data
    entry = {"path": "/x", "dtype": "uint8", "shape": [nbytes], "offset": 0, "nbytes": nbytes,
             "device": "cpu", "xxh3": f"{xxhash.xxh3_64_intdigest(data):016x}"}
    meta = json.dumps({"step": step, "tree": {"x": {"__tensor__": 0}}, "tensors": [entry],
                       "blocks": []}).encode()
    memory.write_commit(buf, step=step, seq=seq, rank=rank, world_size=world_size,
                        run_id=run_id, data_len=nbytes, meta=meta)


class Host:
    """A supervisor's slots for some ranks, and a worker-like writer of committed steps."""

    def __init__(self, run_id: str, host_id: str, ranks: list[int], world_size: int,
                 nbytes: int = 4096) -> None:
        self.run_id, self.world_size, self.nbytes = run_id, world_size, nbytes
        self.owner = SlotOwner(run_id=run_id, host_id=host_id, local_world_size=len(ranks))
        for rank in ranks:
            self.owner.allocate(rank, memory.slot_size(nbytes, 1024))
        self.seq = 0

    def commit(self, rank: int, step: int, *, index: int | None = None) -> int:
        """Commit ``step`` of ``rank`` into slot ``step % 2`` (the double buffer)."""
        self.seq += 1
        segment = self.owner.segments()[rank][step % 2 if index is None else index]
        commit_slot(segment.view, step=step, seq=self.seq, rank=rank,
                    world_size=self.world_size, run_id=self.run_id, nbytes=self.nbytes)
        return self.seq

    def commit_all(self, step: int) -> None:
        for rank in self.owner.segments():
            self.commit(rank, step)

    def writer(self, directory: Path, **kwargs: Any) -> persist.PersistWriter:
        return persist.PersistWriter(directory, run_id=self.run_id,
                                     sources=self.owner.segments, **kwargs)


@pytest.fixture
def shm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private shared-memory directory; no segment may be left in it."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = Path(tempfile.mkdtemp(prefix="gtest-persist-", dir=base))
    monkeypatch.setenv("GEMINI_SHM_DIR", str(path))
    monkeypatch.setattr(memory, "_SHM_DIR", None)  # resolved again, under ``path``
    try:
        yield path
        assert sorted(os.listdir(memory.shm_dir())) == [], "shared-memory segments left behind"
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    return f"test-persist-{os.getpid()}-{request.node.name}"


@pytest.fixture
def hosts(shm: Path) -> Iterator[list[Host]]:
    """Hosts created by a test; closed (segments unlinked) at its end."""
    made: list[Host] = []
    yield made
    for host in made:
        host.owner.close()


def _files(directory: Path, run_id: str) -> dict[int, list[str]]:
    """step -> sorted file names (hidden temporaries included)."""
    return {step: sorted(os.listdir(folder))
            for step, folder in persist._step_dirs(persist.run_dir(directory, run_id))}


def _load(directory: Path, run_id: str, owner: SlotOwner, rank: int,
          step: int) -> tuple[memory.SlotHeader, memory.Segment]:
    """load_into a slot of ``owner``; the committed header and that slot."""
    used: list[memory.Segment] = []

    def target(nbytes: int) -> memory.Segment:
        used.append(owner.write_target(rank, nbytes, replica=False))
        return used[-1]

    return persist.load_into(directory, run_id, rank, step, target), used[-1]
