"""Fault campaign: goodput (ETTR) under random faults, gemini beside torchrun + torch.save
and its peers.

Two simulated hosts on this machine train the example GPT (about 250 MiB of model and
AdamW state per host, one worker each, a batch of 16 tokens, then 0.5 s of stand-in GPU
time per step with the CPU free, one core per host: as ``replication_bench.py``'s host
loss). Faults come at random, a Poisson process with a mean of ``--mtbf`` seconds drawn
from ``--seed``, the same times and kinds for every system, in roughly the proportions
that studies of large training runs report (most interruptions are hardware, GPUs and
hosts; the rest software and the worker processes; Meta's Llama 3 run: 419 unexpected
interruptions in 54 days, 78% hardware):

* ``worker`` (40%): one worker SIGKILLed;
* ``host`` (40%): a host SIGKILLed, supervisor, workers and memory;
* ``freeze`` (10%): a host SIGSTOPped (no connection is ever refused), killed once the
  job has stepped on without it;
* ``store`` (10%): the coordination store (etcd) restarted.

A lost host is replaced the way a scheduler would: gemini's job keeps one hot spare (three
hosts, two in the group), and a new spare is started for each host lost, once the job has
stepped again, and until it takes a place it gets only the CPU time the job leaves idle (a
cgroup of its own with the lowest CPU weight, where the machine has one: on a cluster a
spare is a machine of its own; here its start would take the two cores from the job);
torchrun's job is restarted
whole at once (its c10d rendezvous cannot admit a replacement host into a later round),
and a frozen host stops it until a watchdog (``--hang-after``, 60 s) restarts it, as
torchrun itself waits for gloo's 30-minute timeout; a store restart does not concern it
(its store lives in the agent of host 0). A fault is injected only once the job has
completed a step since the previous one (a fault in the middle of a recovery is
postponed). torchrun writes its checkpoint with torch.save every N steps, N at Young's
optimum sqrt(2 C M) for the write time C measured first and the job's MTBF M.

Two peers run beside them when their virtual environments exist (``--dlrover-env``,
``--lmres-env``; by default ``peers/dlrover`` and ``peers/lmres`` next to this checkout; a
missing one is skipped with a line saying so), each with what it recovers from itself and,
for the rest, what its users would do:

* DLRover 0.6.1 (``dlrover-run``, ``benchmarks/dlrover_gpt.py``): its job master (started by
  hand: ``dlrover-run --standalone`` fails on torch 2.13) and one agent per host. Flash
  Checkpoint copies the state into the agent's shared memory after every step
  (``StorageType.MEMORY``) and every N-th step also to disk (``StorageType.DISK``, persisted
  by the agent in the background), N as torchrun's. A killed worker is restarted by its
  agent and loads from shared memory; a lost host is replaced at once by a new agent with
  the lost node rank, as DLRover's master has the pod relaunched on Kubernetes (the
  survivors' agents restart their workers, which load the newest step on disk: the new
  host's memory is empty); a frozen host stops the job until the watchdog, then is
  replaced the same way. Each host's shared memory and sockets are named by a job name
  of its own, so that two hosts on this machine do not share them; a lost host's shared
  memory is removed with it. Its rendezvous state lives in its job master, part of the
  job, not in an outside store: a store restart does not concern it.
* lm-resiliency 0.2.0 (the GEMINI paper authors' implementation,
  ``benchmarks/lmres_gpt.py``): ``enable_resiliency`` captures the state into CPU memory
  after every step, replicates it to the peer rank over Gloo, writes its node-local disk
  tier every N steps (N as torchrun's) and from its SIGTERM handler and at exit the newest
  own and peer copies. Both hosts' disk tier is one folder, as in the authors' own fault
  campaign (a folder every host sees), so that a restarted rank finds the copy its peer
  wrote. Its torchrun rendezvous backend with standby hosts is not used: torch 2.13's
  torchrun cannot load 0.2.0's (torchrun calls the ``torchrun.handlers`` entry point with
  no argument for a handler factory; 0.2.0's names the factory itself, which wants the
  parameters), and it restarts nothing on its own: every restart waits for an outside
  manager to publish a plan (``TorchrunRecoveryCoordinator``), which the package does not
  include. So the job runs on torchrun's c10d rendezvous, like the baseline: a killed
  worker is restarted by torchrun and both ranks load the newest step they all hold (the
  survivor flushed its own and its peer's copy as it exited); a lost host restarts the job
  whole, the survivors given a 30 s SIGTERM grace to flush as a scheduler gives it; a
  frozen host stops the job until the watchdog, then the same (a survivor blocked in a
  collective cannot flush: the newest step already on disk is loaded); a store restart
  does not concern it.

Measured, per system: ETTR from the workload's own step log (the example's "step N"
lines as they arrive: every step counted once, at its median step time, over the
campaign's wall time from the launch), the faults, and the mean time lost per fault
((wall - useful) / faults). For gemini also its live figure (``gemini status --json``
at the end) and the planner's prediction (``gemini plan --job-mtbf``, with the measured
step time and the campaign's mix: host share = host + freeze faults among those that
stop training).

    python benchmarks/campaign_bench.py --minutes 15 --mtbf 60,300 \
        [--systems gemini,torchrun,dlrover,lmres]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import machine, table  # noqa: E402
from etcd_server import EtcdServer  # noqa: E402
from helpers import kill_tree  # noqa: E402
from replication_bench import (  # noqa: E402
    EXAMPLE,
    GEMINI,
    IDLE,
    LOSS_MODEL,
    Host,
    _events,
    _free_port,
    _shm_dir,
    _signal_tree,
)

FAULTS = (("worker", 0.4), ("host", 0.4), ("freeze", 0.1), ("store", 0.1))
SYSTEMS = ("gemini", "torchrun", "dlrover", "lmres")
PEERS = HERE.parent.parent / "peers"  # the peers' virtual environments, beside the checkout
DLROVER_GPT = str(HERE / "dlrover_gpt.py")
LMRES_GPT = str(HERE / "lmres_gpt.py")
GRACE = 30.0  # seconds between a scheduler's SIGTERM and its SIGKILL (SLURM's and k8s's default)
STEP = re.compile(r"^step (\d+) ")
HOST_BYTES = 250 << 20  # LOSS_MODEL's model and AdamW state, for the planner


def schedule(seed: int, mtbf: float, seconds: float) -> list[tuple[float, str]]:
    """(offset from the start, kind) of each fault: exponential gaps of mean ``mtbf``."""
    rng = random.Random(seed)
    kinds, weights = [k for k, _ in FAULTS], [w for _, w in FAULTS]
    found, at = [], rng.expovariate(1 / mtbf)
    while at < seconds:
        found.append((at, rng.choices(kinds, weights)[0]))
        at += rng.expovariate(1 / mtbf)
    return found


class Job:
    """One system's job: its hosts, how each fault is done to it, and its steps."""

    name = ""
    checkpoint = "every step"  # how often it checkpoints, for the table

    def __init__(self, tmp: str, shm: str, etcd: EtcdServer) -> None:
        self.tmp, self.shm, self.etcd = tmp, shm, etcd
        self.hosts: dict[str, Host] = {}
        self.gone: list[Host] = []  # hosts killed: their step lines still count
        self.count = 0
        self.env = dict(os.environ, GEMINI_RUN_ROOT=f"{tmp}/runs", PYTHONWARNINGS="ignore",
                        OMP_NUM_THREADS="1")
        self.train = [EXAMPLE, "--steps", "100000", "--sleep", str(IDLE), *LOSS_MODEL]

    def steps(self) -> list[tuple[float, int, int]]:
        """(time, step, stream) of every step line of every host, old and new."""
        found = []
        for stream, host in enumerate([*self.gone, *self.hosts.values()]):
            for at, line in list(host.lines):
                if match := STEP.match(line):
                    found.append((at, int(match.group(1)), stream))
        return sorted(found)

    def stepped_since(self, since: float) -> bool:
        return any(at > since for at, _, _ in self.steps())

    def start(self) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        """Called every 0.1 s while the campaign waits: what the scheduler does meanwhile."""

    def applies(self, kind: str) -> bool:
        """Whether a fault of ``kind`` concerns this system."""
        return True

    def fault(self, kind: str, rng: random.Random) -> Callable[[], None] | None:
        """Do a fault of ``kind``; what to do once the job stepped on, if anything."""
        raise NotImplementedError

    def live(self) -> dict[str, Any] | None:
        """The system's own goodput figure, if it has one."""
        return None

    def drop(self, name: str) -> None:
        host = self.hosts.pop(name)
        host.kill()
        self.gone.append(host)

    def close(self) -> None:
        for name in list(self.hosts):
            self.drop(name)


class SpareCPU:
    """A cgroup per waiting spare with the lowest CPU weight, so that its start takes only
    the CPU time the job leaves idle (as a machine of its own would), restored to the
    default once it takes a place. cgroup v1's cpu controller or v2's; without a writable
    one (not root), spares start at full weight and a line says so."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.held: dict[str, Path] = {}
        for root, knob, low, default in ((Path("/sys/fs/cgroup/cpu"), "cpu.shares", 2, 1024),
                                          (Path("/sys/fs/cgroup"), "cpu.weight", 1, 100)):
            if (root / knob).exists() or (root / "cgroup.subtree_control").exists() and \
                    "cpu" in (root / "cgroup.subtree_control").read_text().split():
                probe = root / f"gemini-campaign-{os.getpid()}"
                try:
                    probe.mkdir()
                    probe.rmdir()
                except OSError:
                    continue
                self.root, self.knob, self.low, self.default = root, knob, low, default
                return
        print("campaign: no writable cgroup cpu controller: spares start at full CPU weight",
              file=sys.stderr, flush=True)

    def hold(self, name: str, pid: int) -> None:
        if self.root is None:
            return
        group = self.root / f"gemini-campaign-{os.getpid()}-{name}"
        try:
            group.mkdir()
            (group / self.knob).write_text(str(self.low))
            (group / "cgroup.procs").write_text(str(pid))  # its children follow
        except OSError:
            return
        self.held[name] = group

    def release(self, name: str) -> None:
        if (group := self.held.get(name)) is not None:
            (group / self.knob).write_text(str(self.default))

    def close(self) -> None:
        assert self.root is not None or not self.held
        for group in self.held.values():
            try:
                for pid in (group / "cgroup.procs").read_text().split():
                    (self.root / "cgroup.procs").write_text(pid)  # type: ignore[operator]
                group.rmdir()
            except OSError:
                pass
        self.held.clear()


class Gemini(Job):
    name = "gemini (hot spare)"

    def start(self) -> None:
        self.run_id = f"campaign-{os.getpid()}-{time.monotonic_ns()}"
        self.spares: list[float] = [time.time()]  # spares asked for, when: the first one
        self.cpu, self.waiting = SpareCPU(), set[str]()
        for _ in range(2):  # the group; the spare once it steps
            self._host()

    def tick(self) -> None:
        """Start each spare asked for once the job has stepped since (a spare's start on
        these two cores would slow the take-over it is meant to serve), at the lowest CPU
        weight until it takes a place."""
        while self.spares and self.stepped_since(self.spares[0]):
            self.spares.pop(0)
            name = self._host()
            self.cpu.hold(name, self.hosts[name].proc.pid)
            self.waiting.add(name)
        if self.waiting:
            for name in self.waiting & set(self.members()):
                self.cpu.release(name)
                self.waiting.discard(name)

    def _host(self) -> str:
        name = f"h{self.count}"
        argv = [*GEMINI, "--nnodes", "2:2", "--nproc-per-node", "1", "--rdzv-backend",
                "etcd-v3", "--rdzv-endpoint", self.etcd.endpoint, "--rdzv-id", self.run_id,
                "--rdzv-conf", "last_call_timeout=1", "--store", self.etcd.url,
                "--max-restarts", "1000", "--replication-addr", "127.0.0.1", *self.train]
        self.hosts[name] = Host(argv, dict(self.env, GEMINI_HOST_ID=name,
                                           GEMINI_SHM_DIR=_shm_dir(self.shm, self.count)))
        self.count += 1
        return name

    def members(self) -> list[str]:
        """Live hosts that ever started workers (a spare has not)."""
        started = {str(e["host"]) for e in _events(Path(self.tmp) / "runs")
                   if e["event"] == "start"}
        return sorted(started & set(self.hosts)) or sorted(self.hosts)[:2]

    def fault(self, kind: str, rng: random.Random) -> Callable[[], None] | None:
        victim = rng.choice(self.members())
        if kind == "worker":
            starts = [e for e in _events(Path(self.tmp) / "runs")
                      if e["event"] == "start" and e["host"] == victim]
            try:
                os.kill(int(starts[-1]["workers"][0]["pid"]), signal.SIGKILL)  # type: ignore[index]
            except (IndexError, ProcessLookupError):
                pass
        elif kind == "host":
            self.drop(victim)
            self.spares.append(time.time())  # the scheduler's replacement: the next spare
        elif kind == "freeze":
            _signal_tree(self.hosts[victim].proc.pid, signal.SIGSTOP)

            def after() -> None:  # once the job stepped on without it
                self.drop(victim)
                self.spares.append(time.time())
            return after
        elif kind == "store":
            self.etcd.stop()
            time.sleep(1.0)
            self.etcd.start()
        return None

    def close(self) -> None:
        super().close()
        self.cpu.close()

    def live(self) -> dict[str, Any] | None:
        shown = subprocess.run([sys.executable, "-m", "gemini_cli", "status", "--store",
                                self.etcd.url, "--run-id", self.run_id, "--json"],
                               capture_output=True, text=True, env=self.env, timeout=60)
        if shown.returncode != 0:
            return None
        report: dict[str, Any] | None = json.loads(shown.stdout).get("goodput")
        return report


class Torchrun(Job):
    name = "torchrun + torch.save"

    def __init__(self, *args: Any, every: int, hang_after: float) -> None:
        super().__init__(*args)
        self.every, self.hang_after = every, hang_after
        self.checkpoint = f"every {every}"
        self.frozen_at: float | None = None

    def start(self) -> None:
        self.port, self.run_id = _free_port(), f"campaign-{time.monotonic_ns()}"
        for i in range(2):  # host 0 serves the c10d store: start it first
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    f"127.0.0.1:{self.port}", "--rdzv-id", self.run_id, "--rdzv-conf",
                    f"last_call_timeout=1,is_host={int(i == 0)}", "--max-restarts", "1000",
                    "--monitor-interval", "0.1", *self.train, "--torch-save",
                    f"{self.tmp}/ckpt.pt", "--torch-save-every", str(self.every)]
            self.hosts[f"t{self.count}"] = Host(argv, dict(
                self.env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
            self.count += 1
            time.sleep(0.5)

    def restart(self) -> None:
        for name in list(self.hosts):
            self.drop(name)
        self.start()

    def fault(self, kind: str, rng: random.Random) -> Callable[[], None] | None:
        victim = rng.choice(sorted(self.hosts))
        if kind == "worker":
            for proc in _children(self.hosts[victim].proc.pid):
                if "train_gpt.py" in " ".join(proc.cmdline()):
                    proc.kill()
        elif kind == "host":
            self.restart()
        elif kind == "freeze":
            _signal_tree(self.hosts[victim].proc.pid, signal.SIGSTOP)
            time.sleep(self.hang_after)  # until the watchdog restarts the job
            self.restart()
        return None

    def applies(self, kind: str) -> bool:
        return kind != "store"


class DLRover(Job):
    name = "DLRover Flash Checkpoint"

    def __init__(self, *args: Any, env_dir: Path, every: int, hang_after: float) -> None:
        super().__init__(*args)
        self.env_dir, self.every, self.hang_after = env_dir, every, hang_after
        self.checkpoint = f"memory every step, disk every {every}"
        self.ranks: dict[str, int] = {}  # host -> its node rank
        self.master: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.port, self.job = _free_port(), f"campaign-dlrover-{os.getpid()}-{time.monotonic_ns()}"
        self.master = subprocess.Popen(
            [str(self.env_dir / "bin" / "python"), "-m", "dlrover.python.master.main", "--port",
             str(self.port), "--node_num", "2", "--job_name", self.job, "--platform", "local"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env,
            start_new_session=True)
        _wait_for_port(self.port, timeout=60)
        for rank in range(2):
            self._host(rank)

    def _host(self, rank: int) -> None:
        """A host (a dlrover-run agent) as node ``rank``."""
        name = f"d{self.count}"
        argv = [str(self.env_dir / "bin" / "dlrover-run"), "--nnodes", "2", "--nproc_per_node",
                "1", "--max-restarts", "1000", "--monitor-interval", "0.1", DLROVER_GPT,
                *self.train[1:], "--ckpt-dir", f"{self.tmp}/dlrover", "--disk-every",
                str(self.every)]
        self.hosts[name] = Host(argv, dict(
            self.env, DLROVER_MASTER_ADDR=f"127.0.0.1:{self.port}",
            ELASTIC_JOB_NAME=f"{self.job}-{name}", NODE_RANK=str(rank), NODE_ID=str(self.count),
            NODE_NUM="2"))
        self.ranks[name] = rank
        self.count += 1

    def replace(self, name: str) -> None:
        """The host lost and, at once, a new one in its place (DLRover's pod relaunch)."""
        rank = self.ranks[name]
        self.drop(name)
        self._host(rank)

    def drop(self, name: str) -> None:
        super().drop(name)
        # The host's memory and sockets go with it (named by its own job name).
        for segment in Path("/dev/shm").glob(f"{self.job}-{name}_ckpt_shm_*"):
            segment.unlink(missing_ok=True)
        shutil.rmtree(Path("/tmp/ckpt_sock") / f"{self.job}-{name}", ignore_errors=True)

    def fault(self, kind: str, rng: random.Random) -> Callable[[], None] | None:
        victim = rng.choice(sorted(self.hosts))
        if kind == "worker":  # the agent's checkpoint saver, forked from it, lives on
            for proc in _children(self.hosts[victim].proc.pid):
                argv = " ".join(proc.cmdline())
                if "dlrover_gpt.py" in argv and "dlrover-run" not in argv:
                    proc.kill()
        elif kind == "host":
            self.replace(victim)
        elif kind == "freeze":
            _signal_tree(self.hosts[victim].proc.pid, signal.SIGSTOP)
            time.sleep(self.hang_after)  # until the watchdog replaces it
            self.replace(victim)
        return None

    def applies(self, kind: str) -> bool:
        return kind != "store"

    def close(self) -> None:
        super().close()
        if self.master is not None:
            kill_tree(self.master.pid)
            self.master.wait()
        try:
            Path("/tmp/ckpt_sock").rmdir()  # only if no one else's sockets are left in it
        except OSError:
            pass


class Lmres(Job):
    name = "lm-resiliency (GEMINI)"

    def __init__(self, *args: Any, env_dir: Path, every: int, hang_after: float) -> None:
        super().__init__(*args)
        self.env_dir, self.every, self.hang_after = env_dir, every, hang_after
        self.checkpoint = f"memory every step, disk every {every}"
        # GEMINI's run identity, the same for every restart of the job: a new job loads
        # only the files of a run with its identity.
        self.run_id = f"campaign-lmres-{os.getpid()}-{time.monotonic_ns()}"

    def start(self) -> None:
        self.port, rdzv_id = _free_port(), f"campaign-{time.monotonic_ns()}"
        for i in range(2):  # host 0 serves the c10d store: start it first
            argv = [str(self.env_dir / "bin" / "python"), "-m", "torch.distributed.run",
                    "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", rdzv_id,
                    "--rdzv-conf", f"last_call_timeout=1,is_host={int(i == 0)}",
                    "--max-restarts", "1000", "--monitor-interval", "0.1", LMRES_GPT,
                    *self.train[1:], "--ckpt-dir", f"{self.tmp}/lmres", "--run-id",
                    self.run_id, "--flush-every", str(self.every)]
            self.hosts[f"l{self.count}"] = Host(argv, dict(
                self.env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
            self.count += 1
            time.sleep(0.5)

    def restart(self) -> None:
        """The scheduler restarts the job whole: SIGTERM to every process of it, SIGKILL
        to what is left after the grace, then a new job."""
        for host in self.hosts.values():
            _signal_tree(host.proc.pid, signal.SIGTERM)
        deadline = time.time() + GRACE
        for host in self.hosts.values():
            try:
                host.proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        for name in list(self.hosts):
            self.drop(name)
        self.start()

    def fault(self, kind: str, rng: random.Random) -> Callable[[], None] | None:
        victim = rng.choice(sorted(self.hosts))
        if kind == "worker":
            for proc in _children(self.hosts[victim].proc.pid):
                if "lmres_gpt.py" in " ".join(proc.cmdline()):
                    proc.kill()
        elif kind == "host":
            self.drop(victim)
            self.restart()
        elif kind == "freeze":
            _signal_tree(self.hosts[victim].proc.pid, signal.SIGSTOP)
            time.sleep(self.hang_after)  # until the watchdog restarts the job
            self.restart()
        return None

    def applies(self, kind: str) -> bool:
        return kind != "store"


def _wait_for_port(port: int, timeout: float) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)


def _children(pid: int) -> list[Any]:
    import psutil

    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return []


def log_ettr(steps: list[tuple[float, int, int]], began: float, ended: float
             ) -> tuple[float, float, int]:
    """ETTR by the step lines: distinct steps x median step (consecutive steps of one
    stream) / wall time; and the median step and the steps."""
    done = {step for at, step, _ in steps if at <= ended}
    last: dict[int, tuple[float, int]] = {}
    durations = []
    for at, step, stream in steps:
        if stream in last and step == last[stream][1] + 1:
            durations.append(at - last[stream][0])
        last[stream] = (at, step)
    median = statistics.median(durations) if durations else 0.0
    return len(done) * median / (ended - began), median, len(done)


def campaign(job: Job, faults: list[tuple[float, str]], seconds: float, seed: int
             ) -> dict[str, Any]:
    rng = random.Random(seed + 1)
    began = time.time()
    done = postponed = 0
    last = began
    injected: list[tuple[float, str]] = []

    def wait_for_a_step() -> bool:
        """Wait for a step since the last fault; False once the campaign is over."""
        while not job.stepped_since(last):
            if time.time() >= began + seconds:
                return False
            job.tick()
            time.sleep(0.1)
        return True

    def wait_until(moment: float) -> None:
        while time.time() < moment:
            job.tick()
            time.sleep(0.1)

    try:
        job.start()
        for offset, kind in faults:
            wait_until(began + offset)
            if not job.applies(kind):
                continue
            postponed += not job.stepped_since(last)
            if not wait_for_a_step():
                break
            injected.append((time.time(), kind))
            after = job.fault(kind, rng)
            last = time.time()
            if after is not None and wait_for_a_step():
                after()
                last = time.time()
            done += 1
        wait_until(began + seconds)
        ended = time.time()
        live = job.live()
        lines = job.steps()
    finally:  # an interrupted campaign leaves no process behind
        job.close()
    ettr, step, steps = log_ettr(lines, began, ended)
    _each_fault(job.name, lines, injected, began, step)
    _where_it_went(job.name, lines, [at for at, _ in injected], began, step, live)
    return {"ettr": ettr, "step": step, "steps": steps, "faults": done,
            "postponed": postponed, "wall": ended - began, "live": live}


def _each_fault(name: str, lines: list[tuple[float, int, int]],
                injected: list[tuple[float, str]], began: float, median: float) -> None:
    """What each fault cost (until the next step, the steps redone, and how much longer
    than the median each of the next eight steps took), on stderr."""
    for at, kind in injected:
        before = max((s for t, s, _ in lines if t <= at), default=-1)
        after = [(t, s) for t, s, _ in lines if t > at][:9]
        if after:
            slower = " ".join(f"{b - a - median:+.2f}"
                              for (a, _), (b, _) in itertools.pairwise(after))
            print(f"  {name}: {kind} at +{at - began:.0f} s: next step {after[0][0] - at:.1f} s "
                  f"later, {max(0, before - after[0][1] + 1)} steps redone; the next steps "
                  f"beyond the median: {slower}", file=sys.stderr)


def _where_it_went(name: str, lines: list[tuple[float, int, int]], faults: list[float],
                   began: float, median: float, live: dict[str, Any] | None) -> None:
    """On stderr: the first step's time from the launch, the time lost in steps slower
    than the median (consecutive steps of one stream, no fault between them), and the
    system's own breakdown if it has one."""
    first = min((t for t, _, _ in lines), default=began) - began
    slow, last = 0.0, {}
    for at, step, stream in lines:
        if (stream in last and step == last[stream][1] + 1
                and not any(last[stream][0] <= fault <= at for fault in faults)):
            slow += max(0.0, at - last[stream][0] - median)
        last[stream] = (at, step)
    parts = "" if not live else ", its own breakdown: " + ", ".join(
        f"{part} {seconds:.1f} s" for part, seconds in sorted(
            live.get("lost_s", {}).items(), key=lambda kv: -kv[1]) if seconds >= 0.05)
    print(f"  {name}: first step {first:.1f} s after the launch; steps slower than the "
          f"median {slow:.1f} s{parts}", file=sys.stderr, flush=True)


def save_time(tmp: str) -> float:
    """Seconds rank 0's torch.save of the example's state takes (C of Young's interval)."""
    out = subprocess.run([sys.executable, EXAMPLE, "--steps", "6", *LOSS_MODEL, "--torch-save",
                          f"{tmp}/probe.pt"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    match = re.search(r"median_stall_ms=([\d.]+)", out.stdout)
    if match is None:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    return float(match.group(1)) / 1000


def predicted(mtbf: float, step: float, faults: list[tuple[float, str]]) -> float | None:
    stopping = [k for _, k in faults if k != "store"]
    if not stopping or step <= 0:
        return None
    share = sum(k in ("host", "freeze") for k in stopping) / len(stopping)
    job_mtbf = mtbf * len(faults) / len(stopping)
    out = subprocess.run([sys.executable, "-m", "gemini_cli", "plan", "--nodes", "2",
                          "--job-mtbf", f"{job_mtbf:.3f}", "--step-time", f"{step:.4f}",
                          "--state-bytes", str(HOST_BYTES), "--host-share", f"{share:.3f}",
                          "--spares", "1", "--json"], capture_output=True, text=True,
                         timeout=60)
    value: float = json.loads(out.stdout)["ettr"]
    return value


def installed(system: str, envs: dict[str, Path]) -> str | None:
    """Why ``system`` cannot run here, or None if it can."""
    needs = {"dlrover": "dlrover-run", "lmres": "lm-resiliency-quickstart"}
    if system not in needs:
        return None
    if not (envs[system] / "bin" / needs[system]).exists():
        return (f"no {needs[system]} in {envs[system]} (a virtual environment with it: "
                f"see --{system}-env and ../shared/PEERS.md)")
    return None


def make_job(system: str, tmp: str, shm: str, etcd: EtcdServer, every: int,
             args: argparse.Namespace) -> Job:
    if system == "gemini":
        return Gemini(tmp, shm, etcd)
    if system == "dlrover":
        return DLRover(tmp, shm, etcd, env_dir=args.dlrover_env, every=every,
                       hang_after=args.hang_after)
    if system == "lmres":
        return Lmres(tmp, shm, etcd, env_dir=args.lmres_env, every=every,
                     hang_after=args.hang_after)
    return Torchrun(tmp, shm, etcd, every=every, hang_after=args.hang_after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=15.0, help="per system and rate")
    parser.add_argument("--mtbf", default="60,300", help="mean seconds between faults")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"a comma list of {', '.join(SYSTEMS)} (default: all; a peer "
                             "whose environment is missing is skipped)")
    parser.add_argument("--hang-after", type=float, default=60.0)
    parser.add_argument("--dlrover-env", type=Path, default=PEERS / "dlrover", metavar="PATH",
                        help="a virtual environment with DLRover 0.6.1")
    parser.add_argument("--lmres-env", type=Path, default=PEERS / "lmres", metavar="PATH",
                        help="a virtual environment with lm-resiliency 0.2.0")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C: the jobs, stores and folders of the campaign are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    envs = {"dlrover": args.dlrover_env, "lmres": args.lmres_env}
    systems = []
    for system in args.systems.split(","):
        if system not in SYSTEMS:
            parser.error(f"unknown system {system!r}: one of {', '.join(SYSTEMS)}")
        if (why := installed(system, envs)) is not None:
            print(f"skipping {system}: {why}", file=sys.stderr, flush=True)
        else:
            systems.append(system)
    seconds = args.minutes * 60
    rows = []
    with tempfile.TemporaryDirectory() as probe:
        write = save_time(probe)
    for mtbf in (float(m) for m in args.mtbf.split(",")):
        faults = schedule(args.seed, mtbf, seconds)
        # Young: the step count nearest sqrt(2 C M), M the job's MTBF
        every = max(1, round((2 * write * mtbf) ** 0.5 / (IDLE + 0.1)))
        for system in systems:
            with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(
                    dir="/dev/shm", prefix="bench-") as shm, EtcdServer() as etcd:
                job = make_job(system, tmp, shm, etcd, every, args)
                result = campaign(job, faults, seconds, args.seed)
            live = result["live"]
            plan = predicted(mtbf, result["step"], faults) if system == "gemini" else None
            lost = (1 - result["ettr"]) * result["wall"] / max(1, result["faults"])
            rows.append([f"{mtbf:g} s", job.name, f"{100 * result['ettr']:.1f}%",
                         result["faults"], f"{lost:.1f} s",
                         "-" if not live else f"{100 * live['ettr']:.1f}%",
                         "-" if plan is None else f"{100 * plan:.1f}%",
                         f"{1000 * result['step']:.0f} ms", result["steps"],
                         job.checkpoint])
            print(rows[-1], file=sys.stderr, flush=True)
    print(f"machine: {machine()}; {args.minutes:g} minutes per system and rate, seed "
          f"{args.seed}; torch.save of the state: {write:.2f} s")
    print(table(["one fault every", "system", "ETTR (step log)", "faults",
                 "lost per fault", "live ETTR", "planner", "median step", "steps",
                 "checkpoint"], rows))


if __name__ == "__main__":
    main()
