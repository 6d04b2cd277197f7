"""Coordination through the store: host records, root election and failover, status."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from etcd_server import EtcdServer
from helpers import GEMINI, SCRIPTS, env_with, events, free_port, kill_group, poll, run, start


def _status(tmp: Path, *args: str) -> dict:
    done = run([*GEMINI, "status", "--json", *args], env=env_with(tmp), timeout=60)
    assert done.returncode == 0, done.output
    return json.loads(done.stdout)


def test_single_host_status_with_the_embedded_store(tmp_path: Path) -> None:
    done = run([*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                "--rdzv-id", "status-run", str(SCRIPTS / "train_ckpt.py"), "--steps", "8",
                "--kill", "1:4:step"], env=env_with(tmp_path), timeout=180)
    assert done.returncode == 0, done.output[-3000:]
    status = _status(tmp_path)
    assert status["schema"] == "gemini.status/v1" and status["run_id"] == "status-run"
    (host,) = status["hosts"]
    assert host["status"] == "exited" and host["ranks"] == [0, 1]
    assert host["restart_count"] == 1 and host["round"] == 2
    kinds = [e["event"] for e in status["events"]]
    assert "worker_exit" in kinds and "restart" in kinds and "root_elected" in kinds
    assert kinds[-1] == "exit"
    assert _status(tmp_path, "--run-id", "status-run")["run_id"] == "status-run"
    missing = run([*GEMINI, "status", "--run-id", "nope"], env=env_with(tmp_path))
    assert missing.returncode == 2 and "not found" in missing.stderr


def test_status_during_a_run_shows_every_rank_and_its_newest_step(tmp_path: Path) -> None:
    """While a run trains, ``gemini status`` (printed into a pipe, as in a log) lists
    every rank of the running host from the start, then each rank's newest step in
    memory as it moves; no cell is cut to 80 columns."""
    run_id = "status-live-" + "x" * 70  # a long value: wider than 80 columns with its row
    job = start([*GEMINI, "run", "--nproc-per-node", "2", "--rdzv-id", run_id,
                 str(SCRIPTS / "train_ckpt.py"), "--steps", "400", "--sleep", "0.05"],
                env=env_with(tmp_path), stdout=subprocess.DEVNULL)
    try:
        def live() -> dict | None:
            done = run([*GEMINI, "status", "--json", "--run-id", run_id], env=env_with(tmp_path),
                       timeout=60)
            status = json.loads(done.stdout) if done.returncode == 0 else None
            alive = status and [h for h in status["hosts"] if h["status"] == "alive"]
            return status if alive and sorted(status["ranks"]) == ["0", "1"] else None

        first = poll(live, 120, "the running host's ranks in gemini status")
        assert all(r["host"] == first["hosts"][0]["host"] for r in first["ranks"].values())
        moved = poll(lambda: (s := live()) and all(
            isinstance(r["memory"], int) and r["memory"] >= 20 for r in s["ranks"].values())
            and s, 120, "each rank's newest step in gemini status")
        assert job.poll() is None and moved["hosts"][0]["status"] == "alive"
        shown = run([*GEMINI, "status", "--run-id", run_id], env=env_with(tmp_path), timeout=60)
        assert shown.returncode == 0 and run_id in shown.stdout, shown.stdout
        rows = re.findall(r"^\W*([01])\W+(\S+)\W+(\d+|-)\W", shown.stdout, re.M)
        assert [(rank, step != "-") for rank, _, step in rows] == [("0", True), ("1", True)], (
            shown.stdout)
    finally:
        kill_group(job)


def test_a_member_lost_as_its_round_forms_costs_one_read_timeout(tmp_path: Path) -> None:
    """A member that dies right after the round formed never posts its part of the
    round's set-up (its node slot); the host waits for it for --rdzv-conf read_timeout,
    then rendezvouses again (event round_retry) and trains without it, instead of
    failing (torch's store error) or waiting for the rendezvous' timeout."""
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
    endpoint = f"127.0.0.1:{port}"
    member = start([sys.executable, str(SCRIPTS / "rdzv_member.py"), endpoint, "lost-member"],
                   env=env_with(tmp_path))
    try:
        assert member.stdout is not None and member.stdout.readline() == "waiting\n"
        time.sleep(1)  # in the rendezvous before the host: the round forms as the host joins
        began = time.monotonic()
        done = run([*GEMINI, "run", "--nnodes", "1:2", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                    "--rdzv-id", "lost-member", "--rdzv-conf",
                    "read_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2,"
                    "last_call_timeout=5,is_host=false",
                    str(SCRIPTS / "crash_ddp.py"), "1", "0"], env=env_with(tmp_path), timeout=120)
        elapsed = time.monotonic() - began
        assert member.wait(timeout=10) == -9 and "joined round" in member.stdout.read()
    finally:
        kill_group(member)
    assert done.returncode == 0, done.output[-3000:]
    assert "ok rank=0 restart=0" in done.stdout
    kinds = [e["event"] for e in events(tmp_path / "runs")]
    assert kinds.count("round_retry") == 1 and kinds.count("start") == 1, kinds
    assert elapsed < 60, elapsed


@pytest.mark.etcd
def _killable(tmp: Path, host: str) -> dict[str, str]:
    """The environment of a host whose supervisor the test kills: its segments, which a
    killed supervisor leaves by design, go to a directory of the test's own."""
    shm = tmp / f"{host}-shm"
    shm.mkdir(exist_ok=True)
    return env_with(tmp, GEMINI_HOST_ID=host, GEMINI_SHM_DIR=str(shm))


def test_root_fails_over_within_the_ttl(tmp_path: Path) -> None:
    """Two hosts on etcd; the root host dies; the other becomes root within the TTL and
    records the lost host."""
    with EtcdServer() as etcd:
        port = free_port()

        def host(node_rank: int) -> list[str]:
            return [*GEMINI, "run", "--store", etcd.url, "--host-ttl", "2", "--nnodes", "2",
                    "--node-rank", str(node_rank), "--nproc-per-node", "1",
                    "--master-addr", "127.0.0.1", "--master-port", str(port),
                    "--rdzv-id", "failover", str(SCRIPTS / "idle.py"), "60"]

        # node 1 starts first and becomes root; node 0 hosts the static rendezvous
        first = start(host(1), env=_killable(tmp_path, "h1"))
        try:
            deadline = time.monotonic() + 60
            while True:
                done = run([*GEMINI, "status", "--json", "--store", etcd.url, "--run-id",
                            "failover"], env=env_with(tmp_path), timeout=60)
                if done.returncode == 0 and json.loads(done.stdout)["root"] == "h1":
                    break
                assert time.monotonic() < deadline, done.output
                time.sleep(0.2)
            second = start(host(0), env=_killable(tmp_path, "h0"))
            try:
                deadline = time.monotonic() + 60
                while len([h for h in _status(tmp_path, "--store", etcd.url, "--run-id",
                                              "failover")["hosts"] if h["alive"]]) < 2:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
                time.sleep(1.0)
                kill_group(first)
                killed = time.monotonic()
                while True:
                    status = _status(tmp_path, "--store", etcd.url, "--run-id", "failover")
                    if status["root"] == "h0":
                        break
                    assert time.monotonic() - killed < 2 + 3 + 5, status  # TTL + slack
                    time.sleep(0.2)
                hosts = {h["host"]: h["status"] for h in status["hosts"]}
                # h0 may not have reached a round with h1 before the kill: then it waits
                assert hosts["h1"] == "lost" and hosts["h0"] in ("alive", "waiting"), hosts
                deadline = time.monotonic() + 10
                while not any(e["event"] == "host_lost" and e["lost"] == "h1"
                              for e in status["events"]):
                    assert time.monotonic() < deadline, status["events"]
                    time.sleep(0.2)
                    status = _status(tmp_path, "--store", etcd.url, "--run-id", "failover")
            finally:
                kill_group(second)
        finally:
            kill_group(first)


def test_unreachable_store_fails_fast(tmp_path: Path) -> None:
    began = time.monotonic()
    done = run([*GEMINI, "run", "--store", f"etcd://127.0.0.1:{free_port()}",
                str(SCRIPTS / "idle.py"), "1"], env=env_with(tmp_path), timeout=60)
    assert done.returncode == 3, done.output
    assert time.monotonic() - began < 30
    assert done.stderr.count("\n") == 1 and "gemini: error:" in done.stderr


@pytest.mark.etcd
def test_training_survives_an_etcd_restart(tmp_path: Path) -> None:
    with EtcdServer() as etcd:
        proc = start([*GEMINI, "run", "--store", etcd.url, "--nproc-per-node", "2",
                      "--rdzv-id", "etcd-restart", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                      str(SCRIPTS / "train_ckpt.py"), "--steps", "30", "--sleep", "0.15"],
                     env=env_with(tmp_path))
        try:
            assert proc.stdout is not None
            seen = []
            for line in proc.stdout:
                seen.append(line)
                if line.startswith("step 5 "):
                    break
            etcd.stop()
            time.sleep(3)
            etcd.start()
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, "".join(seen)[-2000:] + out[-3000:]
            assert "step 29 " in out
        finally:
            kill_group(proc)
        status = _status(tmp_path, "--store", etcd.url, "--run-id", "etcd-restart")
        (host,) = status["hosts"]
        assert host["status"] == "exited"
        assert {r["memory"] for r in status["ranks"].values()} == {29}


@pytest.mark.etcd
def test_etcd_v3_rendezvous_survives_the_first_host(tmp_path: Path) -> None:
    """With c10d the first host holds the rendezvous and the job dies with it; with
    etcd-v3 the other host carries on alone (elastic 1:2), from the step its memory holds,
    and the job finishes."""
    with EtcdServer() as etcd:
        def host(name: str, steps: int) -> list[str]:
            return [*GEMINI, "run", "--nnodes", "1:2", "--nproc-per-node", "1",
                    "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,
                    "--rdzv-id", "v3", "--rdzv-conf", "last_call_timeout=1",
                    "--max-restarts", "3", "--store", etcd.url,
                    str(SCRIPTS / "train_ckpt.py"), "--steps", str(steps), "--sleep", "0.05"]

        first = start(host("h0", 200), env=_killable(tmp_path, "h0"))
        second = start(host("h1", 200), env=_killable(tmp_path, "h1"))
        try:
            assert second.stdout is not None
            lines = []
            for line in second.stdout:
                lines.append(line)
                if line.startswith("resume rank="):  # both hosts are training
                    break
            time.sleep(3)
            assert first.poll() is None and second.poll() is None
            kill_group(first)
            out, _ = second.communicate(timeout=180)
            output = "".join(lines) + out
            assert second.returncode == 0, output[-4000:]
            # the survivor went on alone, as rank 0 of a world of 1, from its memory: the
            # job shrank (it had the state of a world of 2). Whether that restart counts
            # against --max-restarts depends on who noticed first: its own failed worker
            # (a failure) or a heartbeat (a membership change).
            resumed = re.search(r"^resume rank=0 start=(\d+) attempt=[01] ", out, re.M)
            assert resumed and int(resumed.group(1)) > 0, output[-4000:]
            assert "step 199 " in out
        finally:
            kill_group(first)
            kill_group(second)


@pytest.mark.etcd
def test_replacement_host_takes_the_lost_slot(tmp_path: Path) -> None:
    """h0 and h1 train; h0 dies; a new host h2 joins and gets h0's node slot (and so its
    ranks) while h1 keeps its own, although torch numbers the members differently."""
    from helpers import events

    with EtcdServer() as etcd:
        def host(name: str) -> subprocess.Popen[str]:
            cmd = [*GEMINI, "run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,
                   "--rdzv-id", "slots", "--max-restarts", "3", "--store", etcd.url,
                   str(SCRIPTS / "train_ckpt.py"), "--steps", "120", "--sleep", "0.05"]
            return start(cmd, env=env_with(tmp_path, GEMINI_HOST_ID=name))

        def slots() -> dict[str, list[int]]:
            found: dict[str, list[int]] = {}
            for e in events(tmp_path / "runs"):
                if e["event"] == "rendezvous":
                    found.setdefault(str(e["host"]), []).append(int(e["group_rank"]))
            return found

        h0, h1 = host("h0"), host("h1")
        h2 = None
        try:
            deadline = time.monotonic() + 60
            while len(slots()) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            first = slots()
            time.sleep(2)
            kill_group(h0)
            h2 = host("h2")
            out, _ = h1.communicate(timeout=180)
            assert h1.returncode == 0, out[-3000:]
            assert h2.wait(timeout=60) == 0
            final = slots()
            assert final["h1"][0] == first["h1"][0] and len(set(final["h1"])) == 1, final
            assert final["h2"][-1] == first["h0"][0], final
        finally:
            for proc in (h0, h1, h2):
                if proc is not None:
                    kill_group(proc)


@pytest.mark.etcd
def test_the_store_does_not_grow_with_restarts(tmp_path: Path) -> None:
    """Two hosts, a worker killed six times: the store holds the rendezvous keys of the
    last two rounds only, so its size does not depend on how often the job restarted."""
    kills = [arg for attempt in range(6) for arg in ("--kill", f"1:{3 + 3 * attempt}:step:{attempt}")]
    with EtcdServer() as etcd:
        def host(i: int) -> subprocess.Popen[str]:
            return start([*GEMINI, "run", "--nnodes", "2:2", "--nproc-per-node", "1",
                          "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,
                          "--rdzv-id", "keys", "--store", etcd.url, "--max-restarts", "10",
                          "--replication-addr", "127.0.0.1", "--no-standby",
                          str(SCRIPTS / "train_ckpt.py"), "--steps", "30", *kills],
                         env=env_with(tmp_path, GEMINI_HOST_ID=f"h{i}",
                                      GEMINI_SHM_DIR=str(tmp_path / f"shm{i}")))
        for i in range(2):
            (tmp_path / f"shm{i}").mkdir()
        hosts = [host(i) for i in range(2)]
        try:
            for proc in hosts:
                out, _ = proc.communicate(timeout=300)
                assert proc.returncode == 0, out[-3000:]
        finally:
            for proc in hosts:
                kill_group(proc)
        restarts = [e for e in events(tmp_path / "runs") if e["event"] == "restart"]
        assert len(restarts) >= 12, restarts
        from launcher.store import open_store

        store = open_store(etcd.url)
        try:
            keys = store.get_prefix("gemini/")
        finally:
            store.close()
    kv = "gemini/rdzv/keys/kv/torch.rendezvous.keys."
    rounds = {k[len(kv):].partition("/")[0] for k in keys if k.startswith(kv)}
    assert len(rounds) <= 2, sorted(rounds)
    assert len(keys) < 120, len(keys)  # 154 before pruning, growing by ~20 a restart


@pytest.mark.etcd
def test_a_run_on_an_etcd_that_asks_for_client_certificates(tmp_path: Path) -> None:
    """Store and etcd-v3 rendezvous on an etcd started with --client-cert-auth: two hosts
    train with the certificate from GEMINI_STORE_* variables, `gemini status` reads the
    run with the same, and nothing of the run's secret is left at its end; without the
    certificate `gemini run` stops with one line and exit code 3."""
    from launcher.coordination import secret_key
    from launcher.store import EtcdCredentials, open_store

    with EtcdServer(tls=True) as etcd:
        assert etcd.tls is not None
        credentials = {"GEMINI_STORE_CACERT": str(etcd.tls.ca),
                       "GEMINI_STORE_CERT": str(etcd.tls.client),
                       "GEMINI_STORE_KEY": str(etcd.tls.client_key)}
        command = [*GEMINI, "run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,
                   "--rdzv-id", "tls", "--store", etcd.url,
                   str(SCRIPTS / "train_ckpt.py"), "--steps", "20", "--sleep", "0.05"]
        procs = [start(command, env=env_with(tmp_path, GEMINI_HOST_ID=name, **credentials))
                 for name in ("h0", "h1")]
        outputs = [proc.communicate(timeout=180)[0] for proc in procs]
        for proc, output in zip(procs, outputs, strict=True):
            assert proc.returncode == 0, output[-3000:]
        assert "step 19 " in outputs[0] + outputs[1]  # rank 0 prints the steps
        done = run([*GEMINI, "status", "--json", "--store", etcd.url, "--run-id", "tls"],
                   env=env_with(tmp_path, **credentials), timeout=60)
        assert done.returncode == 0, done.output
        assert {h["status"] for h in json.loads(done.stdout)["hosts"]} == {"exited"}
        store = open_store(etcd.url, credentials=EtcdCredentials(
            cacert=str(etcd.tls.ca), cert=str(etcd.tls.client), key=str(etcd.tls.client_key)))
        try:
            assert store.get(secret_key("tls")) is None
        finally:
            store.close()

        refused = run([*GEMINI, "run", "--store", etcd.url, "--store-cacert", str(etcd.tls.ca),
                       str(SCRIPTS / "idle.py"), "1"], env=env_with(tmp_path), timeout=60)
        assert refused.returncode == 3, refused.output
        assert refused.stderr.count("\n") == 1 and "gemini: error:" in refused.stderr


def test_a_host_that_stops_answering_heartbeats_is_lost_once_a_majority_agrees(
        tmp_path: Path) -> None:
    """Three supervisors on one store; h0 and h2 run a transport server and heartbeats;
    h1's replication port accepts connections but never answers (a frozen machine: no
    connection is refused). A vote of one host of two is not enough; once both h0 and h2
    suspect h1 it is lost on both, its lease revoked, well within its 30 s TTL, with one
    host_unresponsive event. h0 and h2 never suspect each other."""
    import socket

    from launcher.coordination import CoordinationService
    from launcher.events import EventLog
    from launcher.heartbeat import HeartbeatService
    from launcher.replication.transport import Client, Server
    from launcher.slots import SlotOwner
    from launcher.store import open_store

    url = f"embedded://{tmp_path / 'store.db'}"
    run_id = f"beat-{tmp_path.name}"
    secret = b"s" * 32
    frozen = socket.create_server(("127.0.0.1", 0))  # listens, never accepts
    hosts: dict[str, tuple[CoordinationService, SlotOwner]] = {}
    closers: list = []
    try:
        for name in ("h0", "h1", "h2"):
            owner = SlotOwner(run_id=run_id, host_id=name, local_world_size=1)
            hosts[name] = (CoordinationService(open_store(url), run_id=run_id, host_id=name,
                                               owner=owner, ttl=30.0), owner)
        servers = {name: Server(hosts[name][1], secret=secret, run_id=run_id)
                   for name in ("h0", "h2")}
        closers += servers.values()
        ports = {"h1": frozen.getsockname()[1], **{n: s.address[1] for n, s in servers.items()}}
        for name, port in ports.items():
            hosts[name][0].describe(state="running", replication=["127.0.0.1", port],
                                    node=f"addr_{name}_0")
        (h0, _), (h1, _), (h2, _) = hosts["h0"], hosts["h1"], hosts["h2"]
        assert h0.suspect("h1") is None and h0.lost_hosts() == set()  # 1 of {h0, h2}
        h0.suspect("h1", False)

        def connect(address: tuple[str, int], *, timeout: float) -> Client:
            return Client(address, secret=secret, run_id=run_id, timeout=timeout)

        logs = {name: EventLog(tmp_path / name, host=name) for name in ("h0", "h2")}
        closers += logs.values()
        began = time.monotonic()
        beats = [HeartbeatService(hosts[name][0], logs[name], connect=connect, timeout=0.5)
                 for name in ("h0", "h2")]
        closers[:0] = beats
        while not (h0.lost_hosts() == h2.lost_hosts() == {"h1"}):
            assert time.monotonic() - began < 10, "h1 was not found unresponsive"
            time.sleep(0.05)
        time.sleep(2.0)  # h0 and h2 keep answering each other
        assert h0.lost_hosts() == h2.lost_hosts() == {"h1"}
        assert h0.lost_nodes() == {"addr_h1_0"}
        found = events(tmp_path)
        votes = [e for e in found if e["event"] == "host_unresponsive"]
        assert len(votes) == 1 and votes[0]["lost"] == "h1" and votes[0]["votes"] == 2, votes
        assert not h1.store.get(h1.prefix + "alive/h1")
    finally:
        frozen.close()
        for closer in closers:
            closer.close()
        for service, owner in hosts.values():
            service.close()
            owner.close()
