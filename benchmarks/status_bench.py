"""How long `gemini status` takes for a big run: 1,000 hosts x 8 ranks in the store.

Fills the embedded store (and a real etcd on a loopback port, when the `etcd` binary is
installed) with one run's records as the supervisors write them, then times
`read_status` (one prefix read plus parsing) in this process and the whole
`gemini status --json` command (a new process: Python start-up, imports, read, print).

    python benchmarks/status_bench.py --hosts 1000 --ranks-per-host 8 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import machine, median_time, table  # noqa: E402

from launcher.coordination import read_status, run_prefix  # noqa: E402
from launcher.store import Store, open_store  # noqa: E402


def fill(store: Store, run_id: str, hosts: int, ranks_per_host: int) -> None:
    prefix = run_prefix(run_id)
    now = time.time()
    store.put(prefix + "root", b"host0000")
    for h in range(hosts):
        name = f"host{h:04d}"
        ranks = list(range(h * ranks_per_host, (h + 1) * ranks_per_host))
        store.put(prefix + f"hosts/{name}", json.dumps(
            {"host": name, "pid": 1000 + h, "started": now, "state": "running", "ranks": ranks,
             "round": 3, "restart_count": 2, "updated": now, "group_rank": h}).encode())
        store.put(prefix + f"alive/{name}", b"1")
        for rank in ranks:
            store.put(prefix + f"ranks/{rank}", json.dumps(
                {"host": name, "memory": 12345, "updated": now}).encode())
    for i in range(20):
        store.put(prefix + f"events/{time.time_ns():020d}-host0000", json.dumps(
            {"event": "host_lost", "host": "host0000", "lost": f"host{i:04d}",
             "ts": now}).encode())


def measure(url: str, store: Store, run_id: str, repeat: int) -> list[str]:
    read = median_time(lambda: read_status(store, run_id), repeat=repeat)
    cmd = [sys.executable, "-m", "gemini_cli", "status", "--json", "--store", url,
           "--run-id", run_id]

    def cli() -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(done.stderr)

    whole = median_time(cli, repeat=repeat)
    return [f"{read * 1e3:.0f} ms", f"{whole * 1e3:.0f} ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--ranks-per-host", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        url = f"embedded://{tmp}/store.db"
        store = open_store(url)
        fill(store, "big", args.hosts, args.ranks_per_host)
        rows.append(["embedded (SQLite)", *measure(url, store, "big", args.repeat)])
        store.close()
    if shutil.which("etcd"):
        from etcd_server import EtcdServer

        with EtcdServer() as etcd:
            store = open_store(etcd.url)
            fill(store, "big", args.hosts, args.ranks_per_host)
            rows.append(["etcd 3 (loopback)", *measure(etcd.url, store, "big", args.repeat)])
            store.close()
    print(f"machine: {machine()}")
    print(f"{args.hosts} hosts x {args.ranks_per_host} ranks; medians of {args.repeat} runs\n")
    print(table(["store", "read_status (in process)", "`gemini status --json` (new process)"],
                rows))
    os.environ.pop("GEMINI_STORE", None)


if __name__ == "__main__":
    main()
