"""Test helper: simulated hosts on one machine, each a ``gemini run`` with its own memory.

A host's shared memory is a private tmpfs on /dev/shm in its own mount namespace when the
tests run as root (so killing the host's processes really frees its memory), else its own
GEMINI_SHM_DIR, deleted on kill.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import torch
from helpers import env_with, kill_group, kill_tree, poll

ROOT = os.geteuid() == 0


class Host:
    """One simulated host: a ``gemini run`` with private shared memory and an output file."""

    def __init__(self, tmp: Path, name: str, argv: list[str], *, private_mount: bool = True
                 ) -> None:
        """Start ``argv`` as host ``name``. Without ``private_mount`` its memory is a plain
        directory that outlives it (for a host that exits and is started again)."""
        self.name = name
        self.log = tmp / f"{name}.log"
        self.shm = tmp / f"{name}-shm"
        self.shm.mkdir(exist_ok=True)
        env = env_with(tmp, GEMINI_HOST_ID=name, GEMINI_SHM_DIR=str(self.shm))
        cmd = " ".join(shlex.quote(a) for a in argv)
        self.private_mount = ROOT and private_mount
        if self.private_mount:  # a private tmpfs: the memory dies with the mount namespace
            cmd = f"mount -t tmpfs -o size=512m tmpfs {shlex.quote(str(self.shm))} && exec {cmd}"
            argv = ["unshare", "--mount", "sh", "-c", cmd]
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True,
                                         env=env, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """The whole host at once: supervisor, workers (in sessions of their own) and
        its memory."""
        kill_tree(self.proc.pid)
        kill_group(self.proc)
        self.proc.wait(timeout=30)
        if not self.private_mount:
            shutil.rmtree(self.shm, ignore_errors=True)


def wait_for(predicate, timeout: float, what: str, hosts: list[Host],  # type: ignore[no-untyped-def]
          by: float = float("inf")) -> None:
    """Wait until ``predicate()``, at most ``timeout`` seconds and not past the monotonic
    time ``by``; on timeout fail with the tail of every host's output."""
    poll(predicate, timeout, what, interval=0.2, by=by,
         details=lambda: "\n".join(f"--- {h.name}\n{h.output()[-2500:]}" for h in hosts))


def wait_exit(waited: list[Host], hosts: list[Host], by: float = float("inf")) -> None:
    """Wait until every host of ``waited`` has exited (at most 300 s each); on timeout
    fail with the tail of every host of ``hosts``' output."""
    for host in waited:
        wait_for(lambda h=host: h.proc.poll() is not None, 300, f"{host.name} to exit",
                 hosts, by)


def assert_bitwise(got: dict, want: dict) -> None:
    for key in ("model", "opt"):
        flat_got, flat_want = tensors(got[key]), tensors(want[key])
        assert flat_got.keys() == flat_want.keys()
        for name, tensor in flat_want.items():
            assert torch.equal(flat_got[name], tensor), f"{key} {name} differs"
    assert got["samples"] == want["samples"]
    assert torch.equal(got["rng"], want["rng"])


def tensors(tree: object, path: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {path: tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in tensors(value, f"{path}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in tensors(value, f"{path}/{i}").items()}
    return {}
