"""A worker crash with a framework: how long from the kill to the next completed step.

For each framework's test script (2 workers on this host, CPU, gloo) and the hand-written
loop for scale: one worker is SIGKILLed once training runs and the host's standby workers
are idle (they have imported what they import before they wait), and the clock runs until
rank 0 completes its first step after the restart (``tests/scripts/restart_stamps.py``):
every rank takes part in that step. Side by side, interleaved round by round:

* ``gemini run`` as checked out (standbys import what the workers imported);
* with ``--baseline PATH``, ``gemini run`` from another checkout (e.g. a ``git worktree``
  of an earlier commit), with this checkout's scripts: the previous behaviour;
* torchrun restarting the same script, which resumes from the framework's own checkpoint
  on local disk (written every step; the Trainer's ``resume_from_checkpoint``, Lightning's
  ``ckpt_path="last"``, ``Accelerator.load_state``); not for the hand-written loop.

    python benchmarks/framework_restart_bench.py --repeat 3 [--baseline PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine, table  # noqa: E402

SCRIPTS = HERE.parent / "tests" / "scripts"
STEPS = "100000"  # more than ever run: the run is stopped after the first step past the kill
FRAMEWORKS: dict[str, list[str] | None] = {
    "hand-written loop (MLP, width 1024)": [
        str(SCRIPTS / "train_ckpt.py"), "--steps", STEPS, "--width", "1024", "--sleep", "0.02"],
    "transformers.Trainer (GPT-2, 4 layers x 256)": [
        str(SCRIPTS / "train_hf.py"), "--steps", STEPS, "--n-embd", "256", "--n-layer", "4"],
    "accelerate (MLP, width 1024)": [
        str(SCRIPTS / "train_accelerate.py"), "--steps", STEPS, "--width", "1024"],
    "Lightning Trainer (MLP, width 1024)": [
        str(SCRIPTS / "train_lightning.py"), "--steps", STEPS, "--width", "1024"],
}
WARM_SECONDS = 3.0  # of training before the kill, at the least
RESUME_LIMIT = 120.0  # seconds from the kill: a run not training again by then failed


def restart_seconds(script: list[str], runner: str, package: Path | None) -> float | None:
    """Kill -> rank 0's next completed step, in one run; None when it did not train again
    within :data:`RESUME_LIMIT` (torchrun's restarted gloo workers can fail to connect,
    and fail again)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GEMINI_RUN_ROOT=f"{tmp}/runs", PYTHONWARNINGS="ignore",
                   GEMINI_SHM_DIR=f"{tmp}/shm")
        os.mkdir(f"{tmp}/shm")
        if package is not None:  # another checkout's launcher and gemini_cli come first
            env["PYTHONPATH"] = os.pathsep.join([str(package), env.get("PYTHONPATH", "")])
        cmd = ([sys.executable, "-m", "gemini_cli", "run"] if runner == "gemini" else
               [sys.executable, "-m", "torch.distributed.run", "--standalone"])
        # (torchrun's restarted gloo workers sometimes fail to connect: another restart)
        cmd += ["--nproc-per-node", "2", "--max-restarts", "3", *script]
        if "train_ckpt" not in script[0]:  # the loop keeps nothing on disk
            cmd += ["--output-dir", f"{tmp}/out"]
        if runner == "torchrun":
            cmd += ["--mode", "disk"]
        log = Path(tmp) / "log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=tmp, start_new_session=True)
        try:
            return _kill_and_time(proc, script[0], log, Path(tmp) / "runs"
                                  if runner == "gemini" else None)
        finally:  # torchrun starts its workers in sessions of their own: every process
            tree = [proc.pid]
            with contextlib.suppress(psutil.Error):
                tree += [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()


def _kill_and_time(proc: subprocess.Popen[bytes], script: str, log: Path,
                   run_root: Path | None) -> float | None:
    """``run_root``: gemini's (its standbys are waited for, its events name the workers)."""
    deadline = time.monotonic() + 600
    began: float | None = None
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{script}: ended or stuck before the kill:\n"
                               f"{log.read_text()[-3000:]}")
        if began is None and "resume rank=" in log.read_text():
            began = time.monotonic()
        if began is not None and time.monotonic() - began >= WARM_SECONDS and (
                run_root is None or _standbys_idle(proc.pid)):
            break
        time.sleep(0.2)
    victim = _worker(proc.pid, script, run_root)
    killed = time.time()
    victim.kill()
    while time.time() - killed < RESUME_LIMIT and proc.poll() is None:
        found = re.search(r"next_step at=([\d.]+)", log.read_text())
        if found:
            return float(found.group(1)) - killed
        time.sleep(0.05)
    print(f"  {script}: no step within {RESUME_LIMIT:.0f} s of the kill: "
          f"{log.read_text()[-300:]!r}", flush=True)
    return None


def _standbys_idle(pid: int) -> bool:
    """Whether the run keeps its 2 standby workers and they are idle (done importing)."""
    standbys = [p for p in psutil.Process(pid).children(recursive=True)
                if "launcher.standby" in " ".join(p.cmdline())]
    if len(standbys) < 2:
        return False
    for p in standbys:
        p.cpu_percent()
    time.sleep(0.5)
    return all(p.cpu_percent() < 5 for p in standbys)


def _worker(pid: int, script: str, run_root: Path | None) -> psutil.Process:
    """The worker of local rank 1: from gemini's newest ``start`` event (a worker that a
    standby became keeps the standby's environment in /proc), else from its environment."""
    if run_root is not None:
        import json

        starts = [json.loads(line) for path in run_root.glob("*/events.jsonl")
                  for line in path.read_text().splitlines() if '"start"' in line]
        workers = [w for e in starts if e.get("event") == "start" for w in e["workers"]]
        return psutil.Process(next(w["pid"] for w in reversed(workers) if w["local_rank"] == 1))
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if script in " ".join(p.cmdline()) and p.environ().get("LOCAL_RANK") == "1":
                return p
        except psutil.Error:
            continue
    raise RuntimeError(f"no worker of local rank 1 running {script}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout of gemini to run beside this one")
    parser.add_argument("--only", default="", help="frameworks whose name contains this")
    args = parser.parse_args()
    runners = {"gemini run": ("gemini", None)}
    if args.baseline is not None:
        runners[f"gemini run, {args.baseline.name}"] = ("gemini", args.baseline.resolve())
    runners["torchrun, from its disk checkpoint"] = ("torchrun", None)
    frameworks = {k: v for k, v in FRAMEWORKS.items() if args.only.lower() in k.lower()}
    print(f"machine: {machine()}\nmedians of {args.repeat} runs\n", flush=True)
    times: dict[tuple[str, str], list[float | None]] = {}
    for _ in range(args.repeat):
        for framework, script in frameworks.items():
            for name, (runner, package) in runners.items():
                if runner == "torchrun" and "loop" in framework:
                    continue  # the loop's script keeps no checkpoint on disk
                seconds = restart_seconds(script, runner, package)  # type: ignore[arg-type]
                times.setdefault((framework, name), []).append(seconds)
                print(f"  {framework} / {name}: "
                      f"{'failed' if seconds is None else f'{seconds:.2f} s'}", flush=True)
    loops = [t for t in times.get((next(iter(FRAMEWORKS)), "gemini run"), []) if t is not None]
    loop = statistics.median(loops) if loops else None
    rows = []
    for (framework, name), values in times.items():
        done = [t for t in values if t is not None]
        median = statistics.median(done) if done else None
        rows.append([framework, name, "-" if median is None else f"{median:.2f} s",
                     f"{len(done)} of {len(values)}",
                     f"{median - loop:+.2f} s" if median is not None and loop else "-"])
    print(table(["script", "restarted by", "kill -> next step (median)", "trained again",
                 "vs the loop under gemini run"], rows), flush=True)


if __name__ == "__main__":
    main()
