"""gemini run behaves like torchrun: worker environment, restarts, failure summary, exit code."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
from helpers import (
    GEMINI,
    SCRIPTS,
    TORCHRUN,
    env_with,
    events,
    free_port,
    kill_tree,
    poll,
    run,
    start,
)

# Values that differ between any two launches of the same command, even of torchrun itself.
PER_LAUNCH = {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}


def _worker_envs(launcher: tuple[str, ...], flags: list[str], out: Path,
                 tmp_path: Path, **env: str) -> dict[int, dict[str, str]]:
    out.mkdir()
    script = os.path.relpath(SCRIPTS / "env_probe.py", tmp_path)  # __file__ is absolute
    stdin = tmp_path / "stdin.txt"  # the workers' stdin is the launcher's
    stdin.touch()
    with stdin.open() as fh:
        done = run([*launcher, *flags, script, str(out), "-u", "x"],
                   env=env_with(tmp_path, **env), cwd=tmp_path, stdin=fh)
    assert done.returncode == 0, done.output
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("env-*.json")}


def _main_views(out: Path) -> dict[int, str]:
    """What each worker saw of its main module, argv, path and priority (env_probe.py),
    with its output directory (an argument) masked."""
    return {int(p.stem.split("-")[1]): p.read_text().replace(str(out), "OUT")
            for p in out.glob("main-*.json")}


@pytest.mark.parametrize("flags,standby", [
    (["--nproc-per-node", "2"], "1"),
    (["--nproc-per-node", "2"], "0"),
    (["--standalone", "--nproc_per_node=3", "--max-restarts=1"], "1"),
    (["--nproc_per=2", "--max_rest", "1"], "1"),  # unique prefixes, as torchrun takes them
])
def test_worker_environment_equals_torchrun(tmp_path: Path, flags: list[str],
                                            standby: str) -> None:
    torch_envs = _worker_envs(TORCHRUN, flags, tmp_path / "torchrun", tmp_path,
                              GEMINI_STANDBY=standby)
    gemini_envs = _worker_envs(GEMINI, ["run", *flags], tmp_path / "gemini", tmp_path,
                               GEMINI_STANDBY=standby)
    assert sorted(torch_envs) == sorted(gemini_envs) and len(torch_envs) > 1
    for rank, expected in torch_envs.items():
        got = gemini_envs[rank]
        extra = set(got) - set(expected)
        assert {"GEMINI_RUN_DIR", "GEMINI_HOST_ID"} <= extra
        assert all(k.startswith("GEMINI_") for k in extra), extra
        assert set(expected) <= set(got), set(expected) - set(got)
        differing = {k for k in expected if expected[k] != got[k]} - PER_LAUNCH
        assert not differing, {k: (expected[k], got[k]) for k in differing}
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "ROLE_RANK", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE"):
            assert got[key] == expected[key], key
    # a standby runs the script as `python -u SCRIPT` would: same __main__, argv, priority,
    # stdin, and the same command line for ps and pgrep -f
    assert _main_views(tmp_path / "gemini") == _main_views(tmp_path / "torchrun")


def _traceback(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    first = lines.index("Traceback (most recent call last):")
    last = next(i for i in range(first, len(lines)) if lines[i].startswith("ValueError"))
    return lines[first:last + 1]


@pytest.mark.parametrize("standby", ["1", "0"])
def test_uncaught_error_prints_the_same_traceback(tmp_path: Path, standby: str) -> None:
    script = [str(SCRIPTS / "raise_error.py")]
    env = env_with(tmp_path, GEMINI_STANDBY=standby)
    ours = run([*GEMINI, "run", "--nproc-per-node", "1", *script], env=env, cwd=tmp_path)
    theirs = run([*TORCHRUN, "--nproc-per-node", "1", *script], env=env, cwd=tmp_path)
    assert ours.returncode == theirs.returncode == 1
    assert _traceback(ours.stderr) == _traceback(theirs.stderr)


def test_crash_once_is_restarted_and_succeeds(tmp_path: Path) -> None:
    done = run([*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "2",
                str(SCRIPTS / "crash_ddp.py"), "1", "1"], env=env_with(tmp_path))
    assert done.returncode == 0, done.output
    assert "ok rank=0 restart=1" in done.stdout and "ok rank=1 restart=1" in done.stdout
    kinds = [e["event"] for e in events(tmp_path / "runs")]
    assert kinds.count("restart") == 1 and kinds.count("start") == 2
    assert kinds[-1] == "exit"


def test_gloo_restarts_are_reliable_many_times_in_a_row(tmp_path: Path) -> None:
    """torchrun 2.13 fails this (stale gloo addresses in the reused store, #135712)."""
    done = run([*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "5",
                str(SCRIPTS / "crash_ddp.py"), "1", "5"], env=env_with(tmp_path), timeout=240)
    assert done.returncode == 0, done.output[-3000:]
    assert "connectFullMesh" not in done.output
    assert "ok rank=1 restart=5" in done.stdout
    restarts = [e for e in events(tmp_path / "runs") if e["event"] == "restart"]
    assert [e["restart_count"] for e in restarts] == [1, 2, 3, 4, 5]


def _summary(text: str) -> list[str]:
    """torch elastic's failure block, with per-launch values masked."""
    start_at = text.index("Root Cause (first observed failure):")
    block = text[start_at:].splitlines()[:12]
    masked = [re.sub(r"(time|host)\s*:.*", r"\1: *", line) for line in block]
    return [re.sub(r"pid: \d+", "pid: *", line) for line in masked]


def test_always_crashing_worker_fails_like_torchrun(tmp_path: Path) -> None:
    script = [str(SCRIPTS / "crash_ddp.py"), "1", "99"]
    ours = run([*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "2", *script],
               env=env_with(tmp_path), timeout=180)
    # torchrun itself is compared without restarts: its restarts of gloo jobs fail on stale
    # store keys (#135712), which would change its root cause.
    theirs = run([*TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "0", *script],
                 env=env_with(tmp_path), timeout=180)
    assert ours.returncode == theirs.returncode == 1
    assert "rank      : 1 (local_rank: 1)" in ours.stderr
    assert "exitcode  : 3" in ours.stderr
    assert _summary(ours.stderr) == _summary(theirs.stderr)
    assert "Traceback" not in ours.stderr.split("Root Cause")[-1]
    exits = [e for e in events(tmp_path / "runs") if e["event"] == "worker_exit"]
    assert len(exits) == 3
    assert all(any(f["rank"] == 1 and f["exitcode"] == 3 for f in e["failures"]) for e in exits), exits


def test_two_nodes_restart_across_hosts(tmp_path: Path) -> None:
    """Two supervisors (two "hosts") with c10d: a crash on node B restarts both nodes."""
    port = free_port()
    common = ["run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
              "--max-restarts", "3", "--monitor-interval", "0.2",
              str(SCRIPTS / "crash_ddp.py"), "1", "2"]
    nodes = [start([*GEMINI, *common], env=env_with(tmp_path, GEMINI_HOST_ID=f"host{i}"))
             for i in range(2)]
    outputs = []
    for proc in nodes:
        out, _ = proc.communicate(timeout=240)
        outputs.append(out)
        assert proc.returncode == 0, out[-3000:]
    joined = "\n".join(outputs)
    assert "ok rank=0" in joined and "ok rank=1" in joined
    assert "connectFullMesh" not in joined


@pytest.mark.parametrize("restarts", ["3", "0"])
def test_a_failure_after_the_peers_finished_ends_every_host_at_once(
        tmp_path: Path, restarts: str) -> None:
    """Rank 1 fails 5 s after the job's work, when the other host's workers have exited 0
    and that host waits in torch elastic's exit barrier, which counts only hosts whose
    workers succeeded. With restarts left, a restart could never form a round (that host
    joins none): torchrun waits for minutes (the barrier's 300 s, the rendezvous' 600 s).
    gemini fails the host at once; either way it counts the failed host into the barrier,
    which releases the finished one."""
    port = free_port()
    common = ["run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "late-failure",
              "--max-restarts", restarts, "--monitor-interval", "0.2",
              str(SCRIPTS / "fail_late.py"), "1", "5"]
    began = time.monotonic()
    nodes = [start([*GEMINI, *common], env=env_with(tmp_path, GEMINI_HOST_ID=f"host{i}"))
             for i in range(2)]
    try:
        results = []
        for proc in nodes:
            out, _ = proc.communicate(timeout=120)
            results.append((proc.returncode, out))
    finally:
        for proc in nodes:
            kill_tree(proc.pid)
    assert time.monotonic() - began < 60, results
    failed = [out for code, out in results if code == 1]
    assert len(failed) == 1 and sorted(code for code, _ in results) == [0, 1], results
    assert "exitcode  : 3" in failed[0]
    skipped = [e for e in events(tmp_path / "runs") if e["event"] == "no_restart"]
    if restarts != "0":
        assert "not restarting: 1 of 2 hosts already finished" in failed[0]
        assert len(skipped) == 1 and skipped[0]["reason"] == "peers_finished", skipped
    else:
        assert not skipped
    assert not [e for e in events(tmp_path / "runs") if e["event"] == "restart"]



def test_peers_that_finish_while_a_host_restarts_end_its_restart(tmp_path: Path) -> None:
    """host1's local rank 0 fails right after the job's work and host1 restarts; host0's
    workers finish meanwhile (see the script). A finished host joins no later round, so
    under torch elastic host1 waits for a round that cannot form (600 s) and host0 for
    host1 in the exit barrier (300 s). gemini's host0 closes the rendezvous; host1 ends
    with its failure. (host1 tells host0 of its failure at once, and host0 would restart
    too: the script holds host0's supervisor stopped until its workers are done, so the
    rendezvous and the coordination store are in etcd, which a stopped supervisor does not
    serve, as c10d's store would be, nor hold a lock on, as the embedded store could be.)"""
    from etcd_server import EtcdServer

    with EtcdServer() as etcd:
        common = ["run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "etcd-v3",
                  "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "finish-in-restart",
                  "--max-restarts", "3", "--heartbeat-timeout", "0", "--store", etcd.url,
                  str(SCRIPTS / "finish_during_restart.py"), "host1"]
        began = time.monotonic()
        nodes = [start([*GEMINI, *common], env=env_with(tmp_path, GEMINI_HOST_ID=f"host{i}"))
                 for i in range(2)]
        try:
            outputs = [proc.communicate(timeout=120)[0] for proc in nodes]
        finally:
            for proc in nodes:
                kill_tree(proc.pid)
    assert time.monotonic() - began < 60, outputs
    assert [proc.returncode for proc in nodes] == [0, 1], outputs
    assert "exitcode  : 3" in outputs[1]
    assert "the other hosts finished their workers and closed the rendezvous" in outputs[1]
    kinds = [(e["host"], e["event"], e.get("reason")) for e in events(tmp_path / "runs")]
    assert ("host0", "close_rendezvous", "restarting_hosts_too_few") in kinds, kinds
    assert ("host1", "no_restart", "rendezvous_closed") in kinds, kinds


def _standbys(supervisor: int, workers: set[int]) -> set[int]:
    found = set()
    for child in psutil.Process(supervisor).children():
        try:
            if child.pid not in workers and child.status() != psutil.STATUS_ZOMBIE and (
                    "launcher.standby" in child.cmdline()):
                found.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def _group_nice(pid: int) -> str | None:
    """The niceness of ``pid``'s session where Linux schedules sessions as groups."""
    group = Path(f"/proc/{pid}/autogroup")
    return group.read_text().split()[-1] if group.exists() else None


def test_a_standby_that_dies_is_replaced_at_once(tmp_path: Path) -> None:
    """A waiting standby killed mid-run is replaced then, not at the next restart. While
    the workers run, a standby imports at a lower priority, its session's too; the worker
    it becomes runs at a worker's."""
    proc = start([*GEMINI, "run", "--nproc-per-node", "1", "--max-restarts", "1",
                  str(SCRIPTS / "idle.py"), "30"], env=env_with(tmp_path))
    try:
        deadline = time.monotonic() + 60

        def started(count: int) -> set[int]:
            """The workers of the ``count``-th start."""
            while time.monotonic() < deadline:
                starts = [e for e in events(tmp_path / "runs") if e["event"] == "start"]
                if len(starts) >= count:
                    return {int(w["pid"]) for w in starts[count - 1]["workers"]}
                time.sleep(0.1)
            raise AssertionError(f"no start number {count}")

        workers = started(1)
        standbys: set[int] = set()
        while not standbys and time.monotonic() < deadline:
            time.sleep(0.1)
            standbys = _standbys(proc.pid, workers)
        assert len(standbys) == 1, "no standby waiting"
        os.kill(standbys.pop(), signal.SIGKILL)
        replaced: set[int] = set()
        while not replaced and time.monotonic() < deadline:
            time.sleep(0.1)
            replaced = _standbys(proc.pid, workers)
        assert len(replaced) == 1, "the standby was not replaced"
        assert proc.poll() is None  # the job itself carried on
        standby = replaced.pop()
        while _group_nice(standby) == "0" and time.monotonic() < deadline:
            time.sleep(0.05)  # it lowers its session's priority as it starts
        assert _group_nice(standby) in ("10", None)
        if os.geteuid() == 0:  # else its thread stays at 0: it could not come back
            assert psutil.Process(standby).nice() == 10
        os.kill(workers.pop(), signal.SIGKILL)  # the restart's worker runs in the standby
        assert started(2) == {standby}
        while (_group_nice(standby) not in ("0", None) or psutil.Process(standby).nice()
               ) and time.monotonic() < deadline:
            time.sleep(0.01)  # set as its job arrives, by a thread of its own
        assert _group_nice(standby) in ("0", None) and psutil.Process(standby).nice() == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        kill_tree(proc.pid)
        proc.communicate(timeout=30)


def test_a_standby_imports_what_the_workers_imported(tmp_path: Path) -> None:
    """A worker past its first save lists the installed modules it imported; the standby
    started after it imports them (and the ``--preload`` ones) before it waits, so the
    worker it becomes finds them imported: a framework restarts without its imports."""
    proc = start([*GEMINI, "run", "--nproc-per-node", "1", "--max-restarts", "1",
                  "--preload", "xml.dom.minidom", str(SCRIPTS / "imports_probe.py")],
                 env=env_with(tmp_path))
    try:
        deadline = time.monotonic() + 120
        workers: set[int] = set()
        while not workers and time.monotonic() < deadline:
            starts = [e for e in events(tmp_path / "runs") if e["event"] == "start"]
            workers = {int(w["pid"]) for e in starts for w in e["workers"]}
            time.sleep(0.1)
        listed = poll(lambda: list((tmp_path / "runs").glob("*/imports.json")), 60,
                      "the import list")
        modules = dict(json.loads(listed[0].read_text())["modules"])
        assert modules["yaml"].endswith("__init__.py") and "xml.dom.minidom" not in modules
        assert not [name for name in modules if name.startswith("imports_probe")]

        def idle_standby() -> bool:
            """One standby, and it used no CPU for a second: waiting for its job (one
            still importing at nice 10 on a busy machine gets a few percent of a core,
            which a CPU percentage may read as idle)."""
            standbys = [psutil.Process(pid) for pid in _standbys(proc.pid, workers)]
            if len(standbys) != 1:
                return False
            before = sum(standbys[0].cpu_times()[:2])
            time.sleep(1.0)
            return sum(standbys[0].cpu_times()[:2]) == before

        poll(idle_standby, 120, "a standby done importing")
        os.kill(workers.pop(), signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, out[-3000:]
    assert "attempt=0 yaml=False minidom=False" in out, out[-3000:]
    assert "attempt=1 yaml=True minidom=True" in out, out[-3000:]


def test_a_standby_says_when_it_is_ready() -> None:
    """A pool is ready once its standbys have torch imported (a spare's readiness)."""
    from launcher.standby import StandbyPool

    pool = StandbyPool(1)
    taken = None
    try:
        pool.fill()
        assert not pool.ready()  # importing torch takes seconds
        deadline = time.monotonic() + 120
        while not pool.ready() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.ready()
        taken = pool.take()
        assert taken is not None and not pool.ready()  # none left
    finally:
        pool.close()
    if taken is not None:
        taken.kill()
        taken.wait()
        assert taken.stdin is not None
        taken.stdin.close()


def test_static_two_nodes_end_quietly(tmp_path: Path) -> None:
    """Two nodes with the static rendezvous: node 0 hosts the store and leaves as soon as
    the exit barrier completes; node 1, still polling it, must end quietly (torchrun logs
    nothing there), with no traceback, whichever node leaves first."""
    for _ in range(3):
        port = free_port()
        nodes = [start([*GEMINI, "run", "--nnodes", "2", "--node-rank", str(i),
                        "--master-addr", "127.0.0.1", "--master-port", str(port),
                        "--nproc-per-node", "1", str(SCRIPTS / "crash_ddp.py"), "9", "0"],
                       env=env_with(tmp_path, GEMINI_HOST_ID=f"host{i}"))
                 for i in range(2)]
        for proc in nodes:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out[-3000:]
            assert "Traceback" not in out and "Error" not in out, out[-3000:]
