"""The cluster's own faults while a two-host job trains: etcd killed and restarted, etcd
hung (SIGSTOP), members of a three-member etcd cluster lost.

The workers need no store to train, so an outage shorter than ``--store-timeout`` must
leave the job untouched: no restart, and final weights bitwise equal to a run that saw
no outage. Past the window the supervisors exit 3 and keep their memory, from which the
next ``gemini run`` resumes.
"""

from __future__ import annotations

import random
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from etcd_server import EtcdCluster, EtcdServer
from helpers import GEMINI, SCRIPTS, env_with, events, kill_group, run
from hosts import Host, assert_bitwise, wait_exit, wait_for

from launcher.coordination import read_status
from launcher.store import open_store

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(480)]

TRAIN = (str(SCRIPTS / "train_ckpt.py"), "--grad-sync", "params")
STEPS = 120


def _argv(tmp: Path, endpoint: str, *extra: str, sleep: float = 0.15) -> list[str]:
    return [*GEMINI, "run", "--nnodes", "2:2", "--nproc-per-node", "1",
            "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", "outage",
            "--rdzv-conf", "last_call_timeout=1", "--store", f"etcd://{endpoint}",
            "--host-ttl", "3", "--max-restarts", "3", "--replication-addr", "127.0.0.1",
            "--no-standby", *extra, *TRAIN, "--steps", str(STEPS), "--sleep", str(sleep),
            "--out", str(tmp / "out.pt")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same training on one supervisor with the same world size, with no fault."""
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "reference.pt"
    done = run([*GEMINI, "run", "--nproc-per-node", "2", "--no-standby", *TRAIN,
                "--steps", str(STEPS), "--out", str(out)],
               env=env_with(tmp, GEMINI_HOST_ID="ref"), timeout=240)
    assert done.returncode == 0, done.output[-3000:]
    return torch.load(out)


def _step(host: Host) -> int:
    """The newest step the host's rank 0 printed (-1 before the first)."""
    steps = re.findall(r"^step (\d+) ", host.output(), re.M)
    return int(steps[-1]) if steps else -1


def _train_through(tmp: Path, endpoint: str, fault: Callable[[list[Host]], None],
                   *extra: str, private_mount: bool = True, sleep: float = 0.15) -> list[Host]:
    """Two hosts train, each step lasting at least ``sleep`` seconds; ``fault(hosts)``
    runs once rank 0 reached step 5; returns the hosts once both exited."""
    hosts: list[Host] = []
    by = time.monotonic() + 400
    try:
        hosts += [Host(tmp, f"h{i}", _argv(tmp, endpoint, *extra, sleep=sleep),
                      private_mount=private_mount)
                 for i in range(2)]
        wait_for(lambda: max(_step(h) for h in hosts) >= 5, 180, "step 5", hosts, by)
        fault(hosts)
        wait_exit(hosts, hosts, by)
    finally:
        for host in hosts:
            kill_group(host.proc)
    return hosts


def _assert_untouched(tmp: Path, hosts: list[Host], reference: dict) -> list[dict]:
    """Both hosts finished, nothing restarted, the weights equal the reference; returns
    the store_back events."""
    for host in hosts:
        assert host.proc.returncode == 0, host.output()[-4000:]
    found = events(tmp / "runs")
    assert not [e for e in found if e["event"] in ("restart", "worker_exit")], found
    assert_bitwise(torch.load(tmp / "out.pt"), reference)
    return [e for e in found if e["event"] == "store_back"]


def _backs(tmp: Path) -> int:
    return sum(e["event"] == "store_back" for e in events(tmp / "runs"))


def test_etcd_killed_and_restarted_never_stops_training(tmp_path: Path, reference: dict) -> None:
    """etcd SIGKILLed and restarted on its data after 0.5, 2 and 8 s, at random moments."""
    rng = random.Random()
    with EtcdServer() as etcd:
        def restarts(_: list[Host]) -> None:
            for down in (0.5, 2.0, 8.0):
                time.sleep(rng.uniform(0.2, 1.5))
                etcd.stop(sig=signal.SIGKILL)
                time.sleep(down)
                etcd.start()

        hosts = _train_through(tmp_path, etcd.endpoint, restarts)
    backs = _assert_untouched(tmp_path, hosts, reference)
    assert {e["host"] for e in backs} == {"h0", "h1"}, backs
    assert max(float(e["seconds"]) for e in backs) >= 7, backs  # type: ignore[arg-type]
    unreachable = [e for e in events(tmp_path / "runs") if e["event"] == "store_unreachable"]
    assert len(unreachable) == len(backs), (unreachable, backs)


def test_etcd_cluster_members_lost_never_stop_training(tmp_path: Path, reference: dict) -> None:
    """Three etcd members: the leader killed (the others elect a new one), later two of
    the three killed at once (no quorum) for 3 s and brought back."""
    with EtcdCluster(3) as cluster:
        def member_losses(_: list[Host]) -> None:
            leader = cluster.leader()
            leader.stop(sig=signal.SIGKILL)
            time.sleep(2)
            leader.start()
            time.sleep(1)
            two = cluster.members[:2]
            for member in two:
                member.stop(sig=signal.SIGKILL)
            time.sleep(3)
            for member in two:
                member.launch()
            cluster.leader(timeout=30)

        hosts = _train_through(tmp_path, cluster.endpoint, member_losses)
    _assert_untouched(tmp_path, hosts, reference)


def test_hung_etcd_within_the_window_then_past_it(tmp_path: Path, reference: dict) -> None:
    """etcd frozen for 3 s: ridden out. Frozen for longer than --store-timeout: both
    supervisors exit 3 within the window and a few seconds, keeping their memory; once
    etcd is back, the same command resumes from that memory and ends as an unfailed run."""
    window = 6.0
    with EtcdServer() as etcd:
        frozen: list[float] = []

        def hangs(hosts: list[Host]) -> None:
            etcd.send(signal.SIGSTOP)
            time.sleep(3)
            etcd.send(signal.SIGCONT)
            wait_for(lambda: max(_step(h) for h in hosts) >= 20, 120, "step 20", hosts)
            wait_for(lambda: _backs(tmp_path) >= 2, 60, "the store back", hosts)
            etcd.send(signal.SIGSTOP)
            frozen.append(time.monotonic())

        extra = ("--store-timeout", str(window))
        # Slow steps: the 100 steps left after the freeze outlast the window and the exit.
        first = _train_through(tmp_path, etcd.endpoint, hangs, *extra, private_mount=False,
                               sleep=0.4)
        exited = time.monotonic()
        etcd.send(signal.SIGCONT)
        for host in first:
            assert host.proc.returncode == 3, host.output()[-3000:]
            assert "unreachable for" in host.output() and "--store-timeout 6" in host.output()
            assert any(host.shm.iterdir()), "the slots were not kept"
        assert exited - frozen[0] < window + 12
        stopped_at = max(_step(h) for h in first)
        assert stopped_at < STEPS - 1
        again = _train_through(tmp_path, etcd.endpoint, lambda _: None, *extra,
                               private_mount=False, sleep=0.0)
    for host in again:
        assert host.proc.returncode == 0, host.output()[-4000:]
    plans = [e for e in events(tmp_path / "runs") if e["event"] == "restore_plan"
             and e["step"] is not None]
    assert plans and all(p["step"] >= 15 for p in plans), plans
    assert all(set(p["sources"].values()) == {"memory"} for p in plans), plans  # type: ignore[union-attr]
    assert_bitwise(torch.load(tmp_path / "out.pt"), reference)


def _signal_host(host: Host, sig: signal.Signals) -> None:
    """``sig`` to every process of the host: its supervisor and its workers."""
    import psutil

    root = psutil.Process(host.proc.pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def test_a_frozen_host_is_fenced_out_and_the_job_goes_on(tmp_path: Path, reference: dict) -> None:
    """Two hosts and a spare; every process of the host in node slot 1 is frozen
    (SIGSTOP: no connection is ever refused). Its supervisor stops answering heartbeats:
    the survivor, the only other running host and so a majority, votes it unresponsive
    long before its lease (--host-ttl 30) would expire, its lease is revoked, and the
    round restarts with the spare, which pulls the frozen host's ranks from the survivor's
    memory. Woken (SIGCONT) after the job moved on, the frozen host stops its stale
    workers, waits as a spare and exits 0 when the job ends; the job's result equals an
    unfailed run's."""
    hosts: list[Host] = []
    by = time.monotonic() + 400
    with EtcdServer() as etcd:
        try:
            argv = _argv(tmp_path, etcd.endpoint, "--host-ttl", "30")
            hosts += [Host(tmp_path, f"h{i}", argv) for i in range(2)]
            wait_for(lambda: max(_step(h) for h in hosts) >= 5, 180, "step 5", hosts, by)
            hosts.append(Host(tmp_path, "spare", argv))
            store = open_store(etcd.url)
            try:
                wait_for(lambda: read_status(store, "outage").spares == ["spare"], 60,
                         "the spare to register", hosts, by)
            finally:
                store.close()
            time.sleep(3)  # and to join the rendezvous
            slots = {str(e["host"]): e["group_rank"] for e in events(tmp_path / "runs")
                     if e["event"] == "rendezvous"}
            frozen = next(h for h in hosts if slots.get(h.name) == 1)
            _signal_host(frozen, signal.SIGSTOP)
            wait_for(lambda: any(e["event"] == "rendezvous" and e["host"] == "spare"
                                 for e in events(tmp_path / "runs")), 25,
                     "the spare to take the frozen host's place", hosts, by)
            time.sleep(2)
            _signal_host(frozen, signal.SIGCONT)
            wait_exit(hosts, hosts, by)
        finally:
            for host in hosts:
                kill_group(host.proc)
    for host in hosts:
        assert host.proc.returncode == 0, host.output()[-4000:]
    found = events(tmp_path / "runs")
    survivor = next(h.name for h in hosts[:2] if h is not frozen)
    unresponsive = [(e["host"], e["lost"], e["votes"]) for e in found
                    if e["event"] == "host_unresponsive"]
    # One vote, the survivor's (the only running host besides the frozen one: a
    # majority); the host that sees the majority complete first (the survivor, or the
    # spare, which votes too but is no voter) revokes the lease and reports it.
    assert [(lost, votes) for _, lost, votes in unresponsive] == [(frozen.name, 1)], unresponsive
    assert unresponsive[0][0] in (survivor, "spare"), unresponsive
    lost = [e for e in found if e["event"] == "member_lost"]
    assert lost and all(e["host"] == survivor and e["lost"] == [frozen.name] for e in lost), lost
    assert [e["host"] for e in found if e["event"] == "fenced"] == [frozen.name]
    assert any(e["event"] == "not_needed" and e["host"] == frozen.name and e["fenced"]
               for e in found)
    plans = [e for e in found if e["event"] == "restore_plan" and e["step"] is not None]
    assert {p["host"] for p in plans} == {survivor, "spare"}, plans
    assert len({p["step"] for p in plans}) == 1, plans
    assert_bitwise(torch.load(tmp_path / "out.pt"), reference)


def test_a_host_frozen_briefly_with_no_spare_rejoins_and_the_job_goes_on(
        tmp_path: Path, reference: dict) -> None:
    """``--nnodes 2:2`` and no spare: one host is frozen (SIGSTOP) for 3 s, long enough
    for the other to find it unresponsive, revoke its lease and reopen the round. Thawed,
    it rejoins that round as a member with empty memory (it was fenced) and pulls its
    ranks from the survivor's replicas: both finish, and the result equals an unfailed
    run's. The survivor must not drop it again from the round it joined because it was
    counted lost a moment before."""
    with EtcdServer() as etcd:
        def freeze(hosts: list[Host]) -> None:
            _signal_host(hosts[1], signal.SIGSTOP)
            time.sleep(3)
            _signal_host(hosts[1], signal.SIGCONT)

        hosts = _train_through(tmp_path, etcd.endpoint, freeze, "--host-ttl", "30", sleep=0.05)
    for host in hosts:
        assert host.proc.returncode == 0, host.output()[-4000:]
    found = events(tmp_path / "runs")
    assert [e["host"] for e in found if e["event"] == "fenced"] == ["h1"], found
    rounds = [(e["host"], e["group_world_size"]) for e in found if e["event"] == "rendezvous"]
    assert all(size == 2 for _, size in rounds) and len(rounds) >= 4, rounds
    plans = [e for e in found if e["event"] == "restore_plan" and e["step"] is not None]
    assert {p["host"] for p in plans} == {"h0", "h1"} and len({p["step"] for p in plans}) == 1
    assert_bitwise(torch.load(tmp_path / "out.pt"), reference)
