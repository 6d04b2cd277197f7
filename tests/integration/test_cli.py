"""The command line: bad input gets one line on stderr and a documented exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import GEMINI, SCRIPTS, env_with, kill_group, poll, run


@pytest.mark.parametrize("args,exit_code,message", [
    (["run", "--no-such-flag", "x.py"], 2, "unrecognized arguments: --no-such-flag"),
    (["run", "--max_rest", "-1", "x.py"], 2, "max_restarts"),  # a prefix, as torchrun takes
    (["run", "--st", "x.py"], 2, "ambiguous option: --st could match --standalone"),
    (["run", "--nnodes", "2:1", "x.py"], 2, "nnodes='2:1'"),
    (["run", "--nnodes", "two", "x.py"], 2, "expected N or MIN:MAX"),
    (["run", "--max-restarts", "-1", "x.py"], 2, "max_restarts"),
    (["run", "does-not-exist.py"], 2, "training script not found"),
    (["run", "--no-python", "no-such-binary-xyz"], 2, "not found or not executable"),
    (["run"], 2, "arguments are required: SCRIPT"),
    (["run", "--config", "/nonexistent/gemini.yaml", "x.py"], 2, "cannot read the config file"),
    (["run", "--config", "/", "x.py"], 2, "the config file / is not a regular file"),
    # gemini's own flags are never abbreviated, and an unknown flag's value is not shown
    (["run", "--store-password", "hunter2", "x.py"], 2, "unrecognized arguments: --store-password"),
    (["run", "--store-password=hunter2", "x.py"], 2, "unrecognized arguments: --store-password=..."),
    (["run", "--max-same", "1", "x.py"], 2, "unrecognized arguments: --max-same"),
    (["run", "--on-divergence", "ignore", "x.py"], 2, "on_divergence='ignore': expected one of"),
    (["run", "--max-restarts", "9" * 5000, "x.py"], 2, "is not a valid int"),
    (["run", "--rdzv-id", "\x1b]52;c;aGk=\x07\u202e", "x.py"], 2, "run id '\\x1b]52;c;aGk=\\x07"),
    (["status", "--run-id", "a/../b"], 2, "run id 'a/../b'"),
    (["run", "--rdzv-id", "../../x", str(SCRIPTS / "train_ckpt.py")], 2, "run id '../../x'"),
    (["run", "--rdzv-id", "a" * 200, str(SCRIPTS / "train_ckpt.py")], 2, "1-128 letters"),
    (["run", "--host-ttl", "inf", str(SCRIPTS / "train_ckpt.py")], 2, "host_ttl=inf"),
    (["run", "--host-ttl", "1e300", str(SCRIPTS / "train_ckpt.py")], 2, "between 1 and 86400"),
    (["run", "--store-timeout", "nan", str(SCRIPTS / "train_ckpt.py")], 2, "store_timeout=nan"),
    (["run", "--rdzv-backend", "carrier-pigeon", str(SCRIPTS / "train_ckpt.py")], 2,
     "unknown rendezvous backend 'carrier-pigeon'"),
    (["plan", "--nodes", "1000000000"], 2, "not in the range"),
    (["frobnicate"], 2, "No such command"),
    (["template", "nope"], 2, "Invalid value"),
])
def test_bad_input_one_line(tmp_path: Path, args: list[str], exit_code: int,
                            message: str) -> None:
    done = run([*GEMINI, *args], env=env_with(tmp_path), cwd=tmp_path, timeout=60)
    assert done.returncode == exit_code, done.output
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("gemini: error:") and message in lines[0], lines[0]
    assert done.stdout == ""


@pytest.mark.parametrize("text,message", [
    ("nproc_per_nod: 2\n", "did you mean 'nproc_per_node'"),
    ("nnodes: [\n", "line 2"),
    ("max_restarts: lots\n", "not a valid int"),
    ("replicas: [1, 2]\n", "replicas=[1, 2] is not a valid int"),
    ("host_ttl: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
    ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "c: [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n", "aliases (*name) are not allowed"),
    ("run_root: \xff\xfe\n", "not UTF-8 text"),
    ("nnodes: " + "x" * 2_000_000 + "\n", "larger than 1 MiB"),
    ("max_restarts: " + "9" * 5000 + "\n", "Exceeds the limit (4300 digits)"),
])
def test_invalid_config_file(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "gemini.yaml").write_bytes(text.encode("latin-1"))
    script = tmp_path / "x.py"
    script.write_text("")
    done = run([*GEMINI, "run", "--config", "gemini.yaml", "x.py"], env=env_with(tmp_path),
               cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files regardless of mode")
def test_unreadable_config_file(tmp_path: Path) -> None:
    path = tmp_path / "gemini.yaml"
    path.write_text("nnodes: 1\n")
    path.chmod(0)
    done = run([*GEMINI, "run", "--config", str(path), "x.py"], env=env_with(tmp_path))
    assert done.returncode == 2 and "cannot read the config file" in done.stderr


@pytest.mark.parametrize("flag", ["--config", "--secret-file", "--store-password-file"])
def test_a_fifo_given_as_a_file_is_refused_at_once(tmp_path: Path, flag: str) -> None:
    """A FIFO blocks whoever opens it until a writer comes: refused, never waited on."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    extra = ["--store-user", "u", "--store", "etcd://127.0.0.1:1"] if "password" in flag else []
    done = run([*GEMINI, "run", *extra, flag, str(fifo), str(SCRIPTS / "idle.py"), "1"],
               env=env_with(tmp_path), timeout=60)
    assert done.returncode == 2, done.output
    assert done.stderr.count("\n") == 1 and "is not a regular file" in done.stderr, done.stderr


def test_a_host_id_that_is_not_a_name_is_refused(tmp_path: Path) -> None:
    """GEMINI_HOST_ID names store keys and segments, and `gemini status` shows it: it
    follows the rules of run ids (a '[/]' once made status exit 70)."""
    for bad in ("a[/]b", "../x", "\x1b[2J"):
        done = run([*GEMINI, "run", str(SCRIPTS / "idle.py"), "1"],
                   env=env_with(tmp_path, GEMINI_HOST_ID=bad), timeout=60)
        assert done.returncode == 2, done.output
        assert done.stderr.count("\n") == 1 and "GEMINI_HOST_ID=" in done.stderr, done.stderr
        assert "\x1b" not in done.stderr


def test_a_worker_command_line_over_the_system_limit_is_a_usage_error(tmp_path: Path) -> None:
    """An environment that fits gemini's exec but not a worker's (torch adds variables):
    one line and exit 2, not an internal error."""
    env = env_with(tmp_path)
    argv = [*GEMINI, "run", "--no-standby", str(SCRIPTS / "idle.py"), "1"]
    room = os.sysconf("SC_ARG_MAX") - 600 - sum(len(a) + 9 for a in argv) - sum(
        len(k) + len(v) + 10 for k, v in env.items())
    for i in range(room // 100_000 + 1):
        size = min(100_000, room - 30)
        if size <= 0:
            break
        env[f"GEMINI_TEST_FILL{i}"] = "x" * size
        room -= size + 30
    done = run(argv, env=env, timeout=120)
    assert done.returncode == 2, done.output[-2000:]
    assert "exceed the system's limit on exec arguments" in done.stderr, done.stderr[-2000:]


def test_unwritable_persist_dir(tmp_path: Path) -> None:
    """A --persist-dir that cannot be written: one line and exit 2 before any worker
    starts, not a failure at the first persist. (A file in its path stands for every
    cause; an immutable directory also refuses root, where the file system allows one.)"""
    (tmp_path / "file").write_text("")
    places = [tmp_path / "file" / "persist"]
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    if subprocess.run(["chattr", "+i", str(frozen)], capture_output=True).returncode == 0:
        places.append(frozen)
    try:
        for place in places:
            done = run([*GEMINI, "run", "--persist-dir", str(place), str(SCRIPTS / "idle.py"),
                        "1"], env=env_with(tmp_path), timeout=60)
            assert done.returncode == 2, done.output
            assert done.stderr.count("\n") == 1, done.stderr
            assert f"--persist-dir {place}: cannot write" in done.stderr
            assert "tick" not in done.stdout
    finally:
        subprocess.run(["chattr", "-i", str(frozen)], capture_output=True)


def test_a_flag_that_torch_rejects_is_a_usage_error(tmp_path: Path) -> None:
    """torch's own check of a torchrun flag (an unknown --logs-specs entry point) ends in
    one line and exit 2, as gemini's own checks do, before anything starts."""
    done = run([*GEMINI, "run", "--logs-specs", "DOESNOT_EXIST", str(SCRIPTS / "env_probe.py")],
               env=env_with(tmp_path), timeout=60)
    assert done.returncode == 2, done.output
    assert done.stderr.strip().splitlines()[-1].startswith("gemini: error: "), done.stderr
    assert "DOESNOT_EXIST" in done.stderr and "Traceback" not in done.stderr


def test_env_config_error(tmp_path: Path) -> None:
    done = run([*GEMINI, "run", str(SCRIPTS / "env_probe.py")],
               env=env_with(tmp_path, GEMINI_NPROC_PER_NODE="zero"), timeout=60)
    assert done.returncode == 2 and "set in the environment" in done.stderr


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["template", "config"], []])
def test_fast_paths_do_not_import_torch(args: list[str]) -> None:
    code = (f"import sys; from gemini_cli.main import main; rc = main({args!r}); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout


def test_run_help_lists_both_spellings() -> None:
    done = run([*GEMINI, "run", "--help"])
    for flag in ("--nproc-per-node", "--nproc_per_node", "--rdzv-backend", "--rdzv_backend",
                 "--max-restarts", "--standalone", "--local-ranks-filter", "-m, --module",
                 "--no-python", "--run-path", "-r REDIRECTS, --redirects", "-t TEE, --tee", "--master-port",
                 "--config"):
        assert flag in done.stdout, flag
    # gemini's flags name what they take
    for flag in ("--host-ttl SECONDS", "--store URL", "--store-password-file FILE",
                 "--replicas M", "--persist-every N|Ts", "--max-same-failures N",
                 "--on-divergence {rollback,stop,warn}", "--persist-dir DIR"):
        assert flag in done.stdout, flag
    assert "VALUE" not in done.stdout


def test_template_slurm_uses_slurm_variables() -> None:
    done = run([*GEMINI, "template", "slurm"])
    assert done.returncode == 0
    assert "SLURM_JOB_NODELIST" in done.stdout and "gemini run" in done.stdout
    assert "$SLURM_JOB_ID" in done.stdout
    done = subprocess.run(["bash", "-n"], input=done.stdout, text=True, capture_output=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("spares", "nnodes"), [("", "3:3"), ("1", "2:2")])
def test_template_slurm_keeps_the_nodes_past_the_group_as_spares(
        tmp_path: Path, spares: str, nnodes: str) -> None:
    """The sbatch script run with stand-ins for srun and scontrol: with GEMINI_SPARES=1
    on a 3-node allocation the group has 2 nodes (every node runs `gemini run`; the third
    waits as a spare)."""
    script = tmp_path / "job.sbatch"
    script.write_text(run([*GEMINI, "template", "slurm"]).stdout)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/srun.args\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_NUM_NODES": "3",
           "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-3]", "GEMINI_SPARES": spares}
    done = subprocess.run(["bash", str(script), "train.py"], env=env, text=True,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "srun.args").read_text().split()
    assert args[args.index("--nnodes") + 1] == nnodes, args
    assert "--persist-dir" not in args
    env["GEMINI_SPARES"] = "3"
    done = subprocess.run(["bash", str(script), "train.py"], env=env, text=True,
                          capture_output=True, timeout=60)
    assert done.returncode == 2 and "leaves no node" in done.stderr


def test_template_slurm_persists_on_preemption_and_never_requeues_exit_7(tmp_path: Path) -> None:
    """With GEMINI_PERSIST_DIR the supervisors get --persist-dir (SIGTERM before the time
    limit then persists the newest step); a job ending with exit code 7 (no progress) is
    made non-requeueable and the script exits 7 too."""
    script = tmp_path / "job.sbatch"
    text = run([*GEMINI, "template", "slurm"]).stdout
    assert "#SBATCH --signal=TERM@" in text
    script.write_text(text)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/srun.args\nexit 7\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.args\n'
                                      'echo node1\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]",
           "GEMINI_PERSIST_DIR": str(tmp_path / "shared dir")}
    done = subprocess.run(["bash", str(script), "train.py"], env=env, text=True,
                          capture_output=True, timeout=60)
    assert done.returncode == 7, done.stderr
    args = (tmp_path / "srun.args").read_text()
    assert f"--persist-dir {tmp_path / 'shared dir'} train.py" in args, args
    assert "update JobId=42 Requeue=0" in (tmp_path / "scontrol.args").read_text()
    assert not list((tmp_path / ".gemini").glob("secret-*"))  # removed on the way out


@pytest.mark.parametrize("ending", ["failed", "cancelled"])
def test_template_slurm_removes_the_secret_however_the_job_ends(tmp_path: Path,
                                                                ending: str) -> None:
    """The run's secret file is gone after the script ends: when `gemini run` failed, and
    when the job is cancelled or preempted (SIGTERM to the job's processes) while it runs."""
    script = tmp_path / "job.sbatch"
    script.write_text(run([*GEMINI, "template", "slurm"]).stdout)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    body = "exit 1" if ending == "failed" else "exec sleep 60"
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/srun.args\n{body}\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]"}
    job = subprocess.Popen(["bash", str(script), "train.py"], env=env, text=True,
                           start_new_session=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    try:
        poll(lambda: (tmp_path / "srun.args").exists(), 30, "srun started")
        if ending == "cancelled":
            assert list((tmp_path / ".gemini").glob("secret-42")), "no secret while it runs"
            os.killpg(job.pid, signal.SIGTERM)  # what scancel and a preemption do
        assert job.wait(timeout=30) == (1 if ending == "failed" else 143)
    finally:
        kill_group(job)
    assert not list((tmp_path / ".gemini").glob("secret-*"))


def test_status_shows_hostile_store_values_as_plain_text(tmp_path: Path) -> None:
    """Whoever may write the run's keys (any host of the run) chose what `gemini status`
    prints: markup, terminal escapes and values of the wrong type come out as inert text,
    never as a crash or a sequence the terminal obeys."""
    import json

    from launcher.coordination import run_prefix
    from launcher.store import open_store

    url = f"embedded://{tmp_path / 'store.db'}"
    prefix = run_prefix("hostile")
    store = open_store(url)
    try:
        store.put(prefix + "root", b"[bold red]x[/]\x1b]52;c;aGk=\x07")
        store.put(prefix + "hosts/[/]", json.dumps({"state": "\x1b[2J", "pid": "[/]",
                                                    "ranks": ["a", None], "round": {"x": 1},
                                                    "updated": "soon"}).encode())
        store.put(prefix + "hosts/odd", b"[1, 2, 3]")
        store.put(prefix + "replication/plan", json.dumps({"sstar": "[/]", "target": []}).encode())
        store.put(prefix + "ranks/0", json.dumps({"host": "\u202eevil", "memory": "7",
                                                  "persist": [1]}).encode())
        store.put(prefix + "ranks/1", json.dumps({"host": ["h"], "memory": 2}).encode())
        store.put(prefix + "events/1-x", json.dumps({"event": "[link=file:///]x[/link]",
                                                     "ts": 1e300, "host": 3}).encode())
    finally:
        store.close()
    for extra in ([], ["--json"]):
        done = run([*GEMINI, "status", "--store", url, "--run-id", "hostile", *extra],
                   env=env_with(tmp_path), timeout=60)
        assert done.returncode == 0, done.output
        assert "\x1b" not in done.stdout and "\u202e" not in done.stdout, done.stdout
        if not extra:
            assert "[/]" in done.stdout and "[bold red]" in done.stdout, done.stdout
