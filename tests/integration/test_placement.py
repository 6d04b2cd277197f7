"""The ``gemini plan`` command: replica placement and the recovery probability as it
reports them. Placement itself is tested in tests/unit/test_placement.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import GEMINI, run

from launcher.replication.placement import recovery_probability


def test_cli_json() -> None:
    done = run([*GEMINI, "plan", "--nodes", "5", "--replicas", "2", "--failures", "2",
                "--state-bytes", "512MiB", "--json"], timeout=60)
    assert done.returncode == 0, done.output
    report = json.loads(done.stdout)
    assert report["schema"] == "gemini.plan/v1"
    assert (report["nodes"], report["replicas"], report["kind"]) == (5, 2, "mixed")
    assert report["groups"] == [[0, 1], [2, 3, 4]]
    assert report["holders"] == [[1], [0], [3], [4], [2]]
    assert report["failures"] == 2
    assert report["probability_exact"] == str(recovery_probability(5, 2, 2)) == "3/5"
    assert report["probability"] == pytest.approx(0.6)  # lost: {0,1} and any 2 of the ring 2,3,4
    assert report["memory_per_host_bytes"] == 4 * (512 << 20)  # 2 slots x (own, 1 peer)


@pytest.mark.parametrize(("parallelism", "host"), [("ddp", 1), ("sharded", 8)])
def test_cli_memory_follows_the_parallelism(parallelism: str, host: int) -> None:
    """The 8 ranks of a DDP host keep one copy of the state between them; sharded ranks
    each keep their own shard."""
    done = run([*GEMINI, "plan", "--nodes", "4", "--state-bytes", "1GiB", "--ranks-per-host",
                "8", "--parallelism", parallelism, "--json"], timeout=60)
    assert done.returncode == 0, done.output
    report = json.loads(done.stdout)
    assert report["host_checkpoint_bytes"] == host << 30
    assert report["memory_per_host_bytes"] == 4 * host << 30  # 2 slots x (own, 1 peer)
    human = run([*GEMINI, "plan", "--nodes", "4", "--state-bytes", "1GiB", "--ranks-per-host",
                 "8", "--parallelism", parallelism], timeout=60)
    assert f"{4 * host:.1f} GiB" in human.stdout, human.output
    assert ("one copy of the DDP state for its 8 ranks" in human.stdout) == (parallelism == "ddp")


def test_cli_json_without_state_bytes() -> None:
    done = run([*GEMINI, "plan", "--nodes", "16", "--json"], timeout=60)
    assert done.returncode == 0, done.output
    report = json.loads(done.stdout)
    assert report["replicas"] == 2 and report["failures"] == 2
    assert report["probability_exact"] == "14/15"
    assert report["memory_per_host_bytes"] is None


def test_cli_human() -> None:
    done = run([*GEMINI, "plan", "--nodes", "16", "--replicas", "2", "--state-bytes", "2GiB",
                "--groups"], timeout=60)
    assert done.returncode == 0, done.output
    assert "93.3%" in done.stdout and "14/15" in done.stdout
    assert "8.0 GiB" in done.stdout  # 2 slots x 2 copies x 2 GiB
    assert "14 -> 15" in done.stdout and "group" in done.stdout
    three = run([*GEMINI, "plan", "--nodes", "16", "--failures", "3"], timeout=60)
    assert three.returncode == 0 and "80.0%" in three.stdout


def test_cli_human_summary_first_and_the_units_it_read() -> None:
    """A large plan prints its answer in a few lines (the groups on request); the size it
    read is printed in bytes, decimal and binary units: GB counts in 1000s, G in 1024s."""
    done = run([*GEMINI, "plan", "--nodes", "64", "--state-bytes", "14GB"], timeout=60)
    assert done.returncode == 0, done.output
    lines = done.stdout.splitlines()
    assert len(lines) == 5 and "98.4%" in lines[1] and "->" not in done.stdout, done.stdout
    assert "--groups" in lines[-1] and "52.2 GiB" in lines[2]
    assert "14,000,000,000 bytes = 14.00 GB = 13.0 GiB" in done.stdout
    binary = run([*GEMINI, "plan", "--nodes", "64", "--state-bytes", "14G"], timeout=60)
    assert "15,032,385,536 bytes = 15.03 GB = 14.0 GiB" in binary.stdout, binary.stdout
    table = run([*GEMINI, "plan", "--nodes", "64", "--groups"], timeout=60)
    assert table.stdout.index("98.4%") < table.stdout.index("62 -> 63"), table.stdout
    small = run([*GEMINI, "plan", "--nodes", "4"], timeout=60)
    assert "2 -> 3" in small.stdout  # a few hosts: the table by default


@pytest.mark.parametrize("args,message", [
    (["--nodes", "0"], "nodes must be at least 1"),
    (["--nodes", "4", "--replicas", "0"], "replicas must be at least 1"),
    (["--nodes", "4", "--state-bytes", "bogus"], "'bogus' is not a size"),
    (["--nodes", "4", "--failures", "-1"], "--failures"),
    (["--nodes", "four"], "--nodes"),
    ([], "--nodes"),
])
def test_cli_bad_input_one_line(args: list[str], message: str) -> None:
    done = run([*GEMINI, "plan", *args], timeout=60)
    assert done.returncode == 2, done.output
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("gemini: error:") and message in lines[0], lines[0]
    assert done.stdout == ""


def test_cli_goodput_plan(tmp_path: Path) -> None:
    """--mtbf adds the expected ETTR beside the storage baseline (the model's figures,
    tests/unit/test_goodput.py), and the settings; --from-status takes what a running
    job measured."""
    args = [*GEMINI, "plan", "--nodes", "10", "--mtbf", "10h", "--step-time", "2",
            "--state-bytes", "10GB", "--host-share", "0.5", "--network-bandwidth", "1000",
            "--storage-bandwidth", "500", "--restart-time", "100s"]
    done = run([*args, "--json"], timeout=60)
    assert done.returncode == 0, done.output
    report = json.loads(done.stdout)
    goodput = report["goodput"]
    assert goodput["job_mtbf_s"] == pytest.approx(3600.0)
    assert report["ettr"] == goodput["ettr"] and 0.99 < report["ettr"] < 1.0
    assert goodput["baseline"]["interval_s"] == pytest.approx(math.sqrt(2 * 20.0 * 3600.0))
    assert goodput["recommended"]["replicate_every"] == 5 and goodput["measured"] == []
    human = run(args, timeout=60)
    assert "expected goodput (ETTR) at one failure every 1.0 h" in human.stdout, human.output
    assert "recommended: --replicas 2" in human.stdout
    status = tmp_path / "status.json"
    status.write_text(json.dumps({"goodput": {
        "wall_s": 600.0, "step_s": 0.5, "steps": 1000, "failures": 3, "useful_s": 500.0,
        "lost_s": {"checkpoint": 1.0, "detection": 0.3, "rendezvous": 0.6, "restore": 0.3,
                   "waiting": 0.0, "redone": 0.5, "start_up": 2.0, "other": 0.0}}}))
    measured = run([*GEMINI, "plan", "--nodes", "2", "--state-bytes", "1GiB", "--from-status",
                    str(status), "--json"], timeout=60)
    assert measured.returncode == 0, measured.output
    goodput = json.loads(measured.stdout)["goodput"]
    assert goodput["job_mtbf_s"] == pytest.approx(200.0) and goodput["step_s"] == 0.5
    assert goodput["measured"] == ["host_recovery", "job_mtbf", "stall", "step_time",
                                   "worker_recovery"]


@pytest.mark.parametrize("extra", [
    ["--step-time", "1"],  # no failure rate
    ["--mtbf", "1d"],  # no step time
    ["--mtbf", "1d", "--job-mtbf", "1h", "--step-time", "1"],
    ["--mtbf", "0", "--step-time", "1"],
    ["--mtbf", "soon", "--step-time", "1"],
])
def test_cli_goodput_plan_bad_input(extra: list[str]) -> None:
    done = run([*GEMINI, "plan", "--nodes", "4", "--state-bytes", "1GiB", *extra], timeout=60)
    assert done.returncode == 2, done.output
    assert done.stderr.startswith("gemini: error:") and len(done.stderr.splitlines()) == 1
