"""Replication pacing: the idle gate reads real processes' CPU time; the pacer waits for
idle workers and falls back to a rate when they never idle."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from launcher.priority import IDLE_WINDOW, IdleGate
from launcher.replication.service import _Pacer

BUSY = "import time\nend = time.time() + {busy}\nwhile time.time() < end: pass\ntime.sleep(60)"


Spawn = Callable[[float], "subprocess.Popen[bytes]"]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(busy: float) -> subprocess.Popen[bytes]:
        """A process that keeps a core busy for ``busy`` seconds, then sleeps."""
        proc = subprocess.Popen([sys.executable, "-c", BUSY.format(busy=busy)])
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def watching(proc: subprocess.Popen[bytes], cpus: int = 2) -> IdleGate:
    """A gate on ``proc`` (on a host of ``cpus`` cores), once its interpreter is up."""
    time.sleep(0.3)
    gate = IdleGate(cpus=cpus)
    gate.watch([proc.pid])
    return gate


def answers(gate: IdleGate, seconds: float) -> list[bool]:
    found = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        found.append(gate.idle())
        time.sleep(IDLE_WINDOW / 2)
    return found


def test_idle_gate_tells_busy_processes_from_idle_ones(spawn: Spawn) -> None:
    assert IdleGate.available()
    busy, sleeper = spawn(60), spawn(0)
    time.sleep(0.5)  # both interpreters started
    gate = IdleGate(cpus=2)
    gate.watch([busy.pid, sleeper.pid])
    assert not any(answers(gate, 0.3))
    gate.watch([sleeper.pid])
    seen = answers(gate, 0.3)
    assert not seen[0]  # a fresh window first
    assert all(seen[len(seen) // 2:])
    busy.kill()
    busy.wait()
    gate.watch([busy.pid])  # gone: nothing to protect
    assert answers(gate, 0.1)[-1]
    gate.watch([])
    assert gate.idle()


def test_idle_gate_counts_spare_cores_as_idle(spawn: Spawn) -> None:
    """On a host with cores to spare (a GPU host whose workers spin while they wait),
    busy workers leave room: only workers that fill all but two cores count as busy."""
    busy = spawn(60)
    roomy, full = watching(busy, cpus=4), watching(busy, cpus=2)
    assert answers(roomy, 0.2)[-1]
    assert not any(answers(full, 0.2))


def test_pacer_sends_once_the_workers_idle(spawn: Spawn) -> None:
    gate = watching(spawn(1.0))
    began = time.monotonic()
    pacer = _Pacer(gate, rate=1e3, until=began + 10, stop=threading.Event())
    assert pacer.wait_idle()
    assert 0.3 < time.monotonic() - began < 5
    began = time.monotonic()
    for sent in range(0, 10_000_000, 1_000_000):  # idle: no rate applies (1 kB/s here)
        pacer(sent)
    assert time.monotonic() - began < 1


def test_pacer_falls_back_to_the_rate_when_workers_never_idle(spawn: Spawn) -> None:
    gate = watching(spawn(60))
    began = time.monotonic()
    pacer = _Pacer(gate, rate=1e6, until=began + 0.3, stop=threading.Event())
    pacer(0)
    assert 0.29 < time.monotonic() - began < 2
    began = time.monotonic()
    for sent in (100_000, 200_000, 300_000, 0, 100_000):  # the last two: a second holder
        pacer(sent)
    assert 0.35 < time.monotonic() - began < 2  # 400 kB at 1 MB/s
    assert not pacer.wait_idle()  # past its time: no more waiting for idle workers
