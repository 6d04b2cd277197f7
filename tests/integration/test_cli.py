"""The command line: bad input gets one line on stderr and a documented exit code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import GEMINI, SCRIPTS, env_with, run


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
    (["run", "--config", "/nonexistent/gemini.yaml", "x.py"], 2, "cannot read config file"),
    (["run", "--config", "/", "x.py"], 2, "cannot read config file /: Is a directory"),
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
    assert done.returncode == 2 and "cannot read config file" in done.stderr


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
    env["GEMINI_SPARES"] = "3"
    done = subprocess.run(["bash", str(script), "train.py"], env=env, text=True,
                          capture_output=True, timeout=60)
    assert done.returncode == 2 and "leaves no node" in done.stderr
