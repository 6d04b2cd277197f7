"""Failures across hosts: several supervisors on one machine stand in for several hosts.

Each simulated host is a ``gemini run`` with its own shared memory: a private tmpfs on
/dev/shm in its own mount namespace when the tests run as root (so killing the host's
processes really frees its memory), else its own GEMINI_SHM_DIR, deleted on kill. A
killed host is replaced by a new ``gemini run`` that takes its node slot and pulls its
shards from a peer's memory (or, when a whole placement group is lost, every rank
restores from the persistent tier). The resumed run must end bitwise identical to a run
that never failed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from etcd_server import EtcdServer
from helpers import GEMINI, SCRIPTS, assert_one_copy, env_with, events, kill_group, log_ettr, run
from hosts import Host, assert_bitwise, wait_exit, wait_for

# per-gradient all_reduce: bitwise reproducible across restarts with more than 2 ranks
TRAIN = (str(SCRIPTS / "train_ckpt.py"), "--grad-sync", "params")
STEPS = 40
LONG = 60  # for faults late in the run, and a world that shrinks and grows back
RUN_BUDGET = 400  # seconds for one _run_and_replace, within the module's pytest timeout
pytestmark = [pytest.mark.etcd, pytest.mark.timeout(480)]


def _slots(tmp: Path) -> dict[str, int]:
    """Node slot of each host, from its newest rendezvous event."""
    found: dict[str, int] = {}
    for event in events(tmp / "runs"):
        if event["event"] == "rendezvous":
            found[str(event["host"])] = int(event["group_rank"])  # type: ignore[call-overload]
    return found


_REFERENCES: dict[tuple[int, int, tuple[str, ...]], dict] = {}


def _reference(tmp: Path, world: int, *train: str, steps: int = STEPS) -> dict:
    """The same training on one supervisor with the same world size, with no failure
    (run once per world size and arguments: it is deterministic)."""
    if (world, steps, train) not in _REFERENCES:
        _REFERENCES[world, steps, train] = _run_reference(tmp, world, steps, *train)
    return _REFERENCES[world, steps, train]


def _run_reference(tmp: Path, world: int, steps: int, *train: str) -> dict:
    out = tmp / "reference.pt"
    done = run([*GEMINI, "run", "--nproc-per-node", str(world), "--no-standby", *TRAIN, *train,
                "--steps", str(steps), "--out", str(out)],
               env=env_with(tmp / "ref", GEMINI_HOST_ID="ref"), timeout=240)
    assert done.returncode == 0, done.output[-3000:]
    return torch.load(out)


def _run_and_replace(tmp: Path, nodes: int, victims: list[int], *extra: str,
                     nproc: int = 2, spares: int = 0, kill_at: int = 20, steps: int = STEPS,
                     train: tuple[str, ...] = (), replace_after: float = 0.0,
                     probe: Callable[[EtcdServer, list[Host]], None] | None = None,
                     after: Callable[[EtcdServer], None] | None = None) -> list[dict]:
    """Train on ``nodes`` hosts of ``nproc`` workers; once rank 0 printed step ``kill_at``
    kill the hosts in node slots ``victims`` and start one replacement each,
    ``replace_after`` seconds later (or, with ``spares``, start that many more hosts
    before the kill, which wait as standbys: ``--nnodes N:N`` is full); return the restore_plan
    events that follow the kill. ``probe`` runs just before the kill, ``after`` once the
    survivors exited (the store still up). The output of rank 0 goes to ``tmp/out.pt``."""
    hosts: list[Host] = []
    by = time.monotonic() + RUN_BUDGET  # fail with the hosts' logs before pytest's timeout
    with EtcdServer() as etcd:
        def argv() -> list[str]:
            return [*GEMINI, "run", "--nnodes", f"{nodes}:{nodes}", "--nproc-per-node", str(nproc),
                    "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,
                    "--rdzv-id", "repl", "--rdzv-conf", "last_call_timeout=1",
                    "--store", etcd.url, "--host-ttl", "3", "--max-restarts", "5",
                    "--replication-addr", "127.0.0.1", "--no-standby", *extra,
                    *TRAIN, *train, "--steps", str(steps), "--sleep", "0.1",
                    "--out", str(tmp / "out.pt")]

        try:
            hosts = [Host(tmp, f"h{i}", argv()) for i in range(nodes)]
            wait_for(lambda: len(_slots(tmp)) == nodes, 120, "every host in the rendezvous", hosts,
                  by)
            by_slot = {slot: name for name, slot in _slots(tmp).items()}
            rank0 = next(h for h in hosts if h.name == by_slot[0])
            for i in range(spares):
                hosts.append(Host(tmp, f"new{i}", argv()))
                wait_for(lambda i=i: any(e["event"] == "launch" and e["host"] == f"new{i}"
                                      for e in events(tmp / "runs")), 60, "the standby", hosts, by)
            wait_for(lambda: re.search(rf"^step {kill_at} ", rank0.output(), re.M) is not None,
                  180, f"step {kill_at}", hosts, by)
            assert not {f"new{i}" for i in range(spares)} & set(_slots(tmp))  # waiting
            if probe is not None:
                probe(etcd, hosts)
            for slot in victims:
                next(h for h in hosts if h.name == by_slot[slot]).kill()
            killed = time.time()
            time.sleep(replace_after)
            for i in range(0 if spares else len(victims)):
                hosts.append(Host(tmp, f"new{i}", argv()))
            survivors = [h for h in hosts if h.name not in {by_slot[s] for s in victims}]
            wait_exit(survivors, hosts, by)
            for host in survivors:
                assert host.proc.returncode == 0, host.output()[-4000:]
            if after is not None:
                after(etcd)
        finally:
            for host in hosts:
                kill_group(host.proc)
    return [e for e in events(tmp / "runs")
            if e["event"] == "restore_plan" and float(e["ts"]) > killed]  # type: ignore[arg-type]


def _memory_bound(replicas: int, nproc: int) -> Callable[[EtcdServer, list[Host]], None]:
    """A probe: once replication has completed a step, each host's shared memory (its
    files, as its own mount namespace sees them) holds at most 2 x m x the state of its
    ranks, plus small metadata: two slots per own rank, two per rank of m - 1 peers."""
    def probe(etcd: EtcdServer, hosts: list[Host]) -> None:
        wait_for(lambda: any(e["event"] == "replication_progress"
                             for e in events(hosts[0].log.parent / "runs")), 60,
                 "a replicated step", hosts)
        for host in [h for h in hosts if h.name.startswith("h")]:
            shm = (Path(f"/proc/{host.proc.pid}/root") / str(host.shm).lstrip("/")
                   if host.private_mount else host.shm)
            files = {f.name: f.stat().st_size for f in shm.glob("gemini-*/gemini-*")}
            own = [size for name, size in files.items() if re.search(r"-r\d+-s[01]$", name)]
            replicas_held = [n for n in files if re.search(r"-x\d+-s[01]$", n)]
            assert len(own) == 2 * nproc, files
            assert len(replicas_held) == 2 * (replicas - 1) * nproc, files
            state = max(own)
            assert sum(files.values()) <= 2 * replicas * state * nproc + (1 << 20), (
                host.name, files)
    return probe


@pytest.mark.parametrize(("nodes", "nproc", "every", "replicas"), [(3, 2, 3, 3), (4, 1, 1, 2)])
def test_lost_host_resumes_from_peer_memory(tmp_path: Path, nodes: int, nproc: int, every: int,
                                            replicas: int) -> None:
    """Kill the host in node slot 1 (its supervisor, workers and memory) and start a
    replacement: it pulls its ranks from a peer's memory. With --replicate-every 3 only
    every third step is replicated, so the survivors may need theirs back from peers too.
    Before the kill, each host's shared memory holds 2 x m x its state, no more. With two
    workers per host, their replicated state is split between their slots (one copy per
    host), and the replacement restores each rank from both of its ranks' pulled slots.
    With one worker per host, every host holds the same parameters and optimizer state,
    so replication sends little of them (the receivers copy what they hold)."""
    train = ("--replicated",) if nproc > 1 else ("--width", "512")
    reference = _reference(tmp_path, nproc * nodes, *train)
    plans = _run_and_replace(tmp_path, nodes, [1], "--replicate-every", str(every),
                             "--replicas", str(replicas), nproc=nproc, train=train,
                             probe=_memory_bound(replicas, nproc))
    assert {p["host"] for p in plans} == {"new0"} | {f"h{i}" for i in range(nodes)} - {"h1"}, plans
    assert len({p["step"] for p in plans}) == 1 and plans[0]["step"] >= 15, plans
    assert plans[0]["step"] % every == 0, plans
    for plan in plans:  # the replacement pulls from a peer, the survivors use their own memory
        want = {"peer"} if plan["host"] == "new0" else {"memory"} if every == 1 else {"memory", "peer"}
        assert set(plan["sources"].values()) <= want and plan["sources"], plan  # type: ignore[union-attr]
    assert_bitwise(torch.load(tmp_path / "out.pt"), reference)
    if nproc == 1:
        done = [e for e in events(tmp_path / "runs") if e["event"] == "replication_done"]
        sent, skipped = (sum(int(e[k]) for e in done) for k in ("sent", "skipped"))  # type: ignore[call-overload]
        assert len(done) == nodes and skipped > 2 * sent, done


def test_standby_host_takes_the_lost_slot(tmp_path: Path) -> None:
    """A third host started with the same flags while ``--nnodes 2:2`` is full waits in
    the rendezvous; when a host is lost it is admitted in its place, takes its node slot
    and its ranks' copies from the surviving peer's memory: pulled as soon as it learned
    of the loss (a take-over), or once the round's plan names the step."""
    reference = _reference(tmp_path, 4)
    log = tmp_path / "steps.log"
    goodput: dict = {}

    def read_goodput(etcd: EtcdServer) -> None:
        shown = run([*GEMINI, "status", "--store", etcd.url, "--run-id", "repl", "--json"],
                    env=env_with(tmp_path))
        assert shown.returncode == 0, shown.output
        goodput.update(json.loads(shown.stdout)["goodput"])

    plans = _run_and_replace(tmp_path, 2, [1], spares=1, train=("--step-log", str(log)),
                             after=read_goodput)
    # Goodput is the same on the survivor and on the spare that went on from its ledger,
    # and as the workload's own step log has it.
    want, steps, _ = log_ettr(log)
    assert goodput["steps"] == steps == STEPS and goodput["failures"] >= 1, goodput
    for host in ("h0", "new0"):
        assert abs(goodput["hosts"][host] - want) < 0.03, (host, goodput, want)
    assert _slots(tmp_path)["new0"] == 1
    # A heartbeat (or the survivor's failed worker) found nothing listening where h1's
    # supervisor had: h1's lease was revoked at once rather than left to expire.
    dead = [e for e in events(tmp_path / "runs") if e["event"] == "host_dead"]
    assert dead and {e["lost"] for e in dead} == {"h1"}, dead
    assert all("no longer listens" in str(e["evidence"]) for e in dead), dead
    assert not [e for e in events(tmp_path / "runs") if e["event"] == "host_unresponsive"]
    assert {p["host"] for p in plans} == {"h0", "new0"}, plans
    assert len({p["step"] for p in plans}) == 1 and plans[0]["step"] >= 15, plans
    taken = {e["rank"]: e["step"] for e in events(tmp_path / "runs")
             if e["event"] == "take_over" and e["host"] == "new0"}
    assert set(taken) == {2, 3}, taken  # h1's ranks, pulled before the round formed
    for plan in plans:
        for rank, source in plan["sources"].items():  # type: ignore[union-attr]
            # the newest replica of a rank may be newer than the step every rank holds
            early = plan["host"] == "new0" and taken[int(rank)] == plan["step"]
            want = "peer" if plan["host"] == "new0" and not early else "memory"
            assert source == want, (plan, taken)
    assert_bitwise(torch.load(tmp_path / "out.pt"), reference)


# ~3 MB of model and Adam state per rank and 3 MiB that differ for every rank (a peer
# holds the model and optimizer state already, so only those are sent), replicated at
# 4 MB/s: one replication takes several iterations, so the replicas of every host lag
# behind its own newest steps.
SLOW = ("--replication-rate", "4")
STATE = ("--width", "256", "--depth", "4", "--private-mb", "3")


@pytest.mark.parametrize("spares", [0, 1])
def test_a_lost_host_costs_at_most_the_replication_lag(tmp_path: Path, spares: int) -> None:
    """Replication lags several steps behind training; the host of rank 0 is killed at a
    random step, mid-replication, and a spare (or a replacement started a second later)
    takes its place. Every rank resumes at one step no older than the replication lag
    bound (2k + margin steps, k the steps between two replicated steps), never at step 0,
    and training ends bitwise equal to a run without failure: a torn replica is never
    chosen."""
    reference = _reference(tmp_path, 2, *STATE, steps=LONG)
    kill_at = random.randint(25, 40)
    plans = _run_and_replace(tmp_path, 2, [0], *SLOW, nproc=1, spares=spares, kill_at=kill_at,
                             steps=LONG,
                             train=STATE, replace_after=0 if spares else 1.0)
    killed = min(float(p["ts"]) for p in plans)  # type: ignore[arg-type]
    progress = [e for e in events(tmp_path / "runs")
                if e["event"] == "replication_progress" and float(e["ts"]) < killed]  # type: ignore[arg-type]
    assert progress, "replication never completed a step before the kill"
    every = max(int(e["every"]) for e in progress)  # type: ignore[call-overload]
    margin = max(int(e["margin"]) for e in progress)  # type: ignore[call-overload]
    assert every > 1, progress  # the lag is real: replication takes several steps
    assert {p["host"] for p in plans} == {"h1", "new0"}, plans
    assert len({p["step"] for p in plans}) == 1, plans
    step = plans[0]["step"]
    # 2k + margin, plus a step for each read of the plan and the kill's own delay
    assert step is not None and step >= kill_at - (2 * every + margin + 3), (kill_at, plans)
    assert_bitwise(torch.load(tmp_path / "out.pt"), reference)


def test_a_replica_torn_by_the_loss_is_never_chosen(tmp_path: Path) -> None:
    """The host of rank 0 dies while its push of the next target is on the wire: the
    survivor holds half a replica of it next to its complete replica of s*. Every rank
    resumes at s*, and the run ends bitwise equal to one without failure."""
    from launcher.replication.progress import Plan
    from launcher.store import open_store

    reference = _reference(tmp_path, 2, *STATE)
    at_kill: list[Plan] = []

    def mid_push(etcd: EtcdServer, hosts: list[Host]) -> None:
        store = open_store(etcd.url)
        try:
            def pushing() -> bool:
                plan = Plan.loads(store.get("gemini/runs/repl/replication/plan"))
                if plan is None or plan.sstar < 0:
                    return False
                steps = [int(m) for log in tmp_path.glob("h*.log")
                         for m in re.findall(r"^step (\d+) ", log.read_text(), re.M)]
                # one push takes about 0.8 s, several steps: two steps after the target
                # was committed it is half sent
                if max(steps, default=-1) >= plan.target + 2:
                    at_kill.append(plan)
                    return True
                return False
            wait_for(pushing, 120, "a push on the wire", [])
        finally:
            store.close()

    plans = _run_and_replace(tmp_path, 2, [0], *SLOW, nproc=1, spares=1, train=STATE,
                             probe=mid_push)
    sstar = at_kill[-1].sstar
    assert {p["host"] for p in plans} == {"h1", "new0"}, plans
    assert {p["step"] for p in plans} == {sstar}, (at_kill, plans)
    survivor = next(p for p in plans if p["host"] == "h1")
    assert survivor["replicas"]["0"] == [sstar], survivor  # the other slot: torn, unverified
    assert_bitwise(torch.load(tmp_path / "out.pt"), reference)


def test_a_worker_crash_restarts_every_host_in_one_round(tmp_path: Path) -> None:
    """Three hosts of one worker and a spare; the worker of the host in node slot 1 is
    SIGKILLed. Its supervisor says so through the store, and every member restarts at
    once: none takes it for a spare (no ``spares_waiting``), none waits for its own
    workers' collectives with the dead one to fail (no worker exits but the victim's),
    every member rendezvouses exactly once more, with the same hosts (the spare keeps
    waiting), and the run ends bitwise equal to one that never failed."""
    reference = _reference(tmp_path, 3)
    hosts: list[Host] = []
    by = time.monotonic() + RUN_BUDGET
    with EtcdServer() as etcd:
        argv = [*GEMINI, "run", "--nnodes", "3:3", "--nproc-per-node", "1",
                "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,
                "--rdzv-id", "repl", "--rdzv-conf", "last_call_timeout=1", "--store",
                etcd.url, "--max-restarts", "3", "--replication-addr", "127.0.0.1",
                "--no-standby", *TRAIN, "--steps", str(STEPS), "--sleep", "0.1",
                "--out", str(tmp_path / "out.pt")]
        try:
            hosts = [Host(tmp_path, f"h{i}", argv) for i in range(3)]
            wait_for(lambda: len(_slots(tmp_path)) == 3, 120, "every host in the rendezvous",
                     hosts, by)
            hosts.append(Host(tmp_path, "spare", argv))
            by_slot = {slot: name for name, slot in _slots(tmp_path).items()}
            rank0 = next(h for h in hosts if h.name == by_slot[0])
            wait_for(lambda: re.search(r"^step 20 ", rank0.output(), re.M) is not None, 180,
                     "step 20", hosts, by)
            start = [e for e in events(tmp_path / "runs")
                     if e["event"] == "start" and e["host"] == by_slot[1]][-1]
            killed = time.time()
            os.kill(int(start["workers"][0]["pid"]), signal.SIGKILL)  # type: ignore[index]
            wait_exit(hosts[:3], hosts, by)
            for host in hosts[:3]:
                assert host.proc.returncode == 0, host.output()[-4000:]
            wait_exit(hosts[3:], hosts, by)  # the closed rendezvous ends the spare
        finally:
            for host in hosts:
                kill_group(host.proc)
    after = [e for e in events(tmp_path / "runs") if float(e["ts"]) > killed]  # type: ignore[arg-type]
    restarted = {str(e["host"]): float(e["ts"]) for e in after if e["event"] == "restart"}  # type: ignore[arg-type]
    assert sorted(restarted) == ["h0", "h1", "h2"], after
    # (in the next round the spare waits beside the full group again: that is noted)
    assert not [e for e in after if e["event"] == "spares_waiting"
                and float(e["ts"]) < restarted[str(e["host"])]], after  # type: ignore[arg-type]
    assert [e["host"] for e in after if e["event"] == "worker_exit"] == [by_slot[1]], after
    said = {e["host"] for e in after if e["event"] == "member_failed"}
    assert said == {by_slot[0], by_slot[2]}, after
    rounds = sorted(str(e["host"]) for e in after if e["event"] == "rendezvous")
    assert rounds == ["h0", "h1", "h2"], rounds
    # not a timing target (benchmarks/worker_kill_bench.py): no wait for a timeout
    started = [float(e["ts"]) for e in after if e["event"] == "start"]  # type: ignore[arg-type]
    assert len(started) == 3 and max(started) - killed < 20, after
    plans = [e for e in after if e["event"] == "restore_plan"]
    # the newest step every rank holds in its own memory: the step in flight at the kill,
    # or one older where a survivor's save of the next step had to take the slot that
    # held it while the other kept s* for replication (docs/replication.md)
    held = [set(steps) for p in plans for steps in p["local"].values()]  # type: ignore[union-attr]
    assert len({p["step"] for p in plans}) == 1, plans
    assert plans[0]["step"] == max(set.intersection(*held)) >= 18, plans
    assert all(set(p["sources"].values()) == {"memory"} for p in plans), plans  # type: ignore[union-attr]
    assert_bitwise(torch.load(tmp_path / "out.pt"), reference)


def test_spares_wait_without_disturbing_the_group(tmp_path: Path) -> None:
    """Two spares started while two hosts train: the group never restarts for them; the
    loss of a host costs exactly one recovery round, in which one spare takes its place
    while the other keeps waiting, and ends when the job does (one spare alone:
    test_standby_host_takes_the_lost_slot)."""
    spares = 2
    def status(etcd: EtcdServer, hosts: list[Host]) -> None:
        def read() -> dict:
            done = run([*GEMINI, "status", "--json", "--store", etcd.url, "--run-id", "repl"],
                       env=env_with(tmp_path), timeout=60)
            assert done.returncode == 0, done.output
            return json.loads(done.stdout)

        found = read()
        assert sorted(found["spares"]) == [f"new{i}" for i in range(spares)], found["hosts"]
        assert found["replication"]["sstar"] >= 0, found["replication"]
        # hot once their slots are reserved (these run without standby workers)
        wait_for(lambda: len(read()["ready_spares"]) == spares, 30, "the spares to be ready",
                 hosts)
        table = run([*GEMINI, "status", "--store", etcd.url, "--run-id", "repl"],
                    env=env_with(tmp_path), timeout=60)
        assert "host-loss recovery step s*:" in table.stdout and "new0 (ready)" in table.stdout

    plans = _run_and_replace(tmp_path, 2, [1], nproc=1, spares=spares, probe=status)
    found = events(tmp_path / "runs")
    killed = min(float(e["ts"]) for e in found if e["event"] == "restart")  # type: ignore[arg-type]
    rounds = [e for e in found if e["event"] == "rendezvous"]
    before = [e for e in rounds if float(e["ts"]) < killed]  # type: ignore[arg-type]
    assert sorted(str(e["host"]) for e in before) == ["h0", "h1"], before
    after = [str(e["host"]) for e in rounds if float(e["ts"]) >= killed]  # type: ignore[arg-type]
    assert sorted(after) == ["h0", "new0"] or sorted(after) == ["h0", "new1"], after
    assert len({p["step"] for p in plans}) == 1 and plans[0]["step"] >= 15, plans


def test_lost_group_resumes_from_the_persistent_tier(tmp_path: Path) -> None:
    """Four hosts, two placement groups {0, 1} and {2, 3}: losing both hosts of the first
    group loses every in-memory copy of their ranks, so all ranks restore the newest
    step complete in the persistent tier."""
    from launcher.persist import complete_steps

    reference = _reference(tmp_path, 4)
    persist = tmp_path / "persist"

    def persisted(etcd: EtcdServer, hosts: list[Host]) -> None:
        # the writers run at low priority: on a busy machine step 15 lands after step 20
        wait_for(lambda: max(complete_steps(persist, "repl"), default=-1) >= 15, 60,
                 "a complete persisted step >= 15", hosts)

    plans = _run_and_replace(tmp_path, 4, [0, 1], "--persist-dir", str(persist),
                             "--persist-every", "5", nproc=1, probe=persisted)
    assert len(plans) == 4 and len({p["step"] for p in plans}) == 1, plans
    step = plans[0]["step"]
    assert step is not None and step >= 15 and step % 5 == 0, plans
    for plan in plans:  # survivors may still hold that step in their own memory
        want = {"persist"} if str(plan["host"]).startswith("new") else {"persist", "memory"}
        assert set(plan["sources"].values()) <= want, plan  # type: ignore[union-attr]
    assert {p["host"] for p in plans if "persist" in p["sources"].values()} >= {"new0", "new1"}
    assert_bitwise(torch.load(tmp_path / "out.pt"), reference)


def test_without_a_spare_the_job_shrinks_then_grows_back(tmp_path: Path) -> None:
    """``--nnodes 2:3``, three hosts of one worker, no spare: the host in node slot 1 is
    killed and the two survivors go on at once as a world of 2, each rank from a whole
    copy of the DDP-style state in memory (rank 1 from the replica its new host keeps);
    a host started a little later is admitted at the next round, and the world of 3
    resumes from the world of 2's copies. The result equals a reference that changed its
    world size at the same steps (three plain torchrun runs chained through files)."""
    hosts: list[Host] = []
    by = time.monotonic() + RUN_BUDGET
    with EtcdServer() as etcd:
        argv = [*GEMINI, "run", "--nnodes", "2:3", "--nproc-per-node", "1",
                "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,
                "--rdzv-id", "shrink", "--rdzv-conf", "last_call_timeout=1", "--store", etcd.url,
                "--max-restarts", "5", "--replication-addr", "127.0.0.1", "--no-standby",
                *TRAIN, "--steps", str(LONG), "--sleep", "0.1", "--out", str(tmp_path / "out.pt")]
        try:
            rank0, victim = _kill_node_one(tmp_path, argv, 3, r"^step 20 ", hosts, by)

            def resized(world: int) -> list[dict]:
                return [e for e in events(tmp_path / "runs") if e["event"] == "restore_plan"
                        and e.get("world_size") == world and e.get("from_world_size")]

            wait_for(lambda: len(resized(2)) == 2, 60, "the survivors to shrink", hosts, by)
            shrunk = resized(2)[0]["step"]
            wait_for(lambda: re.search(rf"^step {shrunk + 6} ", rank0.output(), re.M) is not None,
                     60, "steps in the world of 2", hosts, by)
            hosts.append(Host(tmp_path, "back", argv))
            survivors = [h for h in hosts if h is not victim]
            wait_exit(survivors, hosts, by)
            for host in survivors:
                assert host.proc.returncode == 0, host.output()[-4000:]
        finally:
            for host in hosts:
                kill_group(host.proc)
    shrinks, grows = resized(2), resized(3)
    assert len(shrinks) == 2 and {p["from_world_size"] for p in shrinks} == {3}, shrinks
    assert len({p["step"] for p in shrinks}) == 1 and shrunk >= 15, shrinks
    for plan in shrinks:
        assert set(plan["sources"].values()) <= {"memory", "peer"}, plan  # type: ignore[union-attr]
    assert len(grows) == 3 and {p["from_world_size"] for p in grows} == {2}, grows
    grown = grows[0]["step"]
    assert len({p["step"] for p in grows}) == 1 and grown > shrunk, grows
    reference = _chained_reference(tmp_path, [(3, shrunk), (2, grown), (3, LONG - 1)])
    assert_bitwise(torch.load(tmp_path / "out.pt"), reference)


def test_ddp_state_shared_by_local_ranks_shrinks_onto_the_survivor(tmp_path: Path) -> None:
    """``--nnodes 1:2``, two hosts of two workers whose ranks keep one copy of the
    replicated state between them (each rank's slot holds its share and points to the
    other rank's for the rest): the host in node slot 1 is killed and the survivor goes on
    at once as a world of 2, each new rank assembling the old rank's whole state from both
    of its host's slots. The result equals a reference that changed its world size at the
    same step (two plain torchrun runs chained through a file)."""
    rank0, plan = _shrink_two_by_two(tmp_path, r"^step 10 ", *TRAIN, "--replicated",
                                     "--report-slots", "--steps", "30", "--sleep", "0.05",
                                     "--out", str(tmp_path / "out.pt"))
    assert set(plan["sources"].values()) <= {"memory"}, plan  # type: ignore[union-attr]
    shrunk = plan["step"]
    assert isinstance(shrunk, int) and shrunk >= 6, plan
    assert_one_copy([rank0.output()], 2)
    reference = _chained_reference(tmp_path, [(4, shrunk), (2, 29)])
    assert_bitwise(torch.load(tmp_path / "out.pt"), reference)


def _shrink_two_by_two(tmp: Path, step: str, *script: str) -> tuple[Host, dict]:
    """``--nnodes 1:2``, two hosts of two workers running ``script``: once rank 0 printed a
    line matching ``step``, kill the host in node slot 1; the survivor must go on alone
    and finish. Returns the survivor and its one restore plan, for a world of 2 from 4."""
    hosts: list[Host] = []
    by = time.monotonic() + RUN_BUDGET
    with EtcdServer() as etcd:
        argv = [*GEMINI, "run", "--nnodes", "1:2", "--nproc-per-node", "2",
                "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,
                "--rdzv-id", "shrink", "--rdzv-conf", "last_call_timeout=1",
                "--store", etcd.url, "--max-restarts", "3", "--replication-addr", "127.0.0.1",
                "--no-standby", *script]
        try:
            rank0, _ = _kill_node_one(tmp, argv, 2, step, hosts, by)
            wait_for(lambda: rank0.proc.poll() is not None, 300, "the survivor to finish",
                     hosts, by)
            assert rank0.proc.returncode == 0, rank0.output()[-4000:]
        finally:
            for host in hosts:
                kill_group(host.proc)
    plans = [e for e in events(tmp / "runs") if e["event"] == "restore_plan"
             and e.get("world_size") == 2]
    assert len(plans) == 1 and plans[0]["from_world_size"] == 4, plans
    return rank0, plans[0]


def _kill_node_one(tmp: Path, argv: list[str], count: int, step: str, hosts: list[Host],
                   by: float) -> tuple[Host, Host]:
    """Start ``count`` hosts (appended to ``hosts``); once the host in node slot 0 printed
    a line matching ``step``, kill the one in node slot 1. Returns both."""
    hosts += [Host(tmp, f"h{i}", argv) for i in range(count)]
    wait_for(lambda: len(_slots(tmp)) == count, 120, "every host in the rendezvous", hosts, by)
    by_slot = {slot: name for name, slot in _slots(tmp).items()}
    rank0 = next(h for h in hosts if h.name == by_slot[0])
    wait_for(lambda: re.search(step, rank0.output(), re.M) is not None, 180, step, hosts, by)
    victim = next(h for h in hosts if h.name == by_slot[1])
    victim.kill()
    return rank0, victim


def _chained_reference(tmp: Path, phases: list[tuple[int, int]]) -> dict:
    """Plain torchrun runs of the same training, each of ``world`` workers up to and
    including ``last``, each starting from the state the previous one wrote."""
    previous = ""
    for i, (world, last) in enumerate(phases):
        out = tmp / f"phase{i}.pt"
        done = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(world), *TRAIN, "--steps", str(last + 1),
                    "--out", str(out), *(["--init", previous] if previous else [])],
                   env=env_with(tmp / "ref"), timeout=240)
        assert done.returncode == 0, done.output[-3000:]
        previous = str(out)
    return torch.load(previous)


def test_an_fsdp2_job_without_a_spare_reshards_onto_the_survivors(tmp_path: Path) -> None:
    """FSDP2 (DTensor shards, gloo), ``--nnodes 1:2``, two hosts of two workers, no spare:
    the host in node slot 1 is killed and the survivor goes on at once as a world of 2.
    Its ranks assemble their shards of the restore step from the four old ranks' copies
    (two in its own slots, two in the replicas it kept of the lost host): the full state
    right after the restore equals, bit for bit, the full state the world of 4 saved at
    that step, and the job finishes."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    rank0, plan = _shrink_two_by_two(tmp_path, r"^step 12$", str(SCRIPTS / "train_fsdp.py"),
                                     "--steps", "40", "--sleep", "0.1", "--dump", str(dumps))
    step = plan["step"]
    assert step is not None and step >= 8, plan
    assert "each rank assembles its shard" in rank0.output()
    restored = torch.load(dumps / f"restored-2-{step}.pt")
    saved = torch.load(dumps / f"saved-4-{step}.pt")
    assert sorted(restored) == sorted(saved) and len(saved) == 16
    for key, tensor in saved.items():
        assert torch.equal(restored[key], tensor), key
    assert (dumps / "saved-2-39.pt").exists()
