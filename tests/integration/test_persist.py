"""The persistent tier with other processes: workers that keep the CPU busy or idle, a
writer SIGKILLed mid-write, ``gemini export`` and ``gemini inspect --dir``.

Real files under tmp_path; real shared-memory slots owned by a real SlotOwner, in a private
directory under /dev/shm (GEMINI_SHM_DIR for subprocesses) that must be empty at the end.
torch is imported only by the tests that need it, so the crash-test writer starts fast.
The tests within one process are in tests/unit/test_persist.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import GEMINI, REPO, Done, run
from persist_support import Host, _files, _load, hosts, payload, run_id, shm

from launcher import codec, contract, memory, persist
from launcher.errors import CheckpointError
from launcher.slots import SlotOwner

__all__ = ["hosts", "run_id", "shm"]  # fixtures (persist_support), used by name

TESTS = REPO / "tests"


def _gemini(*args: str) -> Done:
    return run([*GEMINI, *args], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


# -- the writer -------------------------------------------------------------------------------

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


# -- loading what a crash or a disk left --------------------------------------------------------

_CRASH_WRITER = """
import sys
import time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from launcher import memory, persist
from persist_support import commit_slot
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
