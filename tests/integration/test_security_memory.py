"""A hostile user on the same host against the shared-memory directory, and lying slot
metadata against the commands that read it: real supervisors, workers and CLI processes,
the other user through ``setpriv`` (as root; skipped otherwise).

* Another user takes ``gemini-<uid>`` and the 63 old fallback names: runs go on, in a
  private directory whose name nobody could take first.
* A name taken while the supervisor starts and freed before its worker starts: the
  worker uses the supervisor's directory, not one it would resolve itself.
* ``gemini inspect`` / ``export`` create no directory; an empty orphaned slot file fails
  no worker; hash-valid lying metadata (``null``, a dtype naming a module) stops neither
  ``gemini run``, ``inspect`` nor ``export`` with an internal error.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import GEMINI, SCRIPTS, env_with, kill_group, poll, run, start

from launcher import memory

UID = os.geteuid()
root_only = pytest.mark.skipif(UID != 0, reason="needs root to act as another user (setpriv)")


def _as_other_user(*cmd: str) -> None:
    subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *cmd],
                   check=True, timeout=30)


@pytest.fixture
def base() -> Iterator[Path]:
    """A shared-memory base like /dev/shm (mode 1777) that other users can write."""
    where = Path(tempfile.mkdtemp(prefix="gtest-shm-",
                                  dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    os.chmod(where, 0o1777)
    yield where
    shutil.rmtree(where, ignore_errors=True)


def _gemini_run(tmp: Path, base: Path, run_id: str, *script: str, timeout: float = 120
                ) -> tuple[int, str]:
    done = run([*GEMINI, "run", "--nproc-per-node", "1", "--no-standby", "--rdzv-id", run_id,
                *script], env=env_with(tmp, GEMINI_SHM_DIR=str(base), GEMINI_HOST_ID="h0"),
               timeout=timeout)
    return done.returncode, done.output


def _ours(base: Path) -> list[str]:
    return sorted(p.name for p in base.iterdir() if p.lstat().st_uid == UID)


@root_only
def test_names_another_user_took_stop_no_run(tmp_path: Path, base: Path) -> None:
    """``gemini-<uid>`` and ``gemini-<uid>-1`` ... ``-63`` taken by another user stopped
    every run of the user (exit 4). Now the run trains in a fallback whose name is random,
    and removes it at the end; the other user's files are untouched."""
    _as_other_user("mkdir", "-m", "0777", str(base / f"gemini-{UID}"))
    _as_other_user("sh", "-c", f"for n in $(seq 1 63); do touch {base}/gemini-{UID}-$n; done")
    code, output = _gemini_run(tmp_path, base, "squatted", str(SCRIPTS / "train_ckpt.py"),
                               "--steps", "3")
    assert code == 0, output[-3000:]
    assert "ignoring" in output and "Traceback" not in output
    assert _ours(base) == []  # the fallback was used and released
    assert len(list(base.iterdir())) == 64


_WAITING_WORKER = """
import os, sys, time
import torch
flag = sys.argv[1]
while not os.path.exists(flag):
    time.sleep(0.02)
from launcher import Checkpointer
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = Checkpointer(model=model, optimizer=opt)
for step in range(ckpt.restore(), 3):
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    ckpt.save(step)
ckpt.wait()
ckpt.close()
print("worker done", flush=True)
"""


@root_only
def test_a_worker_uses_the_directory_its_supervisor_resolved(tmp_path: Path,
                                                             base: Path) -> None:
    """Another user holds ``gemini-<uid>`` while the supervisor starts (it takes a
    fallback), then frees it before the worker starts. The worker resolved the name
    again, made ``gemini-<uid>`` itself and failed; now it uses the supervisor's."""
    _as_other_user("mkdir", "-m", "0777", str(base / f"gemini-{UID}"))
    script, flag = tmp_path / "worker.py", tmp_path / "go"
    script.write_text(_WAITING_WORKER)
    proc = start([*GEMINI, "run", "--nproc-per-node", "1", "--no-standby", "--rdzv-id", "race",
                  str(script), str(flag)],
                 env=env_with(tmp_path, GEMINI_SHM_DIR=str(base), GEMINI_HOST_ID="h0"))
    try:
        fallback = poll(lambda: next((base / n for n in _ours(base)
                                      if any((base / n).glob("*owner"))), None),
                        60, "the supervisor's private directory")
        assert fallback.name.startswith(f"gemini-{UID}-")
        _as_other_user("rmdir", str(base / f"gemini-{UID}"))
        flag.touch()
        output, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 0 and "worker done" in output, output[-3000:]
    assert not (base / f"gemini-{UID}").exists()  # no worker made a directory of its own


def test_inspect_and_export_create_no_directory(tmp_path: Path, base: Path) -> None:
    """Reading commands made the private directory they only read."""
    env = env_with(tmp_path, GEMINI_SHM_DIR=str(base))
    done = run([*GEMINI, "inspect", "--json"], env=env)
    assert done.returncode == 0 and json.loads(done.stdout)["slots"] == [], done.output
    done = run([*GEMINI, "export", "--run-id", "nothing", str(tmp_path / "out")], env=env)
    assert done.returncode == 5, done.output
    assert done.stderr.strip().startswith("gemini: error:") and len(
        done.stderr.strip().splitlines()) == 1, done.stderr
    done = run([*GEMINI, "clean"], env=env)
    assert done.returncode == 0, done.output
    assert list(base.iterdir()) == []


def _private(base: Path) -> Path:
    where = base / f"gemini-{UID}"
    where.mkdir(mode=0o700)
    os.chmod(where, 0o700)
    return where


def test_an_empty_orphaned_slot_fails_no_worker(tmp_path: Path, base: Path) -> None:
    """An empty slot file of the run (a supervisor killed while making it): the next
    supervisor refuses to adopt it and its worker attached it anyway (exit 1 with a
    traceback). Now the supervisor removes it and the run trains."""
    where = _private(base)
    empty = where / memory.slot_name(memory.segment_prefix("orphan", "h0"), 0, 0)
    empty.touch(mode=0o600)
    code, output = _gemini_run(tmp_path, base, "orphan", str(SCRIPTS / "train_ckpt.py"),
                               "--steps", "3")
    assert code == 0 and "Traceback" not in output, output[-3000:]
    assert "resume rank=0 start=0" in output, output[-3000:]


def _lying_slot(where: Path, run_id: str, index: int, meta: bytes, step: int) -> None:
    """A committed slot of rank 0 of ``run_id`` on h0 whose metadata ``meta`` hashes
    right (what a bug or a party with write access could leave)."""
    path = where / memory.slot_name(memory.segment_prefix(run_id, "h0"), 0, index)
    size = memory.slot_size(0, len(meta))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as buf:
            memory.write_commit(buf, step=step, seq=step, rank=0, world_size=1, run_id=run_id,
                                data_len=0, meta=meta)
    finally:
        os.close(fd)


def test_lying_metadata_stops_no_command(tmp_path: Path, base: Path) -> None:
    """Hash-valid metadata that is ``null``, or names the module ``os`` as a dtype: the
    supervisor, ``gemini inspect`` and ``gemini export`` exited 70 (or decoded a module).
    Now inspect reports both slots as corrupt (exit 5), export refuses with one line
    (exit 5), and a run of that id ignores them and starts fresh."""
    where = _private(base)
    _lying_slot(where, "liar", 0, b"null", 5)
    _lying_slot(where, "liar", 1, json.dumps(
        {"tensors": [], "tree": {"extra": {"x": {"__dtype__": "os"}}}}).encode(), 6)
    env = env_with(tmp_path, GEMINI_SHM_DIR=str(base))
    done = run([*GEMINI, "inspect", "--run-id", "liar", "--json"], env=env)
    assert done.returncode == 5, done.output
    errors = [s["error"] for s in json.loads(done.stdout)["slots"]]
    assert len(errors) == 2 and all("malformed metadata" in e for e in errors), errors
    done = run([*GEMINI, "export", "--run-id", "liar", str(tmp_path / "out")], env=env)
    assert done.returncode == 5 and "no verified checkpoint" in done.stderr, done.output
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists()
    code, output = _gemini_run(tmp_path, base, "liar", str(SCRIPTS / "train_ckpt.py"),
                               "--steps", "3")
    assert code == 0 and "Traceback" not in output, output[-3000:]
    assert "resume rank=0 start=0" in output, output[-3000:]


def test_the_supervisor_removes_an_empty_orphaned_slot(base: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor that refuses to adopt an empty slot file of its run and host removes
    it (it holds nothing), so that no worker of the run meets it; a non-empty refused
    file (another mode) is left alone."""
    from launcher.slots import SlotOwner

    monkeypatch.setenv("GEMINI_SHM_DIR", str(base))
    monkeypatch.setattr(memory, "_SHM_DIR", None)
    where = _private(base)
    prefix = memory.segment_prefix("orphan2", "h0")
    empty, loose = where / memory.slot_name(prefix, 0, 0), where / memory.slot_name(prefix, 1, 0)
    empty.touch(mode=0o600)
    loose.write_bytes(b"x" * 64)
    os.chmod(loose, 0o644)
    owner = SlotOwner(run_id="orphan2", host_id="h0", local_world_size=2)
    try:
        assert not empty.exists() and loose.read_bytes() == b"x" * 64
        assert os.environ["GEMINI_SHM_PRIVATE_DIR"] == str(where)
    finally:
        owner.close()
    assert "GEMINI_SHM_PRIVATE_DIR" not in os.environ
    loose.unlink(missing_ok=True)
