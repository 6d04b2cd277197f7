"""Test helpers: run real processes with a deadline, kill their whole process group."""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tests" / "scripts"
FAKE_NVML = REPO / "tests" / "fake_nvml"
EXAMPLES = REPO / "examples"
GEMINI = (sys.executable, "-m", "gemini_cli")
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run(cmd: Sequence[str], *, timeout: float = 120, env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None, stdin: IO[Any] | None = None) -> Done:
    """Run ``cmd`` in its own process group; on timeout kill the group and fail."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(env) if env is not None else None,
                            cwd=cwd, start_new_session=True, stdin=stdin)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {cmd}\n{out}\n{err}") from None
    finally:
        kill_group(proc)
    return Done(proc.returncode, out, err)


def start(cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
          cwd: str | Path | None = None, stdout: int | None = subprocess.PIPE) -> subprocess.Popen[str]:
    """Start ``cmd`` in its own process group (stop it with :func:`kill_group`)."""
    return subprocess.Popen(list(cmd), stdout=stdout, stderr=subprocess.STDOUT, text=True,
                            env=dict(env) if env is not None else None, cwd=cwd,
                            start_new_session=True)


def read_lines(proc: subprocess.Popen[str], sink: list[str]) -> threading.Thread:
    """Append ``proc``'s output lines to ``sink`` as they come, from a daemon thread."""
    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.append(line)
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


T = TypeVar("T")


class TimedOut(AssertionError):
    """What :func:`poll` raises when its condition did not come true in time."""


def poll(predicate: Callable[[], T], timeout: float, what: str, *, interval: float = 0.05,
         by: float = float("inf"), details: Callable[[], str] | None = None) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something true, and
    return that. Past ``timeout`` seconds (or the monotonic time ``by``), after one last
    call, fail with :class:`TimedOut` naming ``what``, followed by ``details()``."""
    deadline = min(time.monotonic() + timeout, by)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            message = f"timed out after {timeout:g} s waiting for {what}"
            raise TimedOut(message + ("\n" + details() if details is not None else ""))
        time.sleep(interval)


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL everything left in ``proc``'s process group (idempotent)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants at once, as a host failure would (torch
    elastic starts workers in sessions of their own, out of reach of :func:`kill_group`)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def env_with(tmp: Path, **extra: str) -> dict[str, str]:
    """The test environment: a private run root, small thread counts, ``extra`` on top."""
    env = dict(os.environ)
    env.update({"GEMINI_RUN_ROOT": str(tmp / "runs"), "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def events(run_root: Path) -> list[dict[str, object]]:
    """Every event of every run under ``run_root``, in file order."""
    from launcher.events import EVENTS_FILE, read_events

    found: list[dict[str, object]] = []
    for path in sorted(run_root.glob(f"*/{EVENTS_FILE}")):
        found.extend(read_events(path.parent))
    return found


def assert_one_copy(outputs: list[str], nproc: int) -> None:
    """Each run's host slots held one copy of the state (train scripts' --report-slots),
    plus each rank's random states and small values, and alignment: not one per rank
    (``nproc`` ranks on the host)."""
    for output in outputs:
        found = re.search(r"^slots bytes=(\d+) state=(\d+)$", output, re.M)
        assert found, output[-3000:]
        held, state = map(int, found.groups())
        assert state <= held < 1.1 * state + nproc * (16 << 10), (held, state)


def log_ettr(path: Path) -> tuple[float, int, float]:
    """ETTR by the workload's own log (train_ckpt.py --step-log): the steps of the run
    (0 to the newest, each counted once: a step whose process was killed right after its
    save is not logged, but done), at its median step time (two consecutive steps of one
    process), over the time from its first start to its last step; and the steps and
    wall time."""
    lines = [line.split() for line in path.read_text().splitlines()]
    first = float(lines[0][-1])
    done: dict[int, float] = {}
    durations, previous = [], None
    for line in lines:
        if line[0] == "start":
            previous = None
            continue
        step, at = int(line[1]), float(line[2])
        if previous is not None and step == previous[0] + 1:
            durations.append(at - previous[1])
        previous = (step, at)
        done[step] = at
    wall = max(done.values()) - first
    steps = max(done) + 1
    return steps * statistics.median(durations) / wall, steps, wall
