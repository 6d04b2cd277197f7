"""Stragglers with simulated hosts: one host's worker slowed by a SIGSTOP/SIGCONT duty
cycle is found and, with ``--replace-stragglers`` and a ready spare, replaced; a healthy
run with evaluation pauses, persist writes and a jittery data loader on every rank blames
no host."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from etcd_server import EtcdServer
from helpers import GEMINI, SCRIPTS, env_with, events, kill_group, run
from hosts import Host, wait_exit, wait_for

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(400)]
TRAIN = (str(SCRIPTS / "train_ckpt.py"), "--grad-sync", "params", "--width", "256",
         "--depth", "4", "--sleep", "0.03")


def _argv(etcd: EtcdServer, tmp: Path, *extra: str, steps: int) -> list[str]:
    return [*GEMINI, "run", "--nnodes", "3:3", "--nproc-per-node", "1", "--rdzv-backend",
            "etcd-v3", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "slow", "--rdzv-conf",
            "last_call_timeout=1", "--store", etcd.url, "--max-restarts", "3",
            "--replication-addr", "127.0.0.1", *extra, *TRAIN, "--steps", str(steps)]


def _step_times(host: Host) -> dict[int, float]:
    """When each step line of ``host``'s rank 0 was written (its log, read afterwards:
    the lines carry no time, so they are stamped by polling while the run goes on)."""
    return {int(m.group(1)): t for t, line in getattr(host, "stamped", [])
            for m in [re.match(r"step (\d+) ", line)] if m}


class _Stamps(threading.Thread):
    """Stamps each new line of the hosts' logs with the time it was first seen."""

    def __init__(self, hosts: list[Host]) -> None:
        super().__init__(daemon=True)
        self.hosts, self.stop = hosts, threading.Event()

    def run(self) -> None:
        seen: dict[str, int] = {}
        while not self.stop.wait(0.05):
            for host in list(self.hosts):  # hosts added later too
                lines = host.output().splitlines()
                new = lines[seen.get(host.name, 0):]
                seen[host.name] = len(lines)
                now = time.time()
                if not hasattr(host, "stamped"):
                    host.stamped = []  # type: ignore[attr-defined]
                host.stamped.extend((now, line) for line in new)  # type: ignore[attr-defined]


def _duty_cycle(pid: int, stop: threading.Event, *, off: float, on: float) -> None:
    """SIGSTOP ``pid`` for ``off`` s out of every ``off + on`` until it is gone."""
    while not stop.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(off)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep(on)


def test_a_slowed_host_is_reported_then_replaced_by_the_spare(tmp_path: Path) -> None:
    """Three hosts and a ready spare, a 10 s window (the default 20 s window takes 25-40 s,
    benchmarks/straggler_bench.py): the host whose worker is stopped half the time is
    reported (event and `gemini status`) within 60 s, naming it; it
    leaves the job (exit 6), the spare takes its node slot, and the step rate comes back
    to at least 0.8x the healthy one."""
    hosts: list[Host] = []
    stop = threading.Event()
    with EtcdServer() as etcd:
        argv = _argv(etcd, tmp_path, "--replace-stragglers", "--straggler-window", "10",
                     steps=100000)
        try:
            hosts = [Host(tmp_path, f"h{i}", argv) for i in range(3)]
            stamps = _Stamps(hosts)
            stamps.start()
            wait_for(lambda: len({e["host"] for e in events(tmp_path / "runs")
                                  if e["event"] == "start"}) == 3, 120, "three hosts", hosts)
            hosts.append(Host(tmp_path, "spare", argv))
            wait_for(lambda: _ready_spares(etcd, tmp_path) == ["spare"], 120,
                     "the spare to be ready", hosts)
            slots = {int(e["group_rank"]): str(e["host"]) for e in events(tmp_path / "runs")  # type: ignore[call-overload]
                     if e["event"] == "rendezvous"}
            rank0, victim = (next(h for h in hosts if h.name == slots[i]) for i in (0, 1))
            time.sleep(5)
            healthy = _rate(rank0, time.time() - 5, time.time())
            assert healthy > 2, healthy  # steps per second
            worker = [e for e in events(tmp_path / "runs")
                      if e["event"] == "start" and e["host"] == victim.name][-1]
            slowed = time.time()
            threading.Thread(target=_duty_cycle, args=(int(worker["workers"][0]["pid"]), stop),  # type: ignore[index]
                             kwargs={"off": 0.06, "on": 0.06}, daemon=True).start()
            wait_for(lambda: _straggler_events(tmp_path), 60, "a straggler report", hosts)
            reported = _straggler_events(tmp_path)[0]
            assert reported["straggler"] == victim.name, reported
            assert float(reported["ts"]) - slowed <= 60, reported  # type: ignore[arg-type]
            wait_exit([victim], hosts)
            assert victim.proc.returncode == 6, victim.output()[-3000:]
            assert "straggler" in victim.output()
            wait_for(lambda: any(e["event"] == "start" and e["host"] == "spare"
                                 for e in events(tmp_path / "runs")), 60, "the spare", hosts)
            rejoined = time.time()
            wait_for(lambda: time.time() > rejoined + 12, 30, "steps with the spare", hosts)
            recovered = _rate(rank0, rejoined + 4, rejoined + 12)
            slow = _rate(rank0, float(reported["ts"]) - 5, float(reported["ts"]))  # type: ignore[arg-type]
            assert slow < 0.8 * healthy, (slow, healthy)  # the duty cycle slowed everyone
            assert recovered >= 0.8 * healthy, (recovered, healthy)
        finally:
            stop.set()
            for host in hosts:
                kill_group(host.proc)
                try:
                    os.kill(host.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass


def _rate(host: Host, since: float, until: float) -> float:
    """Steps per second of ``host``'s rank 0 between two times."""
    times = sorted(t for t in _step_times(host).values() if since <= t <= until)
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 else 0.0


def _straggler_events(tmp: Path) -> list[dict[str, object]]:
    return [e for e in events(tmp / "runs") if e["event"] == "straggler"]


def _ready_spares(etcd: EtcdServer, tmp: Path) -> list[str]:
    shown = run([*GEMINI, "status", "--store", etcd.url, "--run-id", "slow", "--json"],
                env=env_with(tmp))
    return list(json.loads(shown.stdout)["ready_spares"]) if shown.returncode == 0 else []


@pytest.mark.parametrize("minutes", [
    0, pytest.param(10, marks=[pytest.mark.long, pytest.mark.timeout(1800)])],
    ids=["two-windows", "10-minutes"])
def test_pauses_persists_and_a_slow_loader_everywhere_blame_no_host(
        tmp_path: Path, minutes: int) -> None:
    """A healthy run of three hosts whose every rank has a jittery data loader, pauses
    1.5 s for an evaluation every 40 steps and persists every 10 steps: no straggler, and
    `gemini status` shows every host's pace near 1x. The suite's run spans two windows
    of the default 20 s; the long one (``bash tests/run.sh long``) trains for at least
    10 minutes, 30 windows."""
    hosts: list[Host] = []
    with EtcdServer() as etcd:
        argv = _argv(etcd, tmp_path, "--persist-dir", str(tmp_path / "persist"),
                     "--persist-every", "10", steps=4500 if minutes else 260)
        argv += ["--loader-jitter", "0.06", "--pause-every", "40:1.5"]
        try:
            hosts = [Host(tmp_path, f"h{i}", argv) for i in range(3)]
            wait_for(lambda: sum(1 for f in (tmp_path / "persist").rglob("*") if f.is_file())
                     > 3, 120, "persisted steps", hosts)
            began = time.monotonic()
            time.sleep(22)  # more than a window
            shown = run([*GEMINI, "status", "--store", etcd.url, "--run-id", "slow", "--json"],
                        env=env_with(tmp_path))
            verdict = json.loads(shown.stdout)["stragglers"]
            wait_for(lambda: all(h.proc.poll() is not None for h in hosts), 300 + 90 * minutes,
                     "the run to end", hosts)
            trained = time.monotonic() - began
            assert all(h.proc.returncode == 0 for h in hosts), hosts[0].output()[-3000:]
        finally:
            for host in hosts:
                kill_group(host.proc)
    assert not _straggler_events(tmp_path)
    assert verdict and len(verdict["scores"]) == 3, verdict
    assert all(0.75 < s < 1.25 for s in verdict["scores"].values()), verdict
    assert trained >= 60 * minutes, f"trained {trained:.0f} s: give the long run more steps"
