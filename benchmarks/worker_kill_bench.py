"""A worker crash in a job of 1 to 8 simulated hosts: how long until every rank trains again.

Several `gemini run` supervisors on this machine stand in for hosts (one worker each,
gloo over loopback, each host its own shared-memory directory, an etcd-v3 rendezvous and
store). Once rank 0 printed step ``KILL_AT`` and every host's standby workers are ready
(on real hosts, each with cores of its own, they are within seconds of a start; here the
simulated hosts share two cores), the worker of the host in node slot 1 (of the only
host with one host) is SIGKILLed, and the clock runs until rank 0 completes its first step
after the restore: every rank takes part in that step's collectives, so it is every
rank's next step. Printed per host count, side by side:

* gemini as checked out;
* with ``--baseline PATH``, the same from another checkout of gemini (e.g. a ``git
  worktree`` of an earlier commit): the previous behaviour in the same run;
* a host kill with a hot spare at the same host count (this checkout, the same harness:
  the whole host in node slot 1 killed once the spare is ready), for scale.

Also shown: when the last surviving supervisor knew of the failure (its own worker
failed, or it restarted for another host's), had joined the new rendezvous round and had
started its workers; how many hosts took the failed host for a spare (event
``spares_waiting``), how many hosts' workers failed too (their collectives with the dead
worker), and whether every host restarted in one rendezvous round. The example's
default model (about 1 MB of state) and a 0.2 s sleep per step, standing in for GPU time.

    python benchmarks/worker_kill_bench.py --hosts 1,2,4,8 --repeat 3 [--baseline PATH]

Part 2 is the single-host hand-written loop at a realistic size: 2 workers on one host,
about 288 MiB of model and optimizer state per rank, one worker killed.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import machine, table  # noqa: E402
from replication_bench import (  # noqa: E402
    EXAMPLE,
    Host,
    _events,
    _shm,
    _shm_dir,
    _wait_for_spare,
)

KILL_AT = 12  # at least: the kill waits until every host's standby workers are ready
SLEEP = 0.2  # seconds per step with the CPU free: GPU time
LARGE_MODEL = ["--n-embd", "640", "--n-layer", "5", "--n-head", "8", "--batch-size", "1",
               "--seq-len", "16"]
"""About 288 MiB of model and AdamW state per rank."""


def worker_kill(nodes: int, etcd: object, tree: Path | None, *, nproc: int = 1,
                model: list[str] | None = None, timeout: float = 300,
                spare: bool = False) -> dict[str, float]:
    """One run: ``nodes`` hosts of ``nproc`` workers, the first worker of node slot 1
    (slot 0 with one host) SIGKILLed once rank 0 printed step :data:`KILL_AT`; with
    ``spare``, a spare waits and the whole host in node slot 1 is killed instead, once
    the spare is ready."""
    with tempfile.TemporaryDirectory() as tmp, _shm() as shm:
        run_root = Path(tmp) / "runs"
        env = dict(os.environ, GEMINI_RUN_ROOT=str(run_root), PYTHONWARNINGS="ignore",
                   OMP_NUM_THREADS="1")
        if tree is not None:  # the other checkout's launcher and CLI come first (`-m`
            # puts the working directory first on the path: it runs in the checkout)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
        run_id = f"kill-{os.getpid()}-{time.monotonic_ns()}"
        argv = [sys.executable, "-m", "gemini_cli", "run", "--nnodes", f"{nodes}:{nodes}",
                "--nproc-per-node", str(nproc), "--max-restarts", "3"]
        if nodes > 1:
            argv += ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,  # type: ignore[attr-defined]
                     "--rdzv-id", run_id, "--rdzv-conf", "last_call_timeout=1",
                     "--store", etcd.url, "--replication-addr", "127.0.0.1"]  # type: ignore[attr-defined]
        argv += [EXAMPLE, "--steps", "400", "--sleep", str(SLEEP), *(model or [])]
        hosts = {f"h{i}": Host(argv, dict(env, GEMINI_HOST_ID=f"h{i}",
                                          GEMINI_SHM_DIR=_shm_dir(shm, i)),
                               cwd=str(tree or HERE.parent))
                 for i in range(nodes)}
        try:
            if spare:  # once the group trains (started with it, the spare may take a place)
                deadline = time.monotonic() + timeout
                while not any(h.first(r"^step \d+ ") for h in hosts.values()):
                    if time.monotonic() > deadline:
                        raise RuntimeError("no progress")
                    time.sleep(0.1)
                hosts["new"] = Host(argv, dict(env, GEMINI_HOST_ID="new",
                                               GEMINI_SHM_DIR=_shm_dir(shm, nodes)),
                                    cwd=str(tree or HERE.parent))
                _wait_for_spare(etcd.url, run_id, deadline)  # type: ignore[attr-defined]
            return _kill_one(nodes, hosts, run_root, timeout, nproc, spare,
                             getattr(etcd, "proc", None))
        finally:
            for h in hosts.values():
                h.kill()


def _standbys_ready(hosts: object, nproc: int) -> bool:
    """Whether each host keeps ``nproc`` standby workers and they are idle (torch imported,
    waiting for a job): on real hosts, each with cores of its own, they are ready within
    seconds of a start; here the simulated hosts share two cores."""
    import psutil

    standbys = []
    for host in hosts:  # type: ignore[attr-defined]
        found = [p for p in psutil.Process(host.proc.pid).children(recursive=True)
                 if "launcher.standby" in " ".join(p.cmdline())]
        if len(found) < nproc:
            return False
        standbys += found
    for proc in standbys:
        proc.cpu_percent()
    time.sleep(0.5)
    return all(proc.cpu_percent() < 5 for proc in standbys)


class CpuMeter:
    """The CPU time the simulated hosts' processes (each supervisor and everything under
    it) and the store's server use between :meth:`start` and :meth:`stop`, read every
    0.2 s so that a process which exits meanwhile counts up to its last reading: on this
    machine, every host's work during a recovery shares two cores, and this tells how
    much of a slower recovery at more hosts is that sharing."""

    def __init__(self, hosts: dict[str, Host], store: object) -> None:
        import psutil

        self._roots = {name: psutil.Process(h.proc.pid) for name, h in hosts.items()}
        self._store = psutil.Process(store.pid) if store is not None else None  # type: ignore[attr-defined]
        self._first: dict[int, float] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> None:
        import psutil

        found = [("store", self._store)] if self._store is not None else []
        for name, root in self._roots.items():
            try:
                found += [(name, root), *((f"{name} workers", p)
                                          for p in root.children(recursive=True))]
            except psutil.Error:
                continue
        for name, proc in found:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            used = times.user + times.system
            self._first.setdefault(proc.pid, used)
            self._last[proc.pid] = (name, used)

    def _run(self) -> None:
        while not self._done.wait(0.2):
            self._read()

    def start(self) -> None:
        self._read()
        self._thread.start()

    def stop(self) -> dict[str, float]:
        """CPU seconds of each supervisor ("h0"), of everything under it ("h0 workers":
        workers, standbys) and of the store since :meth:`start`."""
        self._done.set()
        self._thread.join()
        self._read()
        used: dict[str, float] = {}
        for pid, (name, last) in self._last.items():
            used[name] = used.get(name, 0.0) + last - self._first[pid]
        return used


def _kill_one(nodes: int, hosts: dict[str, Host], run_root: Path, timeout: float,
              nproc: int, whole_host: bool, store: object = None) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    step = re.compile(rf"^step {KILL_AT} ")

    def wait(what: str, predicate: object) -> None:
        while not predicate():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}:\n" + "\n".join(
                    f"--- {n}\n{h.output()[-2000:]}" for n, h in hosts.items()))
            time.sleep(0.05)

    wait("no progress", lambda: any(h.first(step.pattern) for h in hosts.values()))
    wait("standby workers not ready", lambda: _standbys_ready(hosts.values(), nproc))
    found = _events(run_root)
    slots = {int(e["group_rank"]): str(e["host"]) for e in found  # type: ignore[call-overload]
             if e["event"] == "rendezvous"}
    victim = slots[1 if nodes > 1 else 0]
    start = [e for e in found if e["event"] == "start" and e["host"] == victim][-1]
    pid = int(start["workers"][0]["pid"])  # type: ignore[index]
    rank0 = hosts[slots[0]]
    meter = CpuMeter(hosts, store)
    meter.start()
    killed = time.time()
    if whole_host:
        hosts[victim].kill()
    else:
        os.kill(pid, signal.SIGKILL)

    def resumed() -> float | None:
        at = rank0.first(r"^resumed at step", after=killed)
        return rank0.first(r"^step \d+ ", after=at) if at is not None else None

    wait("no step after the kill", lambda: resumed() is not None)
    first_step = resumed()
    assert first_step is not None
    cpu = meter.stop()
    after = [e for e in _events(run_root) if float(e["ts"]) > killed]  # type: ignore[arg-type]
    summary = _summary(after, killed, first_step, victim)
    on_hosts = [cpu.get(name, 0.0) + cpu.get(f"{name} workers", 0.0) for name in hosts]
    summary["cpu per host"] = statistics.median(on_hosts)
    summary["cpu per supervisor"] = statistics.median(cpu.get(name, 0.0) for name in hosts)
    summary["cpu in all"] = sum(cpu.values())
    return summary


def _summary(after: list[dict[str, object]], killed: float, first_step: float, victim: str
             ) -> dict[str, float]:
    """The figures of one run from the events written after the kill."""
    known: dict[str, float] = {}
    rounds = {str(e["host"]): 0 for e in after}
    for e in after:
        if e["event"] in ("worker_exit", "restart"):
            known.setdefault(str(e["host"]), float(e["ts"]))  # type: ignore[arg-type]
        if e["event"] == "rendezvous":
            rounds[str(e["host"])] += 1

    def last(event: str) -> float:
        return max((float(e["ts"]) for e in after if e["event"] == event),  # type: ignore[arg-type]
                   default=float("nan")) - killed

    return {"total": first_step - killed,
            "every host knows": max(known.values()) - killed if known else float("nan"),
            "round formed": last("rendezvous"), "workers started": last("start"),
            "spares_waiting": sum(e["event"] == "spares_waiting" for e in after),
            "one round": float(all(n == 1 for n in rounds.values())),
            "peers failed": sum(e["event"] == "worker_exit" and e["host"] != victim
                                for e in after)}


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def scaling(args: argparse.Namespace) -> list[str]:
    from etcd_server import EtcdServer

    trees: dict[str, Path | None] = {"gemini": None}
    if args.baseline:
        trees[f"baseline ({args.baseline_name})"] = Path(args.baseline).resolve()
    rows = []
    with EtcdServer() as etcd:
        for nodes in args.hosts:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
            spare: list[dict[str, float]] = []
            for _ in range(args.repeat):  # interleaved: drift hits every variant alike
                for name, tree in trees.items():
                    runs[name].append(worker_kill(nodes, etcd, tree))
                    if args.each:
                        print(f"{nodes} hosts, {name}: {runs[name][-1]}", file=sys.stderr,
                              flush=True)
                if nodes > 1 and not args.no_spare:
                    spare.append(worker_kill(nodes, etcd, None, spare=True))
            ours = _median(runs["gemini"], "total")
            for name, results in runs.items():
                total = _median(results, "total")
                rows.append([str(nodes), name, f"{total:.2f} s",
                             f"{_median(results, 'every host knows'):.2f} s",
                             f"{_median(results, 'round formed'):.2f} s",
                             f"{_median(results, 'workers started'):.2f} s",
                             f"{sum(r['spares_waiting'] for r in results):g}",
                             f"{sum(r['peers failed'] for r in results):g}",
                             f"{sum(r['one round'] for r in results):g}/{len(results)}",
                             f"{_median(results, 'cpu per host'):.2f} s",
                             f"{statistics.median(r['cpu in all'] / r['total'] for r in results):.1f}",
                             f"{total / ours:.2f}x"])
            if spare:
                rows.append([str(nodes), "host kill, hot spare (gemini)",
                             f"{_median(spare, 'total'):.2f} s",
                             f"{_median(spare, 'every host knows'):.2f} s",
                             f"{_median(spare, 'round formed'):.2f} s",
                             f"{_median(spare, 'workers started'):.2f} s", *["-"] * 3,
                             f"{_median(spare, 'cpu per host'):.2f} s",
                             f"{statistics.median(r['cpu in all'] / r['total'] for r in spare):.1f}",
                             "-"])
    return [f"1. worker SIGKILL -> every rank's next step (1 worker per host, the example's "
            f"default model, {SLEEP} s sleep per step, etcd-v3 rendezvous)", "",
            table(["hosts", "launcher", "kill -> next step", "every host knows",
                   "every host in the new round", "every host's workers started",
                   "spares_waiting events", "peers' workers failed", "one round",
                   "CPU per host", "cores busy", "vs gemini"], rows), ""]


def large(args: argparse.Namespace) -> list[str]:
    trees: dict[str, Path | None] = {"gemini": None}
    if args.baseline:
        trees[f"baseline ({args.baseline_name})"] = Path(args.baseline).resolve()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.repeat):
        for name, tree in trees.items():
            runs[name].append(worker_kill(1, None, tree, nproc=2, model=LARGE_MODEL))
            if args.each:
                print(f"large, {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    ours = _median(runs["gemini"], "total")
    rows = [[name, f"{_median(r, 'total'):.2f} s", f"{_median(r, 'total') / ours:.2f}x"]
            for name, r in runs.items()]
    return ["2. worker SIGKILL -> next step, one host, 2 workers, about 288 MiB per rank "
            f"({' '.join(LARGE_MODEL)})", "",
            table(["launcher", "kill -> next step", "vs gemini"], rows), ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=lambda t: [int(n) for n in t.split(",")],
                        default=[1, 2, 4, 8])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", metavar="PATH",
                        help="another checkout of gemini to run side by side")
    parser.add_argument("--baseline-name", default="baseline",
                        help="what to call it in the tables (e.g. its commit)")
    parser.add_argument("--no-spare", action="store_true", help="skip the host-kill rows")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: 1,2")
    parser.add_argument("--each", action="store_true", help="print every run to stderr")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(f"machine: {machine()}\nmedians of {args.repeat} runs\n", flush=True)
    for part, fn in (("1", scaling), ("2", large)):
        if part not in skip:
            print("\n".join(fn(args)), flush=True)


if __name__ == "__main__":
    main()
