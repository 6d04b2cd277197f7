"""The persistent tier (launcher.persist) in one process: what to persist, the writer,
loading what a crash or a disk left, falling back past a corrupt step.

Real files under tmp_path; real shared-memory slots owned by a real SlotOwner, in a private
directory under /dev/shm that must be empty at the end. The tests with other processes
(a worker that keeps the CPU busy, a writer killed mid-write, ``gemini export`` and
``gemini inspect --dir``) are in tests/integration/test_persist.py.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
from persist_support import Host, _files, _load, hosts, payload, run_id, shm

from launcher import export, memory, persist
from launcher.errors import CheckpointError, StorageError, UsageError

__all__ = ["hosts", "run_id", "shm"]  # fixtures (persist_support), used by name


# -- decisions ------------------------------------------------------------------------------

def test_plan_aligns_steps_across_ranks() -> None:
    assert persist.plan({0: [10, 11], 1: [9, 10]}, {}, every_steps=5, time_due=()) == {0: 10,
                                                                                        1: 10}
    assert persist.plan({0: [10, 11], 1: [9, 10]}, {0: 10}, every_steps=5, time_due=()) == {
        1: 10}
    assert persist.plan({0: [11, 12]}, {}, every_steps=5, time_due=()) == {}
    # by time: the newest step every due rank holds
    assert persist.plan({0: [10, 11], 1: [9, 10]}, {}, every_steps=None,
                        time_due={0, 1}) == {0: 10, 1: 10}
    assert persist.plan({0: [10, 11]}, {0: 11}, every_steps=None, time_due={0}) == {}
    # join a step another rank or host started
    assert persist.plan({0: [20, 21]}, {0: 15}, every_steps=None, time_due=(),
                        intents={21, 7}) == {0: 21}
    # by time, a host waits until every local rank holds the step (rank 1 committed first)
    assert persist.plan({0: [], 1: [0]}, {}, every_steps=None, time_due={0, 1}) == {}
    assert persist.plan({0: [1, 2], 1: [0, 1]}, {}, every_steps=None,
                        time_due={0, 1}) == {0: 1, 1: 1}
    # a rank due by time after another persisted step 0 alone (it committed first) joins
    # step 0 rather than its newest: else no step is ever complete until the next period
    assert persist.plan({0: [0, 1]}, {1: 0}, every_steps=None, time_due={0},
                        intents={0}) == {0: 0}
    assert persist.plan({0: [3, 4]}, {0: 2}, every_steps=None, time_due={0},
                        intents={0, 2}) == {0: 4}  # intents it is past are not joined
    with pytest.raises(UsageError):
        persist.PersistWriter(Path("/nonexistent"), run_id="r", sources=dict)
    with pytest.raises(UsageError, match="keep"):
        persist.PersistWriter(Path("/nonexistent"), run_id="r", sources=dict, every_steps=1,
                              keep=0)


# -- the writer -------------------------------------------------------------------------------

def test_every_steps_publishes_aligned_steps_prunes_and_loads_back(
        tmp_path: Path, run_id: str, hosts: list[Host]) -> None:
    host = Host(run_id, "h0", [0, 1], 2)
    hosts.append(host)
    seen: list[tuple[int, int]] = []
    writer = host.writer(tmp_path, every_steps=2, keep=2,
                         on_persisted=lambda rank, step: seen.append((rank, step)))
    seqs: dict[int, int] = {}
    for step in range(6):
        host.commit_all(step)
        seqs[step] = host.seq  # rank 1's seq of this step
        writer.run_once()
    assert writer.status() == {0: 4, 1: 4}
    assert seen == [(0, 0), (1, 0), (0, 2), (1, 2), (0, 4), (1, 4)]
    assert persist.complete_steps(tmp_path, run_id) == [2, 4]  # step 0 pruned (keep=2)
    assert persist.scan(tmp_path, run_id) == writer.scan() == {0: [2, 4], 1: [2, 4]}
    assert _files(tmp_path, run_id)[4] == ["rank-00000.gslot", "rank-00000.json",
                                           "rank-00001.gslot", "rank-00001.json"]
    manifest = json.loads((persist.slot_path(tmp_path, run_id, 1, 4)).with_suffix(
        ".json").read_text())
    assert manifest["schema"] == "gemini.persist/v1" and manifest["seq"] == seqs[4]
    assert manifest["world_size"] == 2 and manifest["step"] == 4
    assert manifest["nbytes"] == persist.slot_path(tmp_path, run_id, 1, 4).stat().st_size

    # a replacement host loads rank 1 into its own slot and it verifies there
    other = Host(run_id, "h1", [], 2)
    hosts.append(other)
    header, segment = _load(tmp_path, run_id, other.owner, 1, 4)
    assert (header.step, header.rank, header.seq, header.state) == (
        4, 1, seqs[4], memory.SlotState.COMMITTED)
    assert other.owner.holdings([1], 2) == {1: [4]}
    start = memory.HEADER_SIZE
    assert bytes(segment.view[start:start + 4096]) == payload(seqs[4], 4096)


def test_every_seconds_follows_the_clock(tmp_path: Path, run_id: str,
                                         hosts: list[Host]) -> None:
    host = Host(run_id, "h0", [0], 1)
    hosts.append(host)
    now = [100.0]
    writer = host.writer(tmp_path, every_seconds=10, clock=lambda: now[0])
    host.commit(0, 1)
    assert writer.run_once() == [(0, 1)]  # nothing persisted yet: due at once
    host.commit(0, 2)
    host.commit(0, 3)
    now[0] = 109.0
    assert writer.run_once() == []
    now[0] = 110.5
    assert writer.run_once() == [(0, 3)]  # the newest step
    assert writer.run_once() == []
    assert persist.scan(tmp_path, run_id) == {0: [1, 3]}


def test_thread_persists_in_background_at_low_priority(tmp_path: Path, run_id: str,
                                                       hosts: list[Host]) -> None:
    host = Host(run_id, "h0", [0], 1)
    hosts.append(host)
    writer = host.writer(tmp_path, every_steps=1, poll_interval=0.01)
    writer.start()
    writer.start()
    try:
        for step in range(3):
            host.commit(0, step)
            deadline = time.monotonic() + 20
            while writer.status().get(0) != step:
                assert time.monotonic() < deadline, f"step {step} not persisted"
                time.sleep(0.01)
        thread = writer._thread
        assert thread is not None and thread.native_id is not None
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        if mine < 19:
            assert os.getpriority(os.PRIO_PROCESS, thread.native_id) > mine
    finally:
        writer.close(timeout=10)
        writer.close()
    assert writer._thread is not None and not writer._thread.is_alive()
    writer.start()  # closed stays closed
    assert not writer._thread.is_alive()
    assert persist.scan(tmp_path, run_id) == {0: [1, 2]}


@pytest.mark.parametrize("change", ["recommit", "writing"])
def test_slot_changed_during_copy_is_not_published(tmp_path: Path, run_id: str,
                                                   hosts: list[Host],
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   change: str) -> None:
    host = Host(run_id, "h0", [0], 1, nbytes=64 << 10)
    hosts.append(host)
    writer = host.writer(tmp_path, every_steps=1, keep=5)
    host.commit(0, 0)
    copy_out = persist._copy_out

    def worker_writes_meanwhile(view: memoryview, fd: int, end: int, stop: Any,
                                gate: Any) -> None:
        copy_out(view, fd, end // 2, stop, gate)
        if change == "recommit":  # the worker commits step 2 into the same slot
            host.commit(0, 2, index=0)
        else:  # the worker starts overwriting the slot (and dies, say)
            memory.set_state(host.owner.segments()[0][0].view, memory.SlotState.WRITING)
        copy_out(view, fd, end, stop, gate)

    monkeypatch.setattr(persist, "_copy_out", worker_writes_meanwhile)
    assert writer.run_once() == []
    assert writer.status() == {} and persist.scan(tmp_path, run_id) == {}
    assert all(names == [] for names in _files(tmp_path, run_id).values())  # no temporary
    monkeypatch.setattr(persist, "_copy_out", copy_out)
    if change == "recommit":
        assert writer.run_once() == [(0, 2)]
        image = persist.read_slot_file(persist.slot_path(tmp_path, run_id, 0, 2))
        with image:
            assert image.header.seq == host.seq
            assert bytes(image.buf[memory.HEADER_SIZE:memory.HEADER_SIZE + 16]) == payload(
                host.seq, 16)
    else:
        assert writer.run_once() == []
        host.commit(0, 1)
        assert writer.run_once() == [(0, 1)]


def test_two_hosts_share_a_directory_and_prune_only_their_own(
        tmp_path: Path, run_id: str, hosts: list[Host]) -> None:
    a, b = Host(run_id, "a", [0, 1], 4), Host(run_id, "b", [2, 3], 4)
    hosts.extend([a, b])
    wa, wb = a.writer(tmp_path, every_steps=1, keep=2), b.writer(tmp_path, every_steps=1, keep=2)
    a.commit_all(0)
    b.commit_all(0)
    assert len(wa.run_once() + wb.run_once()) == 4
    a.commit_all(1)  # b misses step 1
    wa.run_once()
    assert persist.complete_steps(tmp_path, run_id) == [0]  # the only complete step stays
    for step in (2, 3):
        a.commit_all(step)
        b.commit_all(step)
        wa.run_once()
        wb.run_once()
    # b published step 3 last: complete 0, 2, 3 -> it keeps 2 and 3 and deletes its own
    # files of step 0; a's files of steps 0 and 1 are a's to delete
    files = _files(tmp_path, run_id)
    assert files[0] == ["rank-00000.gslot", "rank-00000.json", "rank-00001.gslot",
                        "rank-00001.json"]
    assert len(files[1]) == 4 and len(files[2]) == len(files[3]) == 8
    assert persist.complete_steps(tmp_path, run_id) == [2, 3]
    a.commit_all(4)
    wa.run_once()
    assert sorted(_files(tmp_path, run_id)) == [2, 3, 4]  # a's old steps, empty dirs gone
    assert persist.scan(tmp_path, run_id) == {0: [2, 3, 4], 1: [2, 3, 4], 2: [2, 3],
                                              3: [2, 3]}
    # a restore of step 2: a's later files belong to the abandoned attempt
    wa.rewind(2)
    assert persist.scan(tmp_path, run_id) == {0: [2], 1: [2], 2: [2, 3], 3: [2, 3]}
    assert wa.status() == {}


def test_write_failure_is_logged_retried_and_training_goes_on(
        tmp_path: Path, run_id: str, hosts: list[Host], caplog: pytest.LogCaptureFixture) -> None:
    host = Host(run_id, "h0", [0], 1)
    hosts.append(host)
    blocker = tmp_path / "persist"
    blocker.write_text("a file where the directory should be")
    now = [0.0]
    writer = host.writer(blocker, every_steps=1, clock=lambda: now[0])
    host.commit(0, 0)
    with caplog.at_level(logging.WARNING, logger="launcher.persist"):
        assert writer.run_once() == []
    assert isinstance(writer.last_error, StorageError)
    assert "cannot persist rank 0 step 0" in str(writer.last_error)
    assert "training goes on" in caplog.text
    blocker.unlink()
    assert writer.run_once() == []  # backing off
    now[0] = 1.5
    assert writer.run_once() == [(0, 0)]


# -- loading what a crash or a disk left --------------------------------------------------------

def _persist_one(tmp_path: Path, run_id: str, hosts: list[Host]) -> Path:
    host = Host(run_id, "h0", [0], 1, nbytes=64 << 10)
    hosts.append(host)
    host.commit(0, 7)
    assert host.writer(tmp_path, every_steps=1).run_once() == [(0, 7)]
    return persist.slot_path(tmp_path, run_id, 0, 7)


@pytest.mark.parametrize("damage", ["data", "meta", "header", "truncate", "manifest",
                                    "no-manifest"])
def test_corrupt_or_truncated_file_is_rejected(tmp_path: Path, run_id: str,
                                               hosts: list[Host], damage: str) -> None:
    path = _persist_one(tmp_path, run_id, hosts)
    with persist.read_slot_file(path) as image:
        meta_offset = image.header.meta_offset
    data = bytearray(path.read_bytes())
    if damage == "data":
        data[memory.HEADER_SIZE + 1000] ^= 0x01
    elif damage == "meta":
        data[meta_offset + 3] ^= 0x20
    elif damage == "header":
        data[40] ^= 0x01  # inside data_len
    elif damage == "truncate":
        del data[len(data) // 2:]
    if damage == "manifest":
        manifest = json.loads(path.with_suffix(".json").read_text())
        manifest["seq"] += 1
        path.with_suffix(".json").write_text(json.dumps(manifest))
    elif damage == "no-manifest":
        path.with_suffix(".json").unlink()
    else:
        path.write_bytes(bytes(data))
    # the cheap scan does not read tensor bytes or metadata; loading checks everything
    listed = persist.scan(tmp_path, run_id) == {0: [7]}
    assert listed == (damage in ("data", "meta"))
    other = Host(run_id, "h1", [], 1)
    hosts.append(other)
    segments: list[memory.Segment] = []

    def target(nbytes: int) -> memory.Segment:
        segments.append(other.owner.write_target(0, nbytes, replica=False))
        return segments[-1]

    expected = {"data": "checksum mismatch in tensor /x", "meta": "metadata checksum",
                "header": "header checksum", "truncate": "truncated",
                "manifest": "seq", "no-manifest": "unpublished"}[damage]
    with pytest.raises(CheckpointError, match=expected):
        persist.load_into(tmp_path, run_id, 0, 7, target)
    for segment in segments:  # a slot that received bad bytes is never committed
        header = memory.read_header(segment.view)
        assert header is not None and header.state is memory.SlotState.WRITING
    with pytest.raises(CheckpointError):
        persist.read_slot_file(path)
    [info] = persist.inspect_dir(tmp_path, run_id)
    assert info.error is not None and info.valid_step is None


# -- export --------------------------------------------------------------------------------------

def test_export_falls_back_past_a_corrupt_step(tmp_path: Path, run_id: str,
                                               hosts: list[Host]) -> None:
    host = Host(run_id, "h0", [0], 1)
    hosts.append(host)
    writer = host.writer(tmp_path, every_steps=1, keep=3)
    for step in range(3):
        host.commit(0, step)
        writer.run_once()
    path = persist.slot_path(tmp_path, run_id, 0, 2)
    data = bytearray(path.read_bytes())
    data[memory.HEADER_SIZE] ^= 0xFF
    path.write_bytes(bytes(data))
    with export.open_checkpoint(run_id, directory=tmp_path) as image:
        assert image.header.step == 1
    with pytest.raises(CheckpointError, match="step 2.*checksum mismatch"):
        export.open_checkpoint(run_id, directory=tmp_path, step=2)
    with export.open_checkpoint(run_id) as image:
        assert image.header.step == 2 and image.source.startswith("memory:")
    with pytest.raises(CheckpointError, match="rank 3"):
        export.open_checkpoint(run_id, rank=3)
