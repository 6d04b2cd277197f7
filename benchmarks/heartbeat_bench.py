"""What heartbeats between supervisors cost each host, at 2, 8 and 32 simulated hosts.

Each simulated host is what a supervisor runs for heartbeats: its coordination service
(store lease, host record, watches), its replication transport server (which answers
pings) and its heartbeat service, all of them real and talking to a real etcd over
loopback; the hosts share this process (a supervisor's workers and torch play no part in
heartbeats). Every host says it runs; after a settling time the benchmark counts, for
``--window`` seconds:

* pings sent per host per second, and heartbeat threads per host (a pinger per pinged
  peer, plus one that follows who runs);
* transport connection threads per host (each pinger holds one connection open);
* store reads per host per second, and the keys they return.

Side by side with ``--baseline PATH``, another checkout of gemini (run in a subprocess
with that checkout first on the path).

    python benchmarks/heartbeat_bench.py --hosts 2,8,32 [--baseline PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TIMEOUT = 2.0  # --heartbeat-timeout: the hosts share this process and its two cores


def measure(nodes: int, window: float, settle: float) -> dict[str, float]:
    """One job of ``nodes`` simulated hosts in this process; the counts per host."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from etcd_server import EtcdServer

    from launcher.coordination import CoordinationService
    from launcher.events import EventLog
    from launcher.heartbeat import HeartbeatService
    from launcher.replication.transport import Client, Server
    from launcher.slots import SlotOwner
    from launcher.store import open_store

    secret, run_id = b"s" * 32, f"beat-{os.getpid()}"
    pings = [0]
    reads = [0, 0]  # calls, keys returned
    counting = threading.Event()

    class CountingClient(Client):
        def ping(self, timeout: float) -> str:
            if counting.is_set():
                pings[0] += 1
            return super().ping(timeout)

    def connect(address: tuple[str, int], *, timeout: float) -> Client:
        return CountingClient(address, secret=secret, run_id=run_id, timeout=timeout)

    def counted(store: Any) -> Any:
        return _count_reads(store, counting, reads)

    closers: list[Any] = []
    with EtcdServer() as etcd, tempfile.TemporaryDirectory() as tmp:
        try:
            services = []
            for i in range(nodes):
                name = f"h{i:02d}"
                owner = SlotOwner(run_id=run_id, host_id=name, local_world_size=1)
                closers.append(owner)
                coordination = CoordinationService(counted(open_store(etcd.url)), run_id=run_id,
                                                   host_id=name, owner=owner, ttl=10.0)
                closers.insert(0, coordination)
                server = Server(owner, secret=secret, run_id=run_id)
                closers.insert(0, server)
                coordination.describe(state="running", replication=list(server.address),
                                      node=f"addr_{name}_0")
                services.append(coordination)
            events = EventLog(Path(tmp), host="bench")
            closers.append(events)
            for coordination in services:  # staggered, as hosts start: every connection
                # comes from 127.0.0.1, and a server lets 4 per address authenticate at once
                closers.insert(0, HeartbeatService(coordination, events, connect=connect,
                                                   timeout=TIMEOUT))
                time.sleep(0.1)
            time.sleep(settle)
            counting.set()
            time.sleep(window)
            counting.clear()
            names = [t.name for t in threading.enumerate()]
            return {
                "pings per host per s": pings[0] / nodes / window,
                "heartbeat threads per host": sum(n.startswith("gemini-heartbeat")
                                                  for n in names) / nodes,
                "transport threads per host": sum(n.startswith("gemini-transport-")
                                                  and n.count(":") for n in names) / nodes,
                "store reads per host per s": reads[0] / nodes / window,
                "keys read per host per s": reads[1] / nodes / window,
                "lost": float(sum(len(c.lost_hosts()) for c in services)),
            }
        finally:
            for closer in closers:
                closer.close()


def _count_reads(store: Any, counting: threading.Event, reads: list[int]) -> Any:
    """``store``, its reads counted into ``reads`` (calls, keys) while ``counting``."""
    for name in ("get", "get_prefix"):
        def read(*args: Any, _fn: Any = getattr(store, name)) -> Any:
            found = _fn(*args)
            if counting.is_set():
                reads[0] += 1
                reads[1] += len(found) if isinstance(found, dict) else found is not None
            return found
        setattr(store, name, read)
    return store


def run_in(tree: Path, nodes: int, window: float, settle: float) -> dict[str, float]:
    """:func:`measure` in a subprocess that imports gemini from ``tree`` first."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", str(nodes),
                           "--window", str(window), "--settle", str(settle)],
                          env=env, cwd=tree, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=lambda t: [int(n) for n in t.split(",")],
                        default=[2, 8, 32])
    parser.add_argument("--window", type=float, default=10.0, help="seconds counted")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before counting")
    parser.add_argument("--baseline", metavar="PATH", help="another checkout of gemini")
    parser.add_argument("--baseline-name", default="baseline")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.window, args.settle)))
        return
    sys.path.insert(0, str(HERE))
    from common import machine, table

    trees = {"gemini": HERE.parent}
    if args.baseline:
        trees[f"baseline ({args.baseline_name})"] = Path(args.baseline).resolve()
    rows = []
    print(f"machine: {machine()}\n", flush=True)
    for nodes in args.hosts:
        for name, tree in trees.items():
            try:
                got = run_in(tree, nodes, args.window, args.settle)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"{nodes} hosts, {name}: failed: {str(exc)[-500:]}", file=sys.stderr)
                rows.append([str(nodes), name, "failed", "", "", "", "", ""])
                continue
            rows.append([str(nodes), name, *(f"{got[k]:.1f}" for k in (
                "pings per host per s", "heartbeat threads per host",
                "transport threads per host", "store reads per host per s",
                "keys read per host per s")), f"{got['lost']:g}"])
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    print(f"heartbeats per simulated host ({args.window:g} s counted after {args.settle:g} s; "
          f"--heartbeat-timeout {TIMEOUT:g}; real etcd, transport servers and heartbeat "
          "services in one process)\n")
    print(table(["hosts", "launcher", "pings sent per host per s", "heartbeat threads per host",
                 "transport threads per host", "store reads per host per s",
                 "keys read per host per s", "hosts wrongly lost"], rows))


if __name__ == "__main__":
    main()
