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
3. a host lost (killed, or frozen with SIGSTOP: no connection is ever refused) -> the
   first completed step after the restore, with 2 and 3 hosts, split into detection
   (the first survivor to know: its worker's communication error, a refused probe of
   the dead supervisor, or unanswered heartbeats), rendezvous (until the new round's
   restore plan is made), worker start + restore (until the first rank printed that it
   resumed) and the first step after it, which add up to the total; and the transfer
   (the new host pulls its ranks, begun by a hot spare as soon as it learns of the loss,
   ended while the workers start: it overlaps the other phases); with a hot spare (the
   host is lost once the spare says it is ready: slots reserved, standby workers with
   torch imported), a replacement started at the loss, no spare (the survivors shrink
   the job; with FSDP2 they reshard it), the persistent tier, and side by side
   torchrun restoring with torch.load from a torch.save written every step to local
   disk. About 250 MiB of state per host and a batch of 16 tokens;
   each step then sleeps 0.5 s, standing in for GPU compute that leaves the host's CPU
   free;
4. the time from a host kill until every surviving supervisor knows, with 2, 4 and 8
   hosts (small state): the loss is broadcast, not passed around the ring.

    python benchmarks/replication_bench.py --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import machine, table  # noqa: E402
from helpers import kill_tree  # noqa: E402
from transport_bench import bench_size, parse_size  # noqa: E402

EXAMPLE = str(HERE.parent / "examples" / "train_gpt.py")
MODEL = ["--n-embd", "384", "--n-layer", "4", "--n-head", "6", "--batch-size", "4"]
GEMINI = [sys.executable, "-m", "gemini_cli", "run"]
IDLE = 0.5  # seconds each host-loss step sleeps: GPU time, during which the CPU is free
DEVICE_TIME = 0.2  # seconds of stand-in GPU time per step in part 2's second setting


class Host:
    """One `gemini run` whose output lines are time-stamped as they arrive."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | None = None) -> None:
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True, cwd=cwd)
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
            ) -> tuple[float, float, float, float]:
    """Median step time of rank 0 with two one-worker hosts on a c10d rendezvous, the
    share of the steps due for replication that reached the peer (pushes coalesce to the
    newest step when replication falls behind), the longest time rank 0's loop was
    blocked in gemini's calls in one step (``save()`` and the wait for a copy before the
    optimizer step; the example's ``max_stall_ms``), and the share of rank 0's saves
    skipped because both its slots held steps replication keeps."""
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
        stall = re.search(r"max_stall_ms=([\d.]+) saves_skipped=(\d+)", text)
        if not match or not stall:
            raise RuntimeError(text[-3000:])
        pushes = sum(int(e.get("pushes", 0)) for e in _events(Path(tmp, "runs"))  # type: ignore[call-overload]
                     if e["event"] == "replication_done")
        every = int(mode[mode.index("--replicate-every") + 1]) if "--replicate-every" in mode else 1
        return (float(match.group(1)), pushes / (len(hosts) * (steps // every)),
                float(stall.group(1)), int(stall.group(2)) / steps)


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

LOSS_MODEL = ["--n-embd", "672", "--n-head", "8", "--n-layer", "4", "--batch-size", "1",
              "--seq-len", "16"]
"""About 250 MiB of model and AdamW state per host (one worker), and a batch of 16 tokens:
the CPU computes little, as on a GPU host, where the accelerator does the work (``IDLE``)."""
KNOWS = frozenset({"worker_exit", "host_dead", "host_unresponsive", "member_lost"})
"""Events by which a supervisor shows it knows of a failure in its round."""


@dataclass(frozen=True)
class Variant:
    """One way to lose a host and recover."""

    name: str
    args: tuple[str, ...] = ("--replicas", "2")
    spare: bool = False  # a spare waits; else a replacement starts at the fault
    fault: str = "kill"  # or "freeze": SIGSTOP every process of the host
    shrink: bool = False  # --nnodes N-1:N and no replacement
    torchrun: bool = False  # torchrun + torch.save/torch.load instead of gemini
    script: tuple[str, ...] = ()  # more arguments of the training script


def _signal_tree(pid: int, sig: int) -> None:
    import psutil

    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def host_loss(variant: Variant, nodes: int, etcd: Any, *, model: list[str] = LOSS_MODEL,
              kill_at: int = 10, until_known: bool = False) -> dict[str, float]:
    """Lose the host in node slot 1 once rank 0 printed step ``kill_at`` and time the
    phases until rank 0 completes its first step after the restore (or, with
    ``until_known``, only until every surviving supervisor knows)."""
    with tempfile.TemporaryDirectory() as tmp, _shm() as shm:
        run_root = Path(tmp) / "runs"
        # One core per simulated host, as each real host computes on its own cores: two
        # OpenMP pools of two threads on two shared cores spin against each other, and
        # every first step after a restart (both hosts' workers in lock step) takes 7x
        # longer. The same for torchrun and gemini.
        env = dict(os.environ, GEMINI_RUN_ROOT=str(run_root), PYTHONWARNINGS="ignore",
                   OMP_NUM_THREADS="1")
        run_id = f"loss-{os.getpid()}-{time.monotonic_ns()}"
        low = nodes - 1 if variant.shrink else nodes
        train = [EXAMPLE, "--steps", "400", "--sleep", str(IDLE), *model, *variant.script]
        port = _free_port()

        def host(name: str, i: int) -> Host:
            if variant.torchrun:  # h0 serves the c10d store, and is never the victim
                argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes",
                        f"{low}:{nodes}", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                        "--rdzv-conf", f"last_call_timeout=1,is_host={int(i == 0)}",
                        "--max-restarts", "3",
                        "--monitor-interval", "0.1", *train, "--torch-save", f"{tmp}/ckpt.pt"]
            else:
                argv = [*GEMINI, "--nnodes", f"{low}:{nodes}", "--nproc-per-node", "1",
                        "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,
                        "--rdzv-id", run_id, "--rdzv-conf", "last_call_timeout=1", "--store",
                        etcd.url, "--max-restarts", "3", "--replication-addr", "127.0.0.1",
                        *[a.replace("{tmp}", tmp) for a in variant.args], *train]
            return Host(argv, dict(env, GEMINI_HOST_ID=name, GEMINI_SHM_DIR=_shm_dir(shm, i)))

        hosts: dict[str, Host] = {}
        for i in range(nodes):
            hosts[f"h{i}"] = host(f"h{i}", i)
            time.sleep(0.5 if variant.torchrun else 0)  # h0 first: it serves the store
        try:
            return _lose_one(variant, nodes, hosts, host, run_root, run_id, etcd, kill_at,
                             until_known)
        finally:
            for h in hosts.values():
                h.kill()


def _lose_one(variant: Variant, nodes: int, hosts: dict[str, Host], host: Any, run_root: Path,
              run_id: str, etcd: Any, kill_at: int, until_known: bool) -> dict[str, float]:
    deadline = time.monotonic() + 300
    step = re.compile(rf"^step {kill_at} ")
    while not any(h.first(step.pattern) for h in hosts.values()):
        if time.monotonic() > deadline:
            raise RuntimeError("no progress:\n" + "\n".join(h.output()[-2000:] for h in hosts.values()))
        time.sleep(0.1)
    rank0 = next(name for name, h in hosts.items() if h.first(step.pattern))
    victim = "h1" if variant.torchrun else {
        int(e["group_rank"]): str(e["host"]) for e in _events(run_root)  # type: ignore[call-overload]
        if e["event"] == "rendezvous"}[1]
    if variant.spare:
        hosts["new"] = host("new", nodes)
        _wait_for_spare(etcd.url, run_id, deadline)
    before = hosts[rank0]
    faulted = _fault(variant, nodes, hosts, host, victim)
    survivors = [name for name in hosts if name not in (victim, "new")]
    if until_known:
        return _until_known(run_root, survivors, faulted, deadline)
    while not (done_by := {n: r for n, h in hosts.items() if n != victim
                           and (r := _resumed(h, faulted)) is not None}):
        if time.monotonic() > deadline:
            raise RuntimeError("\n".join(h.output()[-3000:] for h in hosts.values()))
        time.sleep(0.1)
    name, (at, first_step) = min(done_by.items(), key=lambda item: item[1][1])
    match = next(re.match(r"resumed at step (\d+)", line) for t, line in hosts[name].lines
                 if t == at)
    assert match is not None
    done = [int(m.group(1)) for t, line in list(before.lines) if t <= faulted
            and (m := re.match(r"step (\d+) ", line))]
    result = {"steps redone": max(done, default=-1) - (int(match.group(1)) - 1),
              "total": first_step - faulted}
    if variant.torchrun:
        return result
    return {**result, **_phases(variant, run_root, survivors, faulted, at, first_step)}


def _fault(variant: Variant, nodes: int, hosts: dict[str, Host], host: Any, victim: str
           ) -> float:
    """Kill or freeze ``victim``, start what replaces it; the time of the fault."""
    faulted = time.time()
    if variant.fault == "freeze":
        _signal_tree(hosts[victim].proc.pid, signal.SIGSTOP)
    else:
        hosts[victim].kill()
    if variant.torchrun:
        # torchrun's c10d handler publishes the workers' store address in its first round
        # only: a replacement joining a later round waits for it forever. What works is
        # what a scheduler does: restart the whole job (here at once, at the kill).
        for name in list(hosts):
            hosts.pop(name).kill()
        for i in range(nodes):
            hosts[f"r{i}"] = host(f"r{i}", i)
            time.sleep(0.5)
    elif not (variant.spare or variant.shrink):
        hosts["new"] = host("new", nodes)
    return faulted


def _until_known(run_root: Path, survivors: list[str], faulted: float, deadline: float
                 ) -> dict[str, float]:
    """Wait until every surviving supervisor knows of the loss."""
    while True:
        known = _first_known(run_root, survivors, faulted)
        if len(known) == len(survivors):
            return {"first knows": min(known.values()) - faulted,
                    "every supervisor knows": max(known.values()) - faulted}
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every survivor learned of the loss: {known}")
        time.sleep(0.1)


def _resumed(h: Host, faulted: float) -> tuple[float, float] | None:
    """When ``h`` printed that it resumed after ``faulted``, and its first step after."""
    at = h.first(r"^resumed at step", after=faulted)
    first = h.first(r"^step \d+ ", after=at) if at is not None else None
    return None if at is None or first is None else (at, first)


def _phases(variant: Variant, run_root: Path, survivors: list[str], faulted: float,
            resumed: float, first_step: float) -> dict[str, float]:
    """Detection, rendezvous, transfer, worker start + restore and the first step, from
    the supervisors' events and rank 0's output."""
    events = _events(run_root)
    detected = min(_first_known(run_root, survivors, faulted).values())
    plans = [e for e in events if e["event"] == "restore_plan" and float(e["ts"]) > faulted]  # type: ignore[arg-type]
    plan = next((e for e in plans if e["host"] == "new"), plans[-1])
    transfer = float(plan["transfer_seconds"])  # type: ignore[arg-type]
    planned = float(plan["ts"])  # type: ignore[arg-type]
    # the spare's copy is in its memory when it took the lost host's ranks over early
    want = ({"persist"} if "--persist-dir" in variant.args else {"memory", "peer"}
            if plan["host"] == "new" or variant.shrink else {"memory"})
    if not set(plan["sources"].values()) <= want:  # type: ignore[union-attr]
        raise RuntimeError(f"expected a restore from {want}: {plan}")
    made = planned - transfer  # the event is written once the transfer is done
    return {"detection": detected - faulted, "rendezvous": made - detected,
            "start + restore": resumed - made, "first step": first_step - resumed,
            "transfer (overlapped)": transfer}


def _first_known(run_root: Path, survivors: list[str], after: float) -> dict[str, float]:
    """When each surviving supervisor first showed it knew of the loss."""
    known: dict[str, float] = {}
    for e in _events(run_root):
        ts, name = float(e["ts"]), str(e["host"])  # type: ignore[arg-type]
        if e["event"] in KNOWS and ts > after and name in survivors and name not in known:
            known[name] = ts
    return known


def _wait_for_spare(etcd_url: str, run_id: str, deadline: float) -> None:
    from launcher.coordination import read_status
    from launcher.store import open_store

    store = open_store(etcd_url)
    try:
        while read_status(store, run_id).ready_spares != ["new"]:  # slots, standbys ready
            if time.monotonic() > deadline:
                raise RuntimeError("the spare did not get ready")
            time.sleep(0.1)
    finally:
        store.close()


def throughput(args: argparse.Namespace) -> Iterator[list[str]]:
    """Part 1: replication throughput against raw loopback TCP."""
    rows = [bench_size(parse_size(text), args.repeat) for text in args.sizes.split(",")]
    yield ["1. replication throughput (receiver in another process, loopback TCP)", "",
           table(["slot", "raw TCP", "push (+ verify + commit)", "xxh3, one core",
                  "push / raw"], rows), ""]


def slowdown(args: argparse.Namespace) -> Iterator[list[str]]:
    """Part 2: the training step while replicating, against replication off."""
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
    skips: dict[tuple[str, str], list[float]] = {key: [] for key in times}
    for _ in range(args.repeat):
        for setting, device_time in settings.items():
            for name, mode in modes.items():  # interleaved: drift hits every mode alike
                ms, share, stall, skipped = step_ms(mode, args.steps, device_time)
                times[name, setting].append(ms)
                shares[name, setting].append(share)
                stalls[name, setting].append(stall)
                skips[name, setting].append(skipped)
    rows = []
    for name in modes:
        row: list[object] = [name]
        for setting in settings:
            base = statistics.median(times["replication off (--replicas 1)", setting])
            ours = statistics.median(times[name, setting])
            share = statistics.median(shares[name, setting])
            replicated = "--replicas 2" in " ".join(modes[name])
            row += [f"{ours:.1f} ms", f"{100 * (ours / base - 1):+.1f}%",
                    f"{100 * share:.0f}%" if replicated else "-",
                    f"{100 * statistics.median(skips[name, setting]):.0f}%" if replicated
                    else "-", f"{max(stalls[name, setting]):.1f} ms"]
        rows.append(row)
    header = ["replication"]
    for setting in settings:
        header += [f"step, {setting}", "vs off", "steps replicated", "saves skipped",
                   "longest stall"]
    yield [f"2. training step while replicating (example GPT, {' '.join(MODEL)}; 2 hosts x "
           f"1 worker; CPU-bound: both cores train; device time: each step also waits "
           f"{DEVICE_TIME} s with the CPU free, as for a GPU; saves skipped: rank 0's saves "
           f"that found both slots holding steps replication keeps (a worker crash then "
           f"resumes one step further back); longest stall: the most rank 0's loop was "
           f"blocked in gemini's calls in one step, over all runs)", "",
           table(header, rows), ""]


def host_loss_tables(args: argparse.Namespace) -> Iterator[list[str]]:
    """Part 3: host loss -> first step after the restore, one table per host count."""
    from etcd_server import EtcdServer

    variants = [Variant("peer memory, hot spare", spare=True),
                Variant("peer memory, hot spare, frozen host", spare=True, fault="freeze"),
                Variant("peer memory, replacement started at the kill"),
                Variant("memory, no spare: the survivors go on (--nnodes N-1:N)",
                        shrink=True),
                Variant("memory, no spare, FSDP2: the survivors reshard (--nnodes N-1:N)",
                        shrink=True, script=("--fsdp",)),
                Variant("persistent tier (local disk), replacement started at the kill",
                        args=("--replicas", "1", "--persist-dir", "{tmp}/persist",
                              "--persist-every", "1")),
                Variant("torchrun + torch.save/torch.load (local disk), replacement "
                        "started at the kill", torchrun=True)]
    phases = ("detection", "rendezvous", "start + restore", "first step", "total",
              "transfer (overlapped)")
    if args.rows is not None:
        variants = [v for i, v in enumerate(variants, 1)
                    if i in args.rows or i == len(variants)]
    for nodes in args.hosts:
        rows = []
        results: dict[str, list[dict[str, float]]] = {v.name: [] for v in variants}
        with EtcdServer() as etcd:
            for _ in range(args.repeat):
                for variant in variants:  # interleaved
                    results[variant.name].append(host_loss(variant, nodes, etcd))
                    if args.each:
                        print(f"{nodes} hosts, {variant.name}: " + ", ".join(
                            f"{k} {v:.2f}" for k, v in results[variant.name][-1].items()),
                            file=sys.stderr, flush=True)
        baseline = statistics.median(r["total"] for r in results[variants[-1].name])
        for name, runs in results.items():
            medians = {k: statistics.median(r[k] for r in runs) if k in runs[0] else None
                       for k in phases}
            redone = statistics.median(r["steps redone"] for r in runs)
            rows.append([name, f"{redone:g}",
                         *(f"{v:.2f} s" if v is not None else "-" for v in medians.values()),
                         f"{baseline / medians['total']:.1f}x"])  # type: ignore[operator]
        yield [f"3. host loss -> first completed step after restore ({nodes} hosts x 1 "
               f"worker, {' '.join(LOSS_MODEL)}: about 250 MiB of state per host; "
               f"etcd-v3 rendezvous for gemini, c10d for torchrun; {IDLE} s idle per "
               "step)", "",
               table(["restore from", "steps redone", *phases, "speed-up vs torchrun"],
                     rows), ""]


def scaling(args: argparse.Namespace) -> Iterator[list[str]]:
    """Part 4: host kill -> every surviving supervisor knows, per host count."""
    from etcd_server import EtcdServer

    rows = []
    two: float | None = None
    for nodes in args.scaling:
        runs = []
        with EtcdServer() as etcd:
            for _ in range(args.repeat):
                runs.append(host_loss(Variant("kill"), nodes, etcd, model=[],
                                      until_known=True))
        first = statistics.median(r["first knows"] for r in runs)
        every = statistics.median(r["every supervisor knows"] for r in runs)
        two = every if two is None else two
        rows.append([str(nodes), f"{first:.2f} s", f"{every:.2f} s", f"{every / two:.2f}x"])
    yield ["4. host kill -> every surviving supervisor knows (1 worker per host, the "
           "example's default model; no replacement)", "",
           table(["hosts", "first knows", "every supervisor knows",
                  f"vs {args.scaling[0]} hosts"], rows), ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256M,1G", help="slot sizes for the throughput table")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="steps per slowdown run")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: 1,2,3,4")
    parser.add_argument("--hosts", type=lambda t: [int(n) for n in t.split(",")],
                        default=[2, 3], help="host counts of part 3")
    parser.add_argument("--scaling", type=lambda t: [int(n) for n in t.split(",")],
                        default=[2, 4, 8], help="host counts of part 4")
    parser.add_argument("--rows", type=lambda t: {int(n) for n in t.split(",")},
                        default=None, help="part 3: only these rows (1-based; the last "
                        "one, the baseline, always runs)")
    parser.add_argument("--each", action="store_true",
                        help="part 3: print every run's phases to stderr too")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(f"machine: {machine()}\nmedians of {args.repeat} runs\n", flush=True)
    parts = {"1": throughput, "2": slowdown, "3": host_loss_tables, "4": scaling}
    for part, run in parts.items():
        if part not in skip:
            for lines in run(args):
                print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
