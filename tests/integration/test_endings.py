"""How jobs end when no one kills them: a script that fails after every restore, a
restored step the script cannot take, failures from outside that must not count."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import GEMINI, SCRIPTS, env_with, events, kill_group, run

from launcher import memory

TRAIN = str(SCRIPTS / "train_ckpt.py")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def no_leaks() -> None:
    before = set(memory.list_segments())
    yield
    left = set(memory.list_segments()) - before
    assert not left, f"segments left behind: {sorted(left)}"


def _starts(stdout: str) -> list[tuple[int, int]]:
    """(attempt, start step) of rank 0, in order."""
    return [(int(a), int(s)) for s, a in
            re.findall(r"resume rank=0 start=(\d+) attempt=(\d+)", stdout)]


def _gemini(tmp_path: Path, *args: str, restarts: int = 10, flags: tuple[str, ...] = ()
            ) -> list[str]:
    """``gemini run`` of the training script with gemini's ``flags`` and the script's ``args``."""
    return [*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", str(restarts), *flags,
            TRAIN, "--steps", "12", "--out", str(tmp_path / "out.pt"), *args]


def test_a_script_that_fails_after_every_restore_stops_for_good(tmp_path: Path) -> None:
    """Killed after step 6, the script raises after every restore: the second start
    restores 6 and fails, the third restores the next older step (5) once, the fourth
    restores 5 again and fails the same way a third time: gemini stops with exit code 7
    (do not requeue) and one line saying why, long before --max-restarts is spent."""
    done = run(_gemini(tmp_path, "--kill", "0:6:step", "--raise-after-restore", "0",
                       flags=("--rdzv-id", "endings")), env=env_with(tmp_path), timeout=240)
    assert done.returncode == 7, done.output[-4000:]
    found = events(tmp_path / "runs")
    assert _starts(done.stdout) == [(0, 0), (1, 7), (2, 6), (3, 6)], (
        [(e["event"], e.get("failures") or e.get("step")) for e in found
         if e["event"] in ("worker_exit", "avoid_step", "no_progress", "restore_plan")],
        done.output[-3000:])
    errors = [line for line in done.stderr.splitlines() if line.startswith("gemini: error:")]
    assert len(errors) == 1 and "3 times in a row the same way" in errors[0], done.stderr[-3000:]
    assert "(rank 0, exit code 1)" in errors[0] and "do not requeue" in errors[0]
    assert [e["step"] for e in found if e["event"] == "avoid_step"] == [6]
    assert [e["failures"] for e in found if e["event"] == "no_progress"] == [3]
    assert [e["step"] for e in found if e["event"] == "restore_plan"] == [None, 6, 5, 5]
    for extra in (["--json"], []):  # `gemini status` says why the job stopped
        shown = run([*GEMINI, "status", "--run-id", "endings", *extra], env=env_with(tmp_path))
        assert shown.returncode == 0, shown.output
        assert "3 times in a row the same way" in shown.stdout, shown.stdout


def test_a_restored_step_the_script_cannot_take_is_skipped_once(tmp_path: Path) -> None:
    """The script cannot train from step 6's state (an older one it can): after one
    failure the next round restores step 5 and the run ends bitwise equal to one that
    never failed."""
    reference = tmp_path / "reference"
    done = run([*GEMINI, "run", "--nproc-per-node", "2", TRAIN, "--steps", "12",
                "--out", str(reference / "ref.pt")], env=env_with(reference))
    assert done.returncode == 0, done.output[-3000:]
    done = run(_gemini(tmp_path, "--kill", "0:6:step", "--raise-after-restore", "6"),
               env=env_with(tmp_path), timeout=240)
    assert done.returncode == 0, done.output[-4000:]
    assert _starts(done.stdout) == [(0, 0), (1, 7), (2, 6)]
    ours, theirs = torch.load(tmp_path / "out.pt"), torch.load(reference / "ref.pt")
    for key, value in theirs["model"].items():
        assert torch.equal(ours["model"][key], value), key
    assert torch.equal(ours["rng"], theirs["rng"]) and ours["samples"] == theirs["samples"]


def test_a_survivor_finishes_the_save_it_is_writing_before_it_is_stopped(
        tmp_path: Path) -> None:
    """Rank 0 dies right after committing step 6 while rank 1 is still writing its copy
    of 6 (a second): rank 1 is stopped only once that copy is committed, so the next
    round restores step 6, not 5."""
    done = run(_gemini(tmp_path, "--kill", "0:6:step", "--slow-copy", "1:6:1"),
               env=env_with(tmp_path), timeout=240)
    assert done.returncode == 0, done.output[-4000:]
    assert _starts(done.stdout) == [(0, 0), (1, 7)], done.output[-4000:]
    waited = [e for e in events(tmp_path / "runs") if e["event"] == "copies_waited"]
    assert waited and waited[0]["unfinished"] == [], waited


def test_a_rank_that_dies_in_a_copy_its_peer_ran_past_leaves_a_common_step(
        tmp_path: Path) -> None:
    """Rank 1's copy of step 5 takes 2 s and it dies at its end, uncommitted; rank 0 runs
    on meanwhile and saves step 6. Rank 0 keeps step 4 (the newest step both hold) until
    rank 1 has committed 5, which it never does: the next round restores 4, not nothing
    (rank 0 holding 5 and 6, rank 1 only 4: a start from step 0)."""
    done = run(_gemini(tmp_path, "--slow-copy", "1:5:2", "--kill", "1:5:late"),
               env=env_with(tmp_path), timeout=240)
    assert done.returncode == 0, done.output[-4000:]
    assert _starts(done.stdout) == [(0, 0), (1, 5)], done.output[-4000:]
    plans = [e for e in events(tmp_path / "runs") if e["event"] == "restore_plan"]
    assert plans[-1]["local"] == {"0": [4, 5], "1": [4]}, plans


def test_a_worker_stopped_while_it_dies_of_its_own_error_counts_as_failing(
        tmp_path: Path) -> None:
    """Rank 0 raises and is stopped by torch in its teardown, once rank 1 (broken by it)
    has exited first: the guard counts rank 0's error, not a stop."""
    done = run([*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "3",
                "--max-same-failures", "1", str(SCRIPTS / "fail_in_teardown.py")],
               env=env_with(tmp_path), timeout=120)
    assert done.returncode == 7, done.output[-3000:]
    exits = [e for e in events(tmp_path / "runs") if e["event"] == "worker_exit"]
    assert [(f["rank"], f["exitcode"]) for f in exits[0]["failures"]] == [(1, 3), (0, -15)]
    assert "(rank 0, exit code 1)" in done.stderr, done.stderr[-3000:]
    assert not list((tmp_path / "runs").glob("*/raised/*"))


def test_workers_killed_from_outside_never_count(tmp_path: Path) -> None:
    """A worker SIGKILLed four times at the same step, nothing committed in between:
    each is a transient fault, so the run restarts every time and finishes."""
    kills = ["0:6:step", "1:7:copy:1", "1:7:copy:2", "1:7:copy:3"]
    done = run(_gemini(tmp_path, *(a for k in kills for a in ("--kill", k)),
                       flags=("--max-same-failures", "2")), env=env_with(tmp_path), timeout=240)
    assert done.returncode == 0, done.output[-4000:]
    assert _starts(done.stdout) == [(0, 0), (1, 7), (2, 7), (3, 7), (4, 7)]
    assert not [e for e in events(tmp_path / "runs") if e["event"] in ("no_progress",
                                                                       "avoid_step")]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs: needs root")
def test_a_full_shared_memory_keeps_the_committed_step_for_the_next_run(tmp_path: Path) -> None:
    """The state outgrows a 40 MiB /dev/shm at step 10: exit 4, one line, and the slots
    stay; once memory is free (the tmpfs enlarged), the same command adopts the newest
    committed step and ends bitwise equal to a run that had the memory all along."""
    args = ["--steps", "20", "--grow-at", "10:16"]
    reference = tmp_path / "reference"
    done = run([*GEMINI, "run", "--nproc-per-node", "2", TRAIN, *args, "--out",
                str(reference / "ref.pt")], env=env_with(reference))
    assert done.returncode == 0, done.output[-3000:]
    shm = tmp_path / "shm"
    shm.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(shm)], check=True)
    try:
        env = env_with(tmp_path, GEMINI_SHM_DIR=str(shm))
        argv = [*GEMINI, "run", "--nproc-per-node", "2", "--rdzv-id", "full", TRAIN, *args,
                "--sleep", "0.05", "--out", str(tmp_path / "out.pt")]
        done = run(argv, env=env, timeout=240)
        assert done.returncode == 4, done.output[-3000:]
        errors = [line for line in done.stderr.splitlines() if line.startswith("gemini: error:")]
        assert len(errors) == 1 and "stay in shared memory" in errors[0], done.stderr[-3000:]
        subprocess.run(["mount", "-o", "remount,size=200m", str(shm)], check=True)
        done = run(argv, env=env, timeout=240)
        assert done.returncode == 0, done.output[-3000:]
        assert _starts(done.stdout)[0][1] >= 10, done.stdout[:2000]
        assert not list(shm.rglob("gemini-*-r*"))  # the finished run released them
    finally:
        subprocess.run(["umount", "-l", str(shm)], check=False)
    ours, theirs = torch.load(tmp_path / "out.pt"), torch.load(reference / "ref.pt")
    for key, value in theirs["model"].items():
        assert torch.equal(ours["model"][key], value), key
    assert torch.equal(ours["rng"], theirs["rng"]) and ours["samples"] == theirs["samples"]


def test_sigterm_persists_the_newest_step_and_a_fresh_host_resumes_there(tmp_path: Path) -> None:
    """A preemption: SIGTERM while the persistent tier is not due (every 600 s). gemini
    writes the newest step every rank holds before it frees its memory, and the same
    command on a fresh host (its own empty shared memory) resumes right after it and
    ends bitwise equal to a run that was never stopped."""
    import signal

    from helpers import kill_group, poll, read_lines, start

    args = ["--steps", "40", "--sleep", "0.1"]
    reference = tmp_path / "reference"
    done = run([*GEMINI, "run", "--nproc-per-node", "2", TRAIN, *args, "--out",
                str(reference / "ref.pt")], env=env_with(reference), timeout=240)
    assert done.returncode == 0, done.output[-3000:]
    argv = [*GEMINI, "run", "--nproc-per-node", "2", "--rdzv-id", "preempted",
            "--persist-dir", str(tmp_path / "persist"), TRAIN, *args,
            "--out", str(tmp_path / "out.pt")]
    first, second = tmp_path / "shm-a", tmp_path / "shm-b"
    first.mkdir(), second.mkdir()
    proc = start(argv, env=env_with(tmp_path, GEMINI_SHM_DIR=str(first)))
    lines: list[str] = []
    reader = read_lines(proc, lines)
    try:
        poll(lambda: any(line.startswith("step 15 ") for line in lines), 120, "step 15",
             details=lambda: "\n".join(lines[-30:]))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, "\n".join(lines[-30:])
    finally:
        kill_group(proc)
        reader.join(10)
    last = max(int(line.split()[1]) for line in lines if line.startswith("step "))
    saved = [line for line in lines if "gemini: stopping: persisted step" in line]
    assert len(saved) == 1, "\n".join(lines[-30:])
    step = int(saved[0].split("persisted step ")[1].split()[0])
    assert last - 1 <= step <= last + 1, (step, last)
    assert "rank(s) 0, 1" in saved[0]
    assert not [p for p in first.rglob("*") if p.is_file()]  # its memory was freed
    done = run(argv, env=env_with(tmp_path, GEMINI_SHM_DIR=str(second)), timeout=240)
    assert done.returncode == 0, done.output[-3000:]
    assert _starts(done.stdout)[0] == (0, step + 1), done.stdout[:1000]
    ours, theirs = torch.load(tmp_path / "out.pt"), torch.load(reference / "ref.pt")
    for key, value in theirs["model"].items():
        assert torch.equal(ours["model"][key], value), key
    assert torch.equal(ours["rng"], theirs["rng"]) and ours["samples"] == theirs["samples"]


def _etcd_run(etcd: object, run_id: str, nnodes: str, nproc: int, *flags: str) -> list[str]:
    """``gemini run`` of one simulated host of an etcd-v3 job (rendezvous and store in
    ``etcd``), loopback replication, no standbys; ``flags`` go before the script."""
    return [*GEMINI, "run", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
            "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,  # type: ignore[attr-defined]
            "--rdzv-id", run_id, "--rdzv-conf", "last_call_timeout=1",
            "--store", etcd.url, "--replication-addr", "127.0.0.1", "--no-standby",  # type: ignore[attr-defined]
            *flags]


@pytest.mark.etcd
def test_sigterm_on_two_hosts_persists_one_step_of_every_rank(tmp_path: Path) -> None:
    """Both hosts of a 2 x 1 job get SIGTERM (a preempted allocation): they agree on one
    step, each persists its rank's copy of it, and two fresh hosts resume right after it,
    ending bitwise equal to a run never stopped (a world of two: with more ranks, DDP's
    first buckets after any restart sum the gradients in another order)."""
    import signal
    import time

    from etcd_server import EtcdServer
    from hosts import Host, assert_bitwise, wait_exit, wait_for

    steps = ["--steps", "40", "--sleep", "0.1", "--out", str(tmp_path / "out.pt")]
    reference = tmp_path / "reference"
    done = run([*GEMINI, "run", "--nproc-per-node", "2", "--no-standby", TRAIN, *steps[:4],
                "--out", str(reference / "ref.pt")], env=env_with(reference), timeout=240)
    assert done.returncode == 0, done.output[-3000:]
    persist = tmp_path / "persist"
    hosts: list[Host] = []
    with EtcdServer() as etcd:
        argv = _etcd_run(etcd, "preempt2", "2", 1, "--persist-dir", str(persist), TRAIN, *steps)
        try:
            hosts = [Host(tmp_path, f"h{i}", argv) for i in range(2)]
            wait_for(lambda: any(re.search(r"^step 15 ", h.output(), re.M) for h in hosts),
                     180, "step 15", hosts)
            for host in hosts:
                host.proc.send_signal(signal.SIGTERM)
            wait_exit(hosts, hosts, time.monotonic() + 120)
            for host in hosts:
                assert host.proc.returncode == 128 + signal.SIGTERM, host.output()[-3000:]
            saved = [re.findall(r"persisted step (\d+) of rank\(s\) ([\d, ]+)", h.output())
                     for h in hosts]
            assert all(len(s) == 1 for s in saved), [h.output()[-2000:] for h in hosts]
            assert saved[0][0][0] == saved[1][0][0]
            step = int(saved[0][0][0])
            assert sorted(int(r) for s in saved for r in s[0][1].split(", ")) == [0, 1]
            fresh = [Host(tmp_path, f"fresh{i}", argv) for i in range(2)]
            hosts += fresh
            wait_exit(fresh, hosts, time.monotonic() + 240)
            for host in fresh:
                assert host.proc.returncode == 0, host.output()[-3000:]
            resumed = {int(s) for h in fresh
                       for s in re.findall(r"resume rank=\d+ start=(\d+) attempt=0", h.output())}
            assert resumed == {step + 1}, [h.output()[:1500] for h in fresh]
        finally:
            for host in hosts:
                kill_group(host.proc)
    assert_bitwise(torch.load(tmp_path / "out.pt"), torch.load(reference / "ref.pt"))


def _flip_run(tmp_path: Path, *flags: str, nproc: int = 1, train: tuple[str, ...] = (),
              at: int = 12) -> list[dict]:
    """Two etcd hosts of ``nproc`` workers train 40 steps; rank 1 (host h0 with two
    workers, else h1) flips one bit of a parameter it saves in step ``at`` (after its
    optimizer step, before its save) and trains on, raising no error. Both hosts must end
    with exit code 0; their events are returned."""
    import time

    from etcd_server import EtcdServer
    from hosts import Host, wait_exit

    hosts: list[Host] = []
    with EtcdServer() as etcd:
        argv = _etcd_run(etcd, "sdc", "2", nproc, "--replicate-every", "2", *flags, TRAIN,
                         *train, "--steps", "40", "--sleep", "0.1", "--flip-param", f"1:{at}",
                         "--out", str(tmp_path / "out.pt"))
        try:
            hosts = [Host(tmp_path, f"h{i}", argv) for i in range(2)]
            wait_exit(hosts, hosts, time.monotonic() + 240)
            for host in hosts:
                assert host.proc.returncode == 0, host.output()[-3000:]
                assert host.output().count("the replicas of step") == 1, host.output()[-3000:]
            shown = run([*GEMINI, "status", "--json", "--store", etcd.url, "--run-id", "sdc"],
                        env=env_with(tmp_path))
            assert "replicas_diverged" in shown.stdout, shown.output[-2000:]
        finally:
            for host in hosts:
                kill_group(host.proc)
    found = events(tmp_path / "runs")
    diverged = [e for e in found if e["event"] == "replicas_diverged"]
    assert {e["host"] for e in diverged} == {"h0", "h1"}, diverged
    pair = [0, 1] if nproc == 1 else [1, 3]  # ranks 1 and 3 keep the same share
    for e in diverged:
        assert e["ranks"] == pair and e["hosts"] == ["h0", "h1"] and e["odd"] == [], e
        assert at <= e["step"] <= at + 8 and 0 <= e["agreed"] < at, e  # two targets at most
    return found


@pytest.mark.etcd
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_flipped_parameter_is_rolled_back_to_the_step_the_replicas_agreed_on(
        tmp_path: Path, nproc: int) -> None:
    """Silent data corruption on one replica, caught by the digests its saves carry: both
    hosts report it once, go back together to the newest step the replicas agreed on (no
    restart of --max-restarts spent) and end bitwise equal to a run without the flip.
    With two workers per host the replicated state is split between them and the
    flipped rank compares with the rank keeping the same share on the other host (the
    gradients are summed in a fixed order, --grad-sync params, so that a world of four
    resumes bitwise)."""
    import random

    from hosts import assert_bitwise

    train = ("--grad-sync", "params", "--replicated") if nproc == 2 else ()
    at = random.randint(4, 24)  # the step of the flip; shown by a failing assertion
    reference = tmp_path / "reference"
    done = run([*GEMINI, "run", "--nproc-per-node", str(2 * nproc), "--no-standby", TRAIN,
                *train, "--steps", "40", "--out", str(reference / "ref.pt")],
               env=env_with(reference), timeout=240)
    assert done.returncode == 0, done.output[-3000:]
    found = _flip_run(tmp_path, nproc=nproc, train=train, at=at)
    agreed = {e["agreed"] for e in found if e["event"] == "replicas_diverged"}
    rollbacks = [e for e in found if e["event"] == "rollback"]
    assert {e["host"] for e in rollbacks} == {"h0", "h1"} and {e["step"] for e in rollbacks} == agreed
    plans = [e["step"] for e in found if e["event"] == "restore_plan"]
    assert plans.count(agreed.pop()) == 2, plans  # both hosts restored the agreed step
    assert_bitwise(torch.load(tmp_path / "out.pt"), torch.load(reference / "ref.pt"))


@pytest.mark.etcd
def test_with_warn_a_flipped_parameter_is_reported_and_never_becomes_restorable(
        tmp_path: Path) -> None:
    """--on-divergence warn: both hosts report the disagreement once and train on; s*
    never moves past the newest step the replicas agreed on (a host loss restores it)."""
    found = _flip_run(tmp_path, "--on-divergence", "warn")
    assert not [e for e in found if e["event"] == "rollback"]
    progress = [e for e in found if e["event"] == "replication_progress"]
    assert progress and max(e["sstar"] for e in progress) < 12, progress


@pytest.mark.etcd
def test_a_thousand_healthy_steps_raise_no_false_alarm(tmp_path: Path) -> None:
    """Two hosts of two workers, 1,000 steps as fast as they go: every replication target
    (dozens of them) compares the replicas, and they always agree."""
    import time

    from etcd_server import EtcdServer
    from hosts import Host, wait_exit

    hosts: list[Host] = []
    with EtcdServer() as etcd:
        argv = _etcd_run(etcd, "healthy", "2", 2, "--replicate-every", "2", TRAIN,
                         "--steps", "1000", "--width", "16")
        try:
            hosts = [Host(tmp_path, f"h{i}", argv) for i in range(2)]
            wait_exit(hosts, hosts, time.monotonic() + 280)
            for host in hosts:
                assert host.proc.returncode == 0, host.output()[-3000:]
        finally:
            for host in hosts:
                kill_group(host.proc)
    found = events(tmp_path / "runs")
    assert not [e for e in found if e["event"] in ("replicas_diverged", "rollback")]
    done = [e for e in found if e["event"] == "replication_done"]
    assert len(done) == 2 and all(e["checked"] >= 20 for e in done), done


@pytest.mark.etcd
def test_with_exclusion_the_outvoted_host_leaves_and_a_spare_takes_its_place(
        tmp_path: Path) -> None:
    """Three hosts of one worker and a spare, --exclude-divergent: rank 1 flips a bit of
    a parameter; the two other replicas outvote it, its host leaves the job (exit 6), the
    spare takes its node slot from the newest step the replicas agreed on, and the run
    ends bitwise equal to one without the flip (gradients summed in a fixed order: a
    world of three)."""
    import time

    from etcd_server import EtcdServer
    from hosts import Host, assert_bitwise, wait_exit, wait_for

    train = ("--grad-sync", "params", "--replicated")
    reference = tmp_path / "reference"
    done = run([*GEMINI, "run", "--nproc-per-node", "3", "--no-standby", TRAIN, *train,
                "--steps", "40", "--out", str(reference / "ref.pt")],
               env=env_with(reference), timeout=240)
    assert done.returncode == 0, done.output[-3000:]
    hosts: list[Host] = []
    with EtcdServer() as etcd:
        argv = _etcd_run(etcd, "outvoted", "3:3", 1, "--replicate-every", "2",
                         "--exclude-divergent", "--max-restarts", "3", TRAIN, *train,
                         "--steps", "40", "--sleep", "0.1", "--flip-param", "1:12",
                         "--out", str(tmp_path / "out.pt"))
        try:
            hosts = [Host(tmp_path, f"h{i}", argv) for i in range(3)]
            wait_for(lambda: all("resume rank=" in h.output() for h in hosts), 120,
                     "every host training", hosts)
            hosts.append(Host(tmp_path, "spare", argv))
            wait_exit(hosts, hosts, time.monotonic() + 240)
        finally:
            for host in hosts:
                kill_group(host.proc)
    found = events(tmp_path / "runs")
    diverged = [e for e in found if e["event"] == "replicas_diverged"]
    assert diverged and all(e["odd"] == [1] for e in diverged), diverged
    flipped = next(h for h in hosts if "flipped rank=1" in h.output())
    assert flipped.proc.returncode == 6, flipped.output()[-3000:]
    assert "it leaves the job (--exclude-divergent)" in flipped.output()
    for host in hosts:
        if host is not flipped:
            assert host.proc.returncode == 0, host.output()[-3000:]
    assert "resume rank=1" in next(h for h in hosts if h.name == "spare").output()
    assert_bitwise(torch.load(tmp_path / "out.pt"), torch.load(reference / "ref.pt"))
