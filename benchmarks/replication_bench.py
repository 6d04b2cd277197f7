"""Cross-host replication, in one run: throughput, training slowdown, host-loss recovery.

Several `gemini run` supervisors on this machine stand in for hosts (one worker each,
gloo over loopback). Printed, side by side with their baselines:

1. replication throughput vs raw loopback TCP (``transport_bench``; target >= 0.7x);
2. the training-step slowdown while every step is replicated to the peer, with and
   without pacing, against the same job with replication off (``--replicas 1``);
   target <= 5% with pacing; and with the persistent tier written every step instead
   (to this machine's disk), to show that the persistent writer does not stall training.
   Measured twice: CPU-bound (both cores train, nothing is left for replication) and
   with each step also waiting ``DEVICE_TIME`` seconds with the CPU free
   (``--device-time``), a stand-in for a GPU host, whose CPU idles while the GPU computes;
3. the steps redone after killing a whole host (the newest step completed before the
   kill minus the step restored) and the time from the kill to the first completed
   step after restore, split into detection (the survivor's worker fails), rendezvous
   (the replacement host joins; torch's dynamic rendezvous drops the dead host after
   its keep-alive expires), transfer (the replacement pulls its shard) and load + first
   step; next to the same recovery from the persistent tier on local disk
   (``--replicas 1 --persist-dir``, persisted every step). Each step here sleeps 0.2 s,
   standing in for GPU compute that leaves the host's CPU free for replication (on
   these two CPU-bound cores, paced replication of this state lags a few steps behind,
   see part 2, and a host loss then costs those steps).

    python benchmarks/replication_bench.py --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import machine, table  # noqa: E402
from helpers import kill_tree  # noqa: E402
from transport_bench import bench_size, parse_size  # noqa: E402

EXAMPLE = str(HERE.parent / "examples" / "train_gpt.py")
MODEL = ["--n-embd", "384", "--n-layer", "4", "--n-head", "6", "--batch-size", "4"]
GEMINI = [sys.executable, "-m", "gemini_cli", "run"]
IDLE = 0.2  # seconds each host-loss step sleeps: GPU time, during which the CPU is free
DEVICE_TIME = 0.2  # seconds of stand-in GPU time per step in part 2's second setting
STANDBY_READY = 5.0  # seconds a spare waits before the kill: its standbys import torch


class Host:
    """One `gemini run` whose output lines are time-stamped as they arrive."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip()))

    def first(self, pattern: str, after: float = 0.0) -> float | None:
        return next((t for t, line in list(self.lines) if t > after and re.search(pattern, line)),
                    None)

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def kill(self) -> None:
        """The whole host: the supervisor and its workers (in sessions of their own)."""
        kill_tree(self.proc.pid)
        self.proc.wait()

    def wait(self, timeout: float) -> None:
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        if self.proc.returncode != 0:
            raise RuntimeError(f"host failed ({self.proc.returncode}):\n{self.output()[-3000:]}")


def _events(run_root: Path) -> list[dict[str, object]]:
    found = []
    for path in run_root.glob("*/events.jsonl"):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(found, key=lambda e: float(e["ts"]))  # type: ignore[arg-type]


# -- 2. training slowdown -------------------------------------------------------------------

def step_ms(mode: list[str], steps: int, device_time: float = 0.0
            ) -> tuple[float, float, float]:
    """Median step time of rank 0 with two one-worker hosts on a c10d rendezvous, the
    share of the steps due for replication that reached the peer (pushes coalesce to the
    newest step when replication falls behind), and the longest time rank 0's loop was
    blocked in gemini's calls in one step (``save()`` and the wait for a copy before the
    optimizer step; the example's ``max_stall_ms``)."""
    with tempfile.TemporaryDirectory() as tmp, _shm() as shm:
        port = _free_port()
        env = dict(os.environ, GEMINI_RUN_ROOT=f"{tmp}/runs", PYTHONWARNINGS="ignore")
        hosts = []
        for i in range(2):
            argv = [*GEMINI, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "slowdown",
                    "--replication-addr", "127.0.0.1", "--no-standby",
                    *[m.replace("{tmp}", tmp) for m in mode], EXAMPLE, "--steps", str(steps),
                    "--device-time", str(device_time), *MODEL]
            hosts.append(Host(argv, dict(env, GEMINI_HOST_ID=f"h{i}",
                                         GEMINI_SHM_DIR=_shm_dir(shm, i))))
        for host in hosts:
            host.wait(timeout=900)
        text = "\n".join(h.output() for h in hosts)
        match = re.search(r"median_step_ms=([\d.]+)", text)
        stall = re.search(r"max_stall_ms=([\d.]+)", text)
        if not match or not stall:
            raise RuntimeError(text[-3000:])
        pushes = sum(int(e.get("pushes", 0)) for e in _events(Path(tmp, "runs"))  # type: ignore[call-overload]
                     if e["event"] == "replication_done")
        every = int(mode[mode.index("--replicate-every") + 1]) if "--replicate-every" in mode else 1
        return (float(match.group(1)), pushes / (len(hosts) * (steps // every)),
                float(stall.group(1)))


def _shm() -> tempfile.TemporaryDirectory[str]:
    """Where the simulated hosts keep their slots: tmpfs, like /dev/shm itself."""
    return tempfile.TemporaryDirectory(dir="/dev/shm", prefix="bench-")


def _shm_dir(root: str, i: int) -> str:
    path = Path(root) / f"host{i}"
    path.mkdir(exist_ok=True)
    return str(path)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- 3. host-loss recovery ------------------------------------------------------------------

def host_loss(mode: list[str], etcd_endpoint: str, etcd_url: str, spare: bool = False
              ) -> dict[str, float]:
    """Kill the host in node slot 1 after step 10 and time the phases until rank 0
    completes its first step after the restore. The host that takes its place is started
    at the kill, or with ``spare`` is a spare that has been waiting (its standby workers
    ready) since before it."""
    with tempfile.TemporaryDirectory() as tmp, _shm() as shm:
        run_root = Path(tmp) / "runs"
        env = dict(os.environ, GEMINI_RUN_ROOT=str(run_root), PYTHONWARNINGS="ignore")
        run_id = f"loss-{os.getpid()}-{time.monotonic_ns()}"

        def host(name: str, i: int) -> Host:
            argv = [*GEMINI, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3",
                    "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id,
                    "--rdzv-conf", "last_call_timeout=1", "--store", etcd_url,
                    "--max-restarts", "3", "--replication-addr", "127.0.0.1",
                    *[m.replace("{tmp}", tmp) for m in mode], EXAMPLE, "--steps", "40",
                    "--sleep", str(IDLE), *MODEL]
            return Host(argv, dict(env, GEMINI_HOST_ID=name, GEMINI_SHM_DIR=_shm_dir(shm, i)))

        hosts = {"h0": host("h0", 0), "h1": host("h1", 1)}
        deadline = time.monotonic() + 300
        slots: dict[int, str] = {}
        while len(slots) < 2 or not any(h.first(r"^step 1\d ") for h in hosts.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("no progress:\n" + "\n".join(h.output()[-2000:] for h in hosts.values()))
            slots = {int(e["group_rank"]): str(e["host"]) for e in _events(run_root)  # type: ignore[call-overload]
                     if e["event"] == "rendezvous"}
            time.sleep(0.1)
        survivor, victim = hosts[slots[0]], hosts[slots[1]]
        if spare:
            replacement = host("new", 2)
            _wait_for_spare(etcd_url, run_id, deadline)
            time.sleep(STANDBY_READY)
        killed = time.time()
        victim.kill()
        if not spare:
            replacement = host("new", 2)
        survivor.wait(timeout=600)
        replacement.wait(timeout=60)
        resumed = survivor.first(r"^resumed at step", after=killed) or killed
        first_step = survivor.first(r"^step \d+ ", after=resumed)
        events = _events(run_root)
        failed = next(float(e["ts"]) for e in events  # type: ignore[arg-type]
                      if e["event"] == "worker_exit" and e["host"] == slots[0] and float(e["ts"]) > killed)  # type: ignore[arg-type]
        plan = next(e for e in events if e["event"] == "restore_plan" and e["host"] == "new")
        transfer = float(plan["transfer_seconds"])  # type: ignore[arg-type]
        planned = float(plan["ts"])  # type: ignore[arg-type]
        if first_step is None:
            raise RuntimeError(survivor.output()[-3000:])
        want = "persist" if "--persist-dir" in mode else "peer"
        if set(plan["sources"].values()) != {want}:  # type: ignore[union-attr]
            plans = [e for e in events if e["event"] in ("restore_plan", "replication_failed")]
            raise RuntimeError(f"expected a restore from {want}: {plans}\n{survivor.output()[-3000:]}")
        done = [int(m.group(1)) for t, line in list(survivor.lines) if t <= killed
                and (m := re.match(r"step (\d+) ", line))]
        restored = plan["step"] if plan["step"] is not None else -1
        return {"steps redone": max(done, default=-1) - int(restored),  # type: ignore[call-overload]
                "detection": failed - killed, "rendezvous": planned - transfer - failed,
                "transfer": transfer, "load + first step": first_step - planned,
                "total": first_step - killed}


def _wait_for_spare(etcd_url: str, run_id: str, deadline: float) -> None:
    from launcher.coordination import read_status
    from launcher.store import open_store

    store = open_store(etcd_url)
    try:
        while read_status(store, run_id).spares != ["new"]:
            if time.monotonic() > deadline:
                raise RuntimeError("the spare did not register")
            time.sleep(0.1)
    finally:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256M,1G", help="slot sizes for the throughput table")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="steps per slowdown run")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: 1,2,3")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out: list[str] = [f"machine: {machine()}", f"medians of {args.repeat} runs", ""]

    def flush() -> None:
        print("\n".join(out), flush=True)
        out.clear()

    if "1" not in skip:
        rows = [bench_size(parse_size(text), args.repeat) for text in args.sizes.split(",")]
        out += ["1. replication throughput (receiver in another process, loopback TCP)", "",
                table(["slot", "raw TCP", "push (+ verify + commit)", "xxh3, one core",
                       "push / raw"], rows), ""]
        flush()

    if "2" not in skip:
        modes = {"replication off (--replicas 1)": ["--replicas", "1"],
                 "every step, no pacing": ["--replicas", "2", "--no-pace"],
                 "every step, paced": ["--replicas", "2", "--pace"],
                 "every 4th step, paced": ["--replicas", "2", "--pace", "--replicate-every", "4"],
                 "off, persisted every step instead": ["--replicas", "1", "--persist-dir",
                                                       "{tmp}/persist", "--persist-every", "1"]}
        settings = {"CPU-bound": 0.0, f"+{DEVICE_TIME} s device time": DEVICE_TIME}
        times: dict[tuple[str, str], list[float]] = {
            (name, setting): [] for setting in settings for name in modes}
        shares: dict[tuple[str, str], list[float]] = {key: [] for key in times}
        stalls: dict[tuple[str, str], list[float]] = {key: [] for key in times}
        for _ in range(args.repeat):
            for setting, device_time in settings.items():
                for name, mode in modes.items():  # interleaved: drift hits every mode alike
                    ms, share, stall = step_ms(mode, args.steps, device_time)
                    times[name, setting].append(ms)
                    shares[name, setting].append(share)
                    stalls[name, setting].append(stall)
        rows = []
        for name in modes:
            row: list[object] = [name]
            for setting in settings:
                base = statistics.median(times["replication off (--replicas 1)", setting])
                ours = statistics.median(times[name, setting])
                share = statistics.median(shares[name, setting])
                row += [f"{ours:.1f} ms", f"{100 * (ours / base - 1):+.1f}%",
                        f"{100 * share:.0f}%" if "--replicas 2" in " ".join(modes[name]) else "-",
                        f"{max(stalls[name, setting]):.1f} ms"]
            rows.append(row)
        header = ["replication"]
        for setting in settings:
            header += [f"step, {setting}", "vs off", "steps replicated", "longest stall"]
        out += [f"2. training step while replicating (example GPT, {' '.join(MODEL)}; 2 hosts x "
                f"1 worker; CPU-bound: both cores train; device time: each step also waits "
                f"{DEVICE_TIME} s with the CPU free, as for a GPU; longest stall: the most "
                f"rank 0's loop was blocked in gemini's calls in one step, over all runs)", "",
                table(header, rows), ""]
        flush()

    if "3" not in skip:
        from etcd_server import EtcdServer

        peer = ["--replicas", "2"]
        variants = {"peer memory, hot spare": (peer, True),
                    "peer memory, replacement started at the kill": (peer, False),
                    "persistent tier (local disk), replacement started at the kill": (
                        ["--replicas", "1", "--persist-dir", "{tmp}/persist", "--persist-every",
                         "1"], False)}
        phases = ("detection", "rendezvous", "transfer", "load + first step", "total")
        rows = []
        results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        with EtcdServer() as etcd:
            for _ in range(args.repeat):
                for name, (mode, spare) in variants.items():  # interleaved
                    results[name].append(host_loss(mode, etcd.endpoint, etcd.url, spare))
        ours = statistics.median(r["total"] for r in results["peer memory, hot spare"])
        for name, runs in results.items():
            medians = {k: statistics.median(r[k] for r in runs) for k in phases}
            redone = statistics.median(r["steps redone"] for r in runs)
            rows.append([name, f"{redone:g}", *(f"{medians[k]:.2f} s" for k in phases),
                         f"{medians['total'] / ours:.2f}x"])
        out += ["3. host kill -> first completed step after restore (2 hosts x 1 worker, etcd-v3 "
                f"rendezvous, {IDLE} s idle per step)", "",
                table(["restore from", "steps redone", *phases, "vs hot spare"], rows), ""]
    flush()


if __name__ == "__main__":
    main()
