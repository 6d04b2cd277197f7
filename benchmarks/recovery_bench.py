"""Time from a worker kill to its first completed step after restore: gemini vs torchrun.

gemini restores from the in-memory tier; the baseline is the same worker under torchrun
restoring with torch.load from a torch.save file on local disk, with the file still in the
page cache ("disk, warm") and, when run as root, after dropping the page cache ("disk,
cold"), as after a reboot or on a busy host. Every run: one worker, killed (SIGKILL) right
after the checkpoint of step 1 is durable; --max-restarts 1. Medians of --repeat runs.

    python benchmarks/recovery_bench.py --sizes 256M,1G --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine, mib, table  # noqa: E402
from save_bench import parse_size  # noqa: E402

WORKER = str(HERE / "recovery_worker.py")
PHASES = ("restart", "startup", "restore", "first_step", "total")


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def one_run(mode: str, nbytes: int, cold: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GEMINI_RUN_ROOT=os.path.join(tmp, "runs"), PYTHONUNBUFFERED="1")
        launcher = ([sys.executable, "-m", "gemini_cli", "run"] if mode == "gemini"
                    else [sys.executable, "-m", "torch.distributed.run"])
        cmd = [*launcher, "--nproc-per-node", "1", "--max-restarts", "1", "--monitor-interval",
               "0.1", WORKER, "--mode", mode, "--state-bytes", str(nbytes), "--dir", tmp]
        if cold:
            env["BENCH_DROP_CACHES"] = "1"
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RECOVERY ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        result: dict[str, float] = json.loads(lines[-1].split(" ", 1)[1])
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256M,1G")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cold_ok = os.geteuid() == 0 and drop_caches()
    variants = [("gemini", False, "gemini (memory)"), ("disk", False, "torchrun + disk, warm")]
    if cold_ok:
        variants.append(("disk", True, "torchrun + disk, cold"))
    rows = []
    for text in args.sizes.split(","):
        nbytes = parse_size(text)
        runs: dict[str, list[dict[str, float]]] = {label: [] for _, _, label in variants}
        for _ in range(args.repeat):
            for mode, cold, label in variants:  # interleaved: drift hits every variant alike
                runs[label].append(one_run(mode, nbytes, cold))
        medians = {label: {k: statistics.median(r[k] for r in found) for k in PHASES}
                   for label, found in runs.items()}
        print(f"measured {text}; gemini's totals: "
              + ", ".join(f"{r['total']:.2f} s" for r in runs["gemini (memory)"]),
              file=sys.stderr, flush=True)
        ours = medians["gemini (memory)"]["total"]
        for label, m in medians.items():
            rows.append([mib(nbytes), label, *(f"{m[k]:.2f} s" for k in PHASES),
                         f"{m['total'] / ours:.2f}x"])
    print(f"machine: {machine()}")
    print(f"medians of {args.repeat} runs; one worker; SIGKILL after the checkpoint of step 1\n")
    print(table(["state", "restore from", "kill -> new process", "import+build", "restore",
                 "first step", "kill -> first step", "vs gemini"], rows))


if __name__ == "__main__":
    main()
