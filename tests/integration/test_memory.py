"""Shared-memory slots and the worker hook with other processes: a child's RNG, a
supervisor that died, `gemini inspect`, another user's and other processes' attempts on
a run's names and its slot socket. The in-process tests are in tests/unit/test_memory.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from memory_support import _save_two_steps, run_id, supervisor

from launcher import memory
from launcher.errors import StorageError
from launcher.slots import SlotOwner, SlotServer, clean, find_leftovers

__all__ = ["run_id", "supervisor"]  # fixtures (memory_support), used by name


def test_numpy_rng_state_is_kept_once_numpy_random_is_loaded() -> None:
    """torch imports numpy but not numpy.random; numpy's global RNG is captured from the
    moment something loads it, and restored exactly."""
    code = """
import sys
from launcher import rng
assert "numpy.random" not in sys.modules, "numpy.random loaded at start"
assert "numpy" not in rng.capture({})
import numpy
numpy.random.seed(7)
numpy.random.rand(3)
state = rng.capture({})
drawn = numpy.random.rand(2)
assert not (numpy.random.rand(2) == drawn).all()
rng.restore(state)
assert (numpy.random.rand(2) == drawn).all()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


_DIE_WITH_SEGMENTS = """
import os, sys
from launcher import memory
from launcher.slots import SlotOwner
owner = SlotOwner(run_id=sys.argv[1], host_id="h0", local_world_size=1)
owner.allocate(0, 1 << 16)
memory.create_segment(memory.heartbeat_name(owner.prefix), memory.HEARTBEAT_STRIDE)
os._exit(0)  # like SIGKILL: no cleanup
"""


def test_adoption_and_clean_of_dead_owner(run_id: str) -> None:
    subprocess.run([sys.executable, "-c", _DIE_WITH_SEGMENTS, run_id], check=True, timeout=60)
    prefix = memory.segment_prefix(run_id, "h0")
    left = memory.list_segments(prefix)
    assert len(left) == 5  # two slots, their pins, the heartbeats (launcher.health), the owner
    assert prefix in find_leftovers()
    owner = SlotOwner(run_id=run_id, host_id="h0", local_world_size=1)  # adopts
    assert prefix not in find_leftovers()  # live owner now
    second = subprocess.run([sys.executable, "-c",
                             "import sys; from launcher.slots import SlotOwner; "
                             "SlotOwner(run_id=sys.argv[1], host_id='h0', local_world_size=1)",
                             run_id], capture_output=True, text=True, timeout=60)
    assert second.returncode != 0 and "already has a live supervisor" in second.stderr
    owner._slots.clear()  # forget without unlinking, then die like a killed supervisor
    os.unlink(memory.SHM_DIR / (prefix + "owner"))
    held = sum((memory.SHM_DIR / n).stat().st_size for n in left if not n.endswith("owner"))
    other = SlotOwner(run_id=run_id + "-next", host_id="h0", local_world_size=1)
    try:
        with pytest.raises(StorageError) as error:
            other.check_capacity(0, memory.shm_free_bytes() + (1 << 30))
    finally:
        other.close()
    said = re.search(r"available \((\d+) more are held by the segments of dead runs: "
                     r"`gemini clean` frees them\)", str(error.value))
    assert said and int(said.group(1)) >= held, error.value  # other dead runs may hold more
    removed = clean()
    assert sorted(removed[prefix]) == sorted(n for n in left if not n.endswith("owner"))
    assert memory.list_segments(prefix) == []


def test_inspect_command_reports_and_verifies(supervisor: SlotServer) -> None:
    import json

    from helpers import GEMINI, run

    _save_two_steps()
    run_id = supervisor.owner.run_id
    done = run([*GEMINI, "inspect", "--run-id", run_id, "--json", "--tensors"])
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["schema"] == "gemini.inspect/v1"
    slots = {s["step"]: s for s in report["slots"]}
    assert set(slots) == {0, 1} and all(s["verified"] for s in slots.values())
    assert "/model/0.weight" in [t["path"] for t in slots[1]["tensors"]]
    # printed into a pipe (a log): every column whole, not cut to 80 columns
    piped = run([*GEMINI, "inspect", "--run-id", run_id], env={**os.environ, "COLUMNS": "80"})
    header = next(line for line in piped.stdout.splitlines() if "rank" in line)
    assert re.findall(r"\w+", header) == ["run", "rank", "copy", "slot", "state", "step",
                                           "tensors", "data", "size", "check"], piped.stdout
    assert piped.stdout.count("COMMITTED") == 2 and re.search(r" \d+\.\d KiB ", piped.stdout)
    # An empty file and a directory under slot names: each reported, none hides the rest.
    empty = memory.shm_dir() / memory.slot_name(supervisor.owner.prefix, 7, 0)
    folder = memory.shm_dir() / memory.slot_name(supervisor.owner.prefix, 7, 1)
    empty.touch(mode=0o600)
    folder.mkdir()
    try:
        done = run([*GEMINI, "inspect", "--run-id", run_id, "--json"])
        report = json.loads(done.stdout)
        assert done.returncode == 0, done.output
        bad = [s for s in report["slots"] if s["rank"] == 7]
        assert [s["slot"] for s in bad] == [0, 1] and all(s["error"] for s in bad)
        assert {s["step"] for s in report["slots"] if s["rank"] != 7} == {0, 1}
        assert run([*GEMINI, "inspect", "--run-id", run_id]).returncode == 0
    finally:
        empty.unlink()
        folder.rmdir()
    newest = memory.attach_segment(slots[1]["segment"])
    newest.view[memory.HEADER_SIZE + 3] ^= 0x40
    newest.close()
    done = run([*GEMINI, "inspect", "--run-id", run_id, "--json"])
    errors = {s["step"]: s["error"] for s in json.loads(done.stdout)["slots"]}
    assert done.returncode == 5 and "checksum mismatch" in errors[1] and errors[0] is None
    assert run([*GEMINI, "inspect", "--run-id", run_id]).returncode == 5


# -- a hostile user on the same host ------------------------------------------------------
def _as_other_user(*cmd: str) -> None:
    """Run ``cmd`` as another user (nobody), as a neighbour on a shared host would."""
    subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *cmd],
                   check=True, timeout=30)


def test_names_taken_by_another_user_or_a_link_are_skipped(tmp_path: Any) -> None:
    """Another user squats the private directory's name and plants a link under the
    next one: gemini opens neither, writes nothing where the link points, and trains in
    the next free name, a directory of its own, removed when the run ends."""
    import shutil
    import tempfile

    from helpers import GEMINI, SCRIPTS, env_with, run

    # where the other user can reach it (pytest's tmp_path is private to this one)
    base = Path(tempfile.mkdtemp(prefix="gtest-hostile-",
                                 dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        os.chmod(base, 0o1777)  # as /dev/shm
        uid = os.geteuid()
        squatted = base / f"gemini-{uid}"
        if uid == 0:
            _as_other_user("mkdir", "-m", "0777", str(squatted))
        else:  # without root: a directory of ours, but open to everyone
            squatted.mkdir()
            os.chmod(squatted, 0o777)
        victim = tmp_path / "victim"
        victim.write_bytes(b"precious")
        (base / f"gemini-{uid}-1").symlink_to(victim)
        done = run([*GEMINI, "run", "--nproc-per-node", "2", "--no-standby", "--max-restarts", "1",
                    str(SCRIPTS / "train_ckpt.py"), "--steps", "6", "--kill", "1:3:step"],
                   env=env_with(tmp_path, GEMINI_SHM_DIR=str(base)), timeout=180)
        assert done.returncode == 0, done.output[-3000:]
        assert "resume rank=1 start=4 attempt=1" in done.output, done.output[-3000:]
        assert victim.read_bytes() == b"precious" and list(squatted.iterdir()) == []
        assert "ignoring" in done.output and f"gemini-{uid}-2" not in done.output
        assert not (base / f"gemini-{uid}-2").exists()  # used, then released at the end
    finally:
        shutil.rmtree(base, ignore_errors=True)


_ALLOC = """
import json, os, socket, sys, time
address = sys.argv[1]
if sys.argv[2] == "orphan":  # the child is adopted by init: not a worker
    parent = os.getpid()
    if os.fork():
        os._exit(0)
    while os.getppid() == parent:
        time.sleep(0.01)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect("\\0" + address[1:])
try:
    sock.sendall(json.dumps({"op": "alloc", "rank": int(sys.argv[3]), "nbytes": 1 << 40}).encode()
                 + b"\\n")
except BrokenPipeError:  # refused before the request was sent: the refusal is there to read
    pass
print(sock.makefile().readline(), flush=True)
"""


@pytest.mark.parametrize("who", ["other-user", "orphan", "wrong-rank"])
def test_the_slot_socket_serves_only_this_supervisors_workers(supervisor: SlotServer,
                                                              tmp_path: Any, who: str) -> None:
    """Another user's process, a process of this user that is not one of the workers,
    and a worker asking for a rank this host does not run: each is refused, nothing is
    allocated, and the service never counts as failed."""
    if who == "other-user" and os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    supervisor.ranks = frozenset({0})
    cmd = [sys.executable, "-c", _ALLOC, supervisor.env_address,
           "orphan" if who == "orphan" else "child", "7" if who == "wrong-rank" else "0"]
    if who == "other-user":
        cmd = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *cmd]
    reader, writer = os.pipe()
    subprocess.run(cmd, stdout=writer, timeout=60, check=True, cwd="/",
                   env={**os.environ, "PYTHONPATH": ""})
    os.close(writer)  # the orphan keeps its copy until it has answered
    with os.fdopen(reader) as replies:
        reply = json.loads(replies.readline())
    assert reply["ok"] is False, reply
    want = {"other-user": "uid 65534", "orphan": "not one of this supervisor's workers",
            "wrong-rank": "rank 7 does not run on this host"}[who]
    assert want in reply["error"], reply
    assert supervisor.fatal is None
    assert memory.list_segments(supervisor.owner.prefix) == [
        n for n in memory.list_segments(supervisor.owner.prefix) if n.endswith("owner")]


_FLOOD = """
import socket, sys
for _ in range(int(sys.argv[2])):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\\0" + sys.argv[1][1:])
    sock.makefile().readline()
    sock.close()
print("done", flush=True)
"""


def test_a_flood_of_refused_connections_is_logged_in_a_few_lines(supervisor: SlotServer,
                                                                  caplog: Any) -> None:
    """Anyone on the host can connect to the slot socket: 300 refused connections in a
    row write at most a window's worth of log lines, not one each."""
    import logging

    cmd = [sys.executable, "-c", _FLOOD, supervisor.env_address, "300"]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *cmd]
    with caplog.at_level(logging.WARNING, logger="launcher.slots"):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/",
                              env={**os.environ, "PYTHONPATH": ""})
        assert done.stdout.strip() == "done", done.stderr[-2000:]
        time.sleep(0.2)
    refused = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert 1 <= len(refused) <= 10, len(refused)
    assert supervisor.fatal is None
