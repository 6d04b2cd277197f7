"""In-memory checkpoints end to end: real gemini run, real workers, real SIGKILLs.

Every run must end bitwise identical (model, optimizer, RNG, user values) to a run that
never failed, resume exactly after the newest step every rank committed, and leave no
shared-memory segment behind.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import (
    FAKE_NVML,
    GEMINI,
    SCRIPTS,
    TORCHRUN,
    assert_one_copy,
    env_with,
    events,
    free_port,
    kill_group,
    poll,
    read_lines,
    run,
    start,
)

from launcher import memory

TRAIN = str(SCRIPTS / "train_ckpt.py")


def _no_segments() -> list[str]:
    return memory.list_segments()


@pytest.fixture(autouse=True)
def no_leaks() -> None:
    before = set(_no_segments())
    yield
    left = set(_no_segments()) - before
    assert not left, f"segments left behind: {sorted(left)}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("ref")
    done = run([*GEMINI, "run", "--nproc-per-node", "2", TRAIN, "--steps", "12",
                "--out", str(tmp / "ref.pt")], env=env_with(tmp))
    assert done.returncode == 0, done.output
    return torch.load(tmp / "ref.pt")


def _assert_bitwise(result: dict, reference: dict) -> None:
    assert result["model"].keys() == reference["model"].keys()
    for key in reference["model"]:
        assert torch.equal(result["model"][key], reference["model"][key]), key
    for pid, state in reference["opt"]["state"].items():
        for name, value in state.items():
            assert torch.equal(result["opt"]["state"][pid][name], value), (pid, name)
    assert result["samples"] == reference["samples"]
    assert torch.equal(result["rng"], reference["rng"])


def _resumes(stdout: str) -> dict[int, set[int]]:
    """attempt -> start steps printed by the ranks."""
    found: dict[int, set[int]] = {}
    for start_step, attempt in re.findall(r"resume rank=\d+ start=(\d+) attempt=(\d+)", stdout):
        found.setdefault(int(attempt), set()).add(int(start_step))
    return found


@pytest.mark.parametrize("kills,expected", [
    # rank 1 dies inside the copy of step 4: step 3 is the newest complete step (the
    # next case does it too, among others: `long`, left out of the default runs)
    pytest.param(["1:4:copy"], {0: {0}, 1: {4}}, marks=pytest.mark.long),
    # rank 0 dies between steps, after step 6 is committed everywhere (as in the next)
    pytest.param(["0:6:step"], {0: {0}, 1: {7}}, marks=pytest.mark.long),
    # several failures in one run, different ranks, both kinds
    (["1:2:copy", "0:5:step:1", "1:9:copy:2"], {0: {0}, 1: {2}, 2: {6}, 3: {9}}),
    # a flipped bit in rank 1's newest snapshot (step 7): fall back to step 6
    (["1:7:flip"], {0: {0}, 1: {7}}),
])
def test_kill_resumes_bitwise(tmp_path: Path, reference: dict, kills: list[str],
                              expected: dict[int, set[int]]) -> None:
    args = [arg for k in kills for arg in ("--kill", k)]
    env = env_with(tmp_path)
    done = run([*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "3", TRAIN,
                "--steps", "12", "--out", str(tmp_path / "out.pt"), *args],
               env=env, timeout=240)
    assert done.returncode == 0, done.output[-4000:]
    assert _resumes(done.stdout) == expected
    _assert_bitwise(torch.load(tmp_path / "out.pt"), reference)


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_ranks_of_a_host_keep_one_copy_of_replicated_state(tmp_path: Path,
                                                               nproc: int) -> None:
    """Data-parallel ranks hold the same parameters and optimizer state: the ranks of a
    host split them between their slots, one copy in all, not one per rank. Two ranks
    under DistributedDataParallel (found by the Checkpointer); four with all-reduced
    gradients and ``replicated=True`` (DDP rebuilds its buckets after a restart, which
    with more than two ranks changes the rounding). Rank 1 dies inside its copy of step 5:
    its share of step 5 is torn, so every rank resumes from step 4, and the run ends
    bitwise equal to one that never failed."""
    script = [TRAIN, "--steps", "10", "--width", "256", "--report-slots",
              *(["--grad-sync", "params", "--replicated"] if nproc == 4 else [])]
    ref = run([*GEMINI, "run", "--nproc-per-node", str(nproc), *script,
               "--out", str(tmp_path / "ref.pt")], env=env_with(tmp_path), timeout=240)
    assert ref.returncode == 0, ref.output[-3000:]
    done = run([*GEMINI, "run", "--nproc-per-node", str(nproc), "--max-restarts", "1",
                *script, "--kill", "1:5:copy", "--out", str(tmp_path / "out.pt")],
               env=env_with(tmp_path), timeout=240)
    assert done.returncode == 0, done.output[-3000:]
    assert _resumes(done.stdout) == {0: {0}, 1: {5}}
    _assert_bitwise(torch.load(tmp_path / "out.pt"), torch.load(tmp_path / "ref.pt"))
    assert_one_copy([ref.stdout, done.stdout], nproc)


@pytest.mark.parametrize("given", ["model and optimizer", "DCP app state"])
def test_fsdp2_sharded_state_resumes_bitwise(tmp_path: Path, given: str) -> None:
    """FSDP2 (fully_shard, gloo, CPU): parameters and optimizer state are DTensors, each
    rank saving its shard (33 rows split 17/16); a rank killed after step 5 resumes at 6,
    and the full state at the end equals that of a run without failure. The Checkpointer
    is given the model and optimizer, or only a torch.distributed.checkpoint ``Stateful``
    app state (``get_state_dict``/``set_state_dict``), as DCP users and torchtitan do; the
    batches come from a shuffled loader (4 a rank and epoch, DistributedSampler) and the
    kill falls in the second epoch, which the resumed run fast-forwards."""
    script = [str(SCRIPTS / "train_fsdp.py"), "--steps", "10", "--loader",
              *(["--app-state"] if given == "DCP app state" else [])]
    ref = run([*GEMINI, "run", "--nproc-per-node", "2", *script, "--out",
               str(tmp_path / "ref.pt")], env=env_with(tmp_path), timeout=180)
    assert ref.returncode == 0, ref.output[-3000:]
    done = run([*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "1", *script,
                "--kill", "1:5", "--out", str(tmp_path / "out.pt")],
               env=env_with(tmp_path), timeout=180)
    assert done.returncode == 0, done.output[-3000:]
    assert _resumes(done.stdout) == {0: {0}, 1: {6}}
    expected, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "out.pt")
    assert sorted(got) == sorted(expected) and len(got) == 16
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_dcp_app_states_dict_is_built_from_its_model_and_optimizer(tmp_path: Path) -> None:
    """A DCP app state whose ``state_dict()`` is ``get_state_dict(model, optimizer)`` is
    asked at saves 1, 2, 4, ... 32 of 40 (FSDP2 with AdamW, DDP with SGD and momentum:
    the names without DDP's "module."); the reader builds the same dict from the model
    and optimizer at every other step. An app state with more in it (a step count), two
    models, or copies of the model's tensors (equal values, other memory) is asked at
    every save. When the optimizer gains a parameter group (step 10), the dict is read
    from the app state from that save on, and built again after the next check (save
    16). One that gains a key at step 20 is read its own way from the next check on
    (save 32), and what the reader gave in between lacked the key: the window the
    documentation names."""
    done = run([*TORCHRUN, "--standalone", "--nproc-per-node", "2",
                str(SCRIPTS / "app_state_reader.py")], env=env_with(tmp_path), timeout=180)
    assert done.returncode == 0, done.output[-3000:]
    found = dict(re.findall(r"^(\w+) (built=.*)$", done.stdout, re.M))
    assert found == {"fsdp2": "built=True calls=6 unequal=",
                     "ddp": "built=True calls=6 unequal=",
                     "counter": "built=False calls=40 unequal=",
                     "changing": "built=False calls=14 unequal=" + ",".join(
                         map(str, range(20, 31))),
                     "two": "built=False calls=40 unequal=",
                     "copy": "built=False calls=40 unequal=",
                     "grown": "built=True calls=11 unequal="}, done.stdout


def test_hsdp_replicas_on_a_host_keep_one_copy_and_resume_bitwise(tmp_path: Path) -> None:
    """HSDP: FSDP2 on a 2 x 2 mesh, parameters and optimizer state sharded over one
    dimension and replicated over the other, four ranks on one host. The two ranks that
    hold the same shard split it between their slots: the host's slots hold one copy of
    the state, not two. Rank 1 killed after step 4 resumes at 5 (its shard partly read
    from its replica's slot), and the full state at the end equals an unfailed run's."""
    script = [str(SCRIPTS / "train_fsdp.py"), "--steps", "8", "--width", "4096", "--hsdp",
              "--report-slots"]
    ref = run([*GEMINI, "run", "--nproc-per-node", "4", *script, "--out",
               str(tmp_path / "ref.pt")], env=env_with(tmp_path), timeout=240)
    assert ref.returncode == 0, ref.output[-3000:]
    done = run([*GEMINI, "run", "--nproc-per-node", "4", "--max-restarts", "1", *script,
                "--kill", "1:4", "--out", str(tmp_path / "out.pt")],
               env=env_with(tmp_path), timeout=240)
    assert done.returncode == 0, done.output[-3000:]
    assert _resumes(done.stdout) == {0: {0}, 1: {5}}
    expected, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "out.pt")
    assert sorted(got) == sorted(expected) and len(got) == 16
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert_one_copy([ref.stdout, done.stdout], 4)


def test_hung_worker_is_restarted(tmp_path: Path, reference: dict) -> None:
    """Rank 1 stops itself (SIGSTOP) after committing step 5; rank 0 then waits in its
    all-reduce. Neither exits: --hang-timeout notices the silence and kills both."""
    done = run([*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "3",
                "--hang-timeout", "2", TRAIN, "--steps", "12", "--kill", "1:5:stop",
                "--out", str(tmp_path / "out.pt")], env=env_with(tmp_path), timeout=240)
    assert done.returncode == 0, done.output[-4000:]
    assert _resumes(done.stdout) == {0: {0}, 1: {6}}
    hangs = [e for e in events(tmp_path / "runs") if e["event"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["silent_seconds"] >= 2, hangs
    _assert_bitwise(torch.load(tmp_path / "out.pt"), reference)


def test_hang_timeout_spares_slow_and_silent_workers(tmp_path: Path) -> None:
    """Steps slower than nothing but faster than the timeout, and workers that never beat
    (no Checkpointer), are not hangs."""
    slow = run([*GEMINI, "run", "--nproc-per-node", "2", "--hang-timeout", "1.5", TRAIN,
                "--steps", "5", "--sleep", "0.6"], env=env_with(tmp_path), timeout=120)
    assert slow.returncode == 0, slow.output[-3000:]
    silent = run([*GEMINI, "run", "--nproc-per-node", "1", "--hang-timeout", "0.5",
                  str(SCRIPTS / "idle.py"), "2"], env=env_with(tmp_path), timeout=120)
    assert silent.returncode == 0, silent.output[-3000:]
    assert not [e for e in events(tmp_path / "runs") if e["event"] in ("hang", "restart")]


def test_lost_gpu_takes_the_host_out(tmp_path: Path) -> None:
    """NVML (a stand-in module: no GPU here) says a GPU fell off the bus mid-run: the
    supervisor stops its workers, frees its memory and leaves with exit code 6."""
    lost = tmp_path / "lost"
    env = env_with(tmp_path, PYTHONPATH=os.pathsep.join(
        [str(FAKE_NVML), os.environ.get("PYTHONPATH", "")]),
        FAKE_NVML_LOST=str(lost))
    proc = start([*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "3", TRAIN,
                  "--steps", "200", "--sleep", "0.1"], env=env)
    lines: list[str] = []
    pump = read_lines(proc, lines)
    try:
        _wait_for(lines, r"^step 3 ")
        workers = _workers(tmp_path / "runs")
        lost.touch()
        assert proc.wait(timeout=60) == 6, "".join(lines)[-3000:]
        _, alive = psutil.wait_procs(workers, timeout=15)
        assert len(workers) == 2 and not alive
    finally:
        kill_group(proc)
        pump.join(timeout=10)
    said = "gemini: error: GPU 1 is lost (NVML: GPU is lost): this host leaves the job\n"
    assert said in lines, "".join(lines)[-3000:]
    assert [e["event"] for e in events(tmp_path / "runs")][-2:] == ["host_unhealthy", "exit"]


def _wait_for(lines: list[str], pattern: str, timeout: float = 120) -> re.Match[str]:
    def found() -> re.Match[str] | None:
        for line in list(lines):
            match = re.search(pattern, line)
            if match:
                return match
        return None

    return poll(found, timeout, f"a line matching {pattern!r}",
                details=lambda: "".join(lines)[-3000:])


def _workers(run_root: Path) -> list[psutil.Process]:
    """The running workers of the newest round, as the supervisor's events name them."""
    starts = [e for e in events(run_root) if e["event"] == "start"]
    if not starts:
        return []
    found = []
    for worker in starts[-1]["workers"]:
        try:
            found.append(psutil.Process(worker["pid"]))
        except psutil.NoSuchProcess:
            pass
    return found


def test_random_kills_of_running_workers(tmp_path: Path, reference: dict) -> None:
    seed = int(os.environ.get("GEMINI_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    proc = start([*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "5", TRAIN,
                  "--steps", "12", "--sleep", "0.15", "--out", str(tmp_path / "out.pt")],
                 env=env_with(tmp_path))
    lines: list[str] = []
    pump = read_lines(proc, lines)
    try:
        for attempt in range(3):
            _wait_for(lines, rf"resume rank=\d start=\d+ attempt={attempt}")
            time.sleep(rng.uniform(0.2, 1.0))
            victims = _workers(tmp_path / "runs")
            if not victims:
                break
            rng.choice(victims).send_signal(signal.SIGKILL)
            _wait_for(lines, rf"resume rank=\d start=\d+ attempt={attempt + 1}")
        assert proc.wait(timeout=180) == 0, "".join(lines)[-4000:]
    finally:
        kill_group(proc)
        pump.join(timeout=10)
    _assert_bitwise(torch.load(tmp_path / "out.pt"), reference), f"seed {seed}"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_cleanly(tmp_path: Path, signum: int) -> None:
    proc = start([*GEMINI, "run", "--nproc-per-node", "2", TRAIN, "--steps", "200",
                  "--sleep", "0.1"], env=env_with(tmp_path))
    lines: list[str] = []
    pump = read_lines(proc, lines)
    try:
        _wait_for(lines, r"^step 3 ")
        assert memory.list_segments()
        os.kill(proc.pid, signum)
        assert proc.wait(timeout=60) == 128 + signum
    finally:
        kill_group(proc)
        pump.join(timeout=10)


def test_sigterm_before_the_first_round_stops_cleanly(tmp_path: Path) -> None:
    """A supervisor waiting for its first rendezvous (torch elastic has not installed its
    signal handlers yet) stops on SIGTERM as later: exit 143, its memory freed."""
    port = free_port()
    proc = start([*GEMINI, "run", "--nnodes", "2", "--nproc-per-node", "1",
                  "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                  "--rdzv-id", f"early-{port}", TRAIN, "--steps", "5"], env=env_with(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while not [e for e in events(tmp_path / "runs") if e["event"] == "launch"]:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        key = memory.run_key(f"early-{port}")
        assert [n for n in memory.list_segments() if key in n]  # the owner record
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert not [n for n in memory.list_segments() if key in n]
        exits = [e for e in events(tmp_path / "runs") if e["event"] == "exit"]
        assert [e["outcome"] for e in exits] == ["interrupted"]
    finally:
        kill_group(proc)
        proc.communicate(timeout=30)


def test_failed_job_leaves_no_segments(tmp_path: Path) -> None:
    done = run([*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "1", TRAIN,
                "--steps", "12", "--kill", "1:3:step", "--kill", "1:5:step:1"],
               env=env_with(tmp_path), timeout=180)
    assert done.returncode == 1
    assert "rank      : 1 (local_rank: 1)" in done.stderr


def test_restarted_supervisor_adopts_its_segments(tmp_path: Path, reference: dict) -> None:
    """SIGKILL the supervisor and workers (a host reboot without losing /dev/shm): the same
    run started again adopts the slots and resumes instead of starting over."""
    port = free_port()
    command = [*GEMINI, "run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"adopt-{port}",
               TRAIN, "--steps", "12", "--sleep", "0.1", "--out", str(tmp_path / "out.pt")]
    proc = start(command, env=env_with(tmp_path))
    lines: list[str] = []
    pump = read_lines(proc, lines)
    _wait_for(lines, r"^step 5 ")
    workers = _workers(tmp_path / "runs")
    kill_group(proc)
    proc.wait(timeout=30)
    pump.join(timeout=10)
    # the workers run in their own sessions, yet die with their supervisor
    _, alive = psutil.wait_procs(workers, timeout=15)
    assert len(workers) == 2 and not alive
    held = json.loads(run([*GEMINI, "inspect", "--json"]).stdout)
    # a slot the kill caught mid-copy has no step
    steps = {s["step"] for s in held["slots"]
             if s["run_id"] == f"adopt-{port}" and s["step"] is not None}
    assert steps and max(steps) >= 4, held
    done = run(command, env=env_with(tmp_path), timeout=180)
    assert done.returncode == 0, done.output[-3000:]
    starts = [int(s) for s in re.findall(r"resume rank=\d start=(\d+)", done.stdout)]
    assert len(set(starts)) == 1 and starts[0] >= 5
    _assert_bitwise(torch.load(tmp_path / "out.pt"), reference)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a private tmpfs")
def test_shm_too_small_stops_before_training(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    gemini = " ".join(GEMINI)
    script = (f"mount -t tmpfs -o size=1m tmpfs {shm} && exec {gemini} run "
              f"--nproc-per-node 2 {TRAIN} --width 512 --steps 3")
    done = run(["unshare", "--mount", "sh", "-c", script],
               env=env_with(tmp_path, GEMINI_SHM_DIR=str(shm)), timeout=120)
    assert done.returncode == 4, done.output[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert re.match(r"gemini: error: .* too small .* need \d+ bytes .* \d+ bytes available", last)
    assert "step 0" not in done.stdout
