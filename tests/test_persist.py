"""The persistent tier (launcher.persist), ``gemini export`` and ``gemini inspect --dir``.

Real files under tmp_path; real shared-memory slots owned by a real SlotOwner, in a private
directory under /dev/shm (GEMINI_SHM_DIR for subprocesses) that must be empty at the end.
torch is imported only by the tests that need it, so the crash-test writer starts fast.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash
from helpers import GEMINI, Done, run

from launcher import codec, contract, export, memory, persist
from launcher.errors import CheckpointError, StorageError, UsageError
from launcher.slots import SlotOwner

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


# -- helpers (also imported by the crash-test writer subprocess) ----------------------------

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


def _gemini(*args: str) -> Done:
    return run([*GEMINI, *args], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def _load(directory: Path, run_id: str, owner: SlotOwner, rank: int,
          step: int) -> tuple[memory.SlotHeader, memory.Segment]:
    """load_into a slot of ``owner``; the committed header and that slot."""
    used: list[memory.Segment] = []

    def target(nbytes: int) -> memory.Segment:
        used.append(owner.write_target(rank, nbytes, replica=False))
        return used[-1]

    return persist.load_into(directory, run_id, rank, step, target), used[-1]


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


def test_copies_wait_for_idle_workers(tmp_path: Path, run_id: str, hosts: list[Host]) -> None:
    """A copy goes while the workers leave the CPU idle; a worker that never does delays
    it by persist.GATE_WAIT at most."""
    host = Host(run_id, "h0", [0], 1)
    hosts.append(host)
    writer = host.writer(tmp_path, every_steps=1)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.3)
        writer.watch_workers([busy.pid])
        host.commit(0, 1)
        began = time.monotonic()
        assert writer.run_once() == [(0, 1)]
        assert persist.GATE_WAIT <= time.monotonic() - began < persist.GATE_WAIT + 5
        writer.watch_workers([idle.pid])
        host.commit(0, 2)
        began = time.monotonic()
        assert writer.run_once() == [(0, 2)]
        assert time.monotonic() - began < persist.GATE_WAIT
    finally:
        for proc in (busy, idle):
            proc.kill()
            proc.wait()


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


_CRASH_WRITER = """
import sys
import time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from launcher import codec, contract, export, memory, persist
from test_persist import commit_slot
directory, run_id, nbytes = Path(sys.argv[1]), sys.argv[2], int(sys.argv[4])
copy_out = persist._copy_out
def slow_copy_out(view, fd, end, stop, gate):  # widen the window in which a kill tears a file
    for lo in range(0, end, 1 << 20):
        with view[lo:min(lo + (1 << 20), end)] as part:
            copy_out(part, fd, len(part), stop, gate)
        time.sleep(0.004)
persist._copy_out = slow_copy_out
segment = memory.create_segment(sys.argv[5], memory.slot_size(nbytes, 1024))
memory.init_header(segment.view, rank=0, run_id=run_id)
print("ready", flush=True)
i = 0
while True:  # each step twice (seq 2s+1, then 2s+2): a crash may hit a first write or a rewrite
    step, seq = i // 2, i + 1
    commit_slot(segment.view, step=step, seq=seq, rank=0, world_size=1, run_id=run_id,
                nbytes=nbytes)
    writer = persist.PersistWriter(directory, run_id=run_id, sources=lambda: {0: [segment]},
                                   every_steps=1, keep=10**6)
    writer.run_once()
    i += 1
"""


def test_sigkill_mid_write_never_leaves_a_loadable_bad_file(tmp_path: Path, run_id: str,
                                                            shm: Path,
                                                            hosts: list[Host]) -> None:
    rng = random.Random(1234)
    published: set[int] = set()
    missing: set[int] = set()
    nbytes = 8 << 20
    directory = tmp_path / "persist"
    name = f"gtest-crash-writer-{os.getpid()}"
    reader = Host(run_id, "reader", [], 1)
    hosts.append(reader)
    for _ in range(8):
        proc = subprocess.Popen(
            [sys.executable, "-c", _CRASH_WRITER, str(directory), run_id, str(TESTS),
             str(nbytes), name], stdout=subprocess.PIPE, text=True, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            time.sleep(rng.uniform(0.1, 0.5))
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            memory.unlink_segment(name)
        steps = persist.scan(directory, run_id).get(0, [])
        published.update(steps)
        present = {step for step, names in _files(directory, run_id).items()
                   if "rank-00000.gslot" in names}
        loadable = set()
        for step in sorted(present):
            try:
                header, segment = _load(directory, run_id, reader.owner, 0, step)
            except CheckpointError:
                continue
            loadable.add(step)
            assert header.step == step and header.seq in (2 * step + 1, 2 * step + 2)
            tail = memory.HEADER_SIZE + nbytes - 16
            assert bytes(segment.view[tail:tail + 16]) == payload(header.seq, nbytes)[-16:]
        assert loadable == set(steps)  # what scan lists loads, and nothing else does
        # Each writer writes (or rewrites, unpublishing first) steps 0, 1, ... in order:
        # a kill removes at most the one in flight. A later writer killed sooner leaves
        # an older gap open, so gaps add up over writers, one at most per kill.
        gaps = set(range(max(steps) + 1)) - set(steps) if steps else set()
        assert len(gaps - missing) <= 1, (gaps, missing)
        missing = gaps
    assert published, "the writer never published anything before it was killed"


# -- export and inspect ----------------------------------------------------------------------------

@pytest.fixture
def trained(shm: Path, run_id: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Three steps saved through a real Checkpointer and slot server; what they hold."""
    import torch

    from launcher import hook
    from launcher.slots import SlotServer

    owner = SlotOwner(run_id=run_id, host_id="h0", local_world_size=1)
    server = SlotServer(owner)
    for key, value in {contract.ENV_SOCKET: server.env_address, contract.ENV_PREFIX: owner.prefix,
                       "TORCHELASTIC_RUN_ID": run_id, "RANK": "0", "WORLD_SIZE": "1",
                       contract.ENV_RESTORE_STEP: "-1"}.items():
        monkeypatch.setenv(key, value)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2)
        extra: dict[str, Any] = {"count": 0, "sched": sched}
        ckpt = hook.Checkpointer(model=model, optimizer=opt, extra=extra)
        ckpt.restore()
        states = {}
        for step in range(3):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            extra["count"] = step * 10
            ckpt.save(step)
            ckpt.wait()
            states[step] = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                            "optimizer": codec.clone_tensors(opt.state_dict()),
                            "extra": {"count": step * 10, "sched": sched.state_dict()},
                            "step": step}
        ckpt.close()
        yield {"owner": owner, "states": states}
    finally:
        server.close()
        owner.close()


def _fresh_template() -> dict[str, Any]:
    """A state dict of the same layout from a differently initialised model and optimizer."""
    import torch

    torch.manual_seed(99)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # creates the optimizer state that DCP loads into
    sched = torch.optim.lr_scheduler.StepLR(opt, 5)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "extra": {"count": -1, "sched": sched.state_dict()}, "step": -1}


def _assert_bitwise(got: Any, want: Any, where: str = "") -> None:
    import torch

    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert got.shape == want.shape, where
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            _assert_bitwise(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_bitwise(g, w, f"{where}/{i}")
    else:
        assert got == want and type(got) is type(want), where


def _load_export(out: Path) -> dict[str, Any]:
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import load

    state = _fresh_template()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(state, checkpoint_id=out, no_dist=True)
    return state


def test_export_from_persisted_dir_and_from_memory_loads_back_bitwise(
        tmp_path: Path, run_id: str, trained: dict[str, Any]) -> None:
    owner: SlotOwner = trained["owner"]
    states = trained["states"]
    directory = tmp_path / "persist"
    writer = persist.PersistWriter(directory, run_id=run_id, sources=owner.segments,
                                   every_steps=1)
    assert writer.run_once() == [(0, 2)]

    out = tmp_path / "from-dir"
    done = _gemini("export", str(out), "--run-id", run_id, "--from-dir", str(directory),
                   "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["schema"] == "gemini.export/v1" and report["step"] == 2
    assert report["source"].endswith("rank-00000.gslot") and report["tensors"] > 10
    _assert_bitwise(_load_export(out), states[2])

    out = tmp_path / "from-memory"
    done = _gemini("export", str(out), "--run-id", run_id, "--step", "1")
    assert done.returncode == 0, done.stderr
    assert "exported step 1 of rank 0" in done.stdout and "memory:" in done.stdout
    _assert_bitwise(_load_export(out), states[1])


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


def test_export_bad_input_exit_codes(tmp_path: Path, run_id: str, shm: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    done = _gemini("export", str(full), "--run-id", run_id)
    assert done.returncode == 2 and "not empty" in done.stderr
    done = _gemini("export", str(tmp_path / "out"), "--run-id", run_id, "--from-dir",
                   str(tmp_path / "missing"))
    assert done.returncode == 4 and "is not a directory" in done.stderr
    done = _gemini("export", str(full / "x"), "--run-id", run_id)
    assert done.returncode == 4 and "not a directory" in done.stderr
    done = _gemini("export", str(tmp_path / "out"), "--run-id", run_id)
    assert done.returncode == 5 and "no verified checkpoint" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    done = _gemini("export", str(tmp_path / "out"), "--run-id", run_id, "--from-dir",
                   str(tmp_path))
    assert done.returncode == 5 and not (tmp_path / "out").exists()


def test_inspect_dir_lists_and_verifies(tmp_path: Path, run_id: str,
                                        hosts: list[Host]) -> None:
    host = Host(run_id, "h0", [0, 1], 2)
    hosts.append(host)
    writer = host.writer(tmp_path, every_steps=1, keep=2)
    for step in range(2):
        host.commit_all(step)
        writer.run_once()
    done = _gemini("inspect", "--dir", str(tmp_path), "--run-id", run_id, "--json",
                   "--tensors")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["schema"] == "gemini.inspect/v1" and report["dir"] == str(tmp_path)
    rows = {(r["rank"], r["step"]): r for r in report["slots"]}
    assert set(rows) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    assert all(r["verified"] and r["state"] == "COMMITTED" and r["slot"] is None
               for r in rows.values())
    assert rows[(1, 1)]["tensors"][0]["path"] == "/x"
    assert rows[(1, 1)]["segment"].endswith("step-000000000001/rank-00001.gslot")

    path = persist.slot_path(tmp_path, run_id, 1, 1)
    data = bytearray(path.read_bytes())
    data[memory.HEADER_SIZE + 7] ^= 0x01
    path.write_bytes(bytes(data))
    persist.slot_path(tmp_path, run_id, 0, 0).with_suffix(".json").unlink()
    done = _gemini("inspect", "--dir", str(tmp_path), "--json")  # every run in the dir
    rows = {(r["rank"], r["step"]): r for r in json.loads(done.stdout)["slots"]}
    assert done.returncode == 5
    assert "checksum mismatch" in rows[(1, 1)]["error"]
    assert rows[(0, 0)]["state"] == "UNPUBLISHED" and not rows[(0, 0)]["verified"]
    done = _gemini("inspect", "--dir", str(tmp_path))
    assert done.returncode == 5 and "persisted checkpoints in" in done.stdout
    done = _gemini("inspect", "--dir", str(tmp_path / "missing"))
    assert done.returncode == 4 and "not a directory" in done.stderr
