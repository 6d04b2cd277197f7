"""A preemption: what SIGTERM to `gemini run` costs, and what it keeps.

The example GPT (examples/train_gpt.py) with 2 workers (DDP, gloo, CPU), about 288 MiB
and 1 GiB of model and AdamW state per rank, trains with ``--persist-dir`` on local disk
and the persistent tier not due (``--persist-every 600s``). After step 5, SIGTERM goes to
`gemini run`, as SLURM, a spot reclaim or a Kubernetes eviction sends it. Two variants,
interleaved:

* ``--persist-on-exit`` (the default): the supervisor stops the workers, persists the
  newest step every rank holds, frees its memory and exits;
* ``--no-persist-on-exit``, the baseline: it stops the workers, frees its memory and
  exits, as it did before; the state since the last periodic persist (here: since the
  start) is lost.

Printed per size: SIGTERM -> exit of `gemini run`, the persist itself as the supervisor
reports it, the bytes in the persist directory (the periodic tier persists the first
step it sees, then waits 600 s), and the steps a requeued job would redo (the newest
step printed before the signal, plus one, less the step after the newest complete
persisted step).

    python benchmarks/persist_exit_bench.py --sizes 288M,1G --repeat 3
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine, mib, table  # noqa: E402
from large_state_bench import COMMON, SIZES, state_bytes  # noqa: E402

sys.path.insert(0, str(HERE.parent))
from launcher import persist  # noqa: E402

EXAMPLE = str(HERE.parent / "examples" / "train_gpt.py")
SIGNAL_AFTER = 5  # the step after which SIGTERM is sent


def one_run(model: list[str], persist_on_exit: bool, tmp: Path) -> dict[str, float]:
    """Train until step SIGNAL_AFTER is printed, SIGTERM, and time the exit."""
    for name in ("persist", "runs", "shm"):
        shutil.rmtree(tmp / name, ignore_errors=True)
    (tmp / "shm").mkdir()
    env = dict(os.environ, GEMINI_RUN_ROOT=str(tmp / "runs"), GEMINI_SHM_DIR=str(tmp / "shm"),
               OMP_NUM_THREADS="1")
    flag = "--persist-on-exit" if persist_on_exit else "--no-persist-on-exit"
    argv = [sys.executable, "-m", "gemini_cli", "run", "--nproc-per-node", "2",
            "--rdzv-id", "preempted", "--persist-dir", str(tmp / "persist"),
            "--persist-every", "600s", flag, EXAMPLE, *model, *COMMON, "--log-every", "1",
            "--steps", "100000"]
    proc = subprocess.Popen(argv, env=env, cwd=HERE.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(f"step {SIGNAL_AFTER} "):
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not seen.wait(600):
            tail = "".join(lines[-30:])
            raise SystemExit(f"no step {SIGNAL_AFTER} within 600 s:\n{tail}")
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
        seconds = time.monotonic() - began
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(10)
    output = "".join(lines)
    last = max(int(m) for m in re.findall(r"^step (\d+) ", output, re.M))
    saved = re.search(r"persisted step (\d+) of rank\(s\) [\d, ]+ to .* in ([\d.]+) s", output)
    written = sum(p.stat().st_size for p in (tmp / "persist").rglob("*") if p.is_file())
    complete = persist.complete_steps(tmp / "persist", "preempted")  # what a requeue finds
    resume = max(complete) + 1 if complete else 0
    return {"exit": seconds, "persist": float(saved.group(2)) if saved else 0.0,
            "bytes": float(written), "redo": float(last + 1 - resume)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="288M,1G")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(machine())
    rows = []
    with tempfile.TemporaryDirectory(prefix="gemini-persist-exit-") as tmp:
        for size in args.sizes.split(","):
            model, _ = SIZES[size]
            results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
            for i in range(args.repeat):
                for variant in ((True, False) if i % 2 == 0 else (False, True)):
                    results[variant].append(one_run(model, variant, Path(tmp)))
                    print(f"{size} persist_on_exit={variant} round {i + 1}: "
                          f"{results[variant][-1]}", flush=True)
            base = statistics.median(r["exit"] for r in results[False])
            for variant, name in ((True, "--persist-on-exit"),
                                  (False, "--no-persist-on-exit (before)")):
                med = {k: statistics.median(r[k] for r in results[variant])
                       for k in ("exit", "persist", "bytes", "redo")}
                rows.append([mib(state_bytes(model)), name, f"{med['exit']:.2f} s",
                             f"{med['persist']:.2f} s" if variant else "-",
                             mib(med["bytes"]) if med["bytes"] else "0",
                             f"{med['redo']:.0f}", f"{med['exit'] / base:.2f}x"])
    print(table(["state per rank", "variant", "SIGTERM -> exit", "persist (reported)",
                 "written", "steps a requeued job redoes", "exit vs before"], rows))


if __name__ == "__main__":
    main()
