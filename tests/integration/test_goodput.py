"""Goodput as ``gemini status`` shows it, against the workload's own step log."""

from __future__ import annotations

import json
import time
from pathlib import Path

from helpers import GEMINI, SCRIPTS, env_with, events, kill_tree, log_ettr, poll, run, start

TRAIN = (str(SCRIPTS / "train_ckpt.py"), "--sleep", "0.05")


def goodput(env: dict[str, str], run_id: str) -> dict:
    shown = run([*GEMINI, "status", "--run-id", run_id, "--json"], env=env)
    assert shown.returncode == 0, shown.output
    report = json.loads(shown.stdout)["goodput"]
    parts = report["useful_s"] + sum(report["lost_s"].values())
    assert abs(parts - report["wall_s"]) < 1e-6, report  # the parts add up to the wall time
    return report


def test_goodput_matches_the_step_log_through_kills_and_a_supervisor_restart(
        tmp_path: Path) -> None:
    """Two worker kills, then the supervisor itself is killed and started again: the
    ledger goes on from the one in the store (same start, every step counted once), the
    time nobody watched counts as waiting, and ETTR is within 3 points of the workload's
    own log. (--no-standby: the log's first line is then the interpreter's start, as the
    ledger's is the worker's.)"""
    env = env_with(tmp_path)
    log = tmp_path / "steps.log"
    argv = [*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "3", "--no-standby",
            "--rdzv-id", "gp", *TRAIN, "--steps", "160", "--step-log", str(log),
            "--kill", "1:30:step", "--kill", "0:60:step:1"]
    first = start(argv, env=env)
    poll(lambda: log.exists() and " 100 " in log.read_text(), 120, "step 100")
    live = poll(lambda: (r := goodput(env, "gp"))["failures"] == 2 and r, 30,
                "the second failure in the live figure")  # written every 2 s
    assert live["steps"] >= 60 and 0 < live["ettr"] < 1, live
    kill_tree(first.pid)  # the supervisor and its workers, at once
    first.wait(timeout=30)
    time.sleep(1.0)
    again = run(argv, env=env, timeout=180)
    assert again.returncode == 0, again.output[-3000:]
    report = goodput(env, "gp")
    want, steps, wall = log_ettr(log)
    restored = [e for e in events(tmp_path / "runs") if e["event"] == "restore_plan"][-1]
    assert restored["step"] >= 90, restored  # the second supervisor went on from memory
    assert abs(report["wall_s"] - wall) < 1.0, (report, wall)  # from the first start on
    assert report["steps"] == steps == 160, report
    assert report["lost_s"]["waiting"] >= 1.0, report  # the gap between the supervisors
    assert report["redone_steps"] <= 3 and report["failures"] == 3, report  # 2 + its own
    assert abs(report["ettr"] - want) < 0.03, (report, want)
    shown = run([*GEMINI, "status", "--run-id", "gp"], env=env)
    assert "goodput" in shown.stdout and "where the time went" in shown.stdout, shown.stdout
