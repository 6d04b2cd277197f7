"""gemini demo: train the example GPT under `gemini run`, kill a worker, watch it recover.

    python examples/demo.py [--steps 120] [--kill-after 80]

Runs two workers on this machine's CPU with the embedded defaults, SIGKILLs rank 1 after
step --kill-after, and shows the job resuming from the in-memory checkpoint at the next
step. Then it trains once more without a failure and checks that both runs end with
bitwise-identical weights.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# torch's start-up banner and the surviving rank's traceback about its dead peer
NOISE = re.compile(r"^(\[rank\d+\]:|W\d{4} |\*+$|Setting OMP_NUM_THREADS|your application|$)")
GEMINI = [sys.executable, "-m", "gemini_cli", "run"]


def say(text: str) -> None:
    label = "\033[1;36mdemo:\033[0m" if sys.stdout.isatty() else "demo:"
    print(f"{label} {text}", flush=True)


def worker_pid(run_root: Path, rank: int) -> int | None:
    """The pid of ``rank`` in the newest round, from the supervisor's event log."""
    starts = []
    for path in run_root.glob("*/events.jsonl"):
        starts += [e for e in map(json.loads, path.read_text().splitlines())
                   if e["event"] == "start"]
    for worker in (starts[-1]["workers"] if starts else []):
        if worker["rank"] == rank:
            return int(worker["pid"])
    return None


def train(tmp: Path, name: str, steps: int, kill_after: int | None) -> Path:
    weights = tmp / f"{name}.pt"
    run_root = tmp / name
    cmd = [*GEMINI, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
           str(HERE / "train_gpt.py"), "--steps", str(steps), "--sleep", "0.05",
           "--log-every", "5", "--save-weights", str(weights)]
    env = dict(os.environ, GEMINI_RUN_ROOT=str(run_root), PYTHONUNBUFFERED="1",
               PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    killed_at = None
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if kill_after is not None and not NOISE.match(line):
            print(f"  | {line}", flush=True)
        if kill_after is not None and killed_at is None and line.startswith(f"step {kill_after} "):
            pid = worker_pid(run_root, rank=1)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
                say(f"SIGKILL -> worker rank 1 (pid {pid}) after step {kill_after}")
        if killed_at is not None and line.startswith("resumed at step"):
            resumed = int(line.split()[3])
            lost = kill_after + 1 - resumed if kill_after is not None else 0
            say(f"restored {time.monotonic() - killed_at:.2f} s after the kill; steps "
                f"0-{resumed - 1} kept, {lost} step(s) to redo (at most the step that "
                "was in flight when the worker died)")
    if proc.wait() != 0:
        raise SystemExit(f"demo: gemini run exited with {proc.returncode}")
    return weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    # late enough that the supervisor has its standby workers ready (3 s after the start),
    # as it has when a failure comes hours into a run
    parser.add_argument("--kill-after", type=int, default=80)
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory(prefix="gemini-demo-") as name:
        tmp = Path(name)
        say(f"gemini run: 2 workers train a small GPT for {args.steps} steps, saving "
            "every step to memory; rank 1 dies after step "
            f"{args.kill_after}")
        failed = train(tmp, "with-failure", args.steps, args.kill_after)
        say("training again without any failure, for comparison")
        clean = train(tmp, "no-failure", args.steps, None)
        a, b = torch.load(failed), torch.load(clean)
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        say(f"final weights bitwise identical to the run without failure: {same}")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
